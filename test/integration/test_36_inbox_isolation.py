"""
One subscription must not stop the others, and the status tells the truth (issue 36, items 4-9;
issue 37's "Also" items on DROP EXTENSION and refused superusers; its parallel apply):
- a handler that sleeps holds only its own subscription: each has its own inbox worker; the 57014
  dead letter of a handler cut short names outbox.inbox_handler_timeout (item 5);
- a handler that manages its own subscription (unsubscribe, pause, seek) gets 55006, a dead
  letter like any handler error, and the subscription goes on (item 4);
- lag is high watermark minus next offset while paused and while stalled (item 6);
- a subscription whose every recent event fails shows state failing with the error (item 7);
- a reload of outbox.inbox_handler_timeout applies to the next handler call (item 9);
- outbox.inbox_workers_per_subscription = 2 splits a subscription's partitions between two
  workers: every event applied once, each key in order;
- DROP EXTENSION ends the inbox without an ERROR in the log; a superuser's refused subscription
  shows the refusal in last_error.
"""
import json
import uuid

import psycopg2
import pytest

from conftest import (LogWatcher, create_topics, pg_connect, query, query_one, set_conf,
                      wait_until)
from helpers_inbox import (APP_ROLE, as_app, mail_handler, produce, relay_headers, setup_app_role,
                           status, subscribe, unsubscribe_all)

TIMEOUT_S = 60


@pytest.fixture
def app(env, conn):
    setup_app_role(conn)
    yield conn
    c = wait_until(lambda: pg_connect(env), 60, "a connection after the test")
    try:
        unsubscribe_all(c)
        set_conf(c, inbox_handler_timeout=None, inbox_workers_per_subscription=None,
                 inbox_superuser_subscriptions=None)
    finally:
        c.close()


def new_topic(env, tag, partitions=1):
    topic = f"it_iso_{tag}_{uuid.uuid4().hex[:8]}"
    create_topics(env, [topic], partitions=partitions)
    return topic


def records(*pairs):
    return [(k, json.dumps({"n": n}).encode(), relay_headers(str(uuid.uuid4()))) for k, n in pairs]


def settled(conn, sub, n, partition=0):
    wait_until(lambda: query(conn, "SELECT next_offset FROM outbox.inbox_offsets"
                                   " WHERE subscription = %s AND kafka_partition = %s",
                             (sub, partition)) == [(n,)],
               TIMEOUT_S, f"{n} records of {sub} settled")


def applied(conn, table):
    return [(r[0], r[1]) for r in query(conn, f"SELECT key, (payload->>'n')::int FROM {table} ORDER BY id")]


def dead(conn, sub):
    return query(conn, "SELECT key, sqlstate, error FROM outbox.inbox_dead"
                       " WHERE subscription = %s AND NOT held ORDER BY id", (sub,))


def worker_of(conn, sub):
    """pid and wait_event of the inbox worker whose partitions belong to sub."""
    rows = query(conn, "SELECT a.pid, a.wait_event FROM pg_stat_activity AS a"
                       " WHERE a.backend_type = 'outbox inbox' AND a.pid IN"
                       " (SELECT pid FROM outbox.inbox_status WHERE subscription = %s)", (sub,))
    return rows[0] if rows else None


