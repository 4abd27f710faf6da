"""
A relay stopped in the middle of a batch loses nothing ("stopped early" is never "done").

Issue 27: with every default (snapshot relay, at_least_once), a relay stopped by SIGTERM while it
produced a snapshot batch recorded the whole batch as published, the unsent rest included: the
events never reached Kafka, outbox.published(e) said true and the retention deleted them.

The relay's fault hook (src/relay/fault_point.c) sends the relay SIGTERM at a named step of its first
batch after resume(), 300 ms after it got there, so that the delivery reports of what it sent so
far are in (as when a SIGTERM comes during a later fetch): a chunk of the cursor produced (mid_cursor), everything produced but no
report yet (after_produce), every report in (after_ack).  Each is tried in both relay modes and
both delivery modes on a backlog of 2 x 6,000 events (two transactions, outbox.batch_size 5,000,
so the first batch is cut after its first chunk of 256).  Every event must arrive in
per-aggregate order, and the database must count as published only what Kafka has.

Without the fix (produce_snapshot_chunks taking any short fetch for the end of the batch) the
snapshot cases lost 11,744 of 12,000 events.
"""
import pytest

from conftest import (LogWatcher, create_topics, new_aggregate_type, query, query_one,
                      relay_status, report, set_conf, topic_prefix, wait_relay_ready, wait_until)
from helpers_crash import LightReader, assert_delivered, delivery_check

PER_TRANSACTION = 6000
AGGREGATES = 500
FAULT_LINE = "sending itself SIGTERM at"

EMIT_MANY_SQL = """
SELECT outbox.emit(%s, 'a' || (g %% {aggs}), 'stop.event',
                   jsonb_build_object('seq', g), NULL, NULL)::text,
       'a' || (g %% {aggs}), g
  FROM generate_series(%s, %s) AS g ORDER BY g
""".format(aggs=AGGREGATES)


def emit_backlog(conn, agg_type, start):
    """PER_TRANSACTION events in one transaction; event_id -> (aggregate, seq)."""
    rows = query(conn, EMIT_MANY_SQL, (agg_type, start, start + PER_TRANSACTION - 1))
    return {eid: (agg, seq) for eid, agg, seq in rows}


def relay_setting_reached(env, conn, name, value):
    """The relay runs with outbox.<name> = value: a fresh session shows it and the relay is ready."""
    wait_until(lambda: query_one(conn, f"SELECT current_setting('outbox.{name}')")[0] == value,
               20, f"outbox.{name} = {value}")


@pytest.fixture
def relay_modes(env, conn):
    """Set relay_mode and delivery for one test; the cluster's own values again after it."""
    watcher = LogWatcher(env)

    def apply(mode, delivery):
        set_conf(conn, relay_mode=mode, delivery=delivery)
        relay_setting_reached(env, conn, "relay_mode", mode)
        relay_setting_reached(env, conn, "delivery", delivery)
        if delivery == "exactly_once":
            wait_until(lambda: any("exactly-once delivery ready" in ln for ln in watcher.new_lines()),
                       90, "the relay to start exactly-once delivery")
        wait_relay_ready(env)
    yield apply
    query(conn, "SELECT outbox.resume()")
    set_conf(conn, relay_mode=None, delivery=None)
    wait_relay_ready(env)


CASES = [
    ("snapshot", "at_least_once", "mid_cursor"),
    ("snapshot", "at_least_once", "after_produce"),
    ("snapshot", "at_least_once", "after_ack"),
    ("snapshot", "exactly_once", "mid_cursor"),
    ("row", "at_least_once", "mid_cursor"),
    ("row", "exactly_once", "mid_cursor"),
]


@pytest.mark.parametrize("mode,delivery,moment", CASES,
                         ids=[f"{m}-{d}-{p}" for m, d, p in CASES])
