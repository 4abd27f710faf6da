"""
An event Kafka can never take (payload larger than message.max.bytes): its failure is recorded
(attempts, last_error, backoff), later events of the same aggregate wait behind it, other
aggregates are delivered exactly once, and once it is removed the held-back event goes out.
"""
import collections

from conftest import (create_topics, delivery_errors, emit, event_rows, new_aggregate_type,
                      query, relay_status, unique_messages, wait_until)


def test_undeliverable_event_holds_back_only_its_aggregate(env, conn, prefix, reader_factory):
    agg_type = new_aggregate_type("poison")
    topic = prefix + agg_type
    create_topics(env, [topic])
    reader = reader_factory([topic])
    wait_until(lambda: relay_status(conn)[0]["pending"] == 0, 30, "an empty backlog")
    before = relay_status(conn)[0]

    conn.autocommit = False
    with conn.cursor() as cur:
        a = emit(cur, agg_type, "a1", "t.ok", {"n": 1})
        poison = emit(cur, agg_type, "a2", "t.big", {"blob": "x" * 1_100_000})  # > 1048588 bytes
        b = emit(cur, agg_type, "a3", "t.ok", {"n": 3})
        held = emit(cur, agg_type, "a2", "t.after_big", {"n": 4})
    conn.commit()
    conn.autocommit = True

    try:
        wait_until(lambda: event_rows(conn, agg_type)[poison]["attempts"] > 0, 20,
                   "the failed delivery to be recorded")

        msgs = unique_messages(reader.read_until(2, timeout=20, extra=3))
        counts = collections.Counter(m.event_id for m in msgs)
        assert set(counts) == {a, b}, f"expected only {a} and {b}, got {dict(counts)}"
        assert counts == {a: 1, b: 1}, f"duplicates: {dict(counts)}"
        rows = event_rows(conn, agg_type)
        p = rows[poison]
        assert not p["published"] and p["attempts"] >= 1, p
        assert p["last_error"] and "MSG_SIZE_TOO_LARGE" in p["last_error"], p["last_error"]
        assert not rows[held]["published"], "an event overtook the failed one of its aggregate"
        assert rows[held]["attempts"] == 0
        assert rows[a]["published"] and rows[b]["published"]
        after = relay_status(conn)[0]
        assert delivery_errors(after) > delivery_errors(before), after
        assert after["last_error"] and "MSG_SIZE_TOO_LARGE" in after["last_error"], after
    finally:
        # never leave a poison event behind: it would be retried for the rest of the suite
        query(conn, "DELETE FROM outbox.events WHERE event_id = %s", (poison,))

    # without its blocker, the held-back event is published, once
    msgs = unique_messages(reader.read_until(3, timeout=20, extra=2))
    counts = collections.Counter(m.event_id for m in msgs)
    assert set(counts) == {a, b, held}, dict(counts)
    assert counts[held] == 1
    assert wait_until(lambda: event_rows(conn, agg_type)[held]["published"], 10,
                      "the held-back event to be marked published")

