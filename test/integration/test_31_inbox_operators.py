"""
The inbox with producers and operators that are not the relay (issue 36 items 1, 3, 10, 11;
issue 37's seek items), against the real broker:
- an empty or null `id` (or `ce_id`) header is no id: each such record is covered by its offset
  alone, never dropped as a copy of another;
- unsubscribe, then subscribe again with the same name: the ids the former subscription applied
  are still seen (a NOTICE says so), so none of its id-carrying events is applied twice;
- the positions are one set in subscribe() and inbox_seek(): earliest, latest, a timestamp, an
  offset, '-infinity' and 'infinity'; a seek past the end says "not yet", and a seek to the end
  right after it un-stalls the partition; a seek to a partition the topic does not have is 22023
  and names the partitions the subscription knows;
- a role granted only outbox_subscriber can do everything a subscriber does, and sees its own
  dead letters (row-level security), not another role's; what a handler sees of session_user,
  payloads with \\u0000, null keys under hold.
"""
import dataclasses
import json
import uuid

import psycopg2
import pytest

from conftest import create_topics, pg_connect, query, query_one, wait_until
from helpers_inbox import (as_app, mail_handler, produce, relay_headers, setup_app_role, status,
                           subscribe, unsubscribe_all)

TIMEOUT_S = 60
SUBSCRIBER = "inbox_sub_app"         # granted outbox_subscriber only
OTHER = "inbox_sub_other"            # likewise, another owner


