"""
Lifecycle of the relay worker around its database and extension, without server restarts:
the library preloaded before CREATE EXTENSION (the worker waits, then publishes, same pid);
DROP EXTENSION while events flow (no crash, waits, resumes after CREATE EXTENSION); the
configured database missing (waits without a crash loop, publishes once it exists); and
DROP DATABASE of another database never blocked by the worker (idle, broker down, draining).

(a)-(c) use throw-away clusters (env.pg_dir-lc-*, ports env.pg_port+21..23) whose relay serves
database "postgres" (the product default, which exists from initdb on, so the worker starts at
once); their outbox.status is read from a probe database that has the extension.  (d) runs on
the main cluster.
"""
import time
import uuid
from pathlib import Path

from conftest import (LogWatcher, create_topics, emit_round_robin, new_aggregate_type,
                      order_problems, pg_connect, pg_sh, query, query_one, relay_status, report,
                      settle, topic_prefix, unique_messages, wait_relay_ready, wait_until)
from helpers_lifecycle import (Emitter, connect_db, count_check, db_env, error_lines_of, expected_map,
                               extra_cluster, id_counts, order_violations, relay_exit_lines,
                               relay_pids, relay_state, server_crashes, set_system, timed,
                               topic_message_count)

WAITING_EXT = "waiting for CREATE EXTENSION outbox"
PROBE_DB = "outbox_probe"
# DROP DATABASE of a tiny, unused database waits until every process took in its barrier.  A
# launcher or relay that took it in only when it woke by itself would hold it up to the launcher's
# nap (LAUNCHER_NAP_MS, 10 s) or a batch's outbox.delivery_timeout (30 s): the limit is the former,
# not a guess at how fast this machine drops a database.
DROP_DATABASE_LIMIT_S = 10.0
# (d)'s backlog drains at most one batch of DRAIN_BATCH per DRAIN_LINGER_MS (librdkafka's
# linger.ms holds each batch that long), so it lasts at least DRAIN_EVENTS / DRAIN_BATCH *
# DRAIN_LINGER_MS = 12 s whatever this machine's speed: longer than a DROP DATABASE may take
DRAIN_EVENTS = 6_000
DRAIN_BATCH = 100
DRAIN_LINGER_MS = 200
QUIET_AFTER_RESTART_S = 12     # < MISSING_DB_OBSERVE_S; covers two worker restart intervals
MISSING_DB_OBSERVE_S = 20
MAX_EXITS_WHILE_MISSING = 2      # the first connection attempt fails once (FATAL), then it waits
NOCONN_OBSERVE_S = 12


def all_log_lines(other):
    w = LogWatcher(other)
    w.offset = 0
    return w.new_lines()


def since_ready(lines):
    """The lines of the last server start, once it was ready (drop those of a shutdown).  They
    begin at its "starting PostgreSQL" line: the launcher may log before the postmaster says
    "ready to accept connections"."""
    ready = [i for i, ln in enumerate(lines) if "database system is ready to accept connections" in ln]
    assert ready, "\n".join(lines[-30:])
    starts = [i for i, ln in enumerate(lines[:ready[-1]]) if "starting PostgreSQL" in ln]
    return lines[(starts[-1] if starts else ready[-1]) + 1:]


def make_probe(other):
    """A database with the extension, to read outbox.status of a relay serving another one."""
    c = pg_connect(other)
    try:
        query(c, f"CREATE DATABASE {PROBE_DB}")
    finally:
        c.close()
    p = connect_db(other, PROBE_DB)
    query(p, "CREATE EXTENSION outbox")
    return p


def wait_state(probe, state, timeout=30):
    last = []

    def check():
        rows = relay_status(probe)
        last[:] = rows
        return rows[0] if rows and rows[0]["state"] == state else None
    try:
        return wait_until(check, timeout, f"relay state {state}")
    except AssertionError as e:
        raise AssertionError(f"{e}; last outbox.status: {last}") from None


def read_ids(reader, ids, timeout, extra=2.0):
    """Poll until every id in ids arrived (or timeout), then until the relay settled and the
    topic is read to its end, for at most `extra` seconds (conftest.settle)."""
    ids = set(ids)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reader.poll(0.2)
        if ids <= {m.event_id for m in reader.snapshot()}:
            break
    settle(reader, extra, lambda: reader.poll(0.1))
    return reader.snapshot()


