"""
Reliability under load, part 2: a 30 s broker outage while sessions emit continuously; fast
shutdown (pg_ctl stop -m fast) with the broker unreachable and with a large backlog draining;
reloading the Kafka settings (properties and bootstrap servers) while events flow; the broker
lost while a batch is half acknowledged (the relay must keep saying broker_down); a batch that
failed during an outage must drain at batch speed once Kafka is back.

In every case nothing committed is lost and per aggregate the first occurrences arrive in
strictly increasing sequence (every other copy is a re-send).
"""
import collections
import os
import re
import signal
import time

import pytest

from conftest import (LogWatcher, create_topics, kafka_sh, new_aggregate_type, pg_connect, pg_sh,
                      poll_until, query, query_one, relay_status, report, set_conf, stop_server,
                      topic_prefix, wait_relay_ready, wait_until)
from helpers_crash import (EmitLoad, LightReader, StatusMonitor, Watermarks, assert_delivered,
                           delivery_check, kill9, log_marker, unpublished_upto)

SESSIONS = 8
AGGREGATES = 64
OUTAGE_S = 20                   # Kafka stopped this long under load (60, then 30, until CI had to fit in 60 min)
OUTAGE_THINK_S = 0.002         # per session between commits: a few thousand events/s in all
MAX_OUTAGE_WARNINGS = 10        # relay WARNING/ERROR lines for one outage, at most
DRAIN_TIMEOUT_S = 240
# pg_ctl stop must not wait for Kafka: a relay that did would wait out its batch's
# outbox.delivery_timeout.  The tests that stop while Kafka cannot answer set that to
# STOP_DELIVERY_TIMEOUT_MS and allow a quarter of it: far below what a waiting relay takes, far
# above what a loaded machine adds to a stop (the limit was 5 s of wall clock).
STOP_DELIVERY_TIMEOUT_MS = 120_000
SHUTDOWN_LIMIT_S = STOP_DELIVERY_TIMEOUT_MS / 1000 / 4
BULK_EVENTS = 200_000
BULK_TRANSACTIONS = 4
MID_BATCH_EVENTS = 10_000
MID_BATCH_PAD = 200
MID_BATCH_AGGREGATES = 1000
MID_BATCH_TIMEOUT_MS = 5000
STOP_REQUEST_BYTES = 65536      # librdkafka's message.max.bytes: the largest produce request
FAILED_DRAIN_EVENTS = 100
FAILED_DRAIN_TIMEOUT_MS = 5000
FAILED_DRAIN_LIMIT_S = 30
START_MARKER = "outbox-it: test_11 starts Kafka again"


def max_id(conn, agg_type) -> int:
    return query_one(conn, "SELECT coalesce(max(id), 0) FROM outbox.events WHERE aggregate_type = %s",
                     (agg_type,))[0]


