#!/usr/bin/python3
"""The outbox benchmark, all sections in one run (started by bench/run.sh, which starts and stops
the servers).  Writes bench/results/latest.json (raw numbers) and latest.md (tables).

Sections (see bench/README.md):
  1  emit cost: pgbench TPS of order+emit(), order+plain-table insert, order alone
  2  relay drain of a committed backlog: this extension, Debezium embedded, a Python poller
  3  commit-to-consumer latency at a steady rate, for the same three
  4  outbox table growth around the extension's drains (retention 0 and 60 s)
  5  outbox table size under a steady load (BENCH_STEADY_RATE events/s with the relay publishing
     and the retention deleting), sampled every 10 s: (heap + indexes) / rows still retained
"""

import csv
import datetime
import glob
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time

import confluent_kafka
import psycopg

import common
from common import env_int, env_str

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
REPO = os.path.dirname(BENCH)
PY = "/usr/bin/python3"
JAVA = os.path.join(env_str("JAVA_HOME", "/usr/lib/jvm/java-17-openjdk-amd64"), "bin", "java")

EVENTS = env_int("BENCH_EVENTS", 1000000)
# the per-message-flush poller manages hundreds to a few thousand events/s: it drains a smaller
# backlog of its own (its events/s is what is compared)
POLLER_EVENTS = env_int("BENCH_POLLER_EVENTS", min(100000, EVENTS))
AGGREGATES = env_int("BENCH_AGGREGATES", 10000)
PGBENCH_SECONDS = env_int("BENCH_PGBENCH_SECONDS", 30)
PGBENCH_ROUNDS = env_int("BENCH_PGBENCH_ROUNDS", 2)
LATENCY_SECONDS = env_int("BENCH_LATENCY_SECONDS", 60)
RATE = env_int("BENCH_RATE", 1000)
WARMUP_SECONDS = env_int("BENCH_WARMUP_SECONDS", 5)
CHUNK = 100000
# Debezium's poll.interval.ms in the latency run: its default (500) makes every batch wait that long
# when the 2,048-record batch does not fill; 10 ms is the latency setting, like the poller's 0 ms
DBZ_LATENCY_POLL_MS = env_int("BENCH_DBZ_POLL_MS", 10)
# section 3: topics stamped by the broker; the C consumer run.sh builds; the old batch consumer
LAT_TOPIC_CONFIG = {"message.timestamp.type": "LogAppendTime"}
LAT_C_CONSUMER = env_str("BENCH_LAT_C_CONSUMER", "")
# section 2's librdkafka-alone producer (bench/load/produce_alone.c, built by run.sh)
PRODUCE_ALONE = env_str("BENCH_PRODUCE_ALONE", "")
LAT_BATCH_CONSUMER = env_int("BENCH_LAT_BATCH_CONSUMER", 0)
LAT_SYSTEMS = [x for x in env_str("BENCH_LAT_SYSTEMS", "ext,dbz,poller").split(",") if x]
# extra librdkafka properties for the relay during section 3 (outbox.kafka_properties), e.g. to
# compare linger.ms values; empty = the relay's defaults
LAT_KAFKA_PROPERTIES = env_str("BENCH_LAT_KAFKA_PROPERTIES", "")
# the same for the whole run (every section)
RELAY_KAFKA_PROPERTIES = env_str("BENCH_RELAY_KAFKA_PROPERTIES", "")
# 1: the relay's own transactions commit with synchronous_commit = off during section 3 (set on the
# database, the relay restarted to read it; the load generator keeps on through PGOPTIONS): how much
# of the latency is the relay's commit flush
LAT_RELAY_ASYNC_COMMIT = env_int("BENCH_LAT_RELAY_ASYNC_COMMIT", 0)
# section 5: the table under a steady load (events at a steady rate with the relay publishing and
# the retention deleting), sampled every BENCH_STEADY_SAMPLE_SECONDS, once per case
STEADY_EVENTS = env_int("BENCH_STEADY_EVENTS", 5000000)
STEADY_RATE = env_int("BENCH_STEADY_RATE", 20000)
STEADY_BATCH = env_int("BENCH_STEADY_BATCH", 1000)
STEADY_CONNECTIONS = env_int("BENCH_STEADY_CONNECTIONS", 2)
STEADY_SAMPLE_SECONDS = env_int("BENCH_STEADY_SAMPLE_SECONDS", 10)
STEADY_CASES = env_str("BENCH_STEADY_CASES", "snapshot,snapshot:outbox.vacuum_interval=0,row")
STEADY_TARGET = 1.5
WORK = env_str("BENCH_WORK_DIR", "/tmp/outbox-bench-work")
RESULTS = env_str("BENCH_RESULTS_DIR", os.path.join(BENCH, "results"))
MAX_OTHER_CORES = float(env_str("BENCH_MAX_OTHER_CORES", "0.5"))
QUIET_WAIT = env_int("BENCH_QUIET_WAIT", 60)
RUN_ID = datetime.datetime.now().strftime("%Y%m%d%H%M%S")


def log(msg):
    print("[%s] %s" % (time.strftime("%H:%M:%S"), msg), flush=True)


def pct(values, p):
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


