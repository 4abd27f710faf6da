"""
The inbox benchmark (issue 30; bench/run.sh section 8, or bench/inbox/run.sh alone): the same
events, produced by our relay, applied to the same target table in three ways, one after the
other on this machine:

  inbox   outbox.subscribe() with a SQL handler (the extension's inbox worker)
  batch   the same with a batch handler, h(outbox.inbox_event[]): one upsert per batch
  python  a hand-written consumer (python_consumer.py): consumer group, processed-ids table,
          offsets committed to Kafka after the database commit
  jdbc    Debezium's JDBC sink connector in a Kafka Connect standalone worker (jars from Maven)

Each arm gets a database of its own with the same table bench_target (n bigint primary key,
aggregate_id text, body text), filled by upserts on n.  Reported per arm: events/s (from its start
to the last row), CPU seconds per 1,000 events (the arm's processes: the inbox worker; the Python
process and its backend; the JVM and its backends), and the size of what it leaves in the database
(the target table, plus the inbox's seen ids and offsets, or the processed-ids table).  Then the
end-to-end latency from the commit of an outbox event in one database to the inbox handler's
insert in another, p50/p99, at BENCH_INBOX_RATE commits per second.

The events are JSON in Kafka Connect's schema envelope ({"schema": ..., "payload": ...}) because
the JDBC sink needs a schema; the inbox's handler and the Python consumer read the payload part of
the same bytes.

Environment: BENCH_INBOX_EVENTS (1000000), BENCH_INBOX_PARTITIONS (12), BENCH_INBOX_KEYS (10000),
BENCH_INBOX_ARMS (inbox,batch,python,jdbc), BENCH_INBOX_RATE (500), BENCH_INBOX_LATENCY_SECONDS (30),
BENCH_INBOX_CONNECT_LIBS (the jars of connect/pom.xml), BENCH_RESULTS_DIR (bench/results),
BENCH_WORK_DIR, and the servers' PGHOST/PGPORT/OUTBOX_KAFKA (bench/run.sh sets them).
"""
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg2
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "bench" / "load"))
import common  # noqa: E402  (bench/load/common.py: CpuMeter, loadavg)

EVENTS = int(os.environ.get("BENCH_INBOX_EVENTS", "1000000"))
PARTITIONS = int(os.environ.get("BENCH_INBOX_PARTITIONS", "12"))
KEYS = int(os.environ.get("BENCH_INBOX_KEYS", "10000"))
ARMS = os.environ.get("BENCH_INBOX_ARMS", "inbox,batch,python,jdbc").split(",")
RATE = int(os.environ.get("BENCH_INBOX_RATE", "500"))
LAT_SECONDS = int(os.environ.get("BENCH_INBOX_LATENCY_SECONDS", "30"))
MAX_OTHER_CORES = float(os.environ.get("BENCH_MAX_OTHER_CORES", "0.5"))
QUIET_WAIT = float(os.environ.get("BENCH_QUIET_WAIT", "60"))
WORK = Path(os.environ.get("BENCH_WORK_DIR", "/tmp/outbox-bench-work"))
RESULTS = Path(os.environ.get("BENCH_RESULTS_DIR", REPO / "bench" / "results"))
LIBS = os.environ.get("BENCH_INBOX_CONNECT_LIBS", str(WORK / "connect-libs"))
BOOTSTRAP = os.environ.get("OUTBOX_KAFKA", "127.0.0.1:19601")
PGHOST = os.environ.get("PGHOST", "127.0.0.1")
PGPORT = int(os.environ.get("PGPORT", "54601"))
JAVA = os.path.join(os.environ.get("JAVA_HOME", "/usr/lib/jvm/java-17-openjdk-amd64"), "bin", "java")
TOPIC = "bench.inbox"
LAT_TOPIC = "bench.inbox.latency"
# Kafka Connect's REST listener: next to the broker's ports
CONNECT_REST_PORT = int(os.environ.get("BENCH_INBOX_CONNECT_PORT",
                                       str(int(BOOTSTRAP.rsplit(":", 1)[1]) + 2)))

SCHEMA = {"type": "struct", "optional": False, "name": "bench.Event",
          "fields": [{"field": "n", "type": "int64", "optional": False},
                     {"field": "aggregate_id", "type": "string", "optional": False},
                     {"field": "body", "type": "string", "optional": False}]}