def test_broker_outage_under_load(env, prefix):
    agg_type = new_aggregate_type("outage")
    topic = prefix + agg_type
    create_topics(env, [topic])
    reader = LightReader(env, [topic])
    load = EmitLoad(env, agg_type, SESSIONS, AGGREGATES, tag="acct", seed=11, think_s=OUTAGE_THINK_S)
    monitor = None
    try:
        reader.wait_assigned()
        load.start()
        load.wait_progress(50, 60)
        watcher = LogWatcher(env)
        monitor = StatusMonitor(env)
        kafka_sh(env, "stop")
        t_down = time.monotonic()
        wall_down = time.time()
        try:
            committed_at_stop = load.total_commits()
            while time.monotonic() - t_down < OUTAGE_S:
                time.sleep(0.5)
            during = load.total_commits() - committed_at_stop
        finally:
            wall_up = time.time()
            log_marker(env, START_MARKER)
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
    # while Kafka was down (before `kafka.sh start` was called): once the relay said broker_down,
    # it must not say otherwise, nor log that it reached Kafka again
    marker = next(i for i, ln in enumerate(lines) if START_MARKER in ln)
    false_recoveries = [ln for ln in lines[:marker] if "reached Kafka again" in ln]
    samples = [x for x in monitor.samples if wall_down <= x[0] < wall_up]
    states_during = dict(collections.Counter(x[1] for x in samples))
    first_down = next((i for i, x in enumerate(samples) if x[1] == "broker_down"), None)
    left_down = [] if first_down is None else [x for x in samples[first_down:] if x[1] != "broker_down"]
    report(f"OUTBOX OUTAGE UNDER LOAD: Kafka stopped {OUTAGE_S}s while {SESSIONS} sessions emitted "
           f"({during} events committed during the outage, {during / OUTAGE_S:.0f}/s); peak backlog {monitor.peak_pending} "
           f"(outbox.status.pending); backlog drained {drain_s:.1f}s after `kafka.sh start` returned; "
           f"relay states sampled during the outage {states_during}")
    report(f"OUTBOX OUTAGE UNDER LOAD: {len(committed)} events committed, {c.distinct} received, "
           f"{len(c.lost)} lost, {c.reorderings} reorderings, {c.duplicates} duplicates; "
           f"server log: {len(relay)} relay lines, {len(warnings)} WARNING/ERROR; while Kafka was still down "
           f"{len(false_recoveries)} 'reached Kafka again' line(s) and {len(left_down)} of "
           f"{len(samples) - (first_down or 0)} status samples after the first broker_down not broker_down")
    assert_delivered(c, "broker outage")
    assert first_down is not None, f"outbox.status never said broker_down: {states_during}"
    assert not false_recoveries and not left_down, (
        "the relay reported Kafka reachable while it was down (a batch with some events acknowledged "
        "before the outage and the rest timed out counts as a success in relay_step):\n"
        + "\n".join(false_recoveries + [ln for ln in relay if "WARNING:" in ln]) + "\n"
        + f"status samples leaving broker_down (s after the stop, state, published): "
        f"{[(round(x[0] - wall_down, 1), x[1], x[3]) for x in left_down][:10]}")
    assert monitor.peak_pending >= during // 2, (monitor.peak_pending, during)
    assert warnings, "the outage was not logged"
    assert len(warnings) <= MAX_OUTAGE_WARNINGS, \
        f"{len(warnings)} relay WARNING/ERROR lines for one outage:\n" + "\n".join(warnings[:30])
    assert len(relay) <= 3 * MAX_OUTAGE_WARNINGS, "\n".join(relay[:60])
    assert any("reached Kafka again" in ln for ln in relay), "\n".join(relay)


def timed_stop(env, mode: str = "fast") -> float:
    t0 = time.monotonic()
    stop_server(env, mode, timeout=120)
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