class Bench:
    def __init__(self):
        os.makedirs(WORK, exist_ok=True)
        os.makedirs(RESULTS, exist_ok=True)
        self.conn = None
        self.connect()
        self.res = {
            "run_id": RUN_ID,
            "started_at": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "params": {"events": EVENTS, "poller_events": POLLER_EVENTS, "aggregates": AGGREGATES, "pgbench_seconds": PGBENCH_SECONDS, "pgbench_rounds": PGBENCH_ROUNDS,
                       "latency_seconds": LATENCY_SECONDS, "rate": RATE,
                       "warmup_seconds": WARMUP_SECONDS, "pgbench_clients": 8,
                       "steady_events": STEADY_EVENTS, "steady_rate": STEADY_RATE, "steady_batch": STEADY_BATCH,
                       "steady_connections": STEADY_CONNECTIONS, "steady_cases": STEADY_CASES},
            "sections": {},
            "quiet_checks": [],
            "notes": [],
        }
        self.kafka_pid = int(open(os.path.join(env_str("OUTBOX_KAFKA_DIR", "/tmp/outbox-bench-kafka"),
                                               "broker.pid")).read().strip())
        self.has_pause = False
        self.has_relay_mode = False

    # ------------------------------------------------------------------ database helpers

    def connect(self):
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:
                pass
        self.conn = psycopg.connect(common.pg_conninfo(), autocommit=True)

    def q(self, sql, params=None):
        cur = self.conn.execute(sql, params)
        return cur.fetchall() if cur.description else None

    def q1(self, sql, params=None):
        rows = self.q(sql, params)
        return rows[0][0] if rows else None

    def postmaster_pid(self):
        with open(os.path.join(env_str("OUTBOX_PG_DIR", "/tmp/outbox-bench-pg"), "data",
                               "postmaster.pid")) as f:
            return int(f.readline())

    def relay_pid(self):
        return self.q1("SELECT pid FROM outbox.worker_status()")

    def relay_state(self):
        return self.q1("SELECT state FROM outbox.worker_status()")

    def meter(self):
        return common.CpuMeter(self.postmaster_pid(), self.kafka_pid, self.relay_pid())

    def wait_for(self, what, fn, timeout, interval=0.1):
        deadline = time.time() + timeout
        while time.time() < deadline:
            v = fn()
            if v:
                return v
            time.sleep(interval)
        raise RuntimeError("timed out after %ss waiting for %s" % (timeout, what))

    def pg_restart(self):
        subprocess.run([os.path.join(REPO, "test/env/pg.sh"), "restart"], check=True)
        self.wait_for("postgres", self._try_connect, 60, 0.5)

    def _try_connect(self):
        try:
            self.connect()
            return True
        except Exception:
            return False

    def pause(self):
        if self.has_pause:
            self.q("SELECT outbox.pause()")
            self.wait_for("relay paused", lambda: self.relay_state() == "paused", 30)
        else:
            self.q("ALTER SYSTEM SET outbox.bootstrap_servers = ''")
            self.q("SELECT pg_reload_conf()")
            self.wait_for("relay unconfigured", lambda: self.relay_state() == "not_configured", 30)

    def resume(self):
        if self.has_pause:
            self.q("SELECT outbox.resume()")
        else:
            self.q("ALTER SYSTEM RESET outbox.bootstrap_servers")
            self.q("SELECT pg_reload_conf()")

    def set_retention(self, seconds):
        if seconds is None:
            self.q("ALTER SYSTEM RESET outbox.retention")
        else:
            self.q("ALTER SYSTEM SET outbox.retention = %d" % seconds)
        self.q("SELECT pg_reload_conf()")
        time.sleep(1.5)     # the relay applies it at the top of its next loop (SIGHUP wakes it)

    def sizes(self, table):
        r = self.q("""SELECT pg_relation_size(c.oid), pg_indexes_size(c.oid), pg_total_relation_size(c.oid),
                             s.n_live_tup, s.n_dead_tup, s.autovacuum_count, s.vacuum_count,
                             (SELECT count(*) FROM %s)
                        FROM pg_class c JOIN pg_stat_user_tables s ON s.relid = c.oid
                       WHERE c.oid = %%s::regclass""" % table, (table,))[0]
        return {"table_bytes": r[0], "index_bytes": r[1], "total_bytes": r[2], "n_live_tup": r[3],
                "n_dead_tup": r[4], "autovacuum_count": r[5], "vacuum_count": r[6], "rows": r[7]}

    def insert_backlog(self, table, agg_type, n, by_snapshot=False):
        """Commit a backlog of n events in chunks of 100k with INSERT ... SELECT generate_series.
        by_snapshot: the events carry their transaction's xid, as emit() writes them with
        outbox.relay_mode = snapshot (the xid is taken before the first id, as emit() does)."""
        cols = {
            "outbox.events": ("(aggregate_type, aggregate_id, event_type, payload)",
                              "'{t}', (g % {a} + 1)::text, 'order.created', {p}"),
            "dbz_outbox": ("(aggregatetype, aggregateid, type, payload)",
                           "'{t}', (g % {a} + 1)::text, 'order.created', {p}"),
            "poller_outbox": ("(aggregate_type, aggregate_id, event_type, payload)",
                              "'{t}', (g % {a} + 1)::text, 'order.created', {p}"),
        }[table]
        sel = cols[1].format(t=agg_type, a=AGGREGATES, p=common.payload_sql("g %% %d + 1" % AGGREGATES, "g"))
        t0 = time.time()
        for lo in range(1, n + 1, CHUNK):
            hi = min(lo + CHUNK - 1, n)
            if by_snapshot:
                with self.conn.transaction():
                    self.q("SELECT pg_current_xact_id()")
                    self.q("INSERT INTO %s %s SELECT %s, pg_current_xact_id() FROM generate_series(%d, %d) AS g"
                           % (table, cols[0][:-1] + ", xid)", sel, lo, hi))
            else:
                self.q("INSERT INTO %s %s SELECT %s FROM generate_series(%d, %d) AS g"
                       % (table, cols[0], sel, lo, hi))
        self.q("ANALYZE %s" % table)
        return round(time.time() - t0, 2)

    # ------------------------------------------------------------------ machine quietness

    def quiet_check(self, label):
        """Before a measured section: CPU that other users of the machine take right now.  Waits
        (up to BENCH_QUIET_WAIT s) while it is above BENCH_MAX_OTHER_CORES; records it."""
        m = common.CpuMeter(self.postmaster_pid(), self.kafka_pid)
        waited = 0.0
        t0 = time.time()
        while True:
            a = m.snap()
            time.sleep(3)
            d = m.delta(a, m.snap())
            if d["other_cores"] <= MAX_OTHER_CORES or time.time() - t0 >= QUIET_WAIT:
                break
            log("  machine busy before %s: other processes use %.2f cores (load %.2f); waiting"
                % (label, d["other_cores"], common.loadavg()[0]))
            time.sleep(10)
        waited = round(time.time() - t0 - 3, 1)
        rec = {"section": label, "other_cores": d["other_cores"], "load1": common.loadavg()[0],
               "waited_s": waited}
        self.res["quiet_checks"].append(rec)
        return rec

    # ------------------------------------------------------------------ setup / environment

    def environment(self):
        def sh(cmd):
            try:
                return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60).stdout.strip()
            except Exception as e:
                return "unknown (%s)" % e
        cpu = re.search(r"Model name:\s*(.*)", sh("lscpu"))
        kafka_jar = glob.glob(os.path.join(env_str("OUTBOX_CACHE", os.path.join(REPO, ".cache")),
                                           "kafka/libs/kafka_2.13-*.jar"))
        dep = os.path.join(BENCH, "debezium/target/dependency")
        dbz = glob.glob(os.path.join(dep, "debezium-embedded-*.jar"))
        kc = glob.glob(os.path.join(dep, "kafka-clients-*.jar"))
        java = subprocess.run([JAVA, "-version"], capture_output=True, text=True).stderr.splitlines()
        mem = re.search(r"MemTotal:\s*(\d+)", open("/proc/meminfo").read())
        self.res["environment"] = {
            "cpu_model": cpu.group(1).strip() if cpu else platform.processor(),
            "cores": os.cpu_count(),
            "memory_gib": round(int(mem.group(1)) / 1048576, 1) if mem else None,
            "kernel": platform.release(),
            "postgres": self.q1("SHOW server_version"),
            "outbox_extension": self.q1("SELECT extversion FROM pg_extension WHERE extname = 'outbox'"),
            "librdkafka": confluent_kafka.libversion()[0],
            "librdkafka_deb": sh("dpkg-query -W -f='${Version}' librdkafka1"),
            "kafka": os.path.basename(kafka_jar[0])[len("kafka_2.13-"):-4] if kafka_jar else "unknown",
            "debezium": os.path.basename(dbz[0])[len("debezium-embedded-"):-4] if dbz else "unknown",
            "debezium_kafka_clients": os.path.basename(kc[0])[len("kafka-clients-"):-4] if kc else "unknown",
            "java": java[0] if java else "unknown",
            "python": platform.python_version(),
            "psycopg": psycopg.__version__,
            "confluent_kafka": confluent_kafka.version()[0],
            "pgbench": sh("pgbench --version"),
            "load_at_start": common.loadavg(),
        }

    def setup(self):
        log("configuring the bench cluster (wal_level=logical for Debezium, one restart)")
        settings = {
            "wal_level": "logical",
            "shared_buffers": "1GB",
            "max_wal_size": "8GB",
            "checkpoint_timeout": "30min",
            "max_replication_slots": "4",
        }
        for k, v in settings.items():
            self.q("ALTER SYSTEM SET %s = '%s'" % (k, v))
        self.pg_restart()
        self.res["pg_settings"] = {k: self.q1("SHOW %s" % k) for k in
                                   list(settings) + ["synchronous_commit", "fsync", "autovacuum",
                                                     "outbox.batch_size", "outbox.poll_interval",
                                                     "outbox.retention"]}
        # the Debezium peer's offsets belong to the previous cluster
        if os.path.exists(os.path.join(WORK, "dbz-offsets.dat")):
            os.remove(os.path.join(WORK, "dbz-offsets.dat"))
        with open(os.path.join(BENCH, "sql/setup.sql")) as f:
            self.q(f.read())
        # section 5's anatomy of the table at the end of each case (contrib; optional)
        try:
            self.q("CREATE EXTENSION IF NOT EXISTS pgstattuple")
            self.has_pgstattuple = True
        except psycopg.Error:
            self.has_pgstattuple = False
        if RELAY_KAFKA_PROPERTIES:
            self.q("ALTER SYSTEM SET outbox.kafka_properties = '%s'" % RELAY_KAFKA_PROPERTIES.replace("'", "''"))
            self.q("SELECT pg_reload_conf()")
            self.res["notes"].append("relay outbox.kafka_properties = '%s' for the whole run" % RELAY_KAFKA_PROPERTIES)
        self.has_pause = bool(self.q1("SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
                                      " WHERE n.nspname = 'outbox' AND p.proname = 'pause'"))
        if not self.has_pause:
            self.res["notes"].append("extension has no outbox.pause(): paused by outbox.bootstrap_servers = '' + reload")
        self.has_relay_mode = bool(self.q1("SELECT count(*) FROM pg_class WHERE relname = 'relay_progress'"
                                           " AND relnamespace = 'outbox'::regnamespace"))
        self.check_plain_equivalent()
        self.wait_for("relay ready", lambda: self.relay_state() in ("idle", "publishing", "paused"), 60, 0.5)
        self.environment()

    def check_plain_equivalent(self):
        """bench_plain must have outbox.events' columns, defaults, identity and indexes."""
        def shape(rel):
            cols = self.q("""SELECT attname, format_type(atttypid, atttypmod), attnotnull, attidentity,
                                    pg_get_expr(d.adbin, d.adrelid)
                               FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
                              WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum""", (rel,))
            idx = self.q("""SELECT regexp_replace(regexp_replace(pg_get_indexdef(indexrelid), '^.* USING ', ''), '\\s+', ' ', 'g'),
                                   indisunique, indisprimary
                              FROM pg_index WHERE indrelid = %s::regclass ORDER BY 1""", (rel,))
            return cols, idx
        a, b = shape("outbox.events"), shape("bench_plain")
        if a != b:
            raise RuntimeError("bench_plain is not equivalent to outbox.events:\n%s\n%s" % (a, b))
        partial = sum(1 for d, _, _ in a[1] if " WHERE " in d)
        self.res["notes"].append("bench_plain = CREATE TABLE (LIKE outbox.events INCLUDING ALL): columns, "
                                 "defaults, identity ALWAYS and the %d indexes (%d partial) checked equal"
                                 % (len(a[1]), partial))

    # ------------------------------------------------------------------ section 1

    # section 1's pgbench runs: name -> (script, outbox.relay_mode for the run, table the event goes to)
    PGBENCH_RUNS = {
        "emit": ("emit.sql", "row", "outbox.events"),
        "plain": ("plain.sql", None, "bench_plain"),
        "order": ("order.sql", None, None),
        "emit_snapshot": ("emit.sql", "snapshot", "outbox.events"),
        "plain_xid": ("plain_xid.sql", None, "bench_plain"),
    }

    def pgbench(self, name):
        script, mode, table = self.PGBENCH_RUNS[name]
        if mode is not None:
            self.set_relay_mode(mode)
        self.q("TRUNCATE bench_orders, bench_plain, outbox.events")
        self.q("CHECKPOINT")
        quiet = self.quiet_check("1-" + name)
        m = self.meter()
        a = m.snap()
        p = subprocess.run(["pgbench", "-n", "-M", "prepared", "-c", "8", "-j", "2",
                            "-T", str(PGBENCH_SECONDS), "-D", "aggregates=%d" % AGGREGATES,
                            "-f", os.path.join(BENCH, "sql", script)],
                           capture_output=True, text=True)
        # the backends' CPU counts once the postmaster has reaped them (cutime): they exit
        # after pgbench does
        time.sleep(0.5)
        cpu = m.delta(a, m.snap())
        if p.returncode != 0:
            raise RuntimeError("pgbench %s failed: %s" % (name, p.stderr[-2000:]))
        tps = float(re.search(r"tps = ([\d.]+) \(without initial connection time\)", p.stdout).group(1))
        txns = int(re.search(r"number of transactions actually processed: (\d+)", p.stdout).group(1))
        lat = re.search(r"latency average = ([\d.]+) ms", p.stdout)
        orders = self.q1("SELECT count(*) FROM bench_orders")
        events = self.q1("SELECT count(*) FROM %s" % table) if table else 0
        if orders != txns or (table and events != txns):
            raise RuntimeError("section 1 %s: %d transactions but %d orders / %d events"
                               % (name, txns, orders, events))
        with_xid = None
        if table and self.has_relay_mode:
            # the mode took effect: every event of a snapshot run carries its xid, none of a row run
            with_xid = self.q1("SELECT count(*) FROM %s WHERE xid IS NOT NULL" % table)
            want = txns if (mode == "snapshot" or name == "plain_xid") else 0
            if with_xid != want:
                raise RuntimeError("section 1 %s: %d of %d events carry an xid, expected %d"
                                   % (name, with_xid, txns, want))
        log("  %-13s %8.1f tps  (cpu: pg %.1fs relay %.1fs other %.2f cores)"
            % (name, tps, cpu["postgres"], cpu["relay"], cpu["other_cores"]))
        return {"tps": round(tps, 1), "transactions": txns, "relay_mode": mode,
                "events_with_xid": with_xid,
                "latency_ms": float(lat.group(1)) if lat else None, "cpu": cpu, "quiet": quiet}

    def section1(self):
        names = ["emit", "plain", "order"]
        if self.has_relay_mode:
            names += ["emit_snapshot", "plain_xid"]
        log("section 1: emit cost (pgbench, 8 clients, %d s each, %d interleaved rounds of %s)"
            % (PGBENCH_SECONDS, PGBENCH_ROUNDS, ", ".join(names)))
        self.pause()
        # unmeasured warm-up of each script (caches, plans, the first checkpoint after setup)
        for name in names:
            script, mode, _ = self.PGBENCH_RUNS[name]
            if mode is not None:
                self.set_relay_mode(mode)
            subprocess.run(["pgbench", "-n", "-M", "prepared", "-c", "8", "-j", "2", "-T", "2",
                            "-D", "aggregates=%d" % AGGREGATES, "-f", os.path.join(BENCH, "sql", script)],
                           capture_output=True, text=True, check=True)
        runs = {n: [] for n in names}
        # interleaved (a, b, c, a, b, c, ...): other users' load hits all of them alike; noise only
        # ever slows a run down, so the best round of each is reported
        for _ in range(PGBENCH_ROUNDS):
            for name in names:
                runs[name].append(self.pgbench(name))
        self.set_relay_mode(None)
        self.q("TRUNCATE bench_orders, bench_plain, outbox.events")
        out = {}
        for name, rs in runs.items():
            best = max(rs, key=lambda r: r["tps"])
            out[name] = dict(best, all_tps=[r["tps"] for r in rs],
                             all_other_cores=[r["cpu"]["other_cores"] for r in rs],
                             # CPU of the whole cluster per transaction: less moved by other users
                             # of the machine than TPS (which they slow down), though not immune
                             all_cpu_us_per_txn=[round(r["cpu"]["postgres"] * 1e6 / r["transactions"], 1)
                                                 for r in rs])
        out["rounds"] = PGBENCH_ROUNDS
        out["cost_emit_vs_plain"] = round(out["plain"]["tps"] / out["emit"]["tps"], 3)
        out["cost_emit_vs_order"] = round(out["order"]["tps"] / out["emit"]["tps"], 3)
        if "emit_snapshot" in out:
            # snapshot mode: against the plain INSERT of the same row, xid included
            out["cost_emit_snapshot_vs_plain_xid"] = round(out["plain_xid"]["tps"] / out["emit_snapshot"]["tps"], 3)
            out["cost_emit_snapshot_vs_plain"] = round(out["plain"]["tps"] / out["emit_snapshot"]["tps"], 3)
            out["cost_emit_snapshot_vs_order"] = round(out["order"]["tps"] / out["emit_snapshot"]["tps"], 3)
        log("  emit() cost: row mode %.3f x the plain INSERT%s" % (
            out["cost_emit_vs_plain"], "; snapshot mode %.3f x the plain INSERT with xid" %
            out["cost_emit_snapshot_vs_plain_xid"] if "emit_snapshot" in out else ""))
        self.res["sections"]["1_emit_cost"] = out

    # ------------------------------------------------------------------ section 2a + 4

    def sample_relay(self, pid, stop, counts):
        """Where the relay is during the drain: pg_stat_activity of its pid every 100 ms."""
        with psycopg.connect(common.pg_conninfo(), autocommit=True) as c:
            while not stop.is_set():
                r = c.execute("SELECT coalesce(query, ''), coalesce(wait_event_type || ':' || wait_event, 'CPU')"
                              " FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
                if r:
                    act = r[0].replace("outbox relay: ", "") or "idle"
                    key = "%s | %s" % (act, r[1])
                    counts[key] = counts.get(key, 0) + 1
                stop.wait(0.1)

    def set_relay_mode(self, mode):
        """outbox.relay_mode (1.4): 'row' or 'snapshot'; None resets it (snapshot, the default)."""
        if not self.has_relay_mode:
            return
        if mode is None:
            self.q("ALTER SYSTEM RESET outbox.relay_mode")
        else:
            self.q("ALTER SYSTEM SET outbox.relay_mode = '%s'" % mode)
        self.q("SELECT pg_reload_conf()")
        time.sleep(1.5)

    def ext_drain(self, label, retention, truncate=True, mode="row"):
        agg = "bench_drain_%s" % label
        topic = "outbox.event." + agg
        by_snapshot = mode == "snapshot"
        self.pause()
        self.set_retention(retention)
        self.set_relay_mode(mode)
        if truncate:
            self.q("TRUNCATE outbox.events")
        common.create_topic(topic)
        log("  [%s] inserting a backlog of %d events (relay paused, retention %s)"
            % (label, EVENTS, "default" if retention is None else retention))
        ins = self.insert_backlog("outbox.events", agg, EVENTS, by_snapshot)
        self.q("CHECKPOINT")
        before = self.sizes("outbox.events")
        quiet = self.quiet_check("2a-" + label)
        m = self.meter()
        stop = threading.Event()
        counts = {}
        sampler = threading.Thread(target=self.sample_relay, args=(self.relay_pid(), stop, counts))
        sampler.start()
        published0 = self.q1("SELECT published FROM outbox.worker_status()")
        a = m.snap()
        t0 = time.time()
        self.resume()
        polls = 0
        progress = []
        while True:
            time.sleep(max(0.0, 0.1 - (time.time() - t0) % 0.1))
            polls += 1
            if by_snapshot:
                # no published_at to look at: the relay's counter (shared memory, costs nothing),
                # checked against the table below
                if self.q1("SELECT published FROM outbox.worker_status()") - published0 >= EVENTS:
                    break
            elif not self.q1("SELECT EXISTS (SELECT 1 FROM outbox.events WHERE published_at IS NULL)"):
                break
            if polls % 50 == 0:
                pub = self.q1("SELECT published FROM outbox.worker_status()")
                progress.append((round(time.time() - t0, 1), pub))
            if time.time() - t0 > 3600:
                raise RuntimeError("extension drain did not finish within an hour")
        t1 = time.time()
        cpu = m.delta(a, m.snap())
        stop.set()
        sampler.join()
        secs = t1 - t0
        pending = self.q1("SELECT pending FROM outbox.status") if by_snapshot else \
            self.q1("SELECT count(*) FROM outbox.events WHERE published_at IS NULL")
        in_topic = common.topic_message_count(topic)
        after = self.sizes("outbox.events")
        last_pub = None
        if retention != 0 and not by_snapshot:
            last_pub = self.q1("SELECT extract(epoch FROM max(published_at)) FROM outbox.events")
        total = sum(counts.values()) or 1
        profile = {k: round(100.0 * v / total, 1) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}
        r = {"mode": mode or "row", "events": EVENTS, "seconds": round(secs, 2), "events_per_s": round(EVENTS / secs, 1),
             "seconds_by_last_published_at": round(float(last_pub) - t0, 2) if last_pub else None,
             "pending_after": pending, "messages_in_topic": in_topic, "insert_seconds": ins,
             "size_before": before, "size_after": after, "cpu": cpu, "relay_activity_pct": profile,
             "progress": progress, "quiet": quiet}
        log("  [%s] drained %d in %.2f s = %.0f events/s; topic holds %d; relay cpu %.1fs of %.1fs"
            % (label, EVENTS, secs, EVENTS / secs, in_topic, cpu["relay"], secs))
        if pending != 0 or in_topic < EVENTS:
            raise RuntimeError("extension drain %s incomplete: %d pending, %d in topic" % (label, pending, in_topic))
        return r

    def wait_cleanup(self, label, timeout):
        """Wait until the relay's retention cleanup deleted every published row."""
        t0 = time.time()
        self.wait_for("cleanup of %s" % label,
                      lambda: self.q1("SELECT count(*) FROM outbox.events") == 0, timeout, 1.0)
        return round(time.time() - t0, 1)

    def section2a_4(self):
        log("section 2(a) + 4: the extension's relay drains %d events" % EVENTS)
        out = {}
        out["retention_0"] = self.ext_drain("r0", 0)
        out["retention_0"]["size_after_retention"] = out["retention_0"]["size_after"]
        retention = 60
        d = self.ext_drain("r60", None)
        log("  [r60] waiting for the retention cleanup (%d s after publication)" % retention)
        d["cleanup_wait_s"] = self.wait_cleanup("r60", retention + 600)
        d["size_after_retention"] = self.sizes("outbox.events")
        out["retention_60"] = d
        log("  [r60b] second drain of the same size, no VACUUM in between")
        d2 = self.ext_drain("r60b", None, truncate=False)
        d2["cleanup_wait_s"] = self.wait_cleanup("r60b", retention + 600)
        d2["size_after_retention"] = self.sizes("outbox.events")
        out["retention_60_second"] = d2
        alone = []
        if PRODUCE_ALONE:
            alone.append(self.librdkafka_alone("pa1"))
        if self.has_relay_mode:
            # the default relay (relay_mode = snapshot, 1.4): the headline drains
            d = self.ext_drain("s60", None, mode="snapshot")
            log("  [s60] waiting for the retention cleanup (%d s after creation)" % retention)
            d["cleanup_wait_s"] = self.wait_cleanup("s60", retention + 600)
            d["size_after_retention"] = self.sizes("outbox.events")
            out["snapshot_60"] = d
            d2 = self.ext_drain("s60b", None, truncate=False, mode="snapshot")
            d2["cleanup_wait_s"] = self.wait_cleanup("s60b", retention + 600)
            d2["size_after_retention"] = self.sizes("outbox.events")
            out["snapshot_60_second"] = d2
            self.set_relay_mode(None)
        self.set_retention(None)
        self.res["sections"]["2a_4_extension_drain"] = out
        if PRODUCE_ALONE:
            alone.append(self.librdkafka_alone("pa2"))
            batched = self.librdkafka_alone("pab", batch=int(self.q1("SHOW outbox.batch_size")))
            best = max(alone, key=lambda r: r["events_per_s"])
            self.res["sections"]["2d_librdkafka_alone"] = {
                "stream": dict(best, all_events_per_s=[r["events_per_s"] for r in alone]),
                "batched": batched,
                "what": "`bench/load/produce_alone.c` (librdkafka %s) produced the same %d messages (keys over %d "
                        "aggregates, the relay's three headers, the payload as jsonb prints it, %.0f bytes) with the "
                        "relay's producer settings to the same broker, best of %d runs (%s events/s) before and after "
                        "the extension's drains" % (self.res["environment"].get("librdkafka"), EVENTS, AGGREGATES,
                                                     best["value_bytes"], len(alone),
                                                     ", ".join("%.0f" % r["events_per_s"] for r in alone))}

    def librdkafka_alone(self, label, batch=0):
        """Section 2: librdkafka alone (bench/load/produce_alone.c) produces the messages of the
        extension's drain, with the relay's producer settings, to a fresh topic of the same broker;
        batch > 0: in batches of that many, each waited for until its delivery reports are in."""
        topic = "outbox.event.bench_alone_%s" % label
        common.create_topic(topic)
        quiet = self.quiet_check("2a-" + label)
        m = self.meter()
        a = m.snap()
        p = subprocess.run([PRODUCE_ALONE, common.kafka_bootstrap(), topic, str(EVENTS), str(AGGREGATES),
                            "bench_alone_" + label, str(batch)], capture_output=True, text=True)
        cpu = m.delta(a, m.snap())
        if p.returncode != 0:
            raise RuntimeError("produce_alone %s failed: %s" % (label, p.stderr[-2000:]))
        r = json.loads(p.stdout.strip().splitlines()[-1])
        r["messages_in_topic"] = common.topic_message_count(topic)
        r["cpu"] = cpu
        r["quiet"] = quiet
        if r["messages_in_topic"] < EVENTS:
            raise RuntimeError("produce_alone %s: topic holds %d of %d" % (label, r["messages_in_topic"], EVENTS))
        log("  [%s] librdkafka alone%s: %d messages in %.2f s = %.0f/s (producer cpu %.1f s)"
            % (label, " in batches of %d" % batch if batch else "", EVENTS, r["seconds"], r["events_per_s"],
               r["cpu_s"]))
        return r

    # ------------------------------------------------------------------ section 2b (Debezium)

    def dbz_env(self, topic, expect=0, poll_ms=None):
        e = dict(os.environ)
        if poll_ms is not None:
            e["DBZ_POLL_MS"] = str(poll_ms)
        e.update({"DBZ_PG_HOST": env_str("PGHOST", "127.0.0.1"), "DBZ_PG_PORT": env_str("PGPORT", "54601"),
                  "DBZ_PG_DB": env_str("PGDATABASE", "outbox"), "DBZ_PG_USER": env_str("PGUSER", "postgres"),
                  "DBZ_KAFKA": common.kafka_bootstrap(), "DBZ_OFFSETS": os.path.join(WORK, "dbz-offsets.dat"),
                  "DBZ_SLOT": "dbz_bench", "DBZ_TABLE": "public.dbz_outbox", "DBZ_TOPIC": topic,
                  "DBZ_EXPECT": str(expect)})
        return e

    def dbz_start(self, mode, topic, expect=0, poll_ms=None):
        d = os.path.join(BENCH, "debezium")
        cp = "%s/target/classes:%s/target/dependency/*" % (d, d)
        logf = open(os.path.join(WORK, "dbz-%s.log" % mode), "a")
        p = subprocess.Popen([JAVA, "-Xmx1g", "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
                              "-cp", cp, "DbzBench", mode],
                             stdout=subprocess.PIPE, stderr=logf, text=True, env=self.dbz_env(topic, expect, poll_ms))
        lines = []

        def reader():
            for line in p.stdout:
                lines.append(line.strip())
        t = threading.Thread(target=reader, daemon=True)
        t.start()
        return p, lines, t

    def dbz_wait_streaming(self, p, lines, timeout=120):
        def ok():
            if p.poll() is not None:
                raise RuntimeError("Debezium exited: %s (see %s/dbz-*.log)" % (lines[-5:], WORK))
            return "STARTED" in lines and self.q1(
                "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'dbz_bench' AND active")
        self.wait_for("Debezium streaming", ok, timeout, 0.2)

    def dbz_stop(self, p, t):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        t.join(5)

    def dbz_progress(self, lines):
        for line in reversed(lines):
            if line.startswith("PROGRESS"):
                return int(line.split()[2])
        return 0

    def dbz_init(self):
        """Create the slot and publication and commit a first offset: start the engine once
        (snapshot.mode=no_data), push one warm-up event through it, stop it."""
        if os.path.exists(os.path.join(WORK, "dbz-offsets.dat")):
            os.remove(os.path.join(WORK, "dbz-offsets.dat"))
        topic = "outbox.event.bench_dbz_warmup"
        common.create_topic(topic)
        p, lines, t = self.dbz_start("run", topic)
        self.dbz_wait_streaming(p, lines)
        self.q("INSERT INTO dbz_outbox (aggregatetype, aggregateid, type, payload) VALUES "
               "('bench_dbz_warmup', '1', 'warmup', '{}')")
        self.wait_for("Debezium warm-up event", lambda: self.dbz_progress(lines) >= 1, 60, 0.2)
        time.sleep(2.5)       # offset.flush.interval.ms = 1000; close() commits again
        self.dbz_stop(p, t)

    def section2b(self):
        log("section 2(b): Debezium embedded engine drains %d events from the WAL" % EVENTS)
        self.dbz_init()
        agg = "bench_dbz_drain"
        topic = "outbox.event." + agg
        common.create_topic(topic)
        log("  inserting the backlog while the connector is stopped")
        ins = self.insert_backlog("dbz_outbox", agg, EVENTS)
        self.q("CHECKPOINT")
        slot_lag = self.q1("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn) FROM pg_replication_slots"
                           " WHERE slot_name = 'dbz_bench'")
        quiet = self.quiet_check("2b")
        m = self.meter()
        a = m.snap()
        t0 = time.time()
        p, lines, t = self.dbz_start("drain", topic, EVENTS)
        rc = p.wait(7200)
        t1 = time.time()
        cpu = m.delta(a, m.snap())
        t.join(5)
        done = [l for l in lines if l.startswith("DONE")]
        if rc != 0 or not done:
            raise RuntimeError("Debezium drain failed (rc %s): %s" % (rc, lines[-5:]))
        _, n, secs_engine, secs_first = done[-1].split()
        secs_engine, secs_first = float(secs_engine), float(secs_first)
        in_topic = common.topic_message_count(topic)
        r = {"events": EVENTS, "seconds": secs_engine, "events_per_s": round(EVENTS / secs_engine, 1),
             "seconds_from_first_record": secs_first, "seconds_with_jvm_start": round(t1 - t0, 2),
             "acked": int(n), "messages_in_topic": in_topic, "insert_seconds": ins,
             "wal_backlog_bytes": int(slot_lag) if slot_lag is not None else None, "cpu": cpu, "quiet": quiet}
        log("  drained %d in %.2f s (engine start to last ack) = %.0f events/s; %.2f s with JVM start; topic holds %d"
            % (EVENTS, secs_engine, EVENTS / secs_engine, t1 - t0, in_topic))
        if in_topic < EVENTS:
            raise RuntimeError("Debezium drain incomplete: %d in topic" % in_topic)
        self.res["sections"]["2b_debezium_drain"] = r

    # ------------------------------------------------------------------ section 2c (poller)

    def poller_start(self, drain):
        args = [PY, os.path.join(BENCH, "poller/poller.py")] + (["--drain"] if drain else [])
        e = dict(os.environ)
        e["OUTBOX_KAFKA"] = common.kafka_bootstrap()
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=open(os.path.join(WORK, "poller.log"), "a"),
                             text=True, env=e)
        lines = []

        def reader():
            for line in p.stdout:
                lines.append(line.strip())
        t = threading.Thread(target=reader, daemon=True)
        t.start()
        return p, lines, t

    def section2c(self):
        log("section 2(c): the Python poller drains %d events" % POLLER_EVENTS)
        agg = "bench_poller_drain"
        topic = "outbox.event." + agg
        self.q("TRUNCATE poller_outbox")
        common.create_topic(topic)
        ins = self.insert_backlog("poller_outbox", agg, POLLER_EVENTS)
        self.q("CHECKPOINT")
        quiet = self.quiet_check("2c")
        m = self.meter()
        a = m.snap()
        t0 = time.time()
        p, lines, t = self.poller_start(True)
        rc = p.wait(4 * 3600)
        t1 = time.time()
        cpu = m.delta(a, m.snap())
        t.join(5)
        done = [l for l in lines if l.startswith("DONE")]
        if rc != 0 or not done:
            raise RuntimeError("poller drain failed (rc %s): %s" % (rc, lines[-5:]))
        _, n, secs = done[-1].split()
        secs = float(secs)
        pending = self.q1("SELECT count(*) FROM poller_outbox WHERE published_at IS NULL")
        in_topic = common.topic_message_count(topic)
        r = {"events": POLLER_EVENTS, "seconds": secs, "events_per_s": round(POLLER_EVENTS / secs, 1),
             "seconds_with_process_start": round(t1 - t0, 2), "published": int(n), "pending_after": pending,
             "messages_in_topic": in_topic, "insert_seconds": ins, "cpu": cpu, "quiet": quiet,
             "size_after": self.sizes("poller_outbox")}
        log("  drained %d in %.2f s = %.0f events/s; topic holds %d" % (POLLER_EVENTS, secs, POLLER_EVENTS / secs, in_topic))
        if pending != 0 or in_topic < POLLER_EVENTS:
            raise RuntimeError("poller drain incomplete: %d pending, %d in topic" % (pending, in_topic))
        self.res["sections"]["2c_poller_drain"] = r

    # ------------------------------------------------------------------ section 3

    def latency_run(self, system):
        agg = "bench_lat_%s" % system
        topic = "outbox.event." + agg
        # LogAppendTime: every message carries the broker's append time (ms), which splits the
        # latency into commit -> Kafka and Kafka -> consumer without touching the systems
        common.create_topic(topic, config=LAT_TOPIC_CONFIG)
        table = {"ext": "outbox.events", "dbz": None, "poller": "poller_outbox"}[system]
        # fresh tables; Debezium's stays (a TRUNCATE would reach the connector through the slot)
        self.q("TRUNCATE bench_orders" + (", " + table if table else ""))
        self.q("CHECKPOINT")
        proc = None
        acked = {}
        if system == "ext":
            if LAT_RELAY_ASYNC_COMMIT:
                self.relay_sync_commit(False)
            if LAT_KAFKA_PROPERTIES:
                self.q("ALTER SYSTEM SET outbox.kafka_properties = '%s'" % LAT_KAFKA_PROPERTIES.replace("'", "''"))
            self.set_retention(-1)      # keep published_at of every row until it is read below
            self.resume()
            self.wait_for("relay running", lambda: self.relay_state() in ("idle", "publishing"), 30)
        elif system == "dbz":
            proc = self.dbz_start("run", topic, poll_ms=DBZ_LATENCY_POLL_MS)
            self.dbz_wait_streaming(proc[0], proc[1])
        else:
            proc = self.poller_start(False)
        stop_file = os.path.join(WORK, "lat-%s.stop" % system)
        if os.path.exists(stop_file):
            os.remove(stop_file)
        commits_csv = os.path.join(WORK, "lat-%s-commits.csv" % system)
        recv_csv = os.path.join(WORK, "lat-%s-recv.csv" % system)
        # the consumers, each reading the whole topic: the Python one, the C one (lat_consumer.c,
        # built by run.sh), and with BENCH_LAT_BATCH_CONSUMER=1 the Python one as it was before
        # (consume(1000, 0.05)), to show what its batch window cost
        cmds = {"py": [PY, os.path.join(HERE, "consumer.py"), "--topic", topic, "--out", recv_csv,
                       "--stop-file", stop_file]}
        if LAT_C_CONSUMER:
            cmds["c"] = [LAT_C_CONSUMER, common.kafka_bootstrap(), topic, str(common.PARTITIONS),
                         recv_csv.replace(".csv", "-c.csv"), stop_file]
        if LAT_BATCH_CONSUMER:
            cmds["py_batch"] = cmds["py"][:] + ["--batch"]
            cmds["py_batch"][5] = recv_csv.replace(".csv", "-batch.csv")
        consumers = {}
        for k, cmd in cmds.items():
            consumers[k] = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
            if consumers[k].stdout.readline().strip() != "READY":
                raise RuntimeError("latency consumer %s did not start" % k)
        cons = consumers["py"]
        quiet = self.quiet_check("3-" + system)
        m = self.meter()
        stop = threading.Event()
        counts = {}
        sampler = None
        if system == "ext":
            sampler = threading.Thread(target=self.sample_relay, args=(self.relay_pid(), stop, counts))
            sampler.start()
        # run-queue waits (kernel schedstat) of the relay and of Kafka: on a shared 2-core machine
        # the time a woken process waits for a CPU is a part of the latency no setting removes
        sched_pids = {"kafka": self.kafka_pid}
        if system == "ext":
            sched_pids["relay"] = self.relay_pid()
        sched_a = {k: common.schedstat(v) + (time.time(),) for k, v in sched_pids.items() if common.schedstat(v)}
        a = m.snap()
        g = subprocess.run([PY, os.path.join(HERE, "loadgen.py"), "--system", system, "--aggregate-type", agg,
                            "--rate", str(RATE), "--seconds", str(LATENCY_SECONDS), "--warmup", str(WARMUP_SECONDS),
                            "--aggregates", str(AGGREGATES), "--out", commits_csv],
                           capture_output=True, text=True,
                           env=dict(os.environ, PGOPTIONS="-c synchronous_commit=on") if LAT_RELAY_ASYNC_COMMIT else None)
        if g.returncode != 0:
            raise RuntimeError("load generator failed: %s %s" % (g.stdout[-2000:], g.stderr[-2000:]))
        committed = int(g.stdout.split()[1])
        achieved = float(g.stdout.split()[3])
        with open(stop_file, "w") as f:
            f.write(str(committed))
        sched_b = {k: common.schedstat(v) + (time.time(),) for k, v in sched_pids.items() if common.schedstat(v)}
        for c in consumers.values():
            c.communicate(timeout=600)
        t_end = time.time()
        cpu = m.delta(a, m.snap())
        stop.set()
        if sampler is not None:
            sampler.join()
        if proc is not None:
            if system == "dbz":
                self.dbz_stop(proc[0], proc[2])
            else:
                proc[0].send_signal(signal.SIGTERM)
                proc[0].wait(60)
        elif system == "ext":
            self.pause()
            acked = {str(r[0]): r[1] for r in self.q(
                "SELECT event_id, extract(epoch FROM published_at)::float8 FROM outbox.events"
                " WHERE published_at IS NOT NULL")}
            if LAT_KAFKA_PROPERTIES:
                if RELAY_KAFKA_PROPERTIES:
                    self.q("ALTER SYSTEM SET outbox.kafka_properties = '%s'" % RELAY_KAFKA_PROPERTIES.replace("'", "''"))
                else:
                    self.q("ALTER SYSTEM RESET outbox.kafka_properties")
            if LAT_RELAY_ASYNC_COMMIT:
                self.relay_sync_commit(True)
            self.set_retention(None)
        commits = {}
        lags = []
        with open(commits_csv) as f:
            for row in csv.DictReader(f):
                commits[row["event_id"]] = (float(row["commit_time"]), row["phase"])
                if row["phase"] == "measure":
                    lags.append(float(row["sched_lag"]))
        def read_recv(path):
            recv, append, dups = {}, {}, 0
            with open(path) as f:
                for row in csv.DictReader(f):
                    if row["event_id"] in recv:
                        dups += 1
                        continue
                    recv[row["event_id"]] = float(row["recv_time"])
                    if row.get("kafka_ts_type") in ("2",):     # TIMESTAMP_LOG_APPEND_TIME
                        append[row["event_id"]] = int(row["kafka_ts_ms"]) / 1000.0
            return recv, append, dups

        recv, append, dups = read_recv(recv_csv)
        lat = []
        missing = 0
        for eid, (tc, phase) in commits.items():
            if phase != "measure":
                continue
            if eid not in recv:
                missing += 1
                continue
            lat.append((recv[eid] - tc) * 1000.0)

        def dist(values):
            if not values:
                return None
            return {"n": len(values), "p50": round(pct(values, 50), 2), "p95": round(pct(values, 95), 2),
                    "p99": round(pct(values, 99), 2), "max": round(max(values), 2)}

        def span(a, b):
            """b - a in ms over the measured events that have both."""
            return dist([(b[e] - a[e]) * 1000.0 for e, (tc, ph) in commits.items()
                         if ph == "measure" and e in a and e in b])

        commit_t = {e: tc for e, (tc, ph) in commits.items()}
        bd = {"commit_to_py_consumer": dist(lat),
              "sched": {k: common.schedstat_delta(sched_a[k], sched_b[k]) for k in sched_a if k in sched_b}}
        if append:
            # the broker's LogAppendTime has ms resolution (truncated): up to 1 ms too early
            bd["commit_to_kafka_append"] = span(commit_t, append)
            bd["kafka_append_to_py_consumer"] = span(append, recv)
        if system == "ext" and acked:
            # published_at: the relay saw the last delivery report of the batch (GetCurrentTimestamp
            # before its UPDATE); the relay's commit follows
            bd["commit_to_relay_ack"] = span(commit_t, acked)
            meas = sorted(acked[e] for e, (tc, ph) in commits.items() if ph == "measure" and e in acked)
            cycles = sorted(set(meas))
            if len(cycles) > 1:
                gaps = [(b - a) * 1000.0 for a, b in zip(cycles, cycles[1:])]
                bd["relay_batches"] = {"batches": len(cycles), "events_per_batch": round(len(meas) / len(cycles), 2),
                                       "batch_interval_ms": dist(gaps)}
        for k in ("c", "py_batch"):
            if k not in consumers:
                continue
            rc, ra, rd = read_recv(cmds[k][4] if k == "c" else cmds[k][5])
            bd["commit_to_%s_consumer" % k] = span(commit_t, rc)
            bd["missing_%s_consumer" % k] = sum(1 for e, (tc, ph) in commits.items() if ph == "measure" and e not in rc)
            if k == "c" and ra:
                bd["kafka_append_to_c_consumer"] = span(ra, rc)
                if "commit_to_kafka_append" not in bd:
                    bd["commit_to_kafka_append"] = span(commit_t, ra)
        r = {"offered_rate": RATE, "relay_synchronous_commit_off": bool(LAT_RELAY_ASYNC_COMMIT and system == "ext"),
             "relay_kafka_properties": LAT_KAFKA_PROPERTIES if system == "ext" else "", "achieved_commit_rate": achieved, "measured_events": len(lat) + missing,
             "received": len(lat), "missing": missing, "duplicates": dups,
             "p50_ms": round(pct(lat, 50), 2) if lat else None, "p95_ms": round(pct(lat, 95), 2) if lat else None,
             "p99_ms": round(pct(lat, 99), 2) if lat else None, "max_ms": round(max(lat), 2) if lat else None,
             "mean_ms": round(sum(lat) / len(lat), 2) if lat else None,
             "min_ms": round(min(lat), 2) if lat else None,
             "schedule_lag_p99_ms": round(pct(lags, 99) * 1000, 2) if lags else None,
             "cpu": cpu, "quiet": quiet, "breakdown": bd}
        if counts:
            total = sum(counts.values())
            r["relay_activity_pct"] = {k: round(100.0 * v / total, 1)
                                       for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}
        log("  %-6s p50 %s p95 %s p99 %s max %s ms; %d received, %d missing, %d duplicates; commits %.0f/s"
            % (system, r["p50_ms"], r["p95_ms"], r["p99_ms"], r["max_ms"], len(lat), missing, dups, achieved))
        return r

    def relay_sync_commit(self, on):
        db = env_str("PGDATABASE", "outbox")
        self.q("ALTER DATABASE %s %s" % (db, "RESET synchronous_commit" if on else "SET synchronous_commit = off"))
        old = self.relay_pid()
        self.q("SELECT pg_terminate_backend(%s)", (old,))
        self.wait_for("relay restarted", lambda: self.relay_pid() not in (None, old), 120, 0.5)
        self.wait_for("relay ready", lambda: self.relay_state() in ("idle", "publishing", "paused"), 60, 0.5)
        log("  relay restarted with synchronous_commit %s" % ("on" if on else "off"))

    def test_fsync(self):
        """The commit's floor: pg_test_fsync on the cluster's file system (one 8kB write + fdatasync,
        PostgreSQL's wal_sync_method on Linux).  Every commit of the load generator and every
        batch of the relay waits for one such flush (or joins one: group commit)."""
        exe = os.path.join(subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True).stdout.strip(),
                           "pg_test_fsync")
        if not os.path.exists(exe):
            return None
        path = os.path.join(env_str("OUTBOX_PG_DIR", "/tmp/outbox-bench-pg"), "pg_test_fsync.tmp")
        p = subprocess.run([exe, "-s", "1", "-f", path], capture_output=True, text=True)
        m = re.search(r"one 8kB write.*?\n\s+open_datasync.*?\n\s+fdatasync\s+([\d.]+) ops/sec\s+(\d+) usecs/op",
                      p.stdout, re.S)
        if not m:
            return {"error": (p.stdout + p.stderr)[-500:]}
        r = {"fdatasync_ops_per_s": float(m.group(1)), "fdatasync_ms": int(m.group(2)) / 1000.0}
        log("  pg_test_fsync: 8kB write + fdatasync %.2f ms (%.0f/s)" % (r["fdatasync_ms"], r["fdatasync_ops_per_s"]))
        return r

    def kafka_probe(self):
        """Kafka's own produce -> acknowledgement time at BENCH_RATE, with the relay's producer
        settings, from librdkafka's statistics (probe_producer.py), before the systems run."""
        topic = "bench_lat_probe"
        common.create_topic(topic, config=LAT_TOPIC_CONFIG)
        out = {}
        for linger in (1, 0):       # the relay's default, and without linger
            p = subprocess.run([PY, os.path.join(HERE, "probe_producer.py"), "--topic", topic, "--rate", str(RATE),
                                "--seconds", str(min(10, LATENCY_SECONDS)), "--linger-ms", str(linger)],
                               capture_output=True, text=True)
            if p.returncode != 0:
                return {"error": p.stderr[-500:]}
            r = json.loads(p.stdout.strip().splitlines()[-1])
            log("  Kafka probe linger.ms=%d: rtt p50 %s p99 %s us, int_latency p50 %s p99 %s us, dr p50 %.2f p99 %.2f ms"
                % (linger, r["rtt_us"]["p50"], r["rtt_us"]["p99"], r["int_latency_us"]["p50"],
                   r["int_latency_us"]["p99"], r["dr_ms"]["p50"], r["dr_ms"]["p99"]))
            out["linger_%d" % linger] = r
        return out

    def section3(self):
        log("section 3: latency at %d events/s for %d s (+%d s warm-up)" % (RATE, LATENCY_SECONDS, WARMUP_SECONDS))
        out = {"poller_idle_sleep_ms": 10, "dbz_poll_interval_ms": DBZ_LATENCY_POLL_MS,
               "fsync": self.test_fsync(), "kafka_probe": self.kafka_probe()}
        for system in LAT_SYSTEMS:
            out[system] = self.latency_run(system)
        self.res["sections"]["3_latency"] = out

    def cleanup_dbz(self):
        try:
            self.q("SELECT pg_drop_replication_slot('dbz_bench') FROM pg_replication_slots "
                   "WHERE slot_name = 'dbz_bench' AND NOT active")
            self.q("DROP PUBLICATION IF EXISTS dbz_bench")
        except Exception as e:
            log("could not drop the Debezium slot: %s" % e)

    # ------------------------------------------------------------------ section 5

    # case options that are server settings (ALTER SYSTEM + reload) rather than storage
    # parameters of outbox.events; vacuum_every = N: the bench itself runs VACUUM outbox.events
    # every N s (what a relay that vacuums after its deletes would do); retention = N:
    # outbox.retention for the case
    STEADY_SERVER_SETTINGS = ("autovacuum_naptime", "autovacuum_work_mem", "maintenance_work_mem",
                              "autovacuum_vacuum_cost_limit", "vacuum_cost_limit", "outbox.vacuum_interval")

    def steady_case(self, spec):
        """'mode[:key=value...]', e.g. 'snapshot', 'snapshot:autovacuum_naptime=10s',
        'snapshot:fillfactor=90:autovacuum_vacuum_threshold=1000', 'row'."""
        parts = [x.strip() for x in spec.split(":") if x.strip()]
        if not parts or parts[0] not in ("row", "snapshot"):
            raise RuntimeError("BENCH_STEADY_CASES: %r must start with row or snapshot" % spec)
        case = {"spec": spec, "mode": parts[0], "table": {}, "server": {}, "vacuum_every": None,
                "retention": None}
        for opt in parts[1:]:
            if "=" not in opt:
                raise RuntimeError("BENCH_STEADY_CASES: %r in %r is not key=value" % (opt, spec))
            k, v = [x.strip() for x in opt.split("=", 1)]
            if k == "vacuum_every":
                case["vacuum_every"] = float(v)
            elif k == "retention":
                case["retention"] = int(v)
            elif k in self.STEADY_SERVER_SETTINGS:
                case["server"][k] = v
            elif re.match(r"^[a-z_.]+$", k) and re.match(r"^[0-9A-Za-z_.]+$", v):
                case["table"][k] = v
            else:
                raise RuntimeError("BENCH_STEADY_CASES: bad option %r" % opt)
        return case

    def steady_sample(self, t0, phase, exact=False):
        """One sample of outbox.events.  Retained rows = max(id) - min(id) + 1 of the rows a fresh
        snapshot sees (two probes of the primary key; the retention deletes the oldest ids first
        and the loader's ids have no gaps), their size = that count x the average
        pg_column_size(e.*) (each row's tuple: 24-byte header + data, without line pointer or
        page overhead) of the newest 10,000 rows.  exact: also count(*) and sum(pg_column_size)
        over the whole table (a full scan: seconds on this machine, so only at the end).  The
        sizes are read after the row figures: they only grow, so the ratio errs high."""
        t_sample = t = time.time()
        lo, hi = self.q("SELECT min(id), max(id) FROM outbox.events")[0]
        rows = (hi - lo + 1) if lo is not None else 0
        avg = self.q1("SELECT avg(pg_column_size(e.*))::float8 FROM"
                      " (SELECT * FROM outbox.events ORDER BY id DESC LIMIT 10000) AS e") or 0.0
        row_bytes = int(rows * avg)
        scan_ms = (time.time() - t) * 1000.0
        ex = None
        if exact:
            t = time.time()
            n, b = self.q("SELECT count(*), coalesce(sum(pg_column_size(e.*)), 0)::bigint FROM outbox.events AS e")[0]
            ex = {"rows": n, "row_bytes": int(b), "scan_ms": round((time.time() - t) * 1000.0, 1)}
        r = self.q("""SELECT pg_relation_size(c.oid), pg_table_size(c.oid), pg_indexes_size(c.oid),
                             pg_total_relation_size(c.oid), s.n_live_tup, s.n_dead_tup,
                             s.autovacuum_count, s.vacuum_count
                        FROM pg_class c JOIN pg_stat_user_tables s ON s.relid = c.oid
                       WHERE c.oid = 'outbox.events'::regclass""")[0]
        idx = {k: v for k, v in self.q(
            "SELECT c.relname, pg_relation_size(i.indexrelid) FROM pg_index i"
            " JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = 'outbox.events'::regclass"
            " ORDER BY c.relname")}
        st = self.q("SELECT pending, extract(epoch FROM oldest_pending_age)::float8, published FROM outbox.status")
        vac = self.q("SELECT phase FROM pg_stat_progress_vacuum WHERE relid = 'outbox.events'::regclass")
        total = r[3]
        out = {"t": round(t_sample - t0, 1), "phase": phase, "heap_bytes": r[0], "table_bytes": r[1],
               "index_bytes": r[2], "total_bytes": total, "indexes": idx, "n_live_tup": r[4],
               "n_dead_tup": r[5], "autovacuum_count": r[6], "vacuum_count": r[7],
               "rows": rows, "avg_row_bytes": round(avg, 1), "row_bytes": row_bytes, "probe_ms": round(scan_ms, 1),
               "ratio": round(total / float(row_bytes), 3) if rows >= 10000 else None,
               "pending": st[0][0] if st else None,
               "oldest_pending_s": round(st[0][1], 2) if st and st[0][1] is not None else None,
               "published": st[0][2] if st else None,
               "vacuum_phase": vac[0][0] if vac else None}
        if ex is not None:
            out["exact"] = ex
            out["exact_ratio"] = round(total / float(ex["row_bytes"]), 3) if ex["rows"] >= 10000 else None
        return out

    def vacuum_log(self, since, until):
        """The server log's VACUUM reports of outbox.events (log_autovacuum_min_duration = 0 during
        section 5; the bench's own VACUUMs are not logged): start time, tuples removed, remaining,
        dead but not yet removable, elapsed seconds."""
        path = os.path.join(env_str("OUTBOX_PG_DIR", "/tmp/outbox-bench-pg"), "server.log")
        out = []
        try:
            text = open(path, errors="replace").read()
        except OSError:
            return out
        for m in re.finditer(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+ \w+) \[\d+\] [^\n]*automatic vacuum of table "
                             r"\"[^\"]*\.outbox\.events\"(.*?)elapsed: ([\d.]+) s", text, re.S | re.M):
            try:
                ts = datetime.datetime.strptime(m.group(1)[:23], "%Y-%m-%d %H:%M:%S.%f").replace(
                    tzinfo=datetime.timezone.utc).timestamp()
            except ValueError:
                continue
            end_ts = ts
            body = m.group(2)
            tup = re.search(r"tuples: (\d+) removed, (\d+) remain, (\d+) are dead but not yet removable", body)
            scans = re.search(r"index scans: (\d+)", body)
            el = float(m.group(3))
            if not m.group(1).endswith(("UTC", "GMT")):     # the server logs local time
                ts = time.mktime(time.strptime(m.group(1)[:19], "%Y-%m-%d %H:%M:%S")) + float(m.group(1)[19:23] or 0)
                end_ts = ts
            if not (since <= end_ts <= until):
                continue
            out.append({"ended_at": round(end_ts - since, 1), "elapsed_s": el,
                        "removed": int(tup.group(1)) if tup else None, "remain": int(tup.group(2)) if tup else None,
                        "not_yet_removable": int(tup.group(3)) if tup else None,
                        "index_scans": int(scans.group(1)) if scans else None})
        return out

    def vacuum_watch(self, t0, stop, out):
        """Every VACUUM of outbox.events while the load runs, from pg_stat_progress_vacuum sampled
        every 0.25 s: who ran it (autovacuum worker or the relay's outbox vacuum worker), when it
        started and ended (to within a sample), the phases seen, the heap blocks it had to scan
        and how many index passes it made.  A VACUUM shorter than a sample may be missed; the
        vacuum counts of pg_stat_user_tables are exact."""
        seen = {}
        with psycopg.connect(common.pg_conninfo(), autocommit=True) as c:
            while not stop.wait(0.25):
                now = round(time.time() - t0, 2)
                rows = c.execute(
                    "SELECT p.pid, a.backend_type, p.phase, p.heap_blks_total, p.heap_blks_scanned,"
                    "       p.index_vacuum_count, a.backend_start"
                    "  FROM pg_stat_progress_vacuum p LEFT JOIN pg_stat_activity a ON a.pid = p.pid"
                    " WHERE p.relid = 'outbox.events'::regclass").fetchall()
                live = set()
                for pid, btype, phase, total, scanned, passes, bstart in rows:
                    key = (pid, bstart)
                    live.add(key)
                    v = seen.get(key)
                    if v is None:
                        v = seen[key] = {"by": btype, "start": now, "end": now, "phases": [],
                                         "heap_blks_total": 0, "index_passes": 0}
                        out.append(v)
                    v["end"] = now
                    if phase not in v["phases"]:
                        v["phases"].append(phase)
                    v["heap_blks_total"] = max(v["heap_blks_total"], total or 0)
                    v["index_passes"] = max(v["index_passes"], passes or 0)
                for key in [k for k in seen if k not in live]:
                    seen[key]["done"] = True
                    del seen[key]

    def table_anatomy(self):
        """What outbox.events is made of, by pgstattuple (a full read of the table and each index:
        only once the load is over): the heap's live tuples, dead tuples and free space, and each
        btree's leaf density, its empty and deleted pages.  None without pgstattuple."""
        if not self.has_pgstattuple:
            return None
        h = self.q("SELECT table_len, tuple_count, tuple_len, dead_tuple_count, dead_tuple_len, free_space"
                   "  FROM pgstattuple('outbox.events')")[0]
        out = {"heap": {"bytes": h[0], "live_tuples": h[1], "live_bytes": h[2], "dead_tuples": h[3],
                        "dead_bytes": h[4], "free_bytes": h[5]}, "indexes": {}}
        for (name,) in self.q("SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
                              " WHERE i.indrelid = 'outbox.events'::regclass ORDER BY 1"):
            r = self.q("SELECT index_size, leaf_pages, empty_pages, deleted_pages, avg_leaf_density,"
                       "       leaf_fragmentation FROM pgstatindex(%s)", ("outbox." + name,))[0]
            out["indexes"][name] = {"bytes": r[0], "leaf_pages": r[1], "empty_pages": r[2], "deleted_pages": r[3],
                                    "avg_leaf_density": r[4], "leaf_fragmentation": r[5]}
        return out

    def steady_vacuum(self, every, stop, log_):
        """vacuum_every: VACUUM outbox.events every `every` s (own connection, no cost delay)."""
        with psycopg.connect(common.pg_conninfo(), autocommit=True) as c:
            nxt = time.time() + every
            while not stop.wait(max(0.0, nxt - time.time())):
                t = time.time()
                c.execute("VACUUM outbox.events")
                log_.append(round(time.time() - t, 2))
                nxt = max(nxt + every, time.time())

    def steady_run(self, n, case):
        label = "5-%d-%s" % (n, case["mode"])
        agg = "bench_steady_%d" % n
        topic = "outbox.event." + agg
        self.pause()
        self.set_retention(case["retention"])
        self.set_relay_mode(case["mode"])
        orig = self.q1("SELECT reloptions FROM pg_class WHERE oid = 'outbox.events'::regclass") or []
        orig = dict(o.split("=", 1) for o in orig)
        if case["table"]:
            self.q("ALTER TABLE outbox.events SET (%s)" % ", ".join("%s = %s" % kv for kv in case["table"].items()))
        for k, v in case["server"].items():
            self.q("ALTER SYSTEM SET %s = '%s'" % (k, v))
        if case["server"]:
            self.q("SELECT pg_reload_conf()")
            time.sleep(1.5)
        try:
            return self._steady_run(label, agg, topic, case, orig)
        finally:
            self.pause()
            if case["table"]:
                self.q("ALTER TABLE outbox.events RESET (%s)" % ", ".join(case["table"]))
                back = {k: orig[k] for k in case["table"] if k in orig}
                if back:
                    self.q("ALTER TABLE outbox.events SET (%s)" % ", ".join("%s = %s" % kv for kv in back.items()))
            for k in case["server"]:
                self.q("ALTER SYSTEM RESET %s" % k)
            if case["server"]:
                self.q("SELECT pg_reload_conf()")
            self.set_relay_mode(None)
            self.set_retention(None)

    def _steady_run(self, label, agg, topic, case, orig):
        self.q("TRUNCATE outbox.events")
        common.create_topic(topic)
        settings = {
            "outbox.relay_mode": self.q1("SHOW outbox.relay_mode") if self.has_relay_mode else "row",
            "outbox.retention": self.q1("SHOW outbox.retention"),
            "autovacuum": self.q1("SHOW autovacuum"),
            "autovacuum_naptime": self.q1("SHOW autovacuum_naptime"),
            "table reloptions": self.q1("SELECT reloptions FROM pg_class WHERE oid = 'outbox.events'::regclass"),
        }
        retention_s = int(self.q1("SELECT setting FROM pg_settings WHERE name = 'outbox.retention'"))
        for k in case["server"]:
            settings[k] = self.q1("SHOW %s" % k)
        log("  [%s] %s: %d events at %d/s, %d per commit, %d connections; %s"
            % (label, case["spec"], STEADY_EVENTS, STEADY_RATE, STEADY_BATCH, STEADY_CONNECTIONS,
               ", ".join("%s=%s" % kv for kv in settings.items())))
        self.q("CHECKPOINT")
        quiet = self.quiet_check(label)
        self.resume()
        self.wait_for("relay running", lambda: self.relay_state() in ("idle", "publishing"), 30)
        base = self.q("SELECT s.autovacuum_count, s.vacuum_count FROM pg_stat_user_tables s"
                      " WHERE s.relid = 'outbox.events'::regclass")[0]
        published0 = self.q1("SELECT published FROM outbox.worker_status()")
        loader = subprocess.Popen([PY, os.path.join(HERE, "steady.py"), "--events", str(STEADY_EVENTS),
                                   "--rate", str(STEADY_RATE), "--batch", str(STEADY_BATCH),
                                   "--connections", str(STEADY_CONNECTIONS), "--aggregate-type", agg,
                                   "--aggregates", str(AGGREGATES)],
                                  stdout=subprocess.PIPE, text=True)
        if loader.stdout.readline().strip() != "READY":
            raise RuntimeError("steady loader did not start")
        lines = []
        reader = threading.Thread(target=lambda: lines.extend(l.strip() for l in loader.stdout), daemon=True)
        reader.start()
        m = self.meter()
        a = m.snap()
        t0 = time.time()
        stop = threading.Event()
        vac_log = []
        vac_thread = None
        if case["vacuum_every"]:
            vac_thread = threading.Thread(target=self.steady_vacuum, args=(case["vacuum_every"], stop, vac_log))
            vac_thread.start()
        vacuums = []
        watcher = threading.Thread(target=self.vacuum_watch, args=(t0, stop, vacuums), daemon=True)
        watcher.start()
        samples = []

        def peak_ratio(smps):
            # the table against the most it has had to retain so far: when the loader falls behind
            # (a busy machine) fewer rows are retained but the table keeps the size of the peak
            z = smps[-1]
            peak = max(x["row_bytes"] for x in smps)
            z["peak_row_bytes"] = peak
            z["peak_ratio"] = round(z["total_bytes"] / float(peak), 3) if z["ratio"] is not None else None

        def progress():
            p = [l for l in list(lines) if l.startswith("PROGRESS")]
            return int(p[-1].split()[2]) if p else 0
        try:
            nxt = t0 + STEADY_SAMPLE_SECONDS
            while loader.poll() is None:
                while loader.poll() is None and time.time() < nxt:
                    time.sleep(min(0.2, max(0.0, nxt - time.time())))
                if loader.poll() is not None:
                    break
                smp = self.steady_sample(t0, "load")
                smp["committed"] = progress()
                samples.append(smp)
                peak_ratio(samples)
                log("  [%s] t=%5.0fs committed %8d, retained %8d rows %6.1f MB, heap %6.1f + idx %6.1f MB, "
                    "ratio %s, dead %8d, autovacuums %d, pending %s (%s s)"
                    % (label, smp["t"], smp["committed"], smp["rows"], smp["row_bytes"] / 1048576.0,
                       smp["table_bytes"] / 1048576.0, smp["index_bytes"] / 1048576.0,
                       "%.3f" % smp["ratio"] if smp["ratio"] else "-", smp["n_dead_tup"],
                       smp["autovacuum_count"] - base[0], smp["pending"], smp["oldest_pending_s"]))
                nxt = max(nxt + STEADY_SAMPLE_SECONDS, time.time() + 1.0)
            t_load = time.time()
            reader.join(10)
            done = [l for l in lines if l.startswith("DONE")]
            if loader.returncode != 0 or not done:
                raise RuntimeError("steady loader failed (rc %s): %s" % (loader.returncode, lines[-3:]))
            _, n_ev, l_secs, l_rate, l_maxlag, l_p99lag = done[-1].split()
            smp = self.steady_sample(t0, "load end")
            smp["committed"] = int(n_ev)
            samples.append(smp)
            peak_ratio(samples)
            # the relay catches up; the retention has not yet deleted the last minute
            timeout = max(900, STEADY_EVENTS / float(STEADY_RATE))
            caught_up = None
            while time.time() - t_load < timeout:
                if self.q1("SELECT published FROM outbox.worker_status()") - published0 >= int(n_ev) \
                        and self.q1("SELECT pending FROM outbox.status") == 0:
                    caught_up = round(time.time() - t_load, 1)
                    break
                time.sleep(0.2)
        finally:
            stop.set()
            watcher.join(5)
            if vac_thread is not None:
                vac_thread.join()
            if loader.poll() is None:
                loader.kill()
                loader.wait()
        cpu = m.delta(a, m.snap())
        smp = self.steady_sample(t0, "relay caught up" if caught_up is not None else "relay NOT caught up",
                                 exact=True)
        smp["committed"] = int(n_ev)
        samples.append(smp)
        peak_ratio(samples)
        anatomy = self.table_anatomy()
        in_topic = common.topic_message_count(topic)
        published = self.q1("SELECT published FROM outbox.worker_status()") - published0
        load_samples = [x for x in samples if x["phase"] in ("load", "load end") and x["ratio"] is not None]
        mx = max(load_samples, key=lambda x: x["ratio"]) if load_samples else None
        end = samples[-1]
        rates = []
        prog = [(float(l.split()[1]), int(l.split()[2])) for l in lines if l.startswith("PROGRESS")]
        for (ta, na), (tb, nb) in zip(prog, prog[1:]):
            if tb > ta:
                rates.append((nb - na) / (tb - ta))
        time.sleep(0.5)       # the log line of a VACUUM that just ended
        autovac = self.vacuum_log(t0, time.time())
        r = {"spec": case["spec"], "mode": case["mode"], "table_options": case["table"],
             "server_settings": case["server"], "vacuum_every": case["vacuum_every"],
             "settings": settings, "original_reloptions": orig,
             "retention_s": retention_s,
             # a steady state needs the retention to have been deleting for a while
             "steady_state": float(l_secs) >= 2 * retention_s + 2 * STEADY_SAMPLE_SECONDS,
             "events": int(n_ev), "offered_rate": STEADY_RATE, "batch": STEADY_BATCH,
             "connections": STEADY_CONNECTIONS, "load_seconds": float(l_secs), "achieved_rate": float(l_rate),
             "rate_per_second_min": round(min(rates[1:-1]), 1) if len(rates) > 2 else None,
             "rate_per_second_max": round(max(rates[1:-1]), 1) if len(rates) > 2 else None,
             "schedule_lag_max_s": float(l_maxlag), "schedule_lag_p99_s": float(l_p99lag),
             "relay_caught_up_s": caught_up, "published": published, "messages_in_topic": in_topic,
             "max_ratio": mx["ratio"] if mx else None, "max_ratio_t": mx["t"] if mx else None,
             "max_peak_ratio": max((x["peak_ratio"] for x in load_samples if x.get("peak_ratio")), default=None),
             "end_peak_ratio": end.get("peak_ratio"),
             "end_ratio": end["ratio"], "within_target": bool(mx and mx["ratio"] <= STEADY_TARGET
                                                                and end["ratio"] is not None
                                                                and end["ratio"] <= STEADY_TARGET),
             "max_total_bytes": max(x["total_bytes"] for x in samples),
             "max_heap_bytes": max(x["heap_bytes"] for x in samples),
             "max_pending": max((x["pending"] or 0) for x in samples if x["phase"] != "relay caught up"),
             "max_oldest_pending_s": max((x["oldest_pending_s"] or 0) for x in samples
                                         if x["phase"] != "relay caught up"),
             "autovacuums": end["autovacuum_count"] - base[0], "autovacuum_base": base[0],
             "vacuums": end["vacuum_count"] - base[1],
             "autovacuum_log": autovac, "manual_vacuums": len(vac_log),
             "manual_vacuum_seconds": vac_log, "max_probe_ms": max(x["probe_ms"] for x in samples),
             "end_exact": end.get("exact"), "end_exact_ratio": end.get("exact_ratio"),
             "vacuums_seen": vacuums, "anatomy_end": anatomy,
             "runtime_s": round(time.time() - t0, 1), "cpu": cpu, "quiet": quiet, "samples": samples}
        log("  [%s] %s: %d events in %.1f s = %.0f/s (schedule lag max %.2f s); ratio max %s (t=%s s), end %s: %s; "
            "relay caught up %s s after the load; topic %d"
            % (label, case["spec"], r["events"], r["load_seconds"], r["achieved_rate"], r["schedule_lag_max_s"],
               r["max_ratio"], r["max_ratio_t"], r["end_ratio"],
               "within %.1fx" % STEADY_TARGET if r["within_target"] else "ABOVE %.1fx" % STEADY_TARGET,
               caught_up, in_topic))
        if caught_up is not None and in_topic < r["events"]:
            raise RuntimeError("steady run %s: %d events committed but %d in the topic" % (label, r["events"], in_topic))
        return r

    def section5(self):
        specs = [x.strip() for x in STEADY_CASES.split(",") if x.strip()]
        log("section 5: outbox.events under a steady %d events/s, %d events, cases %s"
            % (STEADY_RATE, STEADY_EVENTS, ", ".join(specs)))
        cases = [self.steady_case(x) for x in specs]
        out = {"events": STEADY_EVENTS, "rate": STEADY_RATE, "batch": STEADY_BATCH, "connections": STEADY_CONNECTIONS,
               "sample_seconds": STEADY_SAMPLE_SECONDS, "target_ratio": STEADY_TARGET, "cases": []}
        self.res["sections"]["5_steady_table"] = out
        # every autovacuum of the table in the server log, with its duration and tuples removed
        self.q("ALTER SYSTEM SET log_autovacuum_min_duration = 0")
        self.q("SELECT pg_reload_conf()")
        try:
            for i, c in enumerate(cases, 1):
                if c["mode"] == "snapshot" and not self.has_relay_mode:
                    log("  skipping %s: the extension has no relay_mode" % c["spec"])
                    continue
                out["cases"].append(self.steady_run(i, c))
        finally:
            self.q("ALTER SYSTEM RESET log_autovacuum_min_duration")
            self.q("SELECT pg_reload_conf()")

    # ------------------------------------------------------------------ main

    def run(self):
        t0 = time.time()
        sections = [x.strip() for x in env_str("BENCH_SECTIONS", "1,2a,2b,2c,3,5").split(",")]
        self.setup()
        try:
            if "1" in sections:
                self.section1()
            if "2a" in sections:
                self.section2a_4()
            if "2b" in sections:
                self.section2b()
            if "2c" in sections:
                self.section2c()
            if "3" in sections:
                self.section3()
            if "5" in sections:
                self.section5()
        finally:
            self.cleanup_dbz()
            self.res["runtime_s"] = round(time.time() - t0, 1)
            self.res["finished_at"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
            self.res["environment"]["load_at_end"] = common.loadavg()
            path = os.path.join(RESULTS, "latest.json")
            with open(path, "w") as f:
                json.dump(self.res, f, indent=2)
            import report
            # what the headline compares: the default relay (snapshot mode, every default)
            self.res["headline"] = report.headline(self.res["sections"])
            md = report.render(self.res)
            with open(os.path.join(RESULTS, "latest.md"), "w") as f:
                f.write(md)
            print()
            print(md)


if __name__ == "__main__":
    Bench().run()