def test_a_sleeping_handler_holds_only_its_own_subscription(env, app):
    conn = app
    slow, fast = new_topic(env, "slow"), new_topic(env, "fast")
    mail_handler(conn, "it_iso_slow", "it_iso_handle_slow",
                 extra_sql="IF e.key = 'sleep' THEN PERFORM pg_sleep(60); END IF;")
    mail_handler(conn, "it_iso_fast", "it_iso_handle_fast")
    set_conf(conn, inbox_handler_timeout="90s")
    subscribe(conn, "it_iso_slow", [slow], "it_iso_handle_slow")
    subscribe(conn, "it_iso_fast", [fast], "it_iso_handle_fast")
    produce(env, slow, records(("sleep", 1)), partition=0)
    pid = wait_until(lambda: (lambda w: w[0] if w and w[1] == "PgSleep" else None)(worker_of(conn, "it_iso_slow")),
                     TIMEOUT_S, "the slow handler to sleep")
    produce(env, fast, records(("a", 1), ("b", 1), ("a", 2)), partition=0)
    settled(conn, "it_iso_fast", 3)
    assert applied(conn, "it_iso_fast") == [("a", 1), ("b", 1), ("a", 2)]
    assert worker_of(conn, "it_iso_slow") == (pid, "PgSleep"), \
        "the other subscription applied while the slow handler still slept"
    # cut it short: the dead letter names the setting
    set_conf(conn, inbox_handler_timeout="1s")
    query(conn, "SELECT pg_terminate_backend(%s)", (pid,))
    settled(conn, "it_iso_slow", 1)
    (key, sqlstate, error), = dead(conn, "it_iso_slow")
    assert (key, sqlstate) == ("sleep", "57014")
    assert "outbox.inbox_handler_timeout" in error, error


@pytest.mark.parametrize("call", [
    "outbox.unsubscribe(e.subscription)",
    "outbox.pause_subscription(e.subscription)",
    "outbox.inbox_seek(e.subscription, e.topic, e.kafka_partition, 0::bigint)",
])
def test_a_handler_that_manages_its_own_subscription_gets_55006(env, app, call):
    conn = app
    topic = new_topic(env, "self")
    mail_handler(conn, "it_iso_self", "it_iso_handle_self",
                 extra_sql=f"IF e.key = 'self' THEN PERFORM {call}; END IF;")
    subscribe(conn, "it_iso_self", [topic], "it_iso_handle_self", on_failed_event="skip")
    produce(env, topic, records(("a", 1), ("self", 1), ("b", 1)), partition=0)
    settled(conn, "it_iso_self", 3)
    assert applied(conn, "it_iso_self") == [("a", 1), ("b", 1)]
    (key, sqlstate, error), = dead(conn, "it_iso_self")
    assert (key, sqlstate) == ("self", "55006"), error
    assert "own handler" in error
    row = query_one(conn, "SELECT paused FROM outbox.subscriptions WHERE name = 'it_iso_self'")
    assert row == (False,), "the subscription is still there, not paused"


def test_lag_while_paused_and_while_stalled(env, app):
    conn = app
    topic = new_topic(env, "lag")
    mail_handler(conn, "it_iso_lag", "it_iso_handle_lag")
    subscribe(conn, "it_iso_lag", [topic], "it_iso_handle_lag")
    produce(env, topic, records(("a", 1)), partition=0)
    settled(conn, "it_iso_lag", 1)
    as_app(conn, "SELECT outbox.pause_subscription('it_iso_lag')")
    wait_until(lambda: [(r["state"], r["high_watermark"]) for r in status(conn, "it_iso_lag")] == [("paused", 1)],
               TIMEOUT_S, "paused with its high watermark")
    produce(env, topic, records(("a", 2), ("a", 3), ("a", 4)), partition=0)
    rows = wait_until(lambda: (lambda rs: rs if rs[0]["lag"] == 3 else None)(status(conn, "it_iso_lag")),
                      TIMEOUT_S, f"lag 3 while paused ({status(conn, 'it_iso_lag')})")
    assert rows[0]["state"] == "paused"
    as_app(conn, "SELECT outbox.resume_subscription('it_iso_lag')")
    settled(conn, "it_iso_lag", 4)
    as_app(conn, "SELECT outbox.inbox_seek('it_iso_lag', %s, 0, 1000000::bigint)", (topic,))
    rows = wait_until(lambda: (lambda rs: rs if rs[0]["state"] == "stalled" and rs[0]["lag"] is not None else None)(
        status(conn, "it_iso_lag")), TIMEOUT_S, "stalled past the end, with its lag")
    assert rows[0]["lag"] == 4 - 1000000, rows


