"""
Batch handlers and set-based batches (issue 37):
- a handler h(events outbox.inbox_event[]) is called once per apply transaction with the batch's
  new events in arrival order; copies (same id, later offset) are left out; the set-based
  INSERT ... SELECT FROM unnest(events) of doc/inbox.md applies every event once;
- a batch whose handler fails is narrowed down by bisection: the poison event becomes the only
  dead letter, with O(log n) extra calls, and (hold) the later events of its key are held;
- a per-event handler sees the batch's events in order, with one copy dropped, on several
  partitions at once.
"""
import json
import uuid

import pytest

from conftest import create_topics, pg_connect, query, query_one, set_conf, wait_until
from helpers_inbox import APP_ROLE, produce, relay_headers, setup_app_role, subscribe, unsubscribe_all

TIMEOUT_S = 60


@pytest.fixture
def app(env, conn):
    setup_app_role(conn)
    yield conn
    c = wait_until(lambda: pg_connect(env), 60, "a connection after the test")
    try:
        unsubscribe_all(c)
    finally:
        c.close()


def new_topic(env, tag, partitions=1):
    topic = f"it_batch_{tag}_{uuid.uuid4().hex[:8]}"
    create_topics(env, [topic], partitions=partitions)
    return topic


def batch_handler(conn, table, fn, extra_sql=""):
    """A table of applied events and one of calls, and fn(events outbox.inbox_event[]) that inserts
    the events set-based, as doc/inbox.md shows, after extra_sql."""
    for t in (table, table + "_calls"):
        query(conn, f"DROP TABLE IF EXISTS {t}")
    query(conn, f"CREATE TABLE {table} (event_id uuid PRIMARY KEY, key text, kafka_partition int,"
                f" kafka_offset bigint, n int, id bigserial)")
    query(conn, f"CREATE TABLE {table}_calls (id bigserial PRIMARY KEY, events int)")
    for t in (table, table + "_calls"):
        query(conn, f"ALTER TABLE {t} OWNER TO {APP_ROLE}")
    query(conn, f"""CREATE OR REPLACE FUNCTION {fn}(events outbox.inbox_event[]) RETURNS void
        LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
        BEGIN
            {extra_sql}
            INSERT INTO {table}_calls (events) VALUES (cardinality(events));
            INSERT INTO {table} (event_id, key, kafka_partition, kafka_offset, n)
            SELECT e.event_id, e.key, e.kafka_partition, e.kafka_offset, (e.payload->>'n')::int
              FROM unnest(events) WITH ORDINALITY AS e
             ORDER BY e.ordinality
            ON CONFLICT (event_id) DO NOTHING;
        END $$""")
    query(conn, f"ALTER FUNCTION {fn}(outbox.inbox_event[]) OWNER TO {APP_ROLE}")


def subscribe_batch(conn, name, topics, fn, **options):
    args = ["%s", "%s", "%s::regprocedure"]
    values = [name, topics, f"{fn}(outbox.inbox_event[])"]
    for k, v in options.items():
        args.append(f"{k} => %s")
        values.append(v)
    query(conn, f"SET ROLE {APP_ROLE}")
    try:
        query(conn, f"SELECT outbox.subscribe({', '.join(args)})", values)
    finally:
        query(conn, "RESET ROLE")


def settled_total(conn, sub, n):
    wait_until(lambda: query_one(conn, "SELECT coalesce(sum(next_offset), 0) FROM outbox.inbox_offsets"
                                       " WHERE subscription = %s", (sub,))[0] == n,
               TIMEOUT_S, f"{n} records of {sub} settled")


def test_a_batch_handler_applies_each_event_once_in_few_calls(env, app):
    conn = app
    topic = new_topic(env, "many", partitions=3)
    batch_handler(conn, "it_b_many", "it_b_handle_many")
    ids = [str(uuid.uuid4()) for _ in range(300)]
    recs = [(f"k{i % 30}", json.dumps({"n": i}).encode(), relay_headers(ids[i])) for i in range(300)]
    copies = [(f"k{i % 30}", json.dumps({"n": i}).encode(), relay_headers(ids[i])) for i in range(0, 300, 15)]
    produce(env, topic, recs)
    produce(env, topic, copies)
    subscribe_batch(conn, "it_b_many", [topic], "it_b_handle_many")
    settled_total(conn, "it_b_many", 320)
    assert query_one(conn, "SELECT count(*), count(DISTINCT event_id) FROM it_b_many") == (300, 300)
    calls, events = query_one(conn, "SELECT count(*), sum(events) FROM it_b_many_calls")
    assert events == 300, "copies are left out of the batches, every event is passed once"
    assert calls < 300 / 5, f"{calls} calls for 300 events: not called per batch"
    # arrival order per key
    rows = query(conn, "SELECT key, array_agg(n ORDER BY id) FROM it_b_many GROUP BY key")
    assert all(ns == sorted(ns) for _, ns in rows)
    dup = query_one(conn, "SELECT sum(duplicates) FROM outbox.inbox_offsets WHERE subscription = 'it_b_many'")[0]
    assert dup == 20