def test_preloaded_before_create_extension_waits_then_publishes(env, reader_factory):
    agg_type = new_aggregate_type("lc_create")
    with extra_cluster(env, "lc-create", 21, database="postgres") as other:
        c = pg_connect(other)
        pid = wait_until(lambda: relay_pids(c), 30, "a relay worker")[0]
        probe = make_probe(other)
        st = wait_state(probe, "waiting_for_extension")
        assert st["pid"] == pid and st["database"] == "postgres", st
        time.sleep(3)                 # several poll intervals: still waiting, logged once
        st = relay_status(probe)[0]
        assert st["state"] == "waiting_for_extension" and st["pid"] == pid, st
        assert len([ln for ln in all_log_lines(other) if WAITING_EXT in ln]) == 1, \
            "\n".join(all_log_lines(other)[-30:])

        topic = topic_prefix(c) + agg_type
        create_topics(env, [topic])
        reader = reader_factory([topic])
        reader.settle_env = other      # its events come from that cluster's relay
        t0 = time.time()
        query(c, "CREATE EXTENSION outbox")
        e = pg_connect(other, autocommit=False)
        emitted = emit_round_robin(e, agg_type, 4, 5, "ce")
        e.close()
        expected = {eid: (agg, seq) for eid, agg, seq in emitted}
        msgs = unique_messages(reader.read_until(len(expected), timeout=30, extra=2))
        count_check(id_counts(msgs), list(expected), "events emitted after CREATE EXTENSION")
        probs = order_problems(msgs, expected)
        assert not probs, "per-aggregate order broken:\n  " + "\n  ".join(probs[:10])
        first_s = min(m.recv_time for m in msgs) - t0

        st = relay_status(c)[0]
        assert st["pid"] == pid and relay_pids(c) == [pid], (st, relay_pids(c))
        assert st["state"] in ("idle", "publishing"), st
        assert st["published"] == len(expected), st
        lines = all_log_lines(other)
        assert len([ln for ln in lines if WAITING_EXT in ln]) == 1
        assert relay_exit_lines(lines) == [], relay_exit_lines(lines)
        assert error_lines_of(lines, [pid]) == [], error_lines_of(lines, [pid])
        report(f"OUTBOX LIFECYCLE create-extension: worker {pid} waited (1 log line), then published"
               f" {len(expected)} events without a restart; first arrived {first_s:.2f}s after"
               f" CREATE EXTENSION was sent")
        c.close()
        probe.close()


