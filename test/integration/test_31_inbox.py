"""
The inbox (issue 30), the receiving side, in the test cluster's database: subscriptions whose
handler is called once per event, in the transaction that advances the Kafka offsets kept in the
database.

- events our relay publishes reach the handler once each, in key order, as the subscribing role
  (never a superuser), and outbox.inbox_status, outbox.cluster_status() show them;
- every field of outbox.inbox_event from records produced straight to Kafka: a copy of an event
  at a later offset is dropped (dedupe by event_id), a record without an id is covered by its
  offset only, tombstones, values that are not JSON, keys that are not text, CloudEvents ids that
  are not uuids;
- bad subscriptions and bad calls get their SQLSTATE;
- unsubscribing the last subscription ends the inbox worker.
"""
import json
import uuid

import psycopg2
import pytest

from conftest import create_topics, emit, new_aggregate_type, pg_connect, query, query_one, wait_until
from helpers_inbox import (APP_ROLE, as_app, inbox_event_id, mail_handler, produce, relay_headers, setup_app_role,
                           status, subscribe, unsubscribe_all, wait_caught_up, wait_rows)

APPLY_TIMEOUT_S = 60


@pytest.fixture
def app(conn):
    """The subscribing role; every subscription of the database is dropped afterwards."""
    setup_app_role(conn)
    yield conn
    unsubscribe_all(conn)


def inbox_pid(conn):
    rows = query(conn, "SELECT pid FROM outbox.cluster_status() WHERE kind = 'inbox' AND database = current_database()")
    return rows[0][0] if rows else None


def test_relay_events_reach_the_handler_once_in_key_order(env, app, prefix):
    conn = app
    agg = new_aggregate_type("inbox")
    topic = prefix + agg
    create_topics(env, [topic])
    mail_handler(conn, "it_mail_a", "it_handle_a")
    subscribe(conn, "it_a", [topic], "it_handle_a")

    committed, rolled_back = [], []
    c = pg_connect(env, autocommit=False)
    try:
        for i in range(60):
            key = f"k{i % 6}"
            with c.cursor() as cur:
                eid = emit(cur, agg, key, "it.created", {"key": key, "seq": i})
            if i % 7 == 3:
                c.rollback()
                rolled_back.append(eid)
            else:
                c.commit()
                committed.append(eid)
    finally:
        c.close()

    wait_rows(conn, "SELECT count(*) FROM it_mail_a", len(committed), APPLY_TIMEOUT_S,
              "every committed event applied")
    wait_caught_up(conn, "it_a")
    rows = query(conn, "SELECT event_id::text, key, (payload->>'seq')::int, applied_by, event_type,"
                       " aggregate_type, topic FROM it_mail_a ORDER BY id")
    ids = [r[0] for r in rows]
    assert sorted(ids) == sorted(committed), "each committed event applied exactly once"
    assert not set(ids) & set(rolled_back)
    assert {r[3] for r in rows} == {APP_ROLE}, "the handler runs as the subscribing role"
    assert {(r[4], r[5], r[6]) for r in rows} == {("it.created", agg, topic)}
    for key in {r[1] for r in rows}:
        seqs = [r[2] for r in rows if r[1] == key]
        assert seqs == sorted(seqs), f"key {key} applied out of order: {seqs}"

    st = status(conn, "it_a")
    assert len(st) == 4 and {r["state"] for r in st} <= {"running"}, st
    assert sum(r["applied"] for r in st) == len(committed)
    assert all(r["lag"] in (0, None) and r["dead_letters"] == 0 for r in st), st
    cluster = query(conn, "SELECT kind, state, published FROM outbox.cluster_status() WHERE kind = 'inbox'")
    assert cluster and cluster[0][1] == "running" and cluster[0][2] >= len(committed), cluster


