"""
Per-aggregate order across the two kinds of tracking, when a commit falls inside a batch's window.

A relay batch takes its transaction's snapshot first and runs its queries later. Issue 27 found
two reads that used that older snapshot instead of one taken with the batch's own:
(a) the row claim's ceiling (no row-tracked event above the snapshot progress's id floor while
    snapshot-tracked events exist) was read with it: a snapshot-tracked event committed in
    between was not seen, the ceiling was lifted, and a later row-tracked event of its aggregate
    went out first;
(b) the snapshot batch's held set (aggregates with a pending row-tracked event) was read with
    it: a row-tracked event committed in between was not seen, and a later snapshot-tracked
    event of its aggregate went out first.
Both happen when outbox.relay_mode or outbox.workers_per_database change under load (events of
both kinds are pending), after replay(), after a restore. The relay's fault hook
(src/fault_point.c) holds the batch at claim_start or snapshot_start for a few seconds ("sleep
<ms> pass") while the test commits the two events in commit order; every event must then arrive
in commit order. Without the fix each test saw the later event arrive first.
"""
import os

import pytest

from conftest import (LogWatcher, create_topics, new_aggregate_type, pg_connect, query, query_one,
                      set_conf, topic_prefix, wait_relay_ready, wait_until)
from helpers_crash import LightReader, assert_delivered, delivery_check

WINDOW_MS = 3000


def aggregate_topic(env, conn, tag: str):
    """A new aggregate type and a reader assigned to its routed topic before anything is
    emitted (so that nothing it must see can land before it reads)."""
    agg_type = new_aggregate_type(tag)
    topic = topic_prefix(conn) + agg_type
    create_topics(env, [topic])
    reader = LightReader(env, [topic])
    reader.wait_assigned()
    return agg_type, reader


def emit_open(env, mode: str, agg_type: str, aggregate: str, seq: int):
    """BEGIN; emit one event and leave the transaction open: (connection, event id). The event's
    tracking must be the one relay_mode gives: snapshot (xid set) or row (xid NULL)."""
    c = pg_connect(env, autocommit=False)
    eid = query_one(c, "SELECT outbox.emit(%s, %s, 'window.event', jsonb_build_object('seq', %s))::text",
                    (agg_type, aggregate, seq))[0]
    tracked_by_snapshot = query_one(c, "SELECT xid IS NOT NULL FROM outbox.events WHERE event_id = %s",
                                    (eid,))[0]
    assert tracked_by_snapshot == (mode == "snapshot"), \
        f"event {seq} was tracked {'by snapshot' if tracked_by_snapshot else 'row by row'}, not {mode}"
    return c, eid


def session_mode(env) -> str:
    c = pg_connect(env)
    try:
        return query_one(c, "SELECT current_setting('outbox.relay_mode')")[0]
    finally:
        c.close()


def switch_mode(env, conn, mode: str):
    set_conf(conn, relay_mode=mode)
    wait_until(lambda: session_mode(env) == mode, 20, f"new sessions in relay_mode = {mode}")


def hold_next_batch(env, step: str) -> LogWatcher:
    watcher = LogWatcher(env)
    with open(f"{env.pg_dir}/data/outbox_crash_{step}", "w") as f:
        f.write(f"sleep {WINDOW_MS} pass")
    return watcher


def wait_window(watcher: LogWatcher, step: str):
    wait_until(lambda: any(f'going on at "{step}"' in ln for ln in watcher.new_lines()), 60,
               f"the relay to hold a batch at {step}")


@pytest.fixture
def mode_restored(env, conn):
    yield
    for step in ("claim_start", "snapshot_start"):
        try:
            os.unlink(f"{env.pg_dir}/data/outbox_crash_{step}")
        except FileNotFoundError:
            pass
    set_conf(conn, relay_mode=None)
    wait_relay_ready(env)


def check_order(env, reader, present):
    missing = reader.wait_for(present, 60, extra=1)
    c = delivery_check(reader.snapshot(), present)
    reader.close()
    assert not missing, f"{len(missing)} of {len(present)} events never arrived"
    assert_delivered(c, "events committed inside a batch's window")


def test_claim_ceiling_sees_a_snapshot_event_committed_in_the_window(env, conn, mode_restored):
    """(a): E1 (tracked by snapshot) commits, then E2 (row-tracked, same aggregate), both after the
    claim's transaction began and before its claim ran. The claim must not send E2 before E1."""
    agg_type, reader = aggregate_topic(env, conn, "ceiling")

    switch_mode(env, conn, "snapshot")
    s1, e1 = emit_open(env, "snapshot", agg_type, "x", 1)
    switch_mode(env, conn, "row")
    # the old ceiling was lifted when no snapshot-tracked event was visible to the older snapshot:
    # make sure that is so, or this test would pass without the fix
    wait_until(lambda: query_one(conn, "SELECT count(*) FROM outbox.events e WHERE NOT outbox.published(e)")[0] == 0,
               60, "every earlier event published")
    query(conn, "SELECT outbox.purge('0')")
    assert query_one(conn, "SELECT count(*) FROM outbox.events WHERE xid IS NOT NULL")[0] == 0

    watcher = hold_next_batch(env, "claim_start")
    trigger = query_one(conn, "SELECT outbox.emit(%s, 'y', 'window.event', '{\"seq\": 1}')::text",
                        (agg_type,))[0]
    wait_window(watcher, "claim_start")
    s1.commit()
    e2 = query_one(conn, "SELECT outbox.emit(%s, 'x', 'window.event', '{\"seq\": 2}')::text", (agg_type,))[0]
    assert query_one(conn, "SELECT xid IS NULL FROM outbox.events WHERE event_id = %s", (e2,))[0]
    s1.close()
    check_order(env, reader, {e1: ("x", 1), e2: ("x", 2), trigger: ("y", 1)})


def test_held_set_sees_a_row_event_committed_in_the_window(env, conn, mode_restored):
    """(b): R1 (row-tracked) commits, then S2 (tracked by snapshot, same aggregate), both after the
    snapshot batch's transaction began and before the batch took its own snapshot. S2 must wait
    behind R1."""
    agg_type, reader = aggregate_topic(env, conn, "held")

    switch_mode(env, conn, "row")
    s1, r1 = emit_open(env, "row", agg_type, "x", 1)
    switch_mode(env, conn, "snapshot")
    s2, e2 = emit_open(env, "snapshot", agg_type, "x", 2)

    watcher = hold_next_batch(env, "snapshot_start")
    trigger = query_one(conn, "SELECT outbox.emit(%s, 'y', 'window.event', '{\"seq\": 1}')::text",
                        (agg_type,))[0]
    wait_window(watcher, "snapshot_start")
    s1.commit()
    s2.commit()
    s1.close()
    s2.close()
    check_order(env, reader, {r1: ("x", 1), e2: ("x", 2), trigger: ("y", 1)})