TARGET = ("CREATE TABLE bench_target (n bigint PRIMARY KEY, aggregate_id text NOT NULL,"
          " body text NOT NULL)")


def log(msg):
    print(f"bench inbox: {msg}", file=sys.stderr, flush=True)


def connect(db, autocommit=True):
    c = psycopg2.connect(host=PGHOST, port=PGPORT, user="postgres", dbname=db)
    c.autocommit = autocommit
    return c


def q(c, sql, args=None):
    with c.cursor() as cur:
        cur.execute(sql, args)
        return cur.fetchall() if cur.description else []


def cpu_of(pid):
    """CPU seconds (user + system) of a process, from /proc."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def backends_cpu(admin, db):
    return sum(cpu_of(p) for (p,) in q(admin, "SELECT pid FROM pg_stat_activity WHERE datname = %s"
                                              " AND backend_type = 'client backend'", (db,)))


def wait(pred, timeout, what, interval=0.5):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise SystemExit(f"bench inbox: timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def topic_count(topic):
    c = Consumer({"bootstrap.servers": BOOTSTRAP, "group.id": "bench-wm", "enable.auto.commit": False})
    try:
        total = 0
        for p in range(PARTITIONS):
            lo, hi = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False)
            total += hi - lo
        return total
    finally:
        c.close()


def fresh_database(admin, db):
    q(admin, f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
    q(admin, f"CREATE DATABASE {db}")
    c = connect(db)
    q(c, TARGET)
    return c


def produce_events(admin):
    """Emit EVENTS events in bench_src (their relay publishes them) and wait for Kafka to hold
    them all."""
    a = AdminClient({"bootstrap.servers": BOOTSTRAP})
    for t in (TOPIC, LAT_TOPIC):
        a.delete_topics([t])
    time.sleep(2)
    for f in a.create_topics([NewTopic(t, num_partitions=PARTITIONS, replication_factor=1)
                              for t in (TOPIC, LAT_TOPIC)]).values():
        f.result(60)
    src = connect("bench_src")
    q(src, "CREATE EXTENSION IF NOT EXISTS outbox")
    schema = json.dumps(SCHEMA)
    t0 = time.monotonic()
    step = 50000
    for lo in range(1, EVENTS + 1, step):
        hi = min(lo + step - 1, EVENTS)
        q(src, "SELECT count(outbox.emit('bench', (g %% %s)::text, 'bench.event',"
               " jsonb_build_object('schema', %s::jsonb, 'payload', jsonb_build_object('n', g,"
               " 'aggregate_id', (g %% %s)::text, 'body', repeat('x', 200))), NULL, %s))"
               " FROM generate_series(%s, %s) g", (KEYS, schema, KEYS, TOPIC, lo, hi))
    wait(lambda: topic_count(TOPIC) >= EVENTS, 3600, f"the relay to publish {EVENTS} events", 2)
    log(f"{EVENTS} events in Kafka after {time.monotonic() - t0:.0f}s")
    src.close()


def result(name, seconds, cpu, size, extra=""):
    return {"arm": name, "events": EVENTS, "seconds": round(seconds, 1),
            "events_per_s": round(EVENTS / seconds), "cpu_s": round(cpu, 1),
            "cpu_ms_per_1000": round(cpu * 1e6 / EVENTS, 1),
            "size_mb": round(size / 1048576, 1), "note": extra}


# the per-event handler (arm inbox) and the batch handler (arm batch): the same upsert
HANDLERS = {
    "inbox": ("bench_dst_inbox", "apply_event(outbox.inbox_event)",
              """CREATE FUNCTION apply_event(e outbox.inbox_event) RETURNS void LANGUAGE sql
                 SET search_path = public AS $$
                   INSERT INTO bench_target (n, aggregate_id, body)
                   VALUES ((e.payload->'payload'->>'n')::bigint, e.payload->'payload'->>'aggregate_id',
                           e.payload->'payload'->>'body')
                   ON CONFLICT (n) DO UPDATE SET aggregate_id = excluded.aggregate_id, body = excluded.body
                 $$""", "inbox (handler, dedupe on)"),
    # two events of one n in a batch: the last one wins (DISTINCT ON keeps one row per n)
    "batch": ("bench_dst_batch", "apply_events(outbox.inbox_event[])",
              """CREATE FUNCTION apply_events(events outbox.inbox_event[]) RETURNS void LANGUAGE sql
                 SET search_path = public AS $$
                   INSERT INTO bench_target (n, aggregate_id, body)
                   SELECT DISTINCT ON (n) n, a, b
                     FROM (SELECT (e.payload->'payload'->>'n')::bigint AS n,
                                  e.payload->'payload'->>'aggregate_id' AS a,
                                  e.payload->'payload'->>'body' AS b, e.ordinality AS o
                             FROM unnest(events) WITH ORDINALITY AS e) AS x
                    ORDER BY n, o DESC
                   ON CONFLICT (n) DO UPDATE SET aggregate_id = excluded.aggregate_id, body = excluded.body
                 $$""", "inbox (batch handler, dedupe on)"),
}


def arm_inbox(admin, kind="inbox"):
    db, handler, ddl, label = HANDLERS[kind]
    c = fresh_database(admin, db)
    q(c, "CREATE EXTENSION outbox")
    q(c, "CREATE ROLE bench_app" if not q(c, "SELECT 1 FROM pg_roles WHERE rolname = 'bench_app'")
      else "SELECT 1")
    q(c, "ALTER TABLE bench_target OWNER TO bench_app")
    q(c, "GRANT outbox_subscriber TO bench_app")
    q(c, ddl)
    q(c, f"ALTER FUNCTION {handler} OWNER TO bench_app")
    q(c, "SET ROLE bench_app")
    t0 = time.monotonic()
    q(c, "SELECT outbox.subscribe('bench', %s, %s)", ([TOPIC], handler))
    q(c, "RESET ROLE")
    pid = wait(lambda: (q(c, "SELECT pid FROM pg_stat_activity WHERE backend_type = 'outbox inbox'"
                             " AND datname = %s", (db,)) or [[None]])[0][0], 60, "the inbox worker")
    cpu0 = cpu_of(pid)
    cpu = [0.0]

    def sample():
        cpu[0] = cpu_of(pid) - cpu0
        return q(c, "SELECT count(*) FROM bench_target")[0][0] >= EVENTS
    wait(sample, 7200, "the inbox to apply every event", 0.2)
    seconds = time.monotonic() - t0
    size = q(c, "SELECT pg_total_relation_size('bench_target') + pg_total_relation_size('outbox.inbox_seen_0')"
                " + pg_total_relation_size('outbox.inbox_seen_1') + pg_total_relation_size('outbox.inbox_offsets')")[0][0]
    st = q(c, "SELECT sum(applied), sum(duplicates), sum(dead_letters) FROM outbox.inbox_status")[0]
    c.close()
    return result(label, seconds, cpu[0], size,
                  f"applied {st[0]}, duplicates {st[1]}, dead letters {st[2]}")


def arm_python(admin):
    db = "bench_dst_python"
    c = fresh_database(admin, db)
    q(c, "CREATE TABLE processed_ids (event_id uuid PRIMARY KEY)")
    t0 = time.monotonic()
    p = subprocess.Popen(["/usr/bin/python3", str(HERE / "python_consumer.py"), "--bootstrap", BOOTSTRAP,
                          "--topic", TOPIC, "--dsn", f"host={PGHOST} port={PGPORT} user=postgres dbname={db}",
                          "--events", str(EVENTS)], stdout=subprocess.PIPE, text=True)
    backend = [0.0]

    def done():
        backend[0] = max(backend[0], backends_cpu(admin, db))
        return p.poll() is not None
    wait(done, 7200, "the Python consumer", 0.5)
    seconds = time.monotonic() - t0
    out = p.stdout.read()
    own = float(out.split("cpu_seconds")[1]) if "cpu_seconds" in out else 0.0
    size = q(c, "SELECT pg_total_relation_size('bench_target') + pg_total_relation_size('processed_ids')")[0][0]
    c.close()
    return result("hand-written Python consumer", seconds, own + backend[0], size,
                  "processed-ids table, offsets committed after the DB commit")


def arm_jdbc(admin):
    db = "bench_dst_jdbc"
    c = fresh_database(admin, db)
    d = WORK / "connect"
    d.mkdir(parents=True, exist_ok=True)
    (d / "connect.offsets").unlink(missing_ok=True)
    (d / "worker.properties").write_text(
        f"bootstrap.servers={BOOTSTRAP}\n"
        "key.converter=org.apache.kafka.connect.storage.StringConverter\n"
        "value.converter=org.apache.kafka.connect.json.JsonConverter\n"
        "value.converter.schemas.enable=true\n"
        f"offset.storage.file.filename={d / 'connect.offsets'}\n"
        "offset.flush.interval.ms=10000\n"
        f"listeners=http://127.0.0.1:{CONNECT_REST_PORT}\n")
    (d / "sink.properties").write_text(
        "name=bench-jdbc-sink\n"
        "connector.class=io.debezium.connector.jdbc.JdbcSinkConnector\n"
        "tasks.max=1\n"
        f"topics={TOPIC}\n"
        f"connection.url=jdbc:postgresql://{PGHOST}:{PGPORT}/{db}\n"
        "connection.username=postgres\n"
        "connection.password=\n"
        "insert.mode=upsert\n"
        "primary.key.mode=record_value\n"
        "primary.key.fields=n\n"
        "schema.evolution=none\n"
        "collection.name.format=bench_target\n"
        "table.name.format=bench_target\n"
        "consumer.override.auto.offset.reset=earliest\n")
    t0 = time.monotonic()
    log_file = open(WORK / "connect.log", "w")
    p = subprocess.Popen([JAVA, "-Xms512m", "-Xmx1g", "-cp", f"{LIBS}/*",
                          "org.apache.kafka.connect.cli.ConnectStandalone",
                          str(d / "worker.properties"), str(d / "sink.properties")],
                         stdout=log_file, stderr=subprocess.STDOUT)
    backend = [0.0]

    def done():
        if p.poll() is not None:
            raise SystemExit(f"bench inbox: Kafka Connect exited ({p.returncode}), see {WORK / 'connect.log'}")
        backend[0] = max(backend[0], backends_cpu(admin, db))
        return q(c, "SELECT count(*) FROM bench_target")[0][0] >= EVENTS
    try:
        wait(done, 7200, "the JDBC sink to write every event", 0.5)
        seconds = time.monotonic() - t0
        jvm = cpu_of(p.pid)
    finally:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
        log_file.close()
    size = q(c, "SELECT pg_total_relation_size('bench_target')")[0][0]
    c.close()
    return result("Debezium JDBC sink (Kafka Connect standalone, 1 task)", seconds, jvm + backend[0], size,
                  "insert.mode=upsert, batch.size 500 (default); JVM start included")


def latency(admin):
    """Commit of an outbox event in bench_src -> the inbox handler's insert in bench_dst_inbox,
    at RATE commits per second for LAT_SECONDS."""
    dst = connect("bench_dst_inbox")
    q(dst, "CREATE TABLE IF NOT EXISTS lat_target (n bigint PRIMARY KEY, created_at timestamptz,"
           " applied_at timestamptz DEFAULT clock_timestamp())")
    q(dst, "ALTER TABLE lat_target OWNER TO bench_app")
    q(dst, """CREATE OR REPLACE FUNCTION apply_lat(e outbox.inbox_event) RETURNS void LANGUAGE sql
              SET search_path = public AS $$
                INSERT INTO lat_target (n, created_at)
                VALUES ((e.payload->>'n')::bigint, (e.payload->>'created_at')::timestamptz)
              $$""")
    q(dst, "ALTER FUNCTION apply_lat(outbox.inbox_event) OWNER TO bench_app")
    q(dst, "SET ROLE bench_app")
    q(dst, "SELECT outbox.subscribe('lat', %s, 'apply_lat(outbox.inbox_event)')", ([LAT_TOPIC],))
    q(dst, "RESET ROLE")
    src = connect("bench_src", autocommit=False)
    total = RATE * LAT_SECONDS
    t_start = time.monotonic()
    for i in range(total):
        with src.cursor() as cur:
            cur.execute("SELECT outbox.emit('lat', %s, 'lat.event', jsonb_build_object('n', %s,"
                        " 'created_at', clock_timestamp()), NULL, %s)", (str(i % KEYS), i, LAT_TOPIC))
        src.commit()
        ahead = t_start + (i + 1) / RATE - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)
    wait(lambda: q(dst, "SELECT count(*) FROM lat_target")[0][0] >= total, 300, "the latency events")
    ms = sorted(float(r[0]) for r in q(dst, "SELECT extract(epoch FROM applied_at - created_at) * 1000"
                                            " FROM lat_target"))
    src.close()
    dst.close()
    return {"events": total, "rate": RATE, "p50_ms": round(ms[len(ms) // 2], 1),
            "p99_ms": round(ms[int(len(ms) * 0.99) - 1], 1), "max_ms": round(ms[-1], 1)}


def quiet_check(label):
    """As bench/load/driver.py does before each measured run: CPU that processes outside the
    benchmark (not Postgres, not Kafka, not this driver and its children) use for 3 s; waits (at
    most BENCH_QUIET_WAIT s) while that is above BENCH_MAX_OTHER_CORES.  Returns the figure."""
    pg_dir = os.environ.get("OUTBOX_PG_DIR", "/tmp/outbox-bench-pg")
    kafka_dir = os.environ.get("OUTBOX_KAFKA_DIR", "/tmp/outbox-bench-kafka")
    with open(os.path.join(pg_dir, "data", "postmaster.pid")) as f:
        pm = int(f.readline())
    kafka = int(open(os.path.join(kafka_dir, "broker.pid")).read().strip())
    m = common.CpuMeter(pm, kafka)
    t0 = time.time()
    while True:
        a = m.snap()
        time.sleep(3)
        d = m.delta(a, m.snap())
        if d["other_cores"] <= MAX_OTHER_CORES or time.time() - t0 >= QUIET_WAIT:
            return d["other_cores"]
        log(f"machine busy before {label}: other processes use {d['other_cores']:.2f} cores; waiting")
        time.sleep(10)


def main():
    WORK.mkdir(parents=True, exist_ok=True)
    load_start = common.loadavg()
    admin = connect("postgres")
    q(admin, "DROP DATABASE IF EXISTS bench_src WITH (FORCE)")
    q(admin, "CREATE DATABASE bench_src")
    q(admin, "ALTER SYSTEM SET outbox.databases = 'bench_src, bench_dst_inbox, bench_dst_batch'")
    q(admin, "SELECT pg_reload_conf()")
    produce_events(admin)
    results = []
    for arm in ARMS:
        other = quiet_check(arm)
        log(f"arm {arm} ...")
        r = {"inbox": arm_inbox, "batch": lambda a: arm_inbox(a, "batch"),
             "python": arm_python, "jdbc": arm_jdbc}[arm](admin)
        r["other_cores_before"] = other
        r["load1"] = common.loadavg()[0]
        log(f"arm {arm}: {r}")
        results.append(r)
    lat = None
    if "inbox" in ARMS and LAT_SECONDS > 0:
        other = quiet_check("latency")
        lat = latency(admin)
        lat["other_cores_before"] = other
    lines = [f"# Inbox benchmark ({time.strftime('%Y-%m-%d %H:%M')})", "",
             f"{EVENTS:,} events produced by the relay, {PARTITIONS} partitions, {KEYS:,} keys,"
             f" applied to the same table; {os.cpu_count()} cores, load average at the start: {load_start}.",
             "", "| arm | events/s | seconds | CPU s | CPU ms per 1,000 events | size after (MB) |"
             " other cores before | load after | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['arm']} | {r['events_per_s']:,} | {r['seconds']} | {r['cpu_s']} |"
                     f" {r['cpu_ms_per_1000']} | {r['size_mb']} | {r['other_cores_before']} | {r['load1']} |"
                     f" {r['note']} |")
    by = {r["arm"]: r for r in results}
    names = {"inbox (handler, dedupe on)": "per-event handler",
             "inbox (batch handler, dedupe on)": "batch handler"}
    for arm, name in names.items():
        for r in results:
            if arm in by and r["arm"].split()[0] in ("hand-written", "Debezium"):
                peer = "Debezium JDBC sink" if r["arm"].startswith("Debezium") else "hand-written consumer"
                lines.append(f"\n{name} / {peer} = {by[arm]['events_per_s'] / r['events_per_s']:.1f}x events/s")
    if lat:
        lines.append(f"\nEnd-to-end latency (outbox commit in bench_src -> inbox handler in bench_dst_inbox),"
                     f" {lat['events']} events at {lat['rate']}/s: p50 {lat['p50_ms']} ms, p99 {lat['p99_ms']} ms,"
                     f" max {lat['max_ms']} ms (other cores before: {lat['other_cores_before']}).")
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "inbox.md").write_text(text)
    (RESULTS / "inbox.json").write_text(json.dumps({"arms": results, "latency": lat}, indent=2))
    print(text)


if __name__ == "__main__":
    main()