def test_event_fields_duplicates_and_odd_records(env, app):
    conn = app
    topic = f"it_inbox_raw_{uuid.uuid4().hex[:8]}"
    create_topics(env, [topic], partitions=1)
    mail_handler(conn, "it_mail_b", "it_handle_b")
    subscribe(conn, "it_b", [topic], "it_handle_b")
    wait_until(lambda: any(r["kafka_partition"] == 0 for r in status(conn, "it_b")), 30,
               "the partition to be placed")

    dup = str(uuid.uuid4())
    records = [
        ("k1", json.dumps({"n": 1}).encode(), relay_headers(dup, "t.one", "agg") + [("x-user", b"v")]),
        ("k1", json.dumps({"n": 1}).encode(), relay_headers(dup, "t.one", "agg")),    # a copy
        ("k2", b'{"no": "id"}', []),                                                    # no id
        ("k2", b'{"no": "id"}', []),                                                    # ... again
        ("k3", None, relay_headers(str(uuid.uuid4()))),                                 # tombstone
        ("k4", b"\x00\x01 not json", relay_headers(str(uuid.uuid4()))),
        ("k5", b"[1, 2", relay_headers(str(uuid.uuid4()))),                             # broken JSON
        (None, b'"no key"', [("ce_id", b"order-17"), ("ce_type", b"ce.type")]),       # CloudEvents
        (None, b'"again"', [("ce_id", b"order-17")]),                                  # same ce_id
    ]
    acks = produce(env, topic, records, partition=0)
    wait_until(lambda: query_one(conn, "SELECT applied + duplicates FROM outbox.inbox_offsets"
                                       " WHERE subscription = 'it_b'")[0] == len(records),
               APPLY_TIMEOUT_S, "every record settled")
    rows = query(conn, "SELECT kafka_offset, key, event_id::text, event_type, aggregate_type, headers,"
                       " payload, payload_bytes, kafka_timestamp IS NOT NULL, kafka_partition, topic"
                       " FROM it_mail_b ORDER BY kafka_offset")
    by_offset = {r[0]: r for r in rows}
    offsets = [a[1] for a in acks]
    assert sorted(by_offset) == [offsets[i] for i in (0, 2, 3, 4, 5, 6, 7)], \
        "the copies of an id are dropped, records without one are each applied"
    first = by_offset[offsets[0]]
    assert first[1:5] == ("k1", dup, "t.one", "agg")
    assert first[5] == {"id": dup, "event_type": "t.one", "aggregate_type": "agg", "x-user": "v"}
    assert first[6] == {"n": 1} and first[7] is None and first[8] and first[9] == 0 and first[10] == topic
    assert by_offset[offsets[2]][2] is None and by_offset[offsets[2]][6] == {"no": "id"}
    assert by_offset[offsets[2]][5] is None, "no headers: NULL"
    tomb = by_offset[offsets[4]]
    assert tomb[6] is None and tomb[7] is None, "a tombstone has neither payload nor bytes"
    assert by_offset[offsets[5]][6] is None and bytes(by_offset[offsets[5]][7]) == b"\x00\x01 not json"
    assert by_offset[offsets[6]][6] is None and bytes(by_offset[offsets[6]][7]) == b"[1, 2"
    ce = by_offset[offsets[7]]
    assert ce[1] is None and ce[3] == "ce.type" and ce[6] == "no key"
    assert ce[2] == inbox_event_id(b"order-17"), "an id that is no uuid is hashed"
    st = status(conn, "it_b")[0]
    assert st["applied"] == 7 and st["duplicates"] == 2 and st["next_offset"] == offsets[-1] + 1, st


def test_a_key_that_is_not_text(env, app):
    conn = app
    topic = f"it_inbox_key_{uuid.uuid4().hex[:8]}"
    create_topics(env, [topic], partitions=1)
    mail_handler(conn, "it_mail_k", "it_handle_k")
    subscribe(conn, "it_k", [topic], "it_handle_k")
    p = __import__("confluent_kafka").Producer({"bootstrap.servers": env.bootstrap})
    p.produce(topic, key=b"\xff\x00k", value=b"1", partition=0)
    assert p.flush(30) == 0
    wait_rows(conn, "SELECT count(*) FROM it_mail_k", 1, APPLY_TIMEOUT_S, "the record applied")
    assert query_one(conn, "SELECT key FROM it_mail_k")[0] == "\\xff006b"


def sqlstate_of(conn, sql, args=None, role=APP_ROLE):
    try:
        if role:
            as_app(conn, sql, args, role=role)
        else:
            query(conn, sql, args)
    except psycopg2.Error as e:
        return e.pgcode
    return None


