"""Small end-to-end checks: tombstones, explicit topics, rollbacks, outbox.status."""
import uuid

import psycopg2
import pytest

from conftest import (assert_no_problems, create_topics, delivery_errors, emit, event_rows, message_problems,
                      new_aggregate_type, pg_connect, query, query_one, relay_status, server_major,
                      wait_until)


def test_tombstone_and_event_fields(env, conn, prefix, reader_factory):
    """A normal event then a NULL payload: both arrive, in order, the second as a tombstone."""
    agg_type = new_aggregate_type("tomb")
    topic = prefix + agg_type
    create_topics(env, [topic])
    reader = reader_factory([topic])

    conn.autocommit = False
    with conn.cursor() as cur:
        payload = {"name": "Grüße ✓", "n": 1, "nested": {"a": [1, 2, None], "b": True}}
        e1 = emit(cur, agg_type, "cust-1", "customer.created", payload,
                  {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tenant": "t1"})
        e2 = emit(cur, agg_type, "cust-1", "customer.deleted", None)
    conn.commit()
    conn.autocommit = True

    msgs = reader.read_until(2, timeout=30, extra=2)
    assert [m.event_id for m in msgs] == [e1, e2], f"received {[(m.event_id, m.offset) for m in msgs]}"
    rows = event_rows(conn, agg_type)
    assert set(rows) == {e1, e2}
    assert rows[e2]["payload"] is None
    assert msgs[1].value is None, f"tombstone value is {msgs[1].value!r}"
    problems = message_problems(msgs[0], event_id=e1, aggregate_type=agg_type, aggregate_id="cust-1",
                                event_type="customer.created", payload=payload,
                                headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tenant": "t1"},
                                topic=topic, created_ms=rows[e1]["created_ms"])
    problems += message_problems(msgs[1], event_id=e2, aggregate_type=agg_type, aggregate_id="cust-1",
                                 event_type="customer.deleted", payload=None, headers=None,
                                 topic=topic, created_ms=rows[e2]["created_ms"])
    assert_no_problems(problems, "the tombstone test's messages")
    assert msgs[0].partition == msgs[1].partition

    def published():
        r = event_rows(conn, agg_type)
        return all(x["published"] for x in r.values()) and r
    rows = wait_until(published, 10, "published_at to be set")
    assert all(x["attempts"] == 0 and x["last_error"] is None for x in rows.values()), rows


def test_explicit_topic_is_honoured(env, conn, prefix, reader_factory):
    agg_type = new_aggregate_type("expl")
    routed = prefix + agg_type
    explicit = f"it.explicit.{uuid.uuid4().hex[:10]}"
    create_topics(env, [routed, explicit])
    reader = reader_factory([routed, explicit])

    with conn.cursor() as cur:
        cur.execute("BEGIN")
        e1 = emit(cur, agg_type, "a-1", "thing.happened", {"to": "explicit"}, topic=explicit)
        cur.execute("COMMIT")
        cur.execute("BEGIN")
        e2 = emit(cur, agg_type, "a-1", "thing.happened", {"to": "routed"})
        cur.execute("COMMIT")

    msgs = reader.read_until(2, timeout=30, extra=2)
    got = sorted((m.event_id, m.topic) for m in msgs)
    assert got == sorted([(e1, explicit), (e2, routed)]), got
    rows = event_rows(conn, agg_type)
    assert rows[e1]["topic"] == explicit and rows[e2]["topic"] is None
    by_id = {m.event_id: m for m in msgs}
    problems = message_problems(by_id[e1], event_id=e1, aggregate_type=agg_type, aggregate_id="a-1",
                                event_type="thing.happened", payload={"to": "explicit"},
                                headers=None, topic=explicit, created_ms=rows[e1]["created_ms"])
    problems += message_problems(by_id[e2], event_id=e2, aggregate_type=agg_type, aggregate_id="a-1",
                                 event_type="thing.happened", payload={"to": "routed"},
                                 headers=None, topic=routed, created_ms=rows[e2]["created_ms"])
    assert_no_problems(problems, "the explicit-topic test's messages")


def test_rollback_never_publishes(env, conn, prefix, reader_factory):
    agg_type = new_aggregate_type("rb")
    topic = prefix + agg_type
    create_topics(env, [topic])
    reader = reader_factory([topic])
    rolled_back = []

    # 1. plain ROLLBACK
    conn.autocommit = False
    with conn.cursor() as cur:
        rolled_back.append(emit(cur, agg_type, "r-1", "x.rolledback", {"case": "rollback"}))
    conn.rollback()
    # 2. a failing statement after emit aborts the transaction
    with conn.cursor() as cur:
        rolled_back.append(emit(cur, agg_type, "r-1", "x.rolledback", {"case": "error"}))
        with pytest.raises(psycopg2.errors.DivisionByZero):
            cur.execute("SELECT 1/0")
    conn.rollback()
    # 3. another aggregate, after other statements in the same transaction
    with conn.cursor() as cur:
        cur.execute("SELECT 1")
        rolled_back.append(emit(cur, agg_type, "r-2", "x.rolledback", {"case": "rollback-2"}))
    conn.rollback()
    conn.autocommit = True

    reader.poll(0.5)
    assert reader.count() == 0, f"rolled-back events were published: {[m.event_id for m in reader.snapshot()]}"

    # a rolled-back savepoint inside a committed transaction; the committed event proves the
    # relay is alive and that nothing rolled back was queued ahead of it (a relay that sent
    # rolled-back events would have sent them by the time it sent this one: no sleep needed
    # before it), and the read below settles (nothing pending) before it checks
    conn.autocommit = False
    with conn.cursor() as cur:
        kept = emit(cur, agg_type, "r-1", "x.kept", {"case": "kept"})
        cur.execute("SAVEPOINT s")
        rolled_back.append(emit(cur, agg_type, "r-1", "x.rolledback", {"case": "savepoint"}))
        cur.execute("ROLLBACK TO SAVEPOINT s")
    conn.commit()
    conn.autocommit = True

    msgs = reader.read_until(1, timeout=30, extra=3)
    assert [m.event_id for m in msgs] == [kept], \
        f"expected only {kept}, got {[m.event_id for m in msgs]} (rolled back: {rolled_back})"
    rows = event_rows(conn, agg_type)
    assert set(rows) == {kept}, f"outbox.events holds {sorted(rows)}"


def test_status_shows_worker(env, conn, prefix, reader_factory):
    rows = relay_status(conn)
    assert len(rows) == 1, rows
    st = rows[0]
    assert st["database"] == env.pg_database
    assert st["state"] in ("idle", "publishing"), st
    assert st["started_at"] is not None
    (backend_type, app) = query_one(conn, "SELECT backend_type, datname FROM pg_stat_activity WHERE pid = %s",
                                    (st["pid"],))
    assert backend_type == "outbox relay", backend_type
    assert app == env.pg_database

    wait_until(lambda: relay_status(conn)[0]["pending"] == 0, 30, "an empty backlog")
    before = relay_status(conn)[0]

    agg_type = new_aggregate_type("status")
    topic = prefix + agg_type
    create_topics(env, [topic])
    reader = reader_factory([topic])
    n = 25
    t0 = query_one(conn, "SELECT clock_timestamp()")[0]
    conn.autocommit = False
    with conn.cursor() as cur:
        ids = [emit(cur, agg_type, f"s-{i % 5}", "s.e", {"i": i}) for i in range(n)]
    conn.commit()
    conn.autocommit = True

    msgs = reader.read_until(n, timeout=30, extra=1)
    assert sorted(m.event_id for m in msgs) == sorted(ids)

    def counted():
        s = relay_status(conn)[0]
        return s["pending"] == 0 and s["published"] >= before["published"] + n and s
    after = wait_until(counted, 10, "outbox.status to count the published events")
    assert after["published"] == before["published"] + n, (before, after)
    assert after["failed"] == before["failed"], (before, after)
    assert delivery_errors(after) == delivery_errors(before), (before, after)
    assert after["pid"] == before["pid"]
    assert after["last_publish_at"] is not None and after["last_publish_at"] >= t0, (t0, after)
    assert after["state"] in ("idle", "publishing"), after
    # with nothing left to do, the relay settles in idle
    wait_until(lambda: relay_status(conn)[0]["state"] == "idle", 10, "state idle")


def test_wait_events_name_what_the_relay_waits_for(conn):
    """pg_stat_activity shows what the relay waits for: from PostgreSQL 17 on by name
    (custom wait events), before 17 as the generic "Extension"."""
    major = server_major(conn)
    pid = wait_until(lambda: relay_status(conn) and relay_status(conn)[0]["pid"], 30, "a relay")

    def wait_event():
        row = query_one(conn, "SELECT wait_event_type, wait_event FROM pg_stat_activity WHERE pid = %s",
                        (pid,))
        return row if row and row[1] is not None else None

    idle = "OutboxIdle" if major >= 17 else "Extension"
    paused = "OutboxPaused" if major >= 17 else "Extension"
    wait_until(lambda: wait_event() == ("Extension", idle), 30, f"the idle relay to wait on {idle}")
    query_one(conn, "SELECT outbox.pause()")
    try:
        wait_until(lambda: wait_event() == ("Extension", paused), 30,
                   f"the paused relay to wait on {paused}")
    finally:
        query_one(conn, "SELECT outbox.resume()")
    wait_until(lambda: wait_event() == ("Extension", idle), 30, f"the resumed relay to wait on {idle}")
    if major >= 17:
        names = {r[0] for r in query(conn, "SELECT name FROM pg_wait_events WHERE type = 'Extension'")}
        assert {"OutboxIdle", "OutboxPaused"} <= names, names


def drop_extension_warning(env):
    """Run DROP EXTENSION outbox CASCADE in a transaction that is rolled back; return the
    WARNING lines it raised."""
    c = pg_connect(env, autocommit=False)
    try:
        with c.cursor() as cur:
            cur.execute("SET LOCAL lock_timeout = '20s'")
            cur.execute("DROP EXTENSION outbox CASCADE")
        c.rollback()
        return [n for n in c.notices if n.startswith("WARNING:") and "DROP EXTENSION" in n]
    finally:
        c.close()


def test_drop_extension_counts_events_committed_while_it_waits(env, conn, prefix):
    """A DROP EXTENSION that waits behind a session still emitting counts the events that session
    commits too: it takes its lock on outbox.events before it counts. It counted first (a fresh
    user's try): 1 of 8 discarded events was in the WARNING, the other 7 were dropped silently.
    Rolled back here."""
    import threading
    wait_until(lambda: relay_status(conn)[0]["pending"] == 0, 30, "an empty backlog")
    agg_type = new_aggregate_type("dropwait")
    create_topics(env, [prefix + agg_type])
    query_one(conn, "SELECT outbox.pause()")
    emitter = pg_connect(env, autocommit=False)
    result = {}
    try:
        with conn.cursor() as cur:
            emit(cur, agg_type, "d-0", "d.e", {"i": 0})
        with emitter.cursor() as cur:
            for i in range(1, 8):
                emit(cur, agg_type, f"d-{i}", "d.e", {"i": i})
        dropper = threading.Thread(target=lambda: result.update(w=drop_extension_warning(env)))
        dropper.start()
        wait_until(lambda: query_one(conn, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                                           " AND query LIKE 'DROP EXTENSION outbox%%'")[0] == 1, 30,
                   "the DROP to wait for the emitting session")
        emitter.commit()
        dropper.join(30)
        warnings = result.get("w")
        assert warnings is not None, "the DROP did not return"
        assert len(warnings) == 1 and "discarded 8 events never published to Kafka" in warnings[0], warnings
    finally:
        emitter.close()
        query_one(conn, "SELECT outbox.resume()")
    wait_until(lambda: relay_status(conn)[0]["pending"] == 0, 30, "the events published after resume()")


def test_drop_extension_warns_of_the_events_it_discards(env, conn, prefix):
    """DROP EXTENSION outbox deletes outbox.events with the events Kafka never got: it says how
    many in a WARNING, counted as outbox.status counts pending and failed events (published ones
    are not), and says nothing when there are none.  Rolled back here."""
    wait_until(lambda: relay_status(conn)[0]["pending"] == 0, 30, "an empty backlog")
    agg_type = new_aggregate_type("dropwarn")
    create_topics(env, [prefix + agg_type])
    query_one(conn, "SELECT outbox.pause()")
    try:
        with conn.cursor() as cur:
            for i in range(7):
                emit(cur, agg_type, f"d-{i}", "d.e", {"i": i})
        st = relay_status(conn)[0]
        assert st["pending"] >= 7, st
        discarded = st["pending"] + st["failed_events"]
        warnings = drop_extension_warning(env)
        assert len(warnings) == 1, warnings
        assert f"discarded {discarded} events never published to Kafka" in warnings[0], (warnings, st)
        assert query_one(conn, "SELECT count(*) FROM outbox.events WHERE aggregate_type = %s",
                         (agg_type,))[0] == 7, "ROLLBACK kept the events"
    finally:
        query_one(conn, "SELECT outbox.resume()")
    wait_until(lambda: relay_status(conn)[0]["pending"] == 0, 30, "the events published after resume()")
    st = relay_status(conn)[0]
    warnings = drop_extension_warning(env)
    if st["failed_events"] == 0:
        assert warnings == [], (warnings, st)
    else:
        assert len(warnings) == 1 and f"discarded {st['failed_events']} event" in warnings[0], (warnings, st)