@pytest.fixture
def app(env, conn):
    setup_app_role(conn)
    yield conn
    c = pg_connect(env)
    try:
        unsubscribe_all(c)
        for role in (SUBSCRIBER, OTHER):
            if query(c, "SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)):
                query(c, f"DROP OWNED BY {role}")
                query(c, f"DROP ROLE {role}")
    finally:
        c.close()


def new_topic(env, tag, partitions=1):
    topic = f"it_inbox_{tag}_{uuid.uuid4().hex[:8]}"
    create_topics(env, [topic], partitions=partitions)
    return topic


def settled(conn, sub):
    """Records of sub settled: applied plus dropped as copies."""
    return query_one(conn, "SELECT coalesce(sum(applied + duplicates), 0) FROM outbox.inbox_offsets"
                           " WHERE subscription = %s", (sub,))[0]


def next_offset(conn, sub, partition=0):
    rows = query(conn, "SELECT next_offset FROM outbox.inbox_offsets WHERE subscription = %s"
                       " AND kafka_partition = %s", (sub, partition))
    return rows[0][0] if rows else None


def test_an_empty_or_null_id_header_is_no_id(env, app):
    """Issue 36 #1: headers [("id", b"")] and [("id", None)] hashed like one id, so of five
    distinct events only the first was applied and the others counted as duplicates."""
    conn = app
    topic = new_topic(env, "noid")
    mail_handler(conn, "it_mail_noid", "it_handle_noid")
    subscribe(conn, "it_noid", [topic], "it_handle_noid")
    recs = []
    for headers in ([("id", b"")], [("id", None)], [("ce_id", b"")], [("ce_id", None)]):
        recs += [(k, json.dumps({"k": k, "h": repr(headers)}).encode(), headers) for k in "abcde"]
    produce(env, topic, recs, partition=0)
    wait_until(lambda: settled(conn, "it_noid") == len(recs), TIMEOUT_S, "every record settled")
    rows = query(conn, "SELECT key, event_id, payload->>'h' FROM it_mail_noid ORDER BY id")
    assert len(rows) == len(recs), f"{len(rows)} of {len(recs)} applied: {rows}"
    assert all(r[1] is None for r in rows), "an empty or null id gives no event_id"
    assert [r[0] for r in rows] == [k for k, _, _ in recs]
    st = status(conn, "it_noid")[0]
    assert st["duplicates"] == 0 and st["applied"] == len(recs), st
    # an empty id beside a real ce_id: the ce_id is the id
    eid = str(uuid.uuid4())
    produce(env, topic, [("f", b"{}", [("id", b""), ("ce_id", eid.encode())])] * 2, partition=0)
    wait_until(lambda: settled(conn, "it_noid") == len(recs) + 2, TIMEOUT_S, "the ce_id records settled")
    assert query(conn, "SELECT event_id::text FROM it_mail_noid WHERE key = 'f'") == [(eid,)]


def test_a_resubscribe_with_the_same_name_applies_no_id_twice(env, app):
    """Issue 36 #3: unsubscribe() wiped the seen ids, and subscribe() with the same name applied
    every event again from earliest."""
    conn = app
    topic = new_topic(env, "resub", partitions=3)
    mail_handler(conn, "it_mail_rs", "it_handle_rs")
    subscribe(conn, "it_rs", [topic], "it_handle_rs")
    n = 60
    ids = [str(uuid.uuid4()) for _ in range(n)]
    recs = [(f"k{i % 7}", json.dumps({"i": i}).encode(), relay_headers(ids[i])) for i in range(n)]
    recs += [(f"k{i}", json.dumps({"noid": i}).encode(), []) for i in range(3)]
    produce(env, topic, recs)
    wait_until(lambda: settled(conn, "it_rs") == n + 3, TIMEOUT_S, "the first subscription applied all")
    assert query_one(conn, "SELECT count(*) FROM it_mail_rs")[0] == n + 3

    as_app(conn, "SELECT outbox.unsubscribe('it_rs')")
    del conn.notices[:]
    subscribe(conn, "it_rs", [topic], "it_handle_rs", start_from="earliest")
    assert any("it_rs" in m and "seen" in m for m in conn.notices), \
        f"subscribe() says that the former subscription's seen ids are kept: {conn.notices}"
    try:
        wait_until(lambda: settled(conn, "it_rs") == n + 3, TIMEOUT_S, "the new subscription settled")
    except AssertionError as e:
        raise AssertionError(f"{e}: settled {settled(conn, 'it_rs')} of {n + 3}, {status(conn, 'it_rs')}") from None
    twice = query(conn, "SELECT event_id, count(*) FROM it_mail_rs WHERE event_id IS NOT NULL"
                        " GROUP BY 1 HAVING count(*) > 1")
    assert twice == [], f"{len(twice)} id-carrying events applied twice"
    assert query_one(conn, "SELECT count(*) FROM it_mail_rs WHERE event_id IS NULL")[0] == 6, \
        "events without an id are covered by the offsets alone: applied again, as documented"
    assert sum(r["duplicates"] for r in status(conn, "it_rs")) == n


def test_positions_are_one_set_in_subscribe_and_inbox_seek(env, app):
    """Issue 36 #10: inbox_seek(name, topic, NULL, 'latest') failed with "function ... is not
    unique", and subscribe() took neither an offset nor 'infinity'."""
    conn = app
    topic = new_topic(env, "pos")
    mail_handler(conn, "it_mail_pos", "it_handle_pos")
    produce(env, topic, [("k", json.dumps({"n": i}).encode(), relay_headers(str(uuid.uuid4())))
                         for i in range(5)], partition=0)
    # subscribe() takes every position: an offset, 'infinity' (latest), '-infinity' (earliest)
    subscribe(conn, "it_pos", [topic], "it_handle_pos", dedupe=False, start_from="3")
    subscribe(conn, "it_pos_end", [topic], None, start_from="infinity")
    subscribe(conn, "it_pos_first", [topic], None, start_from="-infinity")
    wait_until(lambda: settled(conn, "it_pos") == 2, TIMEOUT_S, "records 3 and 4 applied")
    assert [r[0] for r in query(conn, "SELECT (payload->>'n')::int FROM it_mail_pos ORDER BY id")] == [3, 4]
    wait_until(lambda: next_offset(conn, "it_pos_end") == 5, TIMEOUT_S, "'infinity' placed at the end")
    wait_until(lambda: settled(conn, "it_pos_first") == 5, TIMEOUT_S, "'-infinity' from the first")
    for bad in ("-1", "soon", "1e3"):
        with pytest.raises(psycopg2.Error) as e:
            subscribe(conn, "it_pos_bad", [topic], None, start_from=bad)
        assert e.value.pgcode in ("22023", "22007"), (bad, e.value.pgcode)

    def applied():
        return [r[0] for r in query(conn, "SELECT (payload->>'n')::int FROM it_mail_pos ORDER BY id")]

    # inbox_seek() takes the same words, as text: no "function ... is not unique"
    assert as_app(conn, "SELECT outbox.inbox_seek('it_pos', %s, NULL, 'earliest')", (topic,)) == [(1,)]
    wait_until(lambda: len(applied()) == 7, TIMEOUT_S, "every record again from earliest")
    assert as_app(conn, "SELECT outbox.inbox_seek('it_pos', %s, 0, '3')", (topic,)) == [(1,)]
    wait_until(lambda: len(applied()) == 9, TIMEOUT_S, "from offset 3 again")
    assert applied()[-2:] == [3, 4]
    as_app(conn, "SELECT outbox.inbox_seek('it_pos', %s, NULL, '-infinity')", (topic,))
    wait_until(lambda: len(applied()) == 14, TIMEOUT_S, "from the first again")
    t = query_one(conn, "SELECT kafka_timestamp FROM it_mail_pos WHERE (payload->>'n')::int = 4"
                        " ORDER BY id LIMIT 1")[0]
    as_app(conn, "SELECT outbox.inbox_seek('it_pos', %s, 0, %s)", (topic, t.isoformat()))
    wait_until(lambda: len(applied()) > 14 and next_offset(conn, "it_pos") == 5, TIMEOUT_S,
               "from a time given as text")
    again = applied()[14:]
    assert again == list(range(5 - len(again), 5)) and again[-1] == 4, again
    for bad in ("-3", "soon"):
        with pytest.raises(psycopg2.Error) as e:
            as_app(conn, "SELECT outbox.inbox_seek('it_pos', %s, 0, %s)", (topic, bad))
        assert e.value.pgcode in ("22023", "22007"), (bad, e.value.pgcode)


def test_a_seek_to_the_end_right_after_a_seek_past_the_end_runs_again(env, app):
    """Issue 37: inbox_seek(..., 'infinity') right after an out-of-range seek left the partition
    stalled; issue 36 #10: the stall said "Kafka no longer has offset" for an offset that does
    not exist yet."""
    conn = app
    topic = new_topic(env, "unstall")
    mail_handler(conn, "it_mail_us", "it_handle_us")
    subscribe(conn, "it_us", [topic], "it_handle_us")

    def one(n):
        produce(env, topic, [("k", json.dumps({"n": n}).encode(), relay_headers(str(uuid.uuid4())))],
                partition=0)

    def applied():
        return [r[0] for r in query(conn, "SELECT (payload->>'n')::int FROM it_mail_us ORDER BY id")]

    for n in range(3):
        one(n)
    wait_until(lambda: next_offset(conn, "it_us") == 3, TIMEOUT_S, "caught up")

    def to_the_end_runs_again(end, what):
        before = len(applied())
        wait_until(lambda: next_offset(conn, "it_us") == before, TIMEOUT_S,
                   f"placed at the end again ({what})")
        one(before)
        wait_until(lambda: next_offset(conn, "it_us") == before + 1, TIMEOUT_S,
                   f"the record after the end applied ({what}; status {status(conn, 'it_us')})")
        assert applied()[-1] == before
        assert status(conn, "it_us")[0]["state"] == "running"

    # right after the seek past the end, before its error came back: the error of the replaced
    # assignment must not stall the partition at the end
    for end in ("'infinity'::timestamptz", "'infinity'", "'latest'"):
        as_app(conn, "SELECT outbox.inbox_seek('it_us', %s, 0, 1000000::bigint)", (topic,))
        as_app(conn, f"SELECT outbox.inbox_seek('it_us', %s, 0, {end})", (topic,))
        to_the_end_runs_again(end, f"{end} right after")
    # a seek past the end stalls the partition, saying "not yet"; one to the end un-stalls it
    as_app(conn, "SELECT outbox.inbox_seek('it_us', %s, 0, 1000000::bigint)", (topic,))
    wait_until(lambda: status(conn, "it_us")[0]["state"] == "stalled", TIMEOUT_S, "stalled")
    err = status(conn, "it_us")[0]["last_error"]
    assert "not yet" in err and "no longer" not in err, err
    as_app(conn, "SELECT outbox.inbox_seek('it_us', %s, NULL, 'latest')", (topic,))
    to_the_end_runs_again("latest", "after the stall")


def test_a_seek_to_a_partition_the_topic_does_not_have_is_refused(env, app):
    """Issue 37: inbox_seek() took a partition the topic does not have (and made a row for it)."""
    conn = app
    topic = new_topic(env, "nopart", partitions=2)
    mail_handler(conn, "it_mail_np", "it_handle_np")
    subscribe(conn, "it_np", [topic], "it_handle_np")
    wait_until(lambda: query_one(conn, "SELECT count(*) FROM outbox.inbox_offsets"
                                       " WHERE subscription = 'it_np'")[0] == 2, TIMEOUT_S, "both partitions known")
    for position in ("5::bigint", "'latest'", "now()"):
        with pytest.raises(psycopg2.Error) as e:
            as_app(conn, f"SELECT outbox.inbox_seek('it_np', %s, 7, {position})", (topic,))
        assert e.value.pgcode == "22023", (position, e.value.pgcode)
        text = f"{e.value.diag.message_primary} {e.value.diag.message_hint}"
        assert "7" in e.value.diag.message_primary and "0, 1" in text, text
    assert query_one(conn, "SELECT count(*) FROM outbox.inbox_offsets WHERE subscription = 'it_np'")[0] == 2


def connect_as(env, role):
    return pg_connect(dataclasses.replace(env, pg_user=role))


def test_outbox_subscriber_carries_every_grant_and_owners_see_their_own_dead_letters(env, app):
    """Issue 36 #11: a role granted outbox_subscriber and nothing else subscribes, pauses,
    resumes, seeks, retries, takes, reads inbox_status and its own dead letters (not another
    role's), and unsubscribes.  Also checked, as doc/inbox.md states them: session_user in a
    handler, a JSON value with \\u0000 in payload_bytes, a null key never held."""
    conn = app
    for role in (SUBSCRIBER, OTHER):
        if not query(conn, "SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)):
            query(conn, f"CREATE ROLE {role} LOGIN")
        query(conn, f"GRANT outbox_subscriber TO {role}")
    topic = new_topic(env, "role")
    qtopic = new_topic(env, "roleq")
    for role, tag in ((SUBSCRIBER, "a"), (OTHER, "o")):
        query(conn, f"DROP TABLE IF EXISTS it_role_{tag}")
        query(conn, f"CREATE TABLE it_role_{tag} (key text, event_id uuid, payload jsonb,"
                    " payload_bytes bytea, who name, session_who name)")
        query(conn, f"ALTER TABLE it_role_{tag} OWNER TO {role}")
        query(conn, f"""CREATE OR REPLACE FUNCTION it_role_h_{tag}(e outbox.inbox_event) RETURNS void
            LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
            BEGIN
                IF e.payload->>'fail' = 'yes' THEN RAISE EXCEPTION 'failing %', e.key; END IF;
                INSERT INTO it_role_{tag} VALUES (e.key, e.event_id, e.payload, e.payload_bytes,
                                                 current_user, session_user);
            END $$""")
        query(conn, f"ALTER FUNCTION it_role_h_{tag}(outbox.inbox_event) OWNER TO {role}")
    bootstrap = query_one(conn, "SELECT rolname FROM pg_roles WHERE oid = 10")[0]

    a = connect_as(env, SUBSCRIBER)
    o = connect_as(env, OTHER)
    try:
        query(a, "SELECT outbox.subscribe('it_role_a', %s, 'it_role_h_a(outbox.inbox_event)')", ([topic],))
        query(o, "SELECT outbox.subscribe('it_role_o', %s, 'it_role_h_o(outbox.inbox_event)')", ([topic],))
        query(a, "SELECT outbox.subscribe('it_role_q', %s)", ([qtopic],))
        fail = json.dumps({"fail": "yes"}).encode()
        ok = json.dumps({"fail": "no"}).encode()
        nul = b'{"s": "a\\u0000b"}'
        produce(env, topic, [("k1", fail, relay_headers(str(uuid.uuid4()))),
                             ("k1", ok, relay_headers(str(uuid.uuid4()))),
                             (None, fail, relay_headers(str(uuid.uuid4()))),
                             (None, ok, relay_headers(str(uuid.uuid4()))),
                             ("k2", nul, relay_headers(str(uuid.uuid4())))], partition=0)
        produce(env, qtopic, [("q", ok, relay_headers(str(uuid.uuid4())))], partition=0)
        for sub in ("it_role_a", "it_role_o"):
            wait_until(lambda: query_one(a, "SELECT coalesce(sum(applied + dead_letters + held), 0)"
                                            " FROM outbox.inbox_status WHERE subscription = %s", (sub,))[0] == 5,
                       TIMEOUT_S, f"{sub} settled")

        # dead letters: each owner sees its own, not the other's
        mine = query(a, "SELECT subscription, key, held FROM outbox.inbox_dead ORDER BY id")
        theirs = query(o, "SELECT subscription, key, held FROM outbox.inbox_dead ORDER BY id")
        assert mine == [("it_role_a", "k1", False), ("it_role_a", "k1", True), ("it_role_a", None, False)], mine
        assert theirs == [("it_role_o", "k1", False), ("it_role_o", "k1", True), ("it_role_o", None, False)], theirs
        assert query_one(conn, "SELECT count(*) FROM outbox.inbox_dead")[0] == 6, "a superuser sees all"
        # a null key is never held: the second null-key event was applied behind the failed one
        got = query(a, "SELECT key, payload, payload_bytes, who, session_who FROM it_role_a ORDER BY key NULLS FIRST")
        assert [r[0] for r in got] == [None, "k2"], got
        # valid JSON that jsonb refuses (\u0000) arrives in payload_bytes
        assert got[1][1] is None and bytes(got[1][2]) == nul, got[1]
        # the handler runs as the owner; session_user is the worker's, the bootstrap superuser
        assert all(r[3] == SUBSCRIBER and r[4] == bootstrap for r in got), got

        # the rest of the API, as the role that has only outbox_subscriber
        assert query(a, "SELECT count(*) FROM outbox.inbox_status WHERE subscription = 'it_role_a'")[0][0] == 1
        query(a, "SELECT outbox.pause_subscription('it_role_a')")
        wait_until(lambda: status(conn, "it_role_a")[0]["state"] == "paused", TIMEOUT_S, "paused")
        query(a, "SELECT outbox.resume_subscription('it_role_a')")
        assert query(a, "SELECT outbox.inbox_seek('it_role_a', %s, 0, 5::bigint)", (topic,)) == [(1,)]
        assert query(a, "SELECT outbox.inbox_seek('it_role_a', %s, 0, now())", (topic,)) == [(1,)]
        assert query(a, "SELECT outbox.inbox_seek('it_role_a', %s, NULL, 'latest')", (topic,)) == [(1,)]
        query(a, "UPDATE it_role_a SET key = key")          # the owner's own table, as ever
        assert query(a, "SELECT outbox.inbox_retry('it_role_a', 'k1')") == [(2,)]
        with pytest.raises(psycopg2.Error) as e:
            query(a, "SELECT outbox.inbox_retry('it_role_o')")
        assert e.value.pgcode == "42501"
        wait_until(lambda: query_one(a, "SELECT count(*) FROM outbox.inbox_dead WHERE retry")[0] == 0,
                   TIMEOUT_S, "the retry taken up by the worker")
        wait_until(lambda: query(a, "SELECT 1 FROM outbox.inbox_status WHERE subscription = 'it_role_q'"
                                    " AND applied = 1"), TIMEOUT_S, "the queued event")
        a.autocommit = False
        taken = query(a, "SELECT key FROM outbox.inbox_take('it_role_q', 10)")
        a.commit()
        a.autocommit = True
        assert taken == [("q",)]
        for sub in ("it_role_a", "it_role_q"):
            query(a, "SELECT outbox.unsubscribe(%s)", (sub,))
        query(o, "SELECT outbox.unsubscribe('it_role_o')")
        assert query(conn, "SELECT name FROM outbox.subscriptions WHERE name LIKE 'it_role_%'") == []
    finally:
        a.close()
        o.close()
