"""
Guarantees the README states that no other test checked (issue 28):

- Wake on commit: a transaction that emitted wakes the relay when it commits, so a long
  outbox.poll_interval does not delay delivery.
- Retention while a large backlog is pending: published events are deleted after
  outbox.retention although newer events wait unpublished behind them (Kafka unconfigured), and
  not one of those is deleted; once Kafka is back each arrives.
- A dead letter's row deleted (the README's way to give it up) releases the events of its
  aggregate held behind it: they stay back while other aggregates pass, and arrive, in order,
  once it is gone.

(pg_ctl stop in smart mode is in test_11_outage.py, with its fast twin; 0 duplicates across a
reload in test_11's reload test.)
"""
import time

from conftest import (create_topics, emit, new_aggregate_type, query, query_one, relay_status,
                      report, set_conf, unique_messages, wait_until)
from helpers_lifecycle import topic_message_count

# A commit that did not wake the relay would wait for its next poll: up to POLL_LONG_MS.  The
# limit is a tenth of that, far from it and far above any delay of a loaded machine.
POLL_LONG_MS = 300_000
WAKE_LIMIT_S = POLL_LONG_MS / 1000 / 10
WAKE_EVENTS = 4

RETAINED_EVENTS = 20_000        # published, then deleted by the retention
BACKLOG_EVENTS = 30_000         # pending behind them meanwhile: three retention chunks (10,000)
RETENTION_WAIT_S = 120

POISON_BYTES = 1_100_000        # > librdkafka's message.max.bytes (1048588): refused for good