def bulk_emit(conn, agg_type, first, last, tag, pad=0, aggregates=AGGREGATES):
    """Events first..last in one transaction through outbox.emit; aggregate = seq % aggregates."""
    rows = query(conn, """
        SELECT outbox.emit(%(t)s, %(tag)s || (g %% %(n)s), 'bulk.event',
                           jsonb_build_object('seq', g, 'pad', repeat('x', %(pad)s)))::text,
               %(tag)s || (g %% %(n)s), g
          FROM generate_series(%(a)s::int, %(b)s::int) AS g""",
                 {"t": agg_type, "tag": tag, "n": aggregates, "a": first, "b": last, "pad": pad})
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
        conn = pg_connect(env)
        watcher = LogWatcher(env)
        set_conf(conn, delivery_timeout=STOP_DELIVERY_TIMEOUT_MS)
        wait_until(lambda: any("Kafka settings changed, reconnecting" in ln for ln in watcher.new_lines()),
                   30, "the relay to apply outbox.delivery_timeout")
        conn.close()
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
            conn = wait_until(lambda: pg_connect(env), 60, "a connection")
            set_conf(conn, delivery_timeout=None)
            conn.close()
        wait_relay_ready(env, timeout=60)

        # (b) a large backlog is draining.  The relay is paused while it is written: it drains
        # about as fast as 4 transactions write, so otherwise "a large backlog" may never exist
        # (once in CI the relay kept up and the state below was never seen in 120 s)
        ctl = pg_connect(env)
        query(ctl, "SELECT outbox.pause()")
        conn = pg_connect(env, autocommit=False)
        t0 = time.monotonic()
        bulk = {}
        per_tx = BULK_EVENTS // BULK_TRANSACTIONS
        try:
            for i in range(BULK_TRANSACTIONS):
                bulk.update(bulk_emit(conn, agg_type, i * per_tx + 1, (i + 1) * per_tx, "bulk-"))
        finally:
            query(ctl, "SELECT outbox.resume()")
            ctl.close()
        insert_s = time.monotonic() - t0
        conn.close()
        assert len(bulk) == BULK_EVENTS

        def draining():
            conn = pg_connect(env)
            try:
                st = relay_status(conn)[0]
            finally:
                conn.close()
            # five batches out and four still pending, whatever this machine's speed
            # (">= a quarter of the backlog pending" failed when the drain was fast)
            return st["published"] >= 5 * batch_size and st["pending"] >= 4 * batch_size and st
        st = wait_until(draining, 120, "the relay to be draining the backlog", interval=0.1)
        # the server that starts after the stop must not publish before the backlog it found is
        # counted: ALTER SYSTEM without a reload reaches only the next start
        ctl = pg_connect(env)
        query(ctl, "ALTER SYSTEM SET outbox.bootstrap_servers = ''")
        ctl.close()
        try:
            watcher = LogWatcher(env)
            stop_backlog_s = timed_stop(env)
            ckpt_backlog = shutdown_checkpoint_s(watcher.new_lines())
            pg_sh(env, "start")
            conn = pg_connect(env)
            wait_until(lambda: relay_status(conn)[0]["state"] == "not_configured", 30, "state not_configured")
            pending_after = query_one(conn, "SELECT count(*) FROM outbox.events WHERE aggregate_type = %s"
                                            " AND NOT outbox.published(events)", (agg_type,))[0]
            conn.close()
        finally:
            ctl = wait_until(lambda: pg_connect(env), 60, "a connection")
            set_conf(ctl, bootstrap_servers=None)
            ctl.close()
        t_start = time.monotonic()

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
    # the shutdown checkpoint writes what the 200,000 inserts dirtied: on a slow disk that alone can
    # take seconds, and it is not the relay's doing, so the limit applies to the rest of the stop
    assert stop_down_s - (ckpt_down or 0) < SHUTDOWN_LIMIT_S, \
        (f"pg_ctl stop -m fast took {stop_down_s:.1f}s with Kafka down (checkpoint {ckpt_down}s;"
         f" outbox.delivery_timeout {STOP_DELIVERY_TIMEOUT_MS} ms)")
    assert stop_backlog_s - (ckpt_backlog or 0) < SHUTDOWN_LIMIT_S, \
        f"pg_ctl stop -m fast took {stop_backlog_s:.1f}s with a backlog (checkpoint {ckpt_backlog}s)"
    # the relay stopped in the middle of the backlog, not after draining it
    assert pending_after > 0, f"the stop drained the backlog first ({st['pending']} pending when it began)"
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
    # the README: the batch in flight finishes before the relay reconnects, so a reload sends
    # nothing twice (assert_delivered allows duplicates: at-least-once)
    assert c.duplicates == 0, f"{c.duplicates} events sent twice across the reloads"