def test_drop_extension_while_relaying_then_create_again(env, reader_factory):
    agg_type = new_aggregate_type("lc_drop")
    with extra_cluster(env, "lc-drop", 22, database="postgres") as other:
        c = pg_connect(other)
        query(c, "CREATE EXTENSION outbox")
        probe = make_probe(other)
        pid = wait_relay_ready(other)["pid"]
        topic = topic_prefix(c) + agg_type
        create_topics(env, [topic])
        reader = reader_factory([topic])
        reader.settle_env = other      # its events come from that cluster's relay
        watcher = LogWatcher(other)

        em = Emitter(other, agg_type, 8, "drop")
        em.start()
        try:
            em.wait_count(200)
            wait_until(lambda: reader.poll(0.2) >= 0 and reader.count() >= 50, 30,
                       "events flowing to Kafka")
            em.phase = "dropping"
            drop_s = timed(query, c, "DROP EXTENSION outbox")
            em.phase = "dropped"
            st = wait_state(probe, "waiting_for_extension", timeout=20)
            assert st["pid"] == pid, f"the relay worker changed: {pid} -> {st}"
            time.sleep(2)              # the emitter keeps failing, the worker keeps waiting
            assert relay_status(probe)[0]["state"] == "waiting_for_extension"
            em.phase = "after"
            t_create = time.time()
            query(c, "CREATE EXTENSION outbox")
            em.wait_count(300, phase="after")
        finally:
            events = em.stop()

        # an emit that began before DROP EXTENSION returned committed before the DROP took its
        # lock, even if its commit returned (here) only after the phase became "dropped"
        def phase(e):
            return "dropping" if e[3] == "dropped" and e[5] != "dropped" else e[3]
        by_phase = {ph: [e for e in events if phase(e) == ph] for ph in ("start", "dropping", "dropped", "after")}
        assert not by_phase["dropped"], "emit() succeeded while the extension was dropped"
        before = by_phase["start"] + by_phase["dropping"]
        after = by_phase["after"]
        expected = expected_map(events)
        msgs = read_ids(reader, [e[0] for e in after], timeout=60)
        counts = id_counts(msgs)
        unknown = set(counts) - set(expected)
        assert not unknown, f"{len(unknown)} messages of events nobody emitted: {sorted(unknown)[:3]}"
        count_check(counts, [e[0] for e in after], "events emitted after CREATE EXTENSION again")
        dups = {e: n for e, n in counts.items() if n > 1}
        assert not dups, f"events delivered more than once across DROP EXTENSION: {list(dups.items())[:5]}"
        probs = order_violations(msgs, expected)
        assert not probs, "per-aggregate order broken:\n  " + "\n  ".join(probs[:10])
        before_delivered = sum(1 for e in before if counts.get(e[0]))
        first_commit = min(e[4] for e in after)

        st = relay_status(c)[0]
        assert st["pid"] == pid and relay_pids(c) == [pid], (st, relay_pids(c))
        assert st["state"] in ("idle", "publishing"), st
        unpublished = wait_until(lambda: query_one(c, "SELECT count(*) = 0 FROM outbox.events"
                                                      " WHERE NOT outbox.published(events)")[0],
                                 20, "every re-created row marked published")
        assert unpublished
        first_lag = query_one(c, "SELECT extract(epoch FROM published_at - created_at)::float8"
                                 " FROM outbox.events ORDER BY id LIMIT 1")[0]
        lines = watcher.new_lines()
        assert len([ln for ln in lines if WAITING_EXT in ln]) == 1, [ln for ln in lines if WAITING_EXT in ln]
        assert relay_exit_lines(lines) == [] and server_crashes(lines) == [], "\n".join(lines[-40:])
        errs = error_lines_of(lines, [pid])
        assert errs == [], "the relay logged errors:\n" + "\n".join(errs)
        report(f"OUTBOX LIFECYCLE drop-extension: DROP EXTENSION with events flowing took {drop_s:.2f}s;"
               f" worker {pid} kept running (0 ERROR/FATAL, 0 exits), waited, then resumed"
               f" {time.time() - t_create:.1f}s window; before the drop {len(before)} committed,"
               f" {before_delivered} delivered once, {len(before) - before_delivered} dropped with the"
               f" table while pending; after CREATE EXTENSION {len(after)} delivered once each"
               f" (first commit {first_commit - t_create:.2f}s after it was sent, published"
               f" {'by snapshot' if first_lag is None else f'{first_lag:.3f}s after its created_at'});"
               f" emit() failed {len(em.errors)}"
               f" time(s) while dropped")
        c.close()
        probe.close()