def test_a_subscription_whose_every_event_fails_says_failing(env, app):
    conn = app
    topic = new_topic(env, "failing")
    mail_handler(conn, "it_iso_fail", "it_iso_handle_fail")
    subscribe(conn, "it_iso_fail", [topic], "it_iso_handle_fail", on_failed_event="skip")
    produce(env, topic, records(("a", 1)), partition=0)
    settled(conn, "it_iso_fail", 1)
    query(conn, f"ALTER TABLE it_iso_fail OWNER TO postgres")
    produce(env, topic, records(*[(f"k{i}", 1) for i in range(12)]), partition=0)
    settled(conn, "it_iso_fail", 13)
    rows = wait_until(lambda: (lambda rs: rs if rs[0]["state"] == "failing" else None)(status(conn, "it_iso_fail")),
                      TIMEOUT_S, "state failing")
    assert "permission denied" in rows[0]["last_error"], rows
    assert len(dead(conn, "it_iso_fail")) == 12
    # it heals when an event is applied again
    query(conn, f"ALTER TABLE it_iso_fail OWNER TO {APP_ROLE}")
    produce(env, topic, records(("z", 1)), partition=0)
    settled(conn, "it_iso_fail", 14)
    wait_until(lambda: status(conn, "it_iso_fail")[0]["state"] == "running", TIMEOUT_S, "running again")


def test_a_reload_applies_to_the_next_handler_call(env, app):
    """Two events in one batch; the first call (of a, the first time only) sleeps 4 s under a 60 s
    timeout; a reload to 1 s during it makes the second call (b sleeps 3 s) a 57014 dead letter, in
    the same batch: not from a later batch.  (The batch then runs again: a, not sleeping, applies.)"""
    conn = app
    topic = new_topic(env, "reload")
    produce(env, topic, records(("a", 1), ("b", 1)), partition=0)
    query(conn, "DROP SEQUENCE IF EXISTS it_iso_rl_seq")
    query(conn, "CREATE SEQUENCE it_iso_rl_seq")
    query(conn, f"ALTER SEQUENCE it_iso_rl_seq OWNER TO {APP_ROLE}")
    mail_handler(conn, "it_iso_rl", "it_iso_handle_rl", extra_sql=(
        "IF e.key = 'a' AND nextval('it_iso_rl_seq') = 1 THEN PERFORM pg_sleep(4); END IF;"
        "IF e.key = 'b' THEN PERFORM pg_sleep(3); END IF;"))
    set_conf(conn, inbox_handler_timeout="60s")
    subscribe(conn, "it_iso_rl", [topic], "it_iso_handle_rl", on_failed_event="skip")
    wait_until(lambda: (lambda w: w and w[1] == "PgSleep")(worker_of(conn, "it_iso_rl")),
               TIMEOUT_S, "the first call to sleep")
    set_conf(conn, inbox_handler_timeout="1s")
    settled(conn, "it_iso_rl", 2)
    assert applied(conn, "it_iso_rl") == [("a", 1)]
    assert [(k, s) for k, s, _ in dead(conn, "it_iso_rl")] == [("b", "57014")]


