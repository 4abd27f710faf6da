"""
The inbox's de-duplication by event_id (issue 30, step 2): a copy of an event at a later offset is
dropped while its id is within outbox.inbox_dedupe_window, the seen ids are dropped a slot at a
time (TRUNCATE of a partition), never row by row, and a subscription with dedupe off applies every
copy (its records are covered by their offsets alone, as records without an id always are).
"""
import json
import uuid

import pytest

from conftest import create_topics, query, query_one, set_conf, wait_until
from helpers_inbox import (mail_handler, produce, relay_headers, setup_app_role, status, subscribe,
                           unsubscribe_all)

WINDOW_S = 4


@pytest.fixture
def app(conn):
    setup_app_role(conn)
    yield conn
    unsubscribe_all(conn)
    set_conf(conn, inbox_dedupe_window=None)


def settled(conn, sub):
    return query_one(conn, "SELECT coalesce(sum(applied + duplicates), 0) FROM outbox.inbox_offsets"
                           " WHERE subscription = %s", (sub,))[0]


def window(conn):
    return query_one(conn, "SELECT current_slot, since FROM outbox.inbox_seen_window")


def test_a_copy_is_dropped_within_the_window_and_ids_go_a_slot_at_a_time(env, app):
    conn = app
    topic = f"it_inbox_dd_{uuid.uuid4().hex[:8]}"
    create_topics(env, [topic], partitions=1)
    mail_handler(conn, "it_mail_dd", "it_handle_dd")
    subscribe(conn, "it_dd", [topic], "it_handle_dd")
    dead_before = dict(query(conn, "SELECT relname, n_tup_del FROM pg_stat_user_tables"
                                   " WHERE relname IN ('inbox_seen_0', 'inbox_seen_1')"))
    set_conf(conn, inbox_dedupe_window=WINDOW_S)
    eid = str(uuid.uuid4())
    rec = ("k", json.dumps({"v": 1}).encode(), relay_headers(eid))

    produce(env, topic, [rec], partition=0)
    wait_until(lambda: settled(conn, "it_dd") == 1, 60, "the event applied")
    slot0, since0 = window(conn)
    filenodes = dict(query(conn, "SELECT relname, pg_relation_filenode(oid) FROM pg_class"
                                 " WHERE relname IN ('inbox_seen_0', 'inbox_seen_1')"))
    assert query_one(conn, "SELECT count(*) FROM outbox.inbox_seen WHERE event_id = %s", (eid,))[0] == 1

    # the first turn: the id's slot becomes the other one, and still drops a copy
    wait_until(lambda: window(conn)[0] != slot0, 60, "the seen ids' first turn")
    produce(env, topic, [rec], partition=0)
    wait_until(lambda: settled(conn, "it_dd") == 2, 60, "the copy settled")
    assert query_one(conn, "SELECT count(*) FROM it_mail_dd")[0] == 1, "a copy within the window is dropped"
    assert status(conn, "it_dd")[0]["duplicates"] == 1

    # the second turn empties the id's slot: the window has passed for it
    wait_until(lambda: window(conn)[0] == slot0, 60, "the seen ids' second turn")
    assert query_one(conn, "SELECT count(*) FROM outbox.inbox_seen WHERE event_id = %s", (eid,))[0] == 0
    produce(env, topic, [rec], partition=0)
    wait_until(lambda: settled(conn, "it_dd") == 3, 60, "the late copy settled")
    assert query_one(conn, "SELECT count(*) FROM it_mail_dd")[0] == 2, \
        "a copy after the window is applied again (documented)"
    # the ids went by TRUNCATE (both slots got a new file), no row of a slot was deleted
    after = dict(query(conn, "SELECT relname, pg_relation_filenode(oid) FROM pg_class"
                             " WHERE relname IN ('inbox_seen_0', 'inbox_seen_1')"))
    assert all(after[r] != filenodes[r] for r in after), (filenodes, after)
    dead_after = dict(query(conn, "SELECT relname, n_tup_del FROM pg_stat_user_tables"
                                  " WHERE relname IN ('inbox_seen_0', 'inbox_seen_1')"))
    assert dead_after == dead_before, f"seen ids deleted row by row: {dead_before} -> {dead_after}"


def test_dedupe_off_applies_every_copy(env, app):
    conn = app
    topic = f"it_inbox_nd_{uuid.uuid4().hex[:8]}"
    create_topics(env, [topic], partitions=1)
    mail_handler(conn, "it_mail_nd", "it_handle_nd")
    subscribe(conn, "it_nd", [topic], "it_handle_nd", dedupe=False)
    eid = str(uuid.uuid4())
    rec = ("k", b'{"v": 1}', relay_headers(eid))
    produce(env, topic, [rec, rec, rec], partition=0)
    wait_until(lambda: settled(conn, "it_nd") == 3, 60, "three records settled")
    assert query_one(conn, "SELECT count(*) FROM it_mail_nd WHERE event_id = %s", (eid,))[0] == 3
    assert query_one(conn, "SELECT count(*) FROM outbox.inbox_seen WHERE subscription = 'it_nd'")[0] == 0