def test_bad_subscriptions_get_their_sqlstate(env, app):
    conn = app
    mail_handler(conn, "it_mail_c", "it_handle_c")
    query(conn, "CREATE OR REPLACE FUNCTION it_wrong(i int) RETURNS void LANGUAGE sql AS 'SELECT 1'")
    query(conn, "CREATE OR REPLACE FUNCTION it_set(e outbox.inbox_event) RETURNS SETOF int"
                " LANGUAGE sql AS 'SELECT 1'")
    query(conn, "CREATE OR REPLACE PROCEDURE it_proc(e outbox.inbox_event) LANGUAGE sql AS 'SELECT 1'")
    query(conn, "CREATE OR REPLACE FUNCTION it_secret(e outbox.inbox_event) RETURNS void"
                " LANGUAGE sql AS 'SELECT 1'")
    query(conn, "REVOKE EXECUTE ON FUNCTION it_secret(outbox.inbox_event) FROM PUBLIC")
    h = "it_handle_c(outbox.inbox_event)"
    cases = {
        "empty name": ("SELECT outbox.subscribe('', '{t}')", "22023"),
        "long name": (f"SELECT outbox.subscribe('{'n' * 64}', '{{t}}')", "22023"),
        "no topic": ("SELECT outbox.subscribe('x', '{}')", "22023"),
        "bad topic": ("SELECT outbox.subscribe('x', '{\"bad topic\"}')", "22023"),
        "pattern": ("SELECT outbox.subscribe('x', '{orders.*}')", "22023"),
        "twice": ("SELECT outbox.subscribe('x', '{t,t}')", "22023"),
        "null topic": ("SELECT outbox.subscribe('x', ARRAY['t', NULL])", "22004"),
        "internal": ("SELECT outbox.subscribe('x', '{__consumer_offsets}')", "22023"),
        "signature": ("SELECT outbox.subscribe('x', '{t}', 'it_wrong(int)')", "42P13"),
        "set": ("SELECT outbox.subscribe('x', '{t}', 'it_set(outbox.inbox_event)')", "42P13"),
        "procedure": ("SELECT outbox.subscribe('x', '{t}', 'it_proc(outbox.inbox_event)')", "42P13"),
        "no execute": ("SELECT outbox.subscribe('x', '{t}', 'it_secret(outbox.inbox_event)')", "42501"),
        "option": (f"SELECT outbox.subscribe('x', '{{t}}', '{h}', on_failed_event => 'drop')", "22023"),
        "start": (f"SELECT outbox.subscribe('x', '{{t}}', '{h}', start_from => 'soon')", "22007"),
        "unknown": ("SELECT outbox.unsubscribe('nope')", "42704"),
        "pause unknown": ("SELECT outbox.pause_subscription('nope')", "42704"),
    }
    got = {name: sqlstate_of(conn, sql) for name, (sql, _) in cases.items()}
    assert got == {name: want for name, (_, want) in cases.items()}
    assert query_one(conn, "SELECT count(*) FROM outbox.subscriptions")[0] == 0

    subscribe(conn, "it_c", ["t_c"], "it_handle_c")
    assert sqlstate_of(conn, f"SELECT outbox.subscribe('it_c', '{{t}}', '{h}')") == "42710"
    assert sqlstate_of(conn, "SELECT outbox.subscribe('su', '{t}')", role=None) == "42501", \
        "a superuser may not subscribe by default"
    assert sqlstate_of(conn, "SELECT outbox.inbox_seek('it_c', 't_c', 0, -5::bigint)") == "22023"
    assert sqlstate_of(conn, "SELECT outbox.inbox_seek('it_c', 'other', 0, 5::bigint)") == "22023"
    assert sqlstate_of(conn, "SELECT * FROM outbox.inbox_take('it_c', 0)") == "22023"
    if not query(conn, "SELECT 1 FROM pg_roles WHERE rolname = 'inbox_other'"):
        query(conn, "CREATE ROLE inbox_other LOGIN")
    setup_app_role(conn, "inbox_other")
    assert sqlstate_of(conn, "SELECT outbox.unsubscribe('it_c')", role="inbox_other") == "42501"
    assert sqlstate_of(conn, "SELECT outbox.pause_subscription('it_c')", role="inbox_other") == "42501"
    assert sqlstate_of(conn, "SELECT * FROM outbox.inbox_take('it_c')", role="inbox_other") == "42501"
    assert sqlstate_of(conn, "SELECT outbox.unsubscribe('it_c')") is None
    assert sqlstate_of(conn, "SELECT outbox.subscribe('x', '{t}')", role="pg_monitor") == "42501", \
        "EXECUTE is not granted to PUBLIC"


def test_the_last_unsubscribe_ends_the_inbox_worker(env, app):
    conn = app
    topic = f"it_inbox_end_{uuid.uuid4().hex[:8]}"
    create_topics(env, [topic], partitions=1)
    mail_handler(conn, "it_mail_e", "it_handle_e")
    subscribe(conn, "it_e", [topic], "it_handle_e")
    pid = wait_until(lambda: inbox_pid(conn), 30, "an inbox worker to start")
    assert query_one(conn, "SELECT backend_type FROM pg_stat_activity WHERE pid = %s", (pid,))[0] \
        == "outbox inbox"
    as_app(conn, "SELECT outbox.unsubscribe('it_e')")
    wait_until(lambda: inbox_pid(conn) is None, 30, "the inbox worker to exit")
    assert query_one(conn, "SELECT count(*) FROM outbox.inbox_offsets WHERE subscription = 'it_e'")[0] == 0