def test_sigterm_mid_batch_loses_nothing(env, conn, relay_modes, mode, delivery, moment):
    relay_modes(mode, delivery)
    agg_type = new_aggregate_type("stop")
    topic = topic_prefix(conn) + agg_type
    create_topics(env, [topic])
    reader = LightReader(env, [topic])
    reader.wait_assigned()
    old_pid = relay_status(conn)[0]["pid"]

    query(conn, "SELECT outbox.pause()")
    present = emit_backlog(conn, agg_type, 1)
    present.update(emit_backlog(conn, agg_type, PER_TRANSACTION + 1))
    watcher = LogWatcher(env)
    with open(f"{env.pg_dir}/data/outbox_crash_{moment}", "w") as f:
        f.write("sleep 300 term")     # the reports of what went out come back first
    query(conn, "SELECT outbox.resume()")

    wait_until(lambda: any(FAULT_LINE in ln for ln in watcher.new_lines()), 60,
               f"the relay to stop itself at {moment}")
    wait_until(lambda: (relay_status(conn) or [{}])[0].get("pid") not in (None, old_pid), 60,
               "a new relay after the stop")
    missing = reader.wait_for(present, 120, extra=1)
    rows = reader.snapshot()
    reader.close()
    c = delivery_check(rows, present)
    unpublished = query_one(conn, "SELECT count(*) FROM outbox.events e"
                                  " WHERE e.aggregate_type = %s AND NOT outbox.published(e)",
                            (agg_type,))[0]
    report(f"OUTBOX STOP MID-BATCH ({mode}, {delivery}, SIGTERM at {moment}): "
           f"{len(present)} events, {len(missing)} lost, {c.duplicates} duplicates, "
           f"{c.reorderings} reordered, {unpublished} not yet marked")
    assert_delivered(c, f"SIGTERM at {moment} ({mode}, {delivery})")
    if delivery == "exactly_once":
        assert c.duplicates == 0, f"{c.duplicates} duplicates with exactly_once"
    # and the relay's own accounting agrees with Kafka: everything arrived, all of it is marked
    wait_until(lambda: query_one(conn, "SELECT count(*) FROM outbox.events e"
                                       " WHERE e.aggregate_type = %s AND NOT outbox.published(e)",
                                 (agg_type,))[0] == 0, 60, "every event to be marked published")


@pytest.mark.parametrize("mode", ["snapshot", "row"])
def test_exactly_once_record_waits_out_a_full_queue(env, conn, relay_modes, mode):
    """exactly_once adds the progress record to each batch's Kafka transaction right after its
    events. It was produced without the backpressure the events get: with librdkafka's local
    queue full it was refused at once, the transaction aborted and the whole batch was sent
    again, into the same full queue (issue 27, finding 3). A queue of 4 messages makes that
    every time it happened. A read_uncommitted consumer sees the events of aborted transactions
    too: it must see each event once (no batch sent twice), and the relay must never have taken
    the abort for a broker outage ("cannot deliver events", with an empty reason)."""
    agg_type = new_aggregate_type("eosqueue")
    topic = topic_prefix(conn) + agg_type
    create_topics(env, [topic])
    reader = LightReader(env, [topic], {"isolation.level": "read_committed"})
    raw = LightReader(env, [topic], {"isolation.level": "read_uncommitted"})
    reader.wait_assigned()
    raw.wait_assigned()
    watcher = LogWatcher(env)
    set_conf(conn, kafka_properties="queue.buffering.max.messages=4")
    try:
        relay_setting_reached(env, conn, "kafka_properties", "queue.buffering.max.messages=4")
        relay_modes(mode, "exactly_once")
        present = {}
        for start in (1, 301):
            rows = query(conn, "SELECT outbox.emit(%s, 'a' || (g %% 20), 'queue.event',"
                               "                   jsonb_build_object('seq', g))::text, 'a' || (g %% 20), g"
                               "  FROM generate_series(%s, %s) AS g ORDER BY g", (agg_type, start, start + 299))
            present.update({eid: (agg, seq) for eid, agg, seq in rows})
        missing = reader.wait_for(present, 90, extra=1)
        raw.wait_for(present, 30, extra=1)
        c = delivery_check(reader.snapshot(), present)
        every_copy = delivery_check(raw.snapshot(), present)
        reader.close()
        raw.close()
        outages = [ln for ln in watcher.new_lines() if "cannot deliver events" in ln]
        report(f"OUTBOX EOS FULL QUEUE ({mode}): {len(present)} events through a 4-message queue,"
               f" {len(missing)} missing, {c.duplicates} duplicates; {every_copy.duplicates} copies"
               f" in aborted transactions, {len(outages)} outage warnings")
        assert not missing, f"{len(missing)} of {len(present)} events never committed to Kafka"
        assert_delivered(c, f"exactly_once through a full queue ({mode})")
        assert c.duplicates == 0, f"{c.duplicates} duplicates with exactly_once"
        assert every_copy.duplicates == 0, \
            f"{every_copy.duplicates} events were sent again after an aborted transaction"
        assert not outages, f"the relay took a full queue for an outage: {outages[:2]}"
    finally:
        set_conf(conn, kafka_properties=None)
        wait_relay_ready(env)
