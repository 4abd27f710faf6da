"""Shared helpers of the outbox benchmark (bench/run.sh): settings from the environment, the
event payload, Kafka topics and offsets, and CPU/load accounting on the shared machine.

Run with Debian's /usr/bin/python3 (psycopg 3 from python3-psycopg, confluent_kafka)."""

import json
import os
import time

from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

PARTITIONS = 4

# Payload of every event in every system: an order of ~300 bytes as JSON text.  The SQL
# expression and the Python function produce the same shape (bench/sql and the load generator).
NOTE = "x" * 72


def payload_json(aid, order_id):
    """The ~300-byte JSON payload for aggregate `aid`, as text (what the load generator sends)."""
    return json.dumps({
        "order_id": order_id,
        "customer": "customer-%d" % aid,
        "currency": "EUR",
        "total": 123.45,
        "status": "created",
        "lines": [{"sku": "SKU-%06d" % (order_id % 1000000), "qty": 2, "price": 19.99},
                  {"sku": "SKU-000042", "qty": 1, "price": 83.47}],
        "note": NOTE,
    }, separators=(", ", ": "))


def payload_sql(aid, order_id):
    """SQL expression building the same payload from SQL expressions `aid` and `order_id`."""
    return ("jsonb_build_object('order_id', ({o})::bigint, 'customer', 'customer-' || ({a})::int, "
            "'currency', 'EUR', 'total', 123.45, 'status', 'created', "
            "'lines', jsonb_build_array("
            "jsonb_build_object('sku', 'SKU-' || lpad((({o})::bigint % 1000000)::text, 6, '0'), 'qty', 2, 'price', 19.99), "
            "jsonb_build_object('sku', 'SKU-000042', 'qty', 1, 'price', 83.47)), "
            "'note', '{n}')").format(a=aid, o=order_id, n=NOTE)


def env_int(name, default):
    v = os.environ.get(name, "")
    return int(v) if v.strip() else default


def env_str(name, default):
    v = os.environ.get(name, "")
    return v if v.strip() else default


def kafka_bootstrap():
    return env_str("OUTBOX_KAFKA", "127.0.0.1:19601")


def pg_conninfo(dbname=None):
    return "host=%s port=%s user=%s dbname=%s" % (
        env_str("PGHOST", "127.0.0.1"), env_str("PGPORT", "54601"),
        env_str("PGUSER", "postgres"), dbname or env_str("PGDATABASE", "outbox"))


# ----------------------------------------------------------------------------- Kafka


def create_topic(name, partitions=PARTITIONS, config=None):
    """Create a topic (replication 1) and wait until its metadata shows every partition."""
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap()})
    fs = admin.create_topics([NewTopic(name, partitions, 1, config=config or {})], operation_timeout=30)
    for _, f in fs.items():
        try:
            f.result(60)
        except Exception as e:  # an existing topic is a harness bug: topics are fresh per run
            raise RuntimeError("cannot create topic %s: %s" % (name, e))
    deadline = time.time() + 60
    while time.time() < deadline:
        md = admin.list_topics(name, timeout=10)
        t = md.topics.get(name)
        if t is not None and t.error is None and len(t.partitions) == partitions and \
                all(p.leader >= 0 for p in t.partitions.values()):
            return
        time.sleep(0.2)
    raise RuntimeError("topic %s not ready" % name)


def topic_message_count(name, partitions=PARTITIONS):
    """Messages in a fresh topic: the sum of the partitions' high watermarks."""
    c = Consumer({"bootstrap.servers": kafka_bootstrap(), "group.id": "bench-watermarks",
                  "enable.auto.commit": False})
    try:
        total = 0
        for p in range(partitions):
            lo, hi = c.get_watermark_offsets(TopicPartition(name, p), timeout=30)
            total += hi - lo
        return total
    finally:
        c.close()


# ----------------------------------------------------------------------- machine / CPU

CLK_TCK = os.sysconf("SC_CLK_TCK")