def test_two_workers_share_a_subscription(env, app):
    conn = app
    topic = new_topic(env, "split", partitions=4)
    mail_handler(conn, "it_iso_split", "it_iso_handle_split")
    set_conf(conn, inbox_workers_per_subscription=2)
    subscribe(conn, "it_iso_split", [topic], "it_iso_handle_split")
    keys = [f"k{i}" for i in range(40)]
    produce(env, topic, records(*[(k, n) for n in range(5) for k in keys]))
    wait_until(lambda: query_one(conn, "SELECT count(*) FROM it_iso_split")[0] == 200
               and query_one(conn, "SELECT sum(next_offset) FROM outbox.inbox_offsets"
                                   " WHERE subscription = 'it_iso_split'")[0] == 200,
               TIMEOUT_S, "200 events applied")
    pids = {r["pid"] for r in status(conn, "it_iso_split")}
    assert len(pids) == 2, f"two workers: {status(conn, 'it_iso_split')}"
    rows = query(conn, "SELECT key, array_agg((payload->>'n')::int ORDER BY id) FROM it_iso_split GROUP BY key")
    assert all(ns == list(range(5)) for _, ns in rows), "each key once, in order"
    # back to one worker: the split changes without applying anything twice
    set_conf(conn, inbox_workers_per_subscription=None)
    wait_until(lambda: len({r["pid"] for r in status(conn, "it_iso_split")} - {None}) == 1
               and all(r["state"] == "running" for r in status(conn, "it_iso_split")),
               TIMEOUT_S, "one worker again")
    produce(env, topic, records(*[(k, 5) for k in keys]))
    wait_until(lambda: query_one(conn, "SELECT count(*) FROM it_iso_split")[0] == 240
               and query_one(conn, "SELECT sum(next_offset) FROM outbox.inbox_offsets"
                                   " WHERE subscription = 'it_iso_split'")[0] == 240,
               TIMEOUT_S, "240 events applied")
    assert query_one(conn, "SELECT count(DISTINCT event_id) FROM it_iso_split")[0] == 240


def test_a_refused_superuser_subscription_says_why(env, app):
    conn = app
    topic = f"it_iso_su_{uuid.uuid4().hex[:8]}"
    mail_handler(conn, "it_iso_su", "it_iso_handle_su", role="postgres")
    # before its first partition is known (a topic that does not exist yet) it showed starting
    set_conf(conn, inbox_superuser_subscriptions="on")
    wait_until(lambda: query_one(pg_connect(env), "SHOW outbox.inbox_superuser_subscriptions")[0] == "on",
               10, "the setting")
    query(conn, "SELECT outbox.subscribe('it_iso_su', %s, 'it_iso_handle_su(outbox.inbox_event)')",
          ([topic + "_later"],))
    set_conf(conn, inbox_superuser_subscriptions=None)
    rows = wait_until(lambda: (lambda rs: rs if rs and rs[0]["last_error"] else None)(status(conn, "it_iso_su")),
                      TIMEOUT_S, "the refusal in last_error")
    assert "outbox.inbox_superuser_subscriptions" in rows[0]["last_error"], rows