def test_broker_lost_in_the_middle_of_a_batch(env, prefix):
    """
    Kafka dies while a batch is half acknowledged: the rest of the batch times out.  The relay
    must stay broker_down (and not log "reached Kafka again") until Kafka is back; nothing is
    lost, order is kept.  A large batch, the broker killed at its first acknowledgements and a
    short delivery timeout make this deterministic.
    """
    agg_type = new_aggregate_type("midbatch")
    topic = prefix + agg_type
    create_topics(env, [topic])
    conn = pg_connect(env)
    pid = relay_status(conn)[0]["pid"]
    reader = LightReader(env, [topic])
    marks = Watermarks(env, topic)
    monitor = None
    kafka_stopped = False
    t0 = time.monotonic()
    phases = {}
    try:
        reader.wait_assigned()
        # hold the relay while the backlog is written, then let it take one big batch
        set_conf(conn, bootstrap_servers="")
        wait_until(lambda: relay_status(conn)[0]["state"] == "not_configured", 30, "state not_configured")
        tx = pg_connect(env, autocommit=False)
        expected = {}
        # after the outage each claim re-sends one event per aggregate with failed events, and
        # its cost grows with their number: 1000 aggregates keep both small
        expected.update(bulk_emit(tx, agg_type, 1, MID_BATCH_EVENTS, "mid-", pad=MID_BATCH_PAD,
                                  aggregates=MID_BATCH_AGGREGATES))
        tx.close()
        phases["written"] = time.monotonic() - t0
        watcher = LogWatcher(env)
        monitor = StatusMonitor(env, interval=0.2)
        set_conf(conn, batch_size=MID_BATCH_EVENTS, delivery_timeout=MID_BATCH_TIMEOUT_MS,
                 retry_backoff_max=MID_BATCH_TIMEOUT_MS // 2, bootstrap_servers=None)
        # kill Kafka as soon as the batch's first messages are acknowledged (SIGKILL: a controlled
        # shutdown takes long enough for a batch to be acknowledged in full)
        wait_until(lambda: sum(marks.high().values()) > 0, 60, "the first acknowledged messages",
                   interval=0.01)
        phases["first_ack"] = time.monotonic() - t0
        with open(os.path.join(env.kafka_dir, "broker.pid")) as f:
            kill9(int(f.read().strip()))
        kafka_stopped = True
        kafka_sh(env, "stop")           # "not running": only to have its view of it
        phases["stopped"] = time.monotonic() - t0
        wall_down = time.time()
        # the rest of the batch times out after outbox.delivery_timeout, then is tried again after
        # its backoff and times out again: once every unpublished event failed and one failed
        # twice, the relay has gone round its loop with Kafka down (3 delivery timeouts at most)
        def failed_twice():
            untried, most = query_one(conn, "SELECT count(*) FILTER (WHERE NOT outbox.published(events)"
                                            " AND attempts = 0), max(attempts) FROM outbox.events"
                                            " WHERE aggregate_type = %s", (agg_type,))
            return untried == 0 and (most or 0) >= 2
        poll_until(failed_twice, 3 * MID_BATCH_TIMEOUT_MS / 1000 + 3, interval=0.2)
        st = relay_status(conn)[0]
        published, tried = query_one(conn, "SELECT count(*) FILTER (WHERE outbox.published(events)), count(*) FILTER (WHERE attempts > 0)"
                                           " FROM outbox.events WHERE aggregate_type = %s", (agg_type,))
        wall_up = time.time()
        log_marker(env, START_MARKER)
    finally:
        try:
            if kafka_stopped:
                kafka_sh(env, "start", timeout=180)
                phases["started"] = time.monotonic() - t0
        finally:
            set_conf(conn, batch_size=None, delivery_timeout=None, retry_backoff_max=None,
                     bootstrap_servers=None)
            if monitor is not None:
                monitor.close()
    missing = reader.wait_for(expected, DRAIN_TIMEOUT_S, extra=0)
    phases["delivered"] = time.monotonic() - t0
    rows = reader.snapshot()
    reader.close()
    marks.close()
    assert relay_status(conn)[0]["pid"] == pid
    conn.close()
    c = delivery_check(rows, expected)
    assert len(missing) == len(c.lost)

    lines = watcher.new_lines()
    marker = next(i for i, ln in enumerate(lines) if START_MARKER in ln)
    relay_down = [ln for ln in lines[:marker] if "outbox relay" in ln]
    false_recoveries = [ln for ln in relay_down if "reached Kafka again" in ln]
    samples = [x for x in monitor.samples if wall_down <= x[0] < wall_up]
    first_down = next((i for i, x in enumerate(samples) if x[1] == "broker_down"), None)
    left_down = [] if first_down is None else [x for x in samples[first_down:] if x[1] != "broker_down"]
    report(f"OUTBOX BROKER LOST MID-BATCH: Kafka killed while a batch of {MID_BATCH_EVENTS} was being "
           f"acknowledged ({published} acknowledged, {tried} failed with outbox.delivery_timeout = "
           f"{MID_BATCH_TIMEOUT_MS} ms); "
           f"while Kafka was down: {len(false_recoveries)} 'reached Kafka again' line(s), "
           f"{len(left_down)} status sample(s) not broker_down after the first broker_down, state at the end "
           f"{st['state']!r}; {c.distinct} of {len(expected)} delivered after it came back, "
           f"{c.reorderings} reorderings, {c.duplicates} duplicates; timeline (s) "
           + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    # How much of the batch Kafka acknowledged before it died depends on timing (the relay may
    # have had all of it acknowledged already); the report above says what happened, and the
    # checks below must hold in every case.
    assert_delivered(c, "broker lost mid-batch")
    assert first_down is not None, f"outbox.status never said broker_down: {samples[:20]}"
    assert not false_recoveries and not left_down and st["state"] == "broker_down", (
        "while Kafka was down the relay reported it reachable: relay_step() (worker.c) takes a batch "
        "with published > 0 as a success even though the rest of the batch failed transiently:\n"
        + "\n".join(relay_down) + "\n"
        + f"status samples leaving broker_down (s after the stop, state, published): "
        f"{[(round(x[0] - wall_down, 1), x[1], x[3]) for x in left_down][:10]}; at the end {st['state']!r}")


@pytest.mark.parametrize("mode", ["fast", "smart"])
def test_stop_while_a_batch_waits_keeps_what_kafka_acknowledged(env, mode):
    """
    pg_ctl stop (-m fast, and -m smart: the README promises "any mode") while a batch waits for
    its delivery reports: the relay must mark what Kafka acknowledged before it exits, so that a
    routine restart re-sends only what was not acknowledged (a trial saw 870 of 1,000
    acknowledged events sent again after a restart).  The broker is frozen (SIGSTOP) right after
    the first acknowledgements, so the rest of the batch stays unacknowledged for as long as the
    test wants.  A smart stop waits for the client sessions to end (the test has none open
    then), then stops the relay as a fast one does: it must not wait for the frozen broker.
    """
    agg_type = new_aggregate_type(f"stopmark_{mode}")
    c0 = pg_connect(env)
    topic = topic_prefix(c0) + agg_type
    c0.close()
    # One partition: the snapshot relay marks the batch's acknowledged prefix, and over several
    # partitions the first event's partition may be the one still waiting (a CI run: 512 in
    # Kafka, 0 marked).  On one partition the prefix is what the first request carried.
    create_topics(env, [topic], partitions=1)
    conn = pg_connect(env)
    reader = LightReader(env, [topic])
    marks = Watermarks(env, topic, partitions=1)
    broker = None
    try:
        reader.wait_assigned(partitions=1)
        set_conf(conn, bootstrap_servers="")
        wait_until(lambda: relay_status(conn)[0]["state"] == "not_configured", 30, "state not_configured")
        tx = pg_connect(env, autocommit=False)
        expected = bulk_emit(tx, agg_type, 1, MID_BATCH_EVENTS, "stop-", pad=MID_BATCH_PAD,
                             aggregates=MID_BATCH_AGGREGATES)
        tx.close()
        # A message in Kafka is not yet an acknowledgement: the broker shows the high watermark
        # before it writes the produce response (a CI run may have frozen it in between: 209
        # messages in Kafka, 0 acknowledged).  But a broker reads the next request on a connection only after
        # it sent the response to the one before, so once Kafka holds more messages than one
        # request can carry, the first response is on its way.  Small requests make that early.
        set_conf(conn, batch_size=MID_BATCH_EVENTS, bootstrap_servers=None,
                 delivery_timeout=STOP_DELIVERY_TIMEOUT_MS,
                 kafka_properties=f"message.max.bytes={STOP_REQUEST_BYTES}")
        wait_until(lambda: sum(marks.high().values()) > STOP_REQUEST_BYTES // MID_BATCH_PAD, 60,
                   "messages of more than one produce request", interval=0.01)
        with open(os.path.join(env.kafka_dir, "broker.pid")) as f:
            broker = int(f.read().strip())
        os.kill(broker, signal.SIGSTOP)
        time.sleep(2)           # the relay serves the delivery reports already received
        # the batch in flight is not affected by pause(); after the restart nothing moves
        query(conn, "SELECT outbox.pause()")
        conn.close()            # a smart stop waits for every client session to end
        stop_s = timed_stop(env, mode)
        os.kill(broker, signal.SIGCONT)
        broker = None
        pg_sh(env, "start")
        conn = wait_until(lambda: pg_connect(env), 30, "a connection after the restart")
        marked = query_one(conn, "SELECT count(*) FILTER (WHERE outbox.published(events)) FROM outbox.events WHERE aggregate_type = %s",
                           (agg_type,))[0]
        time.sleep(2)           # the frozen broker's socket buffers are processed now
        in_kafka = sum(marks.high().values())
        query(conn, "SELECT outbox.resume()")
        missing = reader.wait_for(expected, DRAIN_TIMEOUT_S, extra=1)
        rows = reader.snapshot()
    finally:
        if broker is not None:
            os.kill(broker, signal.SIGCONT)
        c = wait_until(lambda: pg_connect(env), 60, "a connection")
        query(c, "SELECT outbox.resume()")
        set_conf(c, batch_size=None, bootstrap_servers=None, kafka_properties=None, delivery_timeout=None)
        c.close()
        reader.close()
        marks.close()
    wait_relay_ready(env)
    c = delivery_check(rows, expected)
    report(f"OUTBOX STOP MID-BATCH: pg_ctl stop -m {mode} while a batch of {MID_BATCH_EVENTS} waited for"
           f" delivery reports (broker frozen after the first acknowledgements) took {stop_s:.2f}s;"
           f" {marked} acknowledged events marked before the relay exited, {in_kafka} messages in Kafka"
           f" then; after the restart {c.distinct} of {len(expected)} delivered, {c.duplicates} duplicates"
           f" (at most {MID_BATCH_EVENTS - marked} possible), {c.reorderings} reorderings")
    assert stop_s < SHUTDOWN_LIMIT_S, \
        f"pg_ctl stop -m {mode} took {stop_s:.1f}s (outbox.delivery_timeout {STOP_DELIVERY_TIMEOUT_MS} ms)"
    assert not missing and len(missing) == len(c.lost)
    assert_delivered(c, "stop while a batch waits")
    assert marked > 0, "the relay exited without marking what Kafka had acknowledged"
    assert marked <= in_kafka, f"{marked} marked published, but Kafka holds only {in_kafka}"
    assert c.duplicates <= MID_BATCH_EVENTS - marked, (c.duplicates, marked)


def test_failed_batch_drains_promptly_when_kafka_returns(env, prefix):
    """
    An outage longer than outbox.delivery_timeout fails a whole batch of one aggregate.  Once
    Kafka is back the batch must go out at batch speed; it must not be re-sent one event per
    claim (and, with no commits to wake the relay, one claim per outbox.poll_interval).
    """
    agg_type = new_aggregate_type("faileddrain")
    topic = prefix + agg_type
    create_topics(env, [topic])
    conn = pg_connect(env)
    reader = LightReader(env, [topic])
    watcher = LogWatcher(env)
    kafka_stopped = False
    drained_s = None
    try:
        reader.wait_assigned()
        set_conf(conn, delivery_timeout=FAILED_DRAIN_TIMEOUT_MS)
        wait_until(lambda: any("Kafka settings changed, reconnecting" in ln for ln in watcher.new_lines()),
                   30, "the relay to apply outbox.delivery_timeout")
        kafka_sh(env, "stop")
        kafka_stopped = True
        tx = pg_connect(env, autocommit=False)
        expected = bulk_emit(tx, agg_type, 1, FAILED_DRAIN_EVENTS, "hot-", aggregates=1)
        tx.close()
        wait_until(lambda: query_one(conn, "SELECT count(*) FROM outbox.events WHERE aggregate_type = %s"
                                           " AND attempts > 0", (agg_type,))[0] == FAILED_DRAIN_EVENTS,
                   60, "every event's first delivery attempt to fail", interval=0.5)
        kafka_sh(env, "start", timeout=180)
        kafka_stopped = False
        t_back = time.monotonic()
        try:
            wait_until(lambda: query_one(conn, "SELECT count(*) FROM outbox.events WHERE aggregate_type = %s"
                                               " AND NOT outbox.published(events)", (agg_type,))[0] == 0,
                       FAILED_DRAIN_LIMIT_S, "the failed batch to drain", interval=0.2)
            drained_s = time.monotonic() - t_back
        except AssertionError:
            pass
        left = query_one(conn, "SELECT count(*) FROM outbox.events WHERE aggregate_type = %s"
                               " AND NOT outbox.published(events)", (agg_type,))[0]
    finally:
        set_conf(conn, delivery_timeout=None)
        if kafka_stopped:
            kafka_sh(env, "start", timeout=180)
    # the consumer reconnects to the restarted broker by itself, with backoff: give it time
    reader.wait_for(list(expected), timeout=60, extra=1)
    rows = reader.snapshot()
    reader.close()
    c = delivery_check(rows, expected)
    report(f"OUTBOX FAILED BATCH DRAIN: {FAILED_DRAIN_EVENTS} events of one aggregate failed once "
           f"(Kafka down past outbox.delivery_timeout = {FAILED_DRAIN_TIMEOUT_MS} ms); after Kafka came back "
           + (f"they drained in {drained_s:.1f}s" if drained_s is not None else
              f"{FAILED_DRAIN_EVENTS - left} drained in {FAILED_DRAIN_LIMIT_S}s, {left} still pending")
           + f"; {c.distinct} received, {c.reorderings} reorderings, {c.duplicates} duplicates")
    if left:
        # slow, not stuck: they are not undeliverable, but later tests should not wait behind them
        conn2 = pg_connect(env)
        query(conn2, "DELETE FROM outbox.events WHERE aggregate_type = %s", (agg_type,))
        conn2.close()
    conn.close()
    assert not c.order_problems, c.order_problems[:10]
    assert drained_s is not None, (
        f"only {FAILED_DRAIN_EVENTS - left} of {FAILED_DRAIN_EVENTS} failed events of one aggregate were "
        f"re-sent within {FAILED_DRAIN_LIMIT_S}s after Kafka came back: the claim (relay.c, CLAIM_BLOCKED) "
        "holds every event behind the aggregate's oldest failed one, even when that one is claimed in the "
        "same batch, so each claim re-sends one event per aggregate, and relay_step() (worker.c) then "
        "sleeps outbox.poll_interval because the claim was smaller than outbox.batch_size")
    assert not c.lost
