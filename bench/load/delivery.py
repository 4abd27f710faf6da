#!/usr/bin/python3
"""
Section 7 of bench/run.sh (issue 12): what outbox.delivery = exactly_once costs beside
at_least_once, side by side in one run on the cluster bench/run.sh started.

(a) Drain: BENCH_EOS_EVENTS (500,000) events over 10,000 aggregates (the payload of section 2)
    committed while the relay is paused, then drained; wall time, events/s and the relay's CPU
    (utime + stime of its threads, librdkafka's included).  Rounds alternate the modes
    (at_least_once, exactly_once, ...) BENCH_EOS_ROUNDS (2) times each, after an unreported
    warm-up; the table gives every round.
(b) Latency: at each of BENCH_EOS_RATES (500,100) commits per second (BENCH_EOS_RATE, if set,
    replaces the first), one event each, from one session, for BENCH_EOS_LATENCY_SECONDS (20)
    after a 3 s warm-up; latency = the time a read_committed consumer (librdkafka through
    confluent_kafka, polled without a batch window) received the event minus the time its
    COMMIT returned; and the relay's CPU meanwhile (its threads, librdkafka's included, as a
    share of one core).  Same alternation.

Writes bench/results/delivery.md (the tables) and prints them.
"""
import os
import sys
import threading
import time
import uuid

import psycopg2
from confluent_kafka import Consumer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

EVENTS = common.env_int("BENCH_EOS_EVENTS", 500000)
ROUNDS = common.env_int("BENCH_EOS_ROUNDS", 2)
RATES = [int(r) for r in common.env_str("BENCH_EOS_RATES", "500,100").split(",") if r.strip()]
if os.environ.get("BENCH_EOS_RATE", "").strip():
    RATES[0] = int(os.environ["BENCH_EOS_RATE"])
LAT_SECONDS = common.env_int("BENCH_EOS_LATENCY_SECONDS", 20)
WARMUP = 3
AGGS = 10000
CHUNK = 100000
OUT = os.path.join(os.environ.get("BENCH_RESULTS_DIR", "bench/results"), "delivery.md")
MODES = ("at_least_once", "exactly_once")


def log(msg):
    print("bench: " + msg, file=sys.stderr, flush=True)


class Db:
    def __init__(self):
        self.conn = psycopg2.connect(common.pg_conninfo())
        self.conn.autocommit = True

    def q(self, sql, args=None):
        with self.conn.cursor() as cur:
            cur.execute(sql, args)
            return cur.fetchall() if cur.description else None

    def status(self):
        return self.q("SELECT pid, state, published FROM outbox.status WHERE database = current_database()")[0]

    def wait(self, what, fn, timeout=120):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if fn():
                return
            time.sleep(0.05)
        raise RuntimeError("timed out waiting for " + what)

    def set_mode(self, mode):
        """Switch outbox.delivery and wait until the relay serves it (a new producer)."""
        self.q("ALTER SYSTEM SET outbox.delivery = %s", (mode,))
        self.q("SELECT pg_reload_conf()")
        time.sleep(0.5)
        probe_topic = "bench.eos.probe"
        agg = "probe-%s" % uuid.uuid4().hex[:8]
        c = Consumer({"bootstrap.servers": common.kafka_bootstrap(), "group.id": agg,
                      "auto.offset.reset": "latest", "enable.auto.commit": False})
        c.subscribe([probe_topic])
        try:
            deadline = time.time() + 90
            got = False
            while not got:
                if time.time() > deadline:
                    raise RuntimeError("the relay did not publish in mode " + mode)
                self.q("SELECT outbox.emit(%s, 'p', 'probe', '{}', NULL, %s)", (agg, probe_topic))
                t = time.time() + 1
                while time.time() < t and not got:
                    m = c.poll(0.1)
                    got = m is not None and m.error() is None
        finally:
            c.close()


