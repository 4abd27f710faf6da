"""
Reliability under load, part 2: a 60 s broker outage while sessions emit continuously; fast
shutdown (pg_ctl stop -m fast) with the broker unreachable and with a large backlog draining;
reloading the Kafka settings (properties and bootstrap servers) while events flow.

In every case nothing committed is lost and per aggregate the first occurrences arrive in
strictly increasing sequence (every other copy is a re-send).
"""
import re
import time

from conftest import (LogWatcher, create_topics, kafka_sh, new_aggregate_type, pg_connect, pg_sh,
                      query, query_one, relay_status, report, wait_relay_ready, wait_until)
from helpers_crash import (EmitLoad, LightReader, StatusMonitor, assert_delivered,
                           delivery_check, set_conf, unpublished_upto)

SESSIONS = 8
AGGREGATES = 64
OUTAGE_S = 60
MAX_OUTAGE_WARNINGS = 10        # relay WARNING/ERROR lines for one outage, at most
DRAIN_TIMEOUT_S = 240
SHUTDOWN_LIMIT_S = 5.0
BULK_EVENTS = 200_000
BULK_TRANSACTIONS = 4


def max_id(conn, agg_type) -> int:
    return query_one(conn, "SELECT coalesce(max(id), 0) FROM outbox.events WHERE aggregate_type = %s",
                     (agg_type,))[0]


def test_broker_outage_under_load(env, prefix):
    agg_type = new_aggregate_type("outage")
    topic = prefix + agg_type
    create_topics(env, [topic])
    reader = LightReader(env, [topic])
    load = EmitLoad(env, agg_type, SESSIONS, AGGREGATES, tag="acct", seed=11)
    monitor = None
    try:
        reader.wait_assigned()
        load.start()
        load.wait_progress(50, 60)
        watcher = LogWatcher(env)
        monitor = StatusMonitor(env)
        kafka_sh(env, "stop")
        t_down = time.monotonic()
        try:
            committed_at_stop = load.total_commits()
            while time.monotonic() - t_down < OUTAGE_S:
                time.sleep(0.5)
            during = load.total_commits() - committed_at_stop
            states_during = dict(monitor.states)
        finally:
            kafka_sh(env, "start", timeout=180)
        t_back = time.monotonic()
        conn = pg_connect(env)
        backlog_max_id = max_id(conn, agg_type)
        conn.close()
        # the load goes on while the backlog of the outage drains
        wait_until(lambda: unpublished_upto(env, agg_type, backlog_max_id) == 0, DRAIN_TIMEOUT_S,
                   "the backlog of the outage to be published", interval=0.5)
        drain_s = time.monotonic() - t_back
        load.wait_progress(20, 60, "every session to commit after the drain")
    finally:
        load.stop()
        if monitor is not None:
            monitor.close()

    committed, unknown = load.snapshot()
    assert not unknown and not load.unexpected_errors and not any(load.connection_losses), \
        (len(unknown), load.unexpected_errors[:5], load.connection_losses)
    missing = reader.wait_for(committed, 120, extra=3)
    rows = reader.snapshot()
    reader.close()
    c = delivery_check(rows, committed)
    assert len(missing) == len(c.lost)
    lines = watcher.new_lines()
    relay = [ln for ln in lines if "outbox relay" in ln]
    warnings = [ln for ln in relay if "WARNING:" in ln or "ERROR:" in ln]
    report(f"OUTBOX OUTAGE UNDER LOAD: Kafka stopped {OUTAGE_S}s while {SESSIONS} sessions emitted "
           f"({during} events committed during the outage); peak backlog {monitor.peak_pending} "
           f"(outbox.status.pending); backlog drained {drain_s:.1f}s after `kafka.sh start` returned; "
           f"relay states sampled during the outage {states_during}")
    report(f"OUTBOX OUTAGE UNDER LOAD: {len(committed)} events committed, {c.distinct} received, "
           f"{len(c.lost)} lost, {c.reorderings} reorderings, {c.duplicates} duplicates; "
           f"server log: {len(relay)} relay lines, {len(warnings)} WARNING/ERROR")
    assert_delivered(c, "broker outage")
    assert states_during.get("broker_down"), f"outbox.status never said broker_down: {states_during}"
    assert monitor.peak_pending >= during // 2, (monitor.peak_pending, during)
    assert warnings, "the outage was not logged"
    assert len(warnings) <= MAX_OUTAGE_WARNINGS, \
        f"{len(warnings)} relay WARNING/ERROR lines for one outage:\n" + "\n".join(warnings[:30])
    assert len(relay) <= 3 * MAX_OUTAGE_WARNINGS, "\n".join(relay[:60])
    assert any("reached Kafka again" in ln for ln in relay), "\n".join(relay)


