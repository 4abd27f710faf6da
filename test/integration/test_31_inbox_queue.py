"""
Queue mode of the inbox (issue 30, step 3): a subscription without a handler lands its events in
outbox.inbox, and outbox.inbox_take() hands them out inside the application's own transaction:
several events of a key in key order, a key held by one taker at a time (issue 37); a
rolled-back take gives them back; a committed take with the application's writes applies each
event exactly once.
"""
import json
import random
import threading
import uuid

import psycopg2
import pytest

from conftest import create_topics, pg_connect, query, query_one, wait_until
from helpers_inbox import APP_ROLE, produce, relay_headers, setup_app_role, subscribe, unsubscribe_all


@pytest.fixture
def app(conn):
    setup_app_role(conn)
    yield conn
    unsubscribe_all(conn)


def app_conn(env):
    c = pg_connect(env, autocommit=False)
    with c.cursor() as cur:
        cur.execute(f"SET ROLE {APP_ROLE}")
    c.commit()
    return c


def take(c, sub, n=100):
    with c.cursor() as cur:
        cur.execute("SELECT id, key, kafka_offset, (payload->>'seq')::int FROM outbox.inbox_take(%s, %s)",
                    (sub, n))
        return cur.fetchall()


def queued(conn, sub):
    return query_one(conn, "SELECT count(*) FROM outbox.inbox WHERE subscription = %s", (sub,))[0]


def test_take_hands_out_a_key_to_one_taker_at_a_time(env, app):
    """Issue 37: a take returns several events of a key, in key order, and another taker skips
    the keys (and key-less events) the first one holds until it commits or rolls back."""
    conn = app
    topic = f"it_inbox_q_{uuid.uuid4().hex[:8]}"
    create_topics(env, [topic], partitions=2)
    subscribe(conn, "it_q", [topic])
    recs = []
    for seq in range(3):
        for key in ("a", "b", "c"):
            if key == "c" and seq > 0:
                continue
            recs.append((key, json.dumps({"seq": seq}).encode(), relay_headers(str(uuid.uuid4()))))
    recs += [(None, b'{"seq": 9}', []), (None, b'{"seq": 9}', [])]
    produce(env, topic, recs)
    wait_until(lambda: queued(conn, "it_q") == len(recs), 60, "every event queued")

    a, b = app_conn(env), app_conn(env)
    try:
        first = take(a, "it_q")
        assert sorted(((k or ""), s) for _, k, _, s in first) == \
            [("", 9), ("", 9), ("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("b", 2), ("c", 0)]
        assert [r[0] for r in first] == sorted(r[0] for r in first), "in id order"
        assert take(b, "it_q") == [], "every key and key-less event is held by the first taker"
        a.rollback()
        again = take(b, "it_q", 2)
        assert len(again) == 2 and [r[0] for r in again] == sorted(r[0] for r in again), "in id order"
        b.commit()
        takes = [again]
        while True:
            got = take(a, "it_q")
            a.commit()
            if not got:
                break
            takes.append(got)
        by_key = {}
        for t in takes:
            for _, k, _, s in t:
                by_key.setdefault(k, []).append(s)
        assert by_key == {"a": [0, 1, 2], "b": [0, 1, 2], "c": [0], None: [9, 9]}, by_key
        assert queued(conn, "it_q") == 0
    finally:
        a.close()
        b.close()


def test_takers_apply_every_event_exactly_once(env, app):
    """Four application sessions take events and write their effects in the same transaction, one
    take in five rolled back; every queued event is applied once, in key order."""
    conn = app
    topic = f"it_inbox_qx_{uuid.uuid4().hex[:8]}"
    create_topics(env, [topic])
    query(conn, "DROP TABLE IF EXISTS it_orders")
    query(conn, "CREATE TABLE it_orders (event_id uuid, key text, seq int, id bigserial)")
    query(conn, f"ALTER TABLE it_orders OWNER TO {APP_ROLE}")
    subscribe(conn, "it_qx", [topic])
    ids = []
    recs = []
    for seq in range(50):
        for k in range(8):
            eid = str(uuid.uuid4())
            ids.append(eid)
            recs.append((f"k{k}", json.dumps({"seq": seq}).encode(), relay_headers(eid)))
    produce(env, topic, recs)
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        c = app_conn(env)
        try:
            idle = 0
            while idle < 20:
                with c.cursor() as cur:
                    cur.execute("INSERT INTO it_orders (event_id, key, seq)"
                                " SELECT event_id, key, (payload->>'seq')::int"
                                "   FROM outbox.inbox_take('it_qx', 7) ORDER BY id")
                    n = cur.rowcount
                if rng.random() < 0.2:
                    c.rollback()
                else:
                    c.commit()
                idle = idle + 1 if n == 0 else 0
                if n == 0:
                    threading.Event().wait(0.05)
        except psycopg2.Error as e:
            errors.append(str(e))
        finally:
            c.close()
    wait_until(lambda: queued(conn, "it_qx") > 0, 60, "events queued")
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[:3]
    wait_until(lambda: query_one(conn, "SELECT count(*) FROM it_orders")[0] >= len(ids) and queued(conn, "it_qx") == 0,
               60, "every event taken")
    rows = query(conn, "SELECT event_id::text, key, seq FROM it_orders ORDER BY id")
    assert sorted(r[0] for r in rows) == sorted(ids), "each event applied exactly once"
    for k in {r[1] for r in rows}:
        seqs = [r[2] for r in rows if r[1] == k]
        assert seqs == sorted(seqs), f"key {k} out of order"