def test_a_failing_batch_is_bisected_to_its_poison_event(env, app):
    conn = app
    topic = new_topic(env, "poison")
    batch_handler(conn, "it_b_poison", "it_b_handle_poison", extra_sql=(
        "IF EXISTS (SELECT 1 FROM unnest(events) AS e WHERE e.key = 'poison') THEN"
        " RAISE EXCEPTION 'poison in the batch' USING ERRCODE = 'P0001'; END IF;"))
    recs = [(f"k{i % 7}" if i != 37 else "poison", json.dumps({"n": i}).encode(),
             relay_headers(str(uuid.uuid4()))) for i in range(100)]
    recs.append(("poison", json.dumps({"n": 100}).encode(), relay_headers(str(uuid.uuid4()))))
    produce(env, topic, recs, partition=0)
    subscribe_batch(conn, "it_b_poison", [topic], "it_b_handle_poison")
    settled_total(conn, "it_b_poison", 101)
    dead = query(conn, "SELECT key, kafka_offset, held, sqlstate FROM outbox.inbox_dead"
                       " WHERE subscription = 'it_b_poison' ORDER BY kafka_offset")
    assert dead == [("poison", 37, False, "P0001"), ("poison", 100, True, None)], dead
    assert query_one(conn, "SELECT count(*) FROM it_b_poison")[0] == 99
    calls = query_one(conn, "SELECT count(*) FROM it_b_poison_calls")[0]
    # rolled-back calls are not in the table: the committed ones are O(log n) pieces
    assert calls <= 20, f"{calls} committed calls: not a bisection"


def test_four_takers_drain_ten_hot_keys_in_key_order(env, app):
    """Queue mode with few keys: each take returns up to max events, several of a key, while other
    takers skip that key; every key's events are committed in order, each once."""
    import threading
    conn = app
    topic = new_topic(env, "hot")
    query(conn, f"SET ROLE {APP_ROLE}")
    try:
        query(conn, "SELECT outbox.subscribe('it_b_hot', %s)", ([topic],))
    finally:
        query(conn, "RESET ROLE")
    query(conn, "DROP TABLE IF EXISTS it_b_taken")
    query(conn, "DROP SEQUENCE IF EXISTS it_b_taken_seq")
    query(conn, "CREATE SEQUENCE it_b_taken_seq")
    query(conn, "CREATE TABLE it_b_taken (key text, n int, seq bigint, taker int, event_id uuid)")
    n_events = 3000
    produce(env, topic, [(f"k{i % 10}", json.dumps({"n": i}).encode(), relay_headers(str(uuid.uuid4())))
                         for i in range(n_events)], partition=0)
    wait_until(lambda: query_one(conn, "SELECT count(*) FROM outbox.inbox WHERE subscription = 'it_b_hot'")[0]
               == n_events, TIMEOUT_S, "every event queued")
    sizes = []
    errors = []

    def taker(t):
        c = pg_connect(env, autocommit=False)
        try:
            while True:
                with c.cursor() as cur:
                    cur.execute("INSERT INTO it_b_taken (key, n, seq, taker, event_id)"
                                " SELECT key, (payload->>'n')::int, nextval('it_b_taken_seq'), %s, event_id"
                                "   FROM outbox.inbox_take('it_b_hot', 100) ORDER BY id", (t,))
                    got = cur.rowcount
                c.commit()
                sizes.append(got)
                if got == 0 and not query(c, "SELECT 1 FROM outbox.inbox WHERE subscription = 'it_b_hot' LIMIT 1"):
                    c.commit()
                    return
                c.commit()
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))
        finally:
            c.close()
    threads = [threading.Thread(target=taker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors
    assert query_one(conn, "SELECT count(*), count(DISTINCT event_id) FROM it_b_taken") == (n_events, n_events), \
        (sizes[:20], query_one(conn, "SELECT count(*) FROM outbox.inbox WHERE subscription = 'it_b_hot'"))
    rows = query(conn, "SELECT key, array_agg(n ORDER BY seq) FROM it_b_taken GROUP BY key")
    assert len(rows) == 10 and all(ns == sorted(ns) for _, ns in rows), "a key was reordered"
    assert max(sizes) > 10, f"takes returned at most {max(sizes)} events: one per key"
    assert query_one(conn, "SELECT count(*) FROM outbox.inbox_keys WHERE subscription = 'it_b_hot'")[0] == 0