def timed_stop(env) -> float:
    t0 = time.monotonic()
    pg_sh(env, "stop", timeout=120)
    took = time.monotonic() - t0
    assert pg_sh(env, "status", check=False).returncode != 0, "pg.sh stop left the server running"
    return took


def relay_activity(env) -> str:
    conn = pg_connect(env)
    try:
        rows = query(conn, "SELECT query FROM pg_stat_activity WHERE backend_type = 'outbox relay'")
        return rows[0][0] if rows else ""
    finally:
        conn.close()


def bulk_emit(conn, agg_type, first, last, tag):
    """Events first..last in one transaction through outbox.emit; aggregate = seq % AGGREGATES."""
    rows = query(conn, """
        SELECT outbox.emit(%(t)s, %(tag)s || (g %% %(n)s), 'bulk.event',
                           jsonb_build_object('seq', g))::text, %(tag)s || (g %% %(n)s), g
          FROM generate_series(%(a)s::int, %(b)s::int) AS g""",
                 {"t": agg_type, "tag": tag, "n": AGGREGATES, "a": first, "b": last})
    conn.commit()
    return {eid: (agg, seq) for eid, agg, seq in rows}


def shutdown_checkpoint_s(lines):
    """Duration of the shutdown checkpoint, from its "checkpoint complete" log line."""
    started = False
    for ln in lines:
        if "checkpoint starting: shutdown" in ln:
            started = True
        elif started and "checkpoint complete" in ln:
            m = re.search(r"total=([0-9.]+) s", ln)
            return float(m.group(1)) if m else None
    return None


def test_fast_shutdown_with_broker_down_and_with_backlog(env, prefix):
    agg_type = new_aggregate_type("shutdown")
    topic = prefix + agg_type
    create_topics(env, [topic])
    conn = pg_connect(env)
    batch_size = int(query_one(conn, "SHOW outbox.batch_size")[0])
    conn.close()
    reader = LightReader(env, [topic])
    try:
        reader.wait_assigned()

        # (a) the broker is unreachable, a batch waits for its delivery reports
        kafka_sh(env, "stop")
        try:
            conn = pg_connect(env, autocommit=False)
            down = bulk_emit(conn, agg_type, 1, 3000, "down-")
            conn.close()
            wait_until(lambda: relay_status_state(env) == "broker_down", 60, "state broker_down")
            wait_until(lambda: "waiting for delivery reports" in relay_activity(env), 30,
                       "the relay to wait for a batch's delivery reports")
            watcher = LogWatcher(env)
            stop_down_s = timed_stop(env)
            ckpt_down = shutdown_checkpoint_s(watcher.new_lines())
            pg_sh(env, "start")
        finally:
            kafka_sh(env, "start", timeout=180)
        wait_relay_ready(env, timeout=60)

        # (b) a large backlog is draining
        conn = pg_connect(env, autocommit=False)
        t0 = time.monotonic()
        bulk = {}
        per_tx = BULK_EVENTS // BULK_TRANSACTIONS
        for i in range(BULK_TRANSACTIONS):
            bulk.update(bulk_emit(conn, agg_type, i * per_tx + 1, (i + 1) * per_tx, "bulk-"))
        insert_s = time.monotonic() - t0
        conn.close()
        assert len(bulk) == BULK_EVENTS

        def draining():
            conn = pg_connect(env)
            try:
                st = relay_status(conn)[0]
            finally:
                conn.close()
            return st["published"] >= 5 * batch_size and st["pending"] >= BULK_EVENTS // 4 and st
        st = wait_until(draining, 120, "the relay to be draining the backlog", interval=0.1)
        watcher = LogWatcher(env)
        stop_backlog_s = timed_stop(env)
        ckpt_backlog = shutdown_checkpoint_s(watcher.new_lines())
        pg_sh(env, "start")
        t_start = time.monotonic()
        conn = pg_connect(env)
        pending_after = query_one(conn, "SELECT count(*) FROM outbox.events WHERE aggregate_type = %s"
                                        " AND published_at IS NULL", (agg_type,))[0]
        conn.close()

        expected = dict(down)
        expected.update(bulk)
        missing = reader.wait_for(expected, DRAIN_TIMEOUT_S, extra=3)
        drain_s = time.monotonic() - t_start
        rows = reader.snapshot()
    finally:
        reader.close()
    c = delivery_check(rows, expected)
    assert len(missing) == len(c.lost)
    dups_down = delivery_check([r for r in rows if r[4] in down], down).duplicates
    dups_bulk = c.duplicates - dups_down
    report(f"OUTBOX SHUTDOWN: pg_ctl stop -m fast took {stop_down_s:.2f}s with Kafka down and a batch of "
           f"{min(batch_size, len(down))} waiting for delivery reports (shutdown checkpoint {ckpt_down}s); "
           f"{stop_backlog_s:.2f}s while draining a backlog of {BULK_EVENTS} (inserted in {insert_s:.1f}s "
           f"in {BULK_TRANSACTIONS} transactions; {st['published']} published, {st['pending']} pending "
           f"when stopped; shutdown checkpoint {ckpt_backlog}s)")
    report(f"OUTBOX SHUTDOWN: after the restart {pending_after} pending drained in {drain_s:.1f}s; "
           f"{len(expected)} events expected, {c.distinct} received, {len(c.lost)} lost, "
           f"{c.reorderings} reorderings, duplicates {dups_down} (broker-down stop) + {dups_bulk} (backlog stop)")
    assert stop_down_s < SHUTDOWN_LIMIT_S, f"pg_ctl stop -m fast took {stop_down_s:.1f}s with Kafka down"
    assert stop_backlog_s < SHUTDOWN_LIMIT_S, f"pg_ctl stop -m fast took {stop_backlog_s:.1f}s with a backlog"
    assert_delivered(c, "fast shutdown")
    assert dups_down <= batch_size and dups_bulk <= batch_size, (dups_down, dups_bulk, batch_size)