def arrival_of(reader, event_id, timeout):
    """Seconds until event_id arrives at reader, polling it; None if it does not in timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        reader.poll(0.05)
        if any(m.event_id == event_id for m in reader.snapshot()):
            return time.monotonic() - t0
    return None


def test_commit_wakes_the_relay_despite_a_long_poll_interval(env, conn, prefix, reader_factory):
    agg_type = new_aggregate_type("wake")
    topic = prefix + agg_type
    create_topics(env, [topic])
    reader = reader_factory([topic])
    latencies = []
    try:
        set_conf(conn, poll_interval=POLL_LONG_MS)
        wait_until(lambda: query_one(conn, "SELECT setting FROM pg_settings WHERE name = 'outbox.poll_interval'")[0]
                   == str(POLL_LONG_MS), 20, "outbox.poll_interval after the reload")
        # the relay reads the reload at the top of its loop, before its next batch: once the
        # first event is out, it sleeps POLL_LONG_MS between passes whatever woke it before
        for i in range(WAKE_EVENTS):
            with conn.cursor() as cur:
                eid = emit(cur, agg_type, "w-1", "it.wake", {"i": i})
            took = arrival_of(reader, eid, WAKE_LIMIT_S)
            assert took is not None, \
                (f"event {i} did not arrive within {WAKE_LIMIT_S:.0f}s of its commit with"
                 f" outbox.poll_interval = {POLL_LONG_MS} ms: the commit did not wake the relay")
            latencies.append(took)
            # the relay is back in its long sleep before the next commit
            wait_until(lambda: relay_status(conn)[0]["state"] == "idle", 30, "the relay idle")
    finally:
        set_conf(conn, poll_interval=None)
    report(f"OUTBOX WAKE ON COMMIT: with outbox.poll_interval = {POLL_LONG_MS} ms, {WAKE_EVENTS} events"
           f" arrived {', '.join(f'{x:.2f}' for x in latencies)} s after their commits"
           f" (limit {WAKE_LIMIT_S:.0f} s)")


def count_rows(conn, agg_type, published=None):
    sql = "SELECT count(*) FROM outbox.events WHERE aggregate_type = %s"
    if published is not None:
        sql += " AND " + ("" if published else "NOT ") + "outbox.published(events)"
    return query_one(conn, sql, (agg_type,))[0]


def bulk(conn, agg_type, n):
    query(conn, "SELECT count(outbox.emit(%s, 'k-' || (g %% 100), 'it.retention',"
                " jsonb_build_object('g', g))) FROM generate_series(1, %s) AS g", (agg_type, n))


def test_retention_deletes_published_events_while_a_large_backlog_is_pending(env, conn, prefix):
    old_type, new_type = new_aggregate_type("retold"), new_aggregate_type("retnew")
    create_topics(env, [prefix + old_type, prefix + new_type])
    try:
        # published events the retention keeps for now (-1: for ever)
        set_conf(conn, retention=-1)
        wait_until(lambda: query_one(conn, "SHOW outbox.retention")[0] == "-1", 20, "outbox.retention = -1")
        bulk(conn, old_type, RETAINED_EVENTS)
        wait_until(lambda: count_rows(conn, old_type, published=False) == 0, 120,
                   f"the {RETAINED_EVENTS} events to be published")
        # then a backlog the relay cannot send (no Kafka configured) behind them
        set_conf(conn, bootstrap_servers="")
        wait_until(lambda: relay_status(conn)[0]["state"] == "not_configured", 30, "state not_configured")
        bulk(conn, new_type, BACKLOG_EVENTS)
        # the retention must delete the published ones now, and only them
        t0 = time.monotonic()
        set_conf(conn, retention="1s")
        wait_until(lambda: count_rows(conn, old_type) == 0, RETENTION_WAIT_S,
                   f"the retention to delete {RETAINED_EVENTS} published events while"
                   f" {BACKLOG_EVENTS} are pending")
        deleted_s = time.monotonic() - t0
        pending = count_rows(conn, new_type, published=False)
        assert pending == BACKLOG_EVENTS, \
            f"{BACKLOG_EVENTS - pending} of {BACKLOG_EVENTS} pending events were deleted or published"
        assert relay_status(conn)[0]["state"] == "not_configured"
    finally:
        set_conf(conn, bootstrap_servers=None, retention=None)
    # every event of the backlog arrives, once: none was lost to the retention
    wait_until(lambda: topic_message_count(env, prefix + new_type) >= BACKLOG_EVENTS, 240,
               "the backlog in Kafka")
    wait_until(lambda: count_rows(conn, new_type, published=False) == 0, 60, "the backlog marked published")
    in_kafka = topic_message_count(env, prefix + new_type)
    assert in_kafka == BACKLOG_EVENTS, f"{in_kafka} messages for {BACKLOG_EVENTS} events"
    assert topic_message_count(env, prefix + old_type) == RETAINED_EVENTS
    report(f"OUTBOX RETENTION behind a backlog: {RETAINED_EVENTS} published events deleted"
           f" {deleted_s:.1f}s after outbox.retention = 1s while {BACKLOG_EVENTS} newer ones were"
           f" pending; none of those deleted, all {in_kafka} in Kafka once Kafka was configured again")


def test_deleting_a_dead_letter_releases_the_events_held_behind_it(env, conn, prefix, reader_factory):
    agg_type = new_aggregate_type("dlrelease")
    topic = prefix + agg_type
    create_topics(env, [topic])
    reader = reader_factory([topic])
    poison = None
    try:
        set_conf(conn, max_attempts=1, on_failed_event=None)
        wait_until(lambda: query_one(conn, "SHOW outbox.max_attempts")[0] == "1", 20, "outbox.max_attempts = 1")
        conn.autocommit = False
        with conn.cursor() as cur:
            poison = emit(cur, agg_type, "held", "it.poison", {"blob": "x" * POISON_BYTES})
            held = [emit(cur, agg_type, "held", "it.after", {"n": n}) for n in (1, 2)]
        conn.commit()
        conn.autocommit = True
        wait_until(lambda: query_one(conn, "SELECT failed_at IS NOT NULL FROM outbox.events WHERE event_id = %s",
                                     (poison,))[0], 60, "the poison event to become a dead letter")
        # another aggregate passes: the relay has run batches since, and still holds the two
        with conn.cursor() as cur:
            other = emit(cur, agg_type, "other", "it.other", {"n": 0})
        assert arrival_of(reader, other, 60) is not None, "another aggregate's event did not pass"
        states = query(conn, "SELECT event_id::text, outbox.published(events), attempts FROM outbox.events"
                             " WHERE event_id = ANY(%s::uuid[])", (held,))
        assert all(not published and attempts == 0 for _, published, attempts in states), states
        assert not {m.event_id for m in reader.snapshot()} & set(held), "a held event was sent"

        # the README's way to give a dead letter up
        deleted = query(conn, "DELETE FROM outbox.events WHERE event_id = %s AND failed_at IS NOT NULL"
                              " RETURNING 1", (poison,))
        assert deleted == [(1,)]
        poison = None
        t0 = time.monotonic()
        msgs = unique_messages(reader.read_until(3, timeout=60, extra=0))
        released_s = time.monotonic() - t0
        got = [m.event_id for m in msgs if m.key == "held"]
        assert got == held, f"after the dead letter's row was deleted: {got}, expected {held} in order"
        wait_until(lambda: query_one(conn, "SELECT bool_and(outbox.published(events)) FROM outbox.events"
                                           " WHERE event_id = ANY(%s::uuid[])", (held,))[0], 30,
                   "the released events marked published")
    finally:
        conn.autocommit = True
        if poison is not None:
            query(conn, "DELETE FROM outbox.events WHERE event_id = %s", (poison,))
        set_conf(conn, max_attempts=None)
    report(f"OUTBOX DEAD LETTER DELETED: 2 events held behind a dead letter while another aggregate"
           f" passed; its row deleted, both arrived in order {released_s:.2f}s later")