def test_partitions_added_and_a_topic_that_appears_later(env, app):
    conn = app
    topic = f"it_inbox_grow_{uuid.uuid4().hex[:8]}"
    late = f"it_inbox_late_{uuid.uuid4().hex[:8]}"
    create_topics(env, [topic], partitions=2)
    mail_handler(conn, "it_mail_g", "it_handle_g")
    subscribe(conn, "it_grow", [topic, late], "it_handle_g", start_from="latest")
    wait_until(lambda: [r["state"] for r in status(conn, "it_grow") if r["topic"] == late] == ["waiting_for_topic"],
               30, "the late topic waiting")
    wait_until(lambda: len([r for r in status(conn, "it_grow") if r["topic"] == topic
                            and r["next_offset"] is not None]) == 2, 30, "both partitions placed")
    produce(env, topic, [("a", b'{"n": 1}', relay_headers(str(uuid.uuid4())))], partition=0)
    wait_rows(conn, "SELECT count(*) FROM it_mail_g", 1, APPLY_TIMEOUT_S, "the first record")

    # more partitions: the new ones are read from their first offset
    from confluent_kafka.admin import NewPartitions
    from conftest import admin
    a = admin(env)
    for f in a.create_partitions([NewPartitions(topic, 4)]).values():
        f.result(30)
    wait_until(lambda: len([r for r in status(conn, "it_grow") if r["topic"] == topic]) == 4, 60,
               "the new partitions found")
    produce(env, topic, [("b", b'{"n": 2}', relay_headers(str(uuid.uuid4())))], partition=3)
    produce(env, topic, [("c", b'{"n": 3}', relay_headers(str(uuid.uuid4())))], partition=2)
    # a topic that appears is read from its first offset (start_from applies only to the first start)
    create_topics(env, [late], partitions=1)
    produce(env, late, [("d", b'{"n": 4}', relay_headers(str(uuid.uuid4())))], partition=0)
    wait_rows(conn, "SELECT count(*) FROM it_mail_g", 4, APPLY_TIMEOUT_S, "the new partitions' and topic's records")
    got = query(conn, "SELECT topic, kafka_partition, kafka_offset FROM it_mail_g ORDER BY id")
    assert sorted(got) == sorted([(topic, 0, 0), (topic, 3, 0), (topic, 2, 0), (late, 0, 0)]), got


def test_start_from_latest_skips_what_was_there(env, app):
    conn = app
    topic = f"it_inbox_latest_{uuid.uuid4().hex[:8]}"
    create_topics(env, [topic], partitions=1)
    produce(env, topic, [("old", b'{"n": 0}', relay_headers(str(uuid.uuid4())))], partition=0)
    mail_handler(conn, "it_mail_l", "it_handle_l")
    subscribe(conn, "it_latest", [topic], "it_handle_l", start_from="latest")
    wait_until(lambda: status(conn, "it_latest")[0]["next_offset"] == 1, 30, "placed at the end")
    produce(env, topic, [("new", b'{"n": 1}', relay_headers(str(uuid.uuid4())))], partition=0)
    wait_rows(conn, "SELECT count(*) FROM it_mail_l", 1, APPLY_TIMEOUT_S, "the new record")
    assert query(conn, "SELECT key FROM it_mail_l") == [("new",)]


def test_subscribe_unsubscribe_and_pause_under_load(env, app):
    """Records stream into a topic while a second subscription of it is made and dropped, and the
    first is paused and resumed, several times: the first applies every record once."""
    conn = app
    topic = f"it_inbox_churn_{uuid.uuid4().hex[:8]}"
    create_topics(env, [topic], partitions=2)
    mail_handler(conn, "it_mail_ch", "it_handle_ch")
    mail_handler(conn, "it_mail_ch2", "it_handle_ch2")
    subscribe(conn, "it_churn", [topic], "it_handle_ch")
    total = 0
    for rnd in range(4):
        recs = [(f"k{i % 7}", json.dumps({"r": rnd, "i": i}).encode(), relay_headers(str(uuid.uuid4())))
                for i in range(250)]
        produce(env, topic, recs[:125])
        subscribe(conn, f"it_churn_b{rnd}", [topic], "it_handle_ch2")
        as_app(conn, "SELECT outbox.pause_subscription('it_churn')")
        produce(env, topic, recs[125:])
        as_app(conn, "SELECT outbox.resume_subscription('it_churn')")
        as_app(conn, f"SELECT outbox.unsubscribe('it_churn_b{rnd}')")
        total += len(recs)
    wait_rows(conn, "SELECT count(*) FROM it_mail_ch", total, APPLY_TIMEOUT_S, "every record applied")
    wait_caught_up(conn, "it_churn")
    rows = query(conn, "SELECT event_id, count(*) FROM it_mail_ch GROUP BY 1 HAVING count(*) > 1")
    assert rows == [] and query_one(conn, "SELECT count(*) FROM it_mail_ch")[0] == total
    assert query_one(conn, "SELECT count(*) FROM outbox.inbox_offsets WHERE subscription LIKE 'it_churn_b%'")[0] == 0