def relay_status_state(env):
    conn = pg_connect(env)
    try:
        rows = relay_status(conn)
        return rows[0]["state"] if rows else None
    finally:
        conn.close()


def test_reload_kafka_settings_while_events_flow(env, prefix):
    agg_type = new_aggregate_type("reload")
    topic = prefix + agg_type
    create_topics(env, [topic])
    reader = LightReader(env, [topic])
    load = EmitLoad(env, agg_type, SESSIONS, AGGREGATES, tag="acct", seed=12)
    conn = pg_connect(env)
    host, port = env.bootstrap.rsplit(":", 1)
    other_name = f"localhost:{port}" if host != "localhost" else f"127.0.0.1:{port}"
    pid = relay_status(conn)[0]["pid"]
    watcher = LogWatcher(env)
    phases = {}

    def reconnects():
        return sum("Kafka settings changed, reconnecting" in ln for ln in watcher.new_lines())

    def published():
        return relay_status(conn)[0]["published"]

    try:
        reader.wait_assigned()
        load.start()
        load.wait_progress(30, 60)
        try:
            for n, (name, value) in enumerate((("kafka_properties", "linger.ms=5;compression.type=lz4"),
                                               ("bootstrap_servers", other_name)), start=1):
                set_conf(conn, **{name: value})
                wait_until(lambda: reconnects() >= n, 30, f"the relay to reconnect after {name} changed")
                # the relay publishes with the new setting while the sessions go on
                before = published()
                load.wait_progress(30, 60)
                wait_until(lambda: published() >= before + 1000, 60,
                           f"the relay to publish with the new {name}")
                st = relay_status(conn)[0]
                assert st["pid"] == pid, f"the relay worker restarted after changing {name}"
                assert st["state"] in ("idle", "publishing"), st
                phases[name] = published() - before
            assert query_one(conn, "SHOW outbox.bootstrap_servers")[0] == other_name
        finally:
            set_conf(conn, kafka_properties=None, bootstrap_servers=None)
        wait_until(lambda: reconnects() >= 3, 30, "the relay to reconnect after the settings were restored")
        load.wait_progress(30, 60)
    finally:
        load.stop()
    assert query_one(conn, "SHOW outbox.bootstrap_servers")[0] == env.bootstrap
    assert query_one(conn, "SHOW outbox.kafka_properties")[0] == ""

    committed, unknown = load.snapshot()
    assert not unknown and not load.unexpected_errors and not any(load.connection_losses)
    missing = reader.wait_for(committed, 120, extra=3)
    rows = reader.snapshot()
    reader.close()
    st = relay_status(conn)[0]
    conn.close()
    c = delivery_check(rows, committed)
    assert len(missing) == len(c.lost)
    n_reconnects = reconnects()
    report(f"OUTBOX RELOAD UNDER LOAD: kafka_properties and bootstrap_servers ({env.bootstrap} -> "
           f"{other_name}) changed and restored while {SESSIONS} sessions emitted; {n_reconnects} "
           f"reconnects logged, relay pid unchanged; published under each new setting {phases}; "
           f"{len(committed)} events committed, {c.distinct} received, {len(c.lost)} lost, "
           f"{c.reorderings} reorderings, {c.duplicates} duplicates")
    assert st["pid"] == pid, "a reload must not restart the worker"
    assert n_reconnects == 3, n_reconnects
    assert_delivered(c, "reload under load")