def loadavg():
    with open("/proc/loadavg") as f:
        a = f.read().split()
    return [float(a[0]), float(a[1]), float(a[2])]


def _proc_table():
    """pid -> (ppid, own cpu s, reaped children's cpu s) for every live process."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                s = f.read()
        except OSError:
            continue
        rest = s[s.rfind(")") + 2:].split()
        # fields after the command: state ppid ... utime(14) stime(15) cutime(16) cstime(17)
        ppid = int(rest[1])
        own = (int(rest[11]) + int(rest[12])) / CLK_TCK
        children = (int(rest[13]) + int(rest[14])) / CLK_TCK
        out[int(d)] = (ppid, own, children)
    return out


def _tree_cpu(table, root):
    """CPU seconds of a process tree: every live member plus what its members reaped."""
    if root not in table:
        return 0.0
    kids = {}
    for pid, (ppid, _, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        _, own, reaped = table[pid]
        total += own + reaped
        stack.extend(kids.get(pid, []))
    return total


def _busy_seconds():
    with open("/proc/stat") as f:
        cpu = f.readline().split()[1:]
    v = [int(x) for x in cpu]
    idle = v[3] + v[4]          # idle + iowait
    return (sum(v[:8]) - idle) / CLK_TCK   # user nice system idle iowait irq softirq steal


class CpuMeter:
    """CPU used during a section by: Postgres (postmaster tree), the relay worker alone, the
    Kafka broker, the benchmark's own processes (this driver and its children: pgbench, Java,
    Python load generator/consumer/poller), and everything else on the machine ("other": the
    shared machine's other users)."""

    def __init__(self, postmaster_pid, kafka_pid, relay_pid=None):
        self.roots = {"postgres": postmaster_pid, "kafka": kafka_pid, "bench": os.getpid()}
        self.relay_pid = relay_pid

    def snap(self):
        t = _proc_table()
        s = {k: _tree_cpu(t, pid) for k, pid in self.roots.items()}
        s["relay"] = t[self.relay_pid][1] if self.relay_pid in t else 0.0
        s["busy"] = _busy_seconds()
        s["wall"] = time.time()
        s["load"] = loadavg()[0]
        return s

    @staticmethod
    def delta(a, b):
        wall = b["wall"] - a["wall"]
        d = {k: round(b[k] - a[k], 2) for k in ("postgres", "kafka", "bench", "relay", "busy")}
        d["other"] = round(max(0.0, d["busy"] - d["postgres"] - d["kafka"] - d["bench"]), 2)
        d["wall"] = round(wall, 2)
        d["other_cores"] = round(d["other"] / wall, 2) if wall > 0 else 0.0
        d["load_before"] = a["load"]
        d["load_after"] = b["load"]
        return d


def schedstat(pid):
    """(seconds on a CPU, seconds runnable but waiting for a CPU, timeslices) summed over the
    threads of pid (/proc/<pid>/task/*/schedstat; the kernel's per-task run-queue accounting)."""
    run = wait = slices = 0
    try:
        tasks = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return None
    for t in tasks:
        try:
            with open("/proc/%d/task/%s/schedstat" % (pid, t)) as f:
                a, b, c = f.read().split()[:3]
        except (OSError, ValueError):
            continue
        run += int(a)
        wait += int(b)
        slices += int(c)
    return run / 1e9, wait / 1e9, slices


def schedstat_delta(a, b):
    """Run-queue wait between two schedstat() samples: ms per wall second (summed over threads)
    and the mean wait per timeslice (ms): how long a wake-up waited for a CPU."""
    if a is None or b is None:
        return None
    wall = b[3] - a[3]
    slices = b[2] - a[2]
    return {"runqueue_ms_per_s": round((b[1] - a[1]) * 1000.0 / wall, 1) if wall > 0 else None,
            "cpu_ms_per_s": round((b[0] - a[0]) * 1000.0 / wall, 1) if wall > 0 else None,
            "wait_per_slice_ms": round((b[1] - a[1]) * 1000.0 / slices, 3) if slices > 0 else None}

