"""
A row-tracked event must not overtake a snapshot-tracked event of its aggregate that is still
pending below the snapshot progress's id floor.

Found by the fault schedule (test_32, OUTBOX_CHAOS_SEED=5): a reload of outbox.relay_mode from
snapshot to row came in the middle of a transaction of one aggregate; its first 21 events were
tracked by snapshot, its last one row by row, and the last one arrived first.

The row claim takes row-tracked events up to a ceiling, the id floor of the snapshot progress,
while snapshot-tracked events exist: above the floor a snapshot-tracked event of the same
aggregate may still be unsent.  But below the floor one may be unsent too: the events of a
transaction that was running when the relay took the progress snapshot (in its xip list, or with
an xid at or above its xmax) have ids at most the floor and are sent only by the next snapshot
batch (snapshot.c, part A).  The row claim runs first when a row-tracked event is due, so it sent
the later row-tracked event before them.

Both tests hold two transactions of one aggregate open, X1 tracked by snapshot and X2 (larger id)
row by row, while the relay records a progress snapshot (a third, committed, snapshot-tracked
event makes it take one); then X1 commits, X2 commits, with the relay paused so that it sees both
at once.  X1 must arrive first: it has the smaller id and committed first.  Without the fix X2
arrived first in both.
"""
import pytest

from conftest import pg_connect, query, query_one, wait_until
from test_35_batch_windows import aggregate_topic, check_order, emit_open, mode_restored, switch_mode  # noqa: F401


def emit_in(c, agg_type: str, aggregate: str, seq: int, mode: str) -> str:
    eid = query_one(c, "SELECT outbox.emit(%s, %s, 'floor.event', jsonb_build_object('seq', %s))::text",
                    (agg_type, aggregate, seq))[0]
    by_snapshot = query_one(c, "SELECT xid IS NOT NULL FROM outbox.events WHERE event_id = %s", (eid,))[0]
    assert by_snapshot == (mode == "snapshot"), f"event {seq} is not tracked {mode}"
    return eid


@pytest.mark.parametrize("same_transaction", [False, True],
                         ids=["two-transactions", "one-transaction"])
def test_row_claim_waits_for_snapshot_events_below_the_floor(env, conn, mode_restored,
                                                              same_transaction):
    agg_type, reader = aggregate_topic(env, conn, "floor")

    switch_mode(env, conn, "snapshot")
    s1, e1 = emit_open(env, "snapshot", agg_type, "x", 1)
    s0, e0 = emit_open(env, "snapshot", agg_type, "y", 1)
    switch_mode(env, conn, "row")
    if same_transaction:
        s2 = s1         # the reload reaches the open transaction at its next statement
    else:
        s2 = pg_connect(env, autocommit=False)
    e2 = emit_in(s2, agg_type, "x", 2, "row")

    # the relay records a progress snapshot while X1 and X2 are open: both ids are at most its floor
    s0.commit()
    s0.close()
    wait_until(lambda: query_one(conn, "SELECT outbox.published(e) FROM outbox.events e"
                                       " WHERE event_id = %s", (e0,))[0], 60, "Y1 published")
    floor = query_one(conn, "SELECT max(id_floor) FROM outbox.relay_progress")[0]
    query(conn, "SELECT outbox.pause()")
    s1.commit()
    if not same_transaction:
        s2.commit()
        s2.close()
    s1.close()
    ids = dict(query(conn, "SELECT event_id::text, id FROM outbox.events WHERE event_id IN (%s, %s)",
                     (e1, e2)))
    assert ids[e1] < ids[e2] <= floor, (ids, floor)
    query(conn, "SELECT outbox.resume()")
    check_order(env, reader, {e0: ("y", 1), e1: ("x", 1), e2: ("x", 2)})