def test_drop_extension_ends_the_inbox_without_an_error(env, conn):
    db = f"it_iso_drop_{uuid.uuid4().hex[:6]}"
    query(conn, f"CREATE DATABASE {db}")
    other = psycopg2.connect(host=env.pg_host, port=env.pg_port, user=env.pg_user, dbname=db)
    other.autocommit = True
    try:
        topic = new_topic(env, "drop")
        query(other, "CREATE EXTENSION outbox")
        query(other, "CREATE TABLE it_drop (e outbox.inbox_event)")
        query(other, "CREATE FUNCTION it_drop_h(e outbox.inbox_event) RETURNS void LANGUAGE sql"
                     " AS 'INSERT INTO it_drop VALUES (e)'")
        set_conf(conn, inbox_superuser_subscriptions="on", databases="*")
        wait_until(lambda: query_one(other, "SHOW outbox.inbox_superuser_subscriptions")[0] == "on",
                   TIMEOUT_S, "the reload in the other database's session")
        query(other, "SELECT outbox.subscribe('it_drop', %s, 'it_drop_h(outbox.inbox_event)')", ([topic],))
        produce(env, topic, records(("a", 1)), partition=0)
        wait_until(lambda: query_one(other, "SELECT count(*) FROM it_drop")[0] == 1, TIMEOUT_S, "applied")
        pids = [r[0] for r in query(conn, "SELECT pid FROM pg_stat_activity WHERE datname = %s"
                                          " AND backend_type LIKE 'outbox inbox%%'", (db,))]
        assert len(pids) == 2, pids
        watcher = LogWatcher(env)
        query(other, "DROP EXTENSION outbox CASCADE")
        wait_until(lambda: not query(conn, "SELECT 1 FROM pg_stat_activity WHERE datname = %s"
                                           " AND backend_type LIKE 'outbox inbox%%'", (db,)),
                   TIMEOUT_S, "the inbox of the database to exit")
        errors = [ln for ln in watcher.new_lines() if "ERROR" in ln and ("inbox" in ln or "outbox" in ln)]
        assert not errors, errors
        assert any("exits" in ln for ln in watcher.new_lines()), watcher.new_lines()[-20:]
    finally:
        other.close()
        set_conf(conn, inbox_superuser_subscriptions=None, databases=None)
        query(conn, f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")


def recreate_topic(env, topic, partitions):
    """Delete topic and create it again with partitions (Kafka deletes asynchronously: retry the
    create until it is accepted)."""
    from conftest import admin
    from confluent_kafka import KafkaException
    a = admin(env)
    for fut in a.delete_topics([topic], operation_timeout=30).values():
        fut.result(30)

    def created():
        try:
            create_topics(env, [topic], partitions=partitions)
        except KafkaException:
            return None
        return True
    wait_until(created, TIMEOUT_S, f"topic {topic} created again")


def test_a_topic_deleted_and_created_again_stalls_until_a_seek(env, app):
    """Issue 36, item 2: 30 records applied (10 per partition), the topic deleted and created again
    with 90 records (30 per partition): the inbox went on at offset 10 of the new topic and
    skipped 30 records, state running, lag 0.  Now every partition stalls (the record at its
    witness offset is another one) and applies nothing until a seek; the seek to the start
    applies the 90, each once."""
    conn = app
    topic = new_topic(env, "recreated", partitions=3)
    mail_handler(conn, "it_iso_rc", "it_iso_handle_rc")
    subscribe(conn, "it_iso_rc", [topic], "it_iso_handle_rc")
    for p in range(3):
        produce(env, topic, records(*[(f"old{p}", n) for n in range(10)]), partition=p)
    for p in range(3):
        settled(conn, "it_iso_rc", 10, partition=p)
    recreate_topic(env, topic, 3)
    for p in range(3):
        produce(env, topic, records(*[(f"new{p}", n) for n in range(30)]), partition=p)
    rows = wait_until(lambda: (lambda rs: rs if len(rs) == 3 and all(r["state"] == "stalled" for r in rs) else None)(
        [r for r in status(conn, "it_iso_rc") if r["kafka_partition"] is not None]),
        TIMEOUT_S, f"every partition stalled ({status(conn, 'it_iso_rc')})")
    assert any("created again" in (r["last_error"] or "") for r in rows), rows
    assert query_one(conn, "SELECT count(*) FROM it_iso_rc WHERE key LIKE 'new%'")[0] == 0, \
        "nothing of the new topic applied at the old offsets"
    as_app(conn, "SELECT outbox.inbox_seek('it_iso_rc', %s, NULL, '-infinity'::timestamptz)", (topic,))
    wait_until(lambda: query_one(conn, "SELECT count(*) FROM it_iso_rc WHERE key LIKE 'new%'")[0] == 90,
               TIMEOUT_S, "the new topic's 90 records applied after the seek")
    for p in range(3):
        settled(conn, "it_iso_rc", 30, partition=p)
    rows = query(conn, "SELECT key, array_agg((payload->>'n')::int ORDER BY id) FROM it_iso_rc GROUP BY key ORDER BY key")
    assert rows == [(f"new{p}", list(range(30))) for p in range(3)] + [(f"old{p}", list(range(10))) for p in range(3)]
