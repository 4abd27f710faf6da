"""
A user's trigger on outbox.events that makes the relay's UPDATE (marking events published) skip
rows.  Found by a README-only trial: the relay sent the same two events about 900 times a second
for 10 minutes, logged nothing and showed state `publishing`.

Now: the relay notices that its UPDATE changed fewer rows than it was given, raises an ERROR
(logged, retried with backoff), and outbox.status shows state `error` with the reason.  Kafka gets
a few copies (one per retry), not thousands.  Once the trigger is dropped the event is marked
published, the state is no longer `error`, and no further copies arrive.

The relay writes such marks only for events tracked row by row: the event here is written with
a plain INSERT (no xid), as a data migration would, so it is row-tracked whatever
outbox.relay_mode says (events tracked by snapshot get no mark for a trigger to skip).
"""
import time

from conftest import (LogWatcher, create_topics, new_aggregate_type, query, relay_status,
                      report, wait_until)

TRIGGER_FN = "public.it_skip_relay_marks"


def test_trigger_that_skips_the_relays_update_is_an_error_not_a_resend_loop(env, conn, prefix,
                                                                            reader_factory):
    agg = new_aggregate_type("skipmark")
    topic = prefix + agg
    create_topics(env, [topic])
    reader = reader_factory([topic])
    watcher = LogWatcher(env)
    query(conn, f"""
        CREATE FUNCTION {TRIGGER_FN}() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF OLD.aggregate_type = '{agg}' THEN RETURN NULL; END IF;
            RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
        END $$;
        CREATE TRIGGER it_skip_relay_marks BEFORE UPDATE OR DELETE ON outbox.events
            FOR EACH ROW EXECUTE FUNCTION {TRIGGER_FN}();""")
    try:
        event_id = query(conn, "INSERT INTO outbox.events (aggregate_type, aggregate_id, event_type, payload)"
                               " VALUES (%s, 'k1', 'it.skip', '{\"n\": 1}') RETURNING event_id::text",
                         (agg,))[0][0]
        st = wait_until(lambda: (lambda r: r[0] if r and r[0]["state"] == "error" else None)(
            relay_status(conn)), 20, "state error in outbox.status")
        time.sleep(6)                       # let the relay retry a few times
        copies_while_failing = reader.read_until(10_000, timeout=0.5, extra=1.0)
        errors = [ln for ln in watcher.new_lines() if "could not record the outcome" in ln]
        pending = query(conn, "SELECT NOT outbox.published(events) FROM outbox.events WHERE event_id = %s",
                        (event_id,))
    finally:
        query(conn, f"DROP TRIGGER it_skip_relay_marks ON outbox.events; DROP FUNCTION {TRIGGER_FN}()")
    t_drop = time.monotonic()
    wait_until(lambda: not query(conn, "SELECT 1 FROM outbox.events WHERE event_id = %s"
                                       " AND NOT outbox.published(events)", (event_id,)),
               30, "the event marked published after the trigger was dropped")
    marked_s = time.monotonic() - t_drop
    after = wait_until(lambda: (lambda r: r[0] if r and r[0]["state"] != "error" else None)(
        relay_status(conn)), 20, "state no longer error")
    n_marked = reader.read_until(10_000, timeout=0.5, extra=2.0)
    # marked published: nothing is sent again; read the topic to its end once more (settle())
    n_final = reader.read_until(10_000, timeout=0.5, extra=3.0)

    report(f"OUTBOX INTERFERENCE: a BEFORE UPDATE OR DELETE trigger skipping the relay's marks ->"
           f" state {st['state']}, last_error {st['last_error']!r}; {len(errors)} ERROR line(s) and"
           f" {len(copies_while_failing)} cop(ies) in Kafka within ~7 s; trigger dropped: marked"
           f" published in {marked_s:.1f}s, state {after['state']}, {len(n_final)} copies in all,"
           f" {len(n_final) - len(n_marked)} after that")
    assert pending == [(True,)], pending
    assert "could not record the outcome of 1 event(s)" in (st["last_error"] or ""), st
    assert 1 <= len(errors) <= 6, errors
    assert 1 <= len(copies_while_failing) <= 8, \
        f"{len(copies_while_failing)} copies in ~7 s: the relay re-sends without backoff"
    assert all(m.key == "k1" for m in n_final)
    assert len(n_final) == len(n_marked), "copies kept arriving after the event was marked"