def cpu_of(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return (int(rest[11]) + int(rest[12])) / common.CLK_TCK
    except OSError:
        return 0.0


def drain(db, mode, events):
    db.set_mode(mode)
    db.q("SELECT outbox.pause()")
    db.wait("paused", lambda: db.status()[1] == "paused")
    agg = "bench_eos_%s_%d" % (mode, int(time.time()))
    for lo in range(1, events + 1, CHUNK):
        hi = min(lo + CHUNK - 1, events)
        db.q("INSERT INTO outbox.events (aggregate_type, aggregate_id, event_type, payload, xid)"
             " SELECT %s, (g %% {a} + 1)::text, 'order.created', {p}, pg_current_xact_id()"
             "   FROM generate_series(%s, %s) AS g".format(a=AGGS, p=common.payload_sql("g", "g").replace("%", "%%")),
             (agg, lo, hi))
    db.q("VACUUM (ANALYZE) outbox.events")
    db.q("CHECKPOINT")
    pid, _, pub0 = db.status()
    c0, t0 = cpu_of(pid), time.time()
    db.q("SELECT outbox.resume()")
    db.wait("the drain", lambda: db.status()[2] - pub0 >= events, timeout=1800)
    t1, c1 = time.time(), cpu_of(pid)
    same = db.status()[0] == pid
    db.q("TRUNCATE outbox.events")
    return {"mode": mode, "events": events, "s": t1 - t0, "rate": events / (t1 - t0),
            "cpu": c1 - c0, "same_pid": same}


def latency(db, mode, rate):
    db.set_mode(mode)
    topic = "bench.eos.lat.%s.%d" % (mode, int(time.time()))
    common.create_topic(topic)
    commits, recv = {}, {}
    stop = threading.Event()
    c = Consumer({"bootstrap.servers": common.kafka_bootstrap(), "group.id": topic,
                  "auto.offset.reset": "earliest", "enable.auto.commit": False,
                  "isolation.level": "read_committed", "fetch.wait.max.ms": 5})
    c.subscribe([topic])

    def consume():
        while not stop.is_set():
            m = c.poll(0.05)
            if m is None or m.error() is not None:
                continue
            now = time.time()
            for k, v in m.headers() or []:
                if k == "id":
                    recv.setdefault(v.decode(), now)
    th = threading.Thread(target=consume, daemon=True)
    th.start()
    time.sleep(2)
    conn = psycopg2.connect(common.pg_conninfo())
    conn.autocommit = True
    cur = conn.cursor()
    pid = db.status()[0]
    start = time.time()
    n = 0
    c0 = None
    while time.time() - start < WARMUP + LAT_SECONDS:
        if c0 is None and time.time() - start >= WARMUP:
            c0, t0 = cpu_of(pid), time.time()
        ahead = start + n / rate - time.time()
        if ahead > 0:
            time.sleep(ahead)
        cur.execute("SELECT outbox.emit('bench_eos_lat', %s, 'e', '{}', NULL, %s)::text",
                    ("a%d" % (n % 100), topic))
        eid = cur.fetchone()[0]
        if time.time() - start >= WARMUP:
            commits[eid] = time.time()
        n += 1
    cpu = (cpu_of(pid) - c0) / (time.time() - t0) if c0 is not None else float("nan")
    deadline = time.time() + 60
    while time.time() < deadline and any(e not in recv for e in commits):
        time.sleep(0.1)
    stop.set()
    th.join(5)
    c.close()
    conn.close()
    lat = sorted((recv[e] - t) * 1000 for e, t in commits.items() if e in recv)
    missing = sum(1 for e in commits if e not in recv)

    def pct(p):
        return lat[min(len(lat) - 1, int(round(p / 100 * (len(lat) - 1))))] if lat else float("nan")
    return {"mode": mode, "rate": rate, "cpu": cpu, "events": len(commits), "missing": missing, "p50": pct(50),
            "p90": pct(90), "p99": pct(99), "max": lat[-1] if lat else float("nan")}


def main():
    db = Db()
    db.q("CREATE EXTENSION IF NOT EXISTS outbox")
    # a section before may have left the relay paused (the driver's sections pause it to build a
    # backlog); after section 6's restart it may take a while to start: wait, and say what it shows
    db.q("SELECT outbox.resume()")
    try:
        db.wait("the relay", lambda: db.q("SELECT count(*) FROM outbox.status WHERE database = current_database()"
                                          " AND state IN ('idle', 'publishing')")[0][0] == 1, timeout=300)
    except RuntimeError:
        log("section 7: outbox.status shows %r" % (db.q("SELECT database, pid, state, last_error FROM outbox.status"),))
        raise
    db.q("ALTER SYSTEM SET outbox.retention = -1")
    db.q("SELECT pg_reload_conf()")
    log("section 7: warm-up drain")
    drain(db, "exactly_once", EVENTS // 10)
    drains, lats = [], []
    for r in range(ROUNDS):
        for mode in MODES:
            log("section 7: drain %d events, %s (round %d)" % (EVENTS, mode, r + 1))
            drains.append(drain(db, mode, EVENTS))
            log("  %.1f s, %.0f events/s, relay %.1f CPU s" % (drains[-1]["s"], drains[-1]["rate"], drains[-1]["cpu"]))
    for rate in RATES:
        for r in range(ROUNDS):
            for mode in MODES:
                log("section 7: latency at %d/s for %d s, %s (round %d)" % (rate, LAT_SECONDS, mode, r + 1))
                lats.append(latency(db, mode, rate))
                log("  p50 %.1f ms, p99 %.1f ms" % (lats[-1]["p50"], lats[-1]["p99"]))
    db.q("ALTER SYSTEM RESET outbox.delivery")
    db.q("ALTER SYSTEM RESET outbox.retention")
    db.q("SELECT pg_reload_conf()")

    def best(rows, key, mode, fn):
        return fn(x[key] for x in rows if x["mode"] == mode)
    alo_rate = best(drains, "rate", "at_least_once", max)
    eos_rate = best(drains, "rate", "exactly_once", max)
    first = [x for x in lats if x["rate"] == RATES[0]]
    alo_p99 = best(first, "p99", "at_least_once", min)
    eos_p99 = best(first, "p99", "exactly_once", min)
    server = db.q("SHOW server_version")[0][0]
    batch = db.q("SHOW outbox.batch_size")[0][0]
    lines = [
        "## Section 7: exactly_once beside at_least_once (issue 12)",
        "",
        "%s, PostgreSQL %s, %d cores, one Kafka broker; outbox.batch_size %s, relay_mode snapshot."
        % (time.strftime("%Y-%m-%d", time.gmtime()), server, os.cpu_count(), batch),
        "",
        "(a) drain of %d events (10,000 aggregates, ~300-byte payloads) committed while the relay was paused:" % EVENTS,
        "",
        "| round | delivery | events | wall s | events/s | relay CPU s | relay CPU µs/event | same relay pid |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for i, d in enumerate(drains):
        lines.append("| %d | %s | %d | %.2f | %.0f | %.2f | %.2f | %s |" % (
            i // 2 + 1, d["mode"], d["events"], d["s"], d["rate"], d["cpu"],
            d["cpu"] * 1e6 / d["events"], "yes" if d["same_pid"] else "no"))
    lines += [
        "",
        "(b) latency, COMMIT returned -> a read_committed consumer received it, at %s commits/s"
        " (one event each) for %d s; relay CPU = its threads' CPU time over the run's time:"
        % (" and ".join(str(r) for r in RATES), LAT_SECONDS),
        "",
        "| commits/s | round | delivery | events | missing | p50 ms | p90 ms | p99 ms | max ms | relay CPU % of a core |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, x in enumerate(lats):
        lines.append("| %d | %d | %s | %d | %d | %.1f | %.1f | %.1f | %.1f | %.0f |" % (
            x["rate"], (i // 2) % ROUNDS + 1, x["mode"], x["events"], x["missing"], x["p50"],
            x["p90"], x["p99"], x["max"], 100 * x["cpu"]))
    lines += [
        "",
        "Best of the rounds: drain %.0f (exactly_once) vs %.0f events/s (at_least_once), %.1f%% less;"
        " p99 latency at %d/s %.1f vs %.1f ms, %+.1f ms."
        % (eos_rate, alo_rate, 100 * (1 - eos_rate / alo_rate), RATES[0], eos_p99, alo_p99,
           eos_p99 - alo_p99),
    ]
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