def test_database_missing_or_closed_waits_without_crash_loop(env, reader_factory):
    agg_type = new_aggregate_type("lc_nodb")
    later = "outbox_later"
    with extra_cluster(env, "lc-nodb", 23, database="postgres") as other:
        make_probe(other).close()
        conf = Path(other.pg_dir) / "data" / "postgresql.conf"
        conf.write_text(conf.read_text() + f"\noutbox.database = '{later}'\n")
        watcher = LogWatcher(other)
        pg_sh(other, "restart")
        t0 = time.monotonic()
        # no client connects for a while: until one does, no backend has written the shared
        # relcache init file, and a worker without a database must still be able to look for it
        time.sleep(QUIET_AFTER_RESTART_S)
        probe = wait_until(lambda: connect_db(other, PROBE_DB), 30, "a connection")
        states = []
        while time.monotonic() - t0 < MISSING_DB_OBSERVE_S:
            rows = relay_status(probe)
            states.append((rows[0]["state"], rows[0]["pid"], rows[0]["database"]) if rows else None)
            time.sleep(0.5)
        lines = since_ready(watcher.new_lines())
        exits = relay_exit_lines(lines)
        st = relay_status(probe)
        assert st and st[0]["state"] == "waiting_for_database" and st[0]["database"] == later, (st, states[-5:])
        assert st[0]["last_error"] == f'database "{later}" does not exist', st
        wait_pid = st[0]["pid"]
        waiting = [ln for ln in lines if f'outbox relay is waiting: database "{later}" does not exist' in ln]
        fatal = [ln for ln in lines if f'database "{later}" does not exist' in ln and "FATAL" in ln]
        report(f"OUTBOX LIFECYCLE missing database: over {MISSING_DB_OBSERVE_S}s {len(exits)} relay exit(s),"
               f" {len(fatal)} FATAL 'does not exist', {len(waiting)} 'waiting for database' line(s);"
               f" states seen {sorted({s[0] if s else None for s in states}, key=str)}")
        assert len(exits) <= MAX_EXITS_WHILE_MISSING, "crash loop:\n" + "\n".join(exits)
        assert len(waiting) == 1, "\n".join(lines[-30:])
        assert len(fatal) <= 1, fatal
        pg_class = [ln for ln in lines if "cannot read pg_class" in ln]
        assert not pg_class, "the waiting worker needs a database to look for one:\n" + "\n".join(pg_class)
        assert all(s is None or s[1] == wait_pid for s in states[len(states) // 2:]), states

        # another database comes and goes while the worker waits
        c = pg_connect(other)
        query(c, "CREATE DATABASE outbox_scratch")
        drop_s = timed(query, c, "DROP DATABASE outbox_scratch")
        assert drop_s < DROP_DATABASE_LIMIT_S, f"DROP DATABASE took {drop_s:.1f}s"

        topic = topic_prefix(c) + agg_type
        create_topics(env, [topic])
        reader = reader_factory([topic])
        reader.settle_env = db_env(other, later)   # the relay there serves that database

        # the database appears but does not accept connections yet (e.g. while it is restored):
        # the worker can only wait, as for a missing one; it must not restart every few seconds
        w2 = LogWatcher(other)
        query(c, f"CREATE DATABASE {later} ALLOW_CONNECTIONS false")
        time.sleep(NOCONN_OBSERVE_S)
        noconn_lines = w2.new_lines()
        noconn_exits = relay_exit_lines(noconn_lines)
        noconn_fatal = [ln for ln in noconn_lines if "not currently accepting connections" in ln]
        report(f"OUTBOX LIFECYCLE database without connections: over {NOCONN_OBSERVE_S}s after CREATE"
               f" DATABASE ... ALLOW_CONNECTIONS false: {len(noconn_exits)} relay exit(s),"
               f" {len(noconn_fatal)} FATAL 'not currently accepting connections'")

        t1 = time.monotonic()
        query(c, f"ALTER DATABASE {later} ALLOW_CONNECTIONS true")
        wait_state(probe, "waiting_for_extension", timeout=30)
        found_s = time.monotonic() - t1
        lc = connect_db(other, later)
        query(lc, "CREATE EXTENSION outbox")
        lc.autocommit = False
        emitted = emit_round_robin(lc, agg_type, 3, 4, "later")
        lc.autocommit = True
        expected = {eid: (agg, seq) for eid, agg, seq in emitted}
        msgs = unique_messages(reader.read_until(len(expected), timeout=30, extra=2))
        count_check(id_counts(msgs), list(expected), f"events emitted in {later}")
        probs = order_problems(msgs, expected)
        assert not probs, "per-aggregate order broken:\n  " + "\n  ".join(probs[:10])
        st = relay_status(lc)[0]
        assert st["database"] == later and st["state"] in ("idle", "publishing"), st

        lines = since_ready(watcher.new_lines())
        exits = relay_exit_lines(lines)
        relay_errors = [ln for ln in error_lines_of(lines, []) if f'database "{later}" does not exist' not in ln
                        and "not currently accepting connections" not in ln]
        assert relay_errors == [], "\n".join(relay_errors)
        assert server_crashes(lines) == [], server_crashes(lines)
        report(f"OUTBOX LIFECYCLE missing database: ALLOW_CONNECTIONS true -> relay connected and waiting"
               f" for the extension after {found_s:.1f}s; {len(expected)} events then delivered once each;"
               f" {len(exits)} relay exit(s) in all; DROP DATABASE of another database while it"
               f" waited took {drop_s:.2f}s")
        assert len(noconn_exits) <= 1, (
            f"restart loop while {later} exists but does not accept connections: {len(noconn_exits)} exits"
            f" in {NOCONN_OBSERVE_S}s:\n" + "\n".join(ln for ln in noconn_lines if "outbox relay" in ln))
        assert len(exits) <= MAX_EXITS_WHILE_MISSING + 2, "\n".join(exits)
        for x in (c, lc, probe):
            x.close()


def test_drop_other_database_is_not_blocked(env, conn, prefix, reader_factory):
    agg_type = new_aggregate_type("lc_dropdb")
    topic = prefix + agg_type
    create_topics(env, [topic])
    reader = reader_factory([topic])
    timings = []

    def create_drop(label):
        name = f"obx_scratch_{uuid.uuid4().hex[:8]}"
        create_s = timed(query, conn, f'CREATE DATABASE "{name}"')
        drop_s = timed(query, conn, f'DROP DATABASE "{name}"')
        timings.append((label, create_s, drop_s))
        assert drop_s < DROP_DATABASE_LIMIT_S, f"DROP DATABASE ({label}) took {drop_s:.1f}s"
        return drop_s

    wait_relay_ready(env)
    watcher = LogWatcher(env)
    create_drop("relay idle")

    # Kafka unreachable while a batch waits for its delivery reports: the relay is pointed at a
    # port nobody listens on (what it sees is the same as a stopped broker: connection refused;
    # stopping the real broker would cost ~20 s more)
    try:
        set_system(conn, "outbox.bootstrap_servers", "127.0.0.1:1")
        wait_until(lambda: "Kafka settings changed" in "\n".join(watcher.new_lines()), 20,
                   "the relay to take the unreachable bootstrap server")
        down = [str(r[0]) for r in query(conn, "SELECT outbox.emit(%s, 'd-' || g, 'it.down', '{}')"
                                               " FROM generate_series(1, 10) g", (agg_type,))]
        wait_until(lambda: query_one(conn, "SELECT count(*) FROM pg_stat_activity WHERE backend_type"
                                           " = 'outbox relay' AND query LIKE '%waiting for delivery%'")[0],
                   20, "the relay to wait for delivery reports")
        create_drop("Kafka unreachable, batch waiting for reports")
        wait_until(lambda: relay_state(conn) == "broker_down", 30, "state broker_down")
        create_drop("Kafka unreachable, state broker_down")
    finally:
        set_system(conn, "outbox.bootstrap_servers", None)
    msgs = read_ids(reader, down, timeout=90, extra=1)
    count_check(id_counts(msgs), down, "events emitted while Kafka was unreachable")

    # a backlog being drained, paced so that the drain outlasts the DROP DATABASE on any machine
    # (60,000 events in batches of 100 once drained before DROP DATABASE returned)
    n = DRAIN_EVENTS
    try:
        set_system(conn, "outbox.bootstrap_servers", "")
        wait_until(lambda: relay_state(conn) == "not_configured", 20, "state not_configured")
        query(conn, "SELECT count(outbox.emit(%s, (g %% 100)::text, 'it.backlog',"
                    " jsonb_build_object('n', g))) FROM generate_series(1, %s) g", (agg_type, n))
        set_system(conn, "outbox.batch_size", DRAIN_BATCH)
        set_system(conn, "outbox.kafka_properties", f"linger.ms={DRAIN_LINGER_MS}")
    finally:
        set_system(conn, "outbox.bootstrap_servers", None)

    def pending():
        return query_one(conn, "SELECT count(*) FROM outbox.events WHERE aggregate_type = %s"
                               " AND NOT outbox.published(events)", (agg_type,))[0]
    try:
        wait_until(lambda: relay_state(conn) == "publishing" and pending() < n, 30, "the drain to start")
        drop_s = create_drop("draining a backlog")
        left = pending()
        assert left > 0, "the backlog was drained before DROP DATABASE returned (linger.ms not applied?)"
        wait_until(lambda: pending() == 0, 120, "the backlog to drain", interval=0.5)
    finally:
        set_system(conn, "outbox.batch_size", None)
        set_system(conn, "outbox.kafka_properties", None)
    wait_until(lambda: topic_message_count(env, topic) >= n + len(down), 30, "the backlog in Kafka")
    in_kafka = topic_message_count(env, topic)
    assert in_kafka == n + len(down), f"{in_kafka} messages in {topic}, expected {n + len(down)}"
    report("OUTBOX LIFECYCLE DROP DATABASE of another database: "
           + "; ".join(f"{label}: CREATE {c:.2f}s DROP {d:.2f}s" for label, c, d in timings)
           + f" ({left} of {n} backlog events still pending after the drop)")
    query(conn, "DELETE FROM outbox.events WHERE aggregate_type = %s", (agg_type,))
