"""
Failures of the inbox (issue 30, step 4):
- a handler error makes the event a dead letter with its error and SQLSTATE; with on_failed_event =
  hold the later events of its key wait behind it (held), other keys flow on; with skip they go
  on; outbox.inbox_retry() applies the dead letters again in key order, and one that fails again
  stays, with the key's later ones held behind it;
- transient errors (40001, 40P01) are retried and applied once; past outbox.inbox_max_attempts
  they become dead letters too; a handler slower than outbox.inbox_handler_timeout is one (57014);
- a handler that crashes its process (killed while it runs) is dead-lettered after
  outbox.inbox_max_attempts crashes, with no crash loop, and the batch's other records applied;
- a stored offset Kafka no longer has (records deleted by retention) stalls the partition with a
  visible state, applies and skips nothing, until outbox.inbox_seek();
- a handler dropped shows an error state and is picked up again once it exists.
"""
import json
import os
import signal
import subprocess
import uuid

import pytest

from conftest import (KAFKA_SH, LogWatcher, create_topics, pg_connect, query, query_one, set_conf,
                      wait_until)
from helpers_crash import start_pg_after_crash
from helpers_inbox import (APP_ROLE, as_app, mail_handler, produce, relay_headers, setup_app_role,
                           status, subscribe, unsubscribe_all)

TIMEOUT_S = 60


@pytest.fixture
def app(env, conn):
    setup_app_role(conn)
    query(conn, "DROP TABLE IF EXISTS it_broken")
    query(conn, "CREATE TABLE it_broken (key text PRIMARY KEY)")
    query(conn, f"ALTER TABLE it_broken OWNER TO {APP_ROLE}")
    yield conn
    c = wait_until(lambda: pg_connect(env), 60, "a connection after the test")
    try:
        unsubscribe_all(c)
        set_conf(c, inbox_max_attempts=None, inbox_handler_timeout=None)
    finally:
        c.close()


BROKEN = ("IF EXISTS (SELECT 1 FROM it_broken WHERE key = e.key) THEN"
          " RAISE EXCEPTION 'no mail for %', e.key USING ERRCODE = 'P0001'; END IF;")


def new_topic(env, tag):
    topic = f"it_inbox_{tag}_{uuid.uuid4().hex[:8]}"
    create_topics(env, [topic], partitions=1)
    return topic


def records(*pairs):
    return [(k, json.dumps({"n": n}).encode(), relay_headers(str(uuid.uuid4()))) for k, n in pairs]


def settled(conn, sub, n):
    """Every record up to offset n-1 of partition 0 is settled (applied, dropped or dead)."""
    wait_until(lambda: query(conn, "SELECT next_offset FROM outbox.inbox_offsets"
                                   " WHERE subscription = %s AND kafka_partition = 0", (sub,)) == [(n,)],
               TIMEOUT_S, f"{n} records of {sub} settled")


def applied(conn, table):
    return [(r[0], r[1]) for r in query(conn, f"SELECT key, (payload->>'n')::int FROM {table} ORDER BY id")]


def dead(conn, sub):
    return query(conn, "SELECT key, (payload->>'n')::int, held, sqlstate, attempts, retry,"
                       " error IS NOT NULL FROM outbox.inbox_dead WHERE subscription = %s ORDER BY id", (sub,))


def test_hold_a_key_behind_its_dead_letter_and_retry_in_order(env, app):
    conn = app
    topic = new_topic(env, "hold")
    mail_handler(conn, "it_mail_h", "it_handle_h", extra_sql=BROKEN)
    query(conn, "INSERT INTO it_broken VALUES ('k1')")
    subscribe(conn, "it_h", [topic], "it_handle_h")
    produce(env, topic, records(("k1", 1), ("k2", 1), ("k1", 2), ("k2", 2), ("k1", 3)), partition=0)
    settled(conn, "it_h", 5)
    assert applied(conn, "it_mail_h") == [("k2", 1), ("k2", 2)], "other keys flow on"
    assert dead(conn, "it_h") == [("k1", 1, False, "P0001", 1, False, True),
                                  ("k1", 2, True, None, 0, False, False),
                                  ("k1", 3, True, None, 0, False, False)]
    st = status(conn, "it_h")[0]
    assert (st["dead_letters"], st["held"], st["applied"], st["lag"]) == (1, 2, 2, 0), st
    assert query_one(conn, "SELECT error FROM outbox.inbox_dead WHERE held = false AND subscription = 'it_h'")[0] \
        == "no mail for k1"

    # a retry while the cause stays: the first fails again, the later ones stay held
    assert as_app(conn, "SELECT outbox.inbox_retry('it_h')")[0][0] == 3
    wait_until(lambda: dead(conn, "it_h")[0][4] == 2, TIMEOUT_S, "the retried dead letter to fail again")
    assert [d[:3] for d in dead(conn, "it_h")] == [("k1", 1, False), ("k1", 2, True), ("k1", 3, True)]
    assert not any(d[5] for d in dead(conn, "it_h")), "retry marks cleared"

    produce(env, topic, records(("k1", 4), ("k2", 3)), partition=0)
    settled(conn, "it_h", 7)
    assert len(dead(conn, "it_h")) == 4, "a new event of the held key waits too"

    query(conn, "DELETE FROM it_broken")
    assert as_app(conn, "SELECT outbox.inbox_retry('it_h', 'k1')")[0][0] == 4
    wait_until(lambda: not dead(conn, "it_h"), TIMEOUT_S, "the dead letters applied")
    assert applied(conn, "it_mail_h") == [("k2", 1), ("k2", 2), ("k2", 3), ("k1", 1), ("k1", 2), ("k1", 3), ("k1", 4)]
    produce(env, topic, records(("k1", 5)), partition=0)
    settled(conn, "it_h", 8)
    assert applied(conn, "it_mail_h")[-1] == ("k1", 5), "the key flows again"


def test_skip_lets_the_key_go_on(env, app):
    conn = app
    topic = new_topic(env, "skip")
    mail_handler(conn, "it_mail_s", "it_handle_s", extra_sql=(
        "IF EXISTS (SELECT 1 FROM it_broken WHERE key = e.key || ':' || (e.payload->>'n')) THEN"
        " RAISE EXCEPTION 'no mail' USING ERRCODE = 'P0001'; END IF;"))
    query(conn, "INSERT INTO it_broken VALUES ('k1:1')")
    subscribe(conn, "it_s", [topic], "it_handle_s", on_failed_event="skip")
    produce(env, topic, records(("k1", 1), ("k1", 2)), partition=0)
    settled(conn, "it_s", 2)
    assert [d[:3] for d in dead(conn, "it_s")] == [("k1", 1, False)]
    assert applied(conn, "it_mail_s") == [("k1", 2)], "later events of the key go on"
    query(conn, "DELETE FROM it_broken")
    as_app(conn, "SELECT outbox.inbox_retry('it_s')")
    wait_until(lambda: not dead(conn, "it_s"), TIMEOUT_S, "the dead letter applied")
    assert applied(conn, "it_mail_s") == [("k1", 2), ("k1", 1)], "the retried one comes after (skip)"


def test_transient_errors_are_retried(env, app):
    conn = app
    topic = new_topic(env, "transient")
    for seq in ("it_ser", "it_dl", "it_always"):
        query(conn, f"DROP SEQUENCE IF EXISTS {seq}")
        query(conn, f"CREATE SEQUENCE {seq}")
        query(conn, f"ALTER SEQUENCE {seq} OWNER TO {APP_ROLE}")
    mail_handler(conn, "it_mail_t", "it_handle_t", extra_sql=(
        "IF e.key = 'ser' AND nextval('it_ser') <= 2 THEN"
        " RAISE EXCEPTION 'conflict' USING ERRCODE = 'serialization_failure'; END IF;"
        "IF e.key = 'dl' AND nextval('it_dl') <= 1 THEN"
        " RAISE EXCEPTION 'deadlock' USING ERRCODE = 'deadlock_detected'; END IF;"
        "IF e.key = 'always' THEN PERFORM nextval('it_always');"
        " RAISE EXCEPTION 'conflict' USING ERRCODE = 'serialization_failure'; END IF;"))
    set_conf(conn, inbox_max_attempts=3)
    subscribe(conn, "it_t", [topic], "it_handle_t")
    produce(env, topic, records(("ser", 1), ("dl", 1), ("ok", 1), ("always", 1)), partition=0)
    settled(conn, "it_t", 4)
    assert sorted(applied(conn, "it_mail_t")) == [("dl", 1), ("ok", 1), ("ser", 1)], \
        "each applied once after its retries"
    assert [(d[0], d[3], d[4]) for d in dead(conn, "it_t")] == [("always", "40001", 3)]
    assert query_one(conn, "SELECT last_value FROM it_always")[0] == 3, "3 attempts, no more"


def test_a_slow_handler_times_out(env, app):
    conn = app
    topic = new_topic(env, "slow")
    mail_handler(conn, "it_mail_w", "it_handle_w",
                 extra_sql="IF e.key = 'slow' THEN PERFORM pg_sleep(30); END IF;")
    set_conf(conn, inbox_handler_timeout="300ms")
    subscribe(conn, "it_w", [topic], "it_handle_w")
    produce(env, topic, records(("slow", 1), ("fast", 1)), partition=0)
    settled(conn, "it_w", 2)
    assert applied(conn, "it_mail_w") == [("fast", 1)]
    assert [(d[0], d[3]) for d in dead(conn, "it_w")] == [("slow", "57014")]


def inbox_backend(env):
    c = pg_connect(env)
    try:
        rows = query(c, "SELECT pid, wait_event FROM pg_stat_activity WHERE backend_type = 'outbox inbox'")
        return rows[0] if rows else None
    finally:
        c.close()


def test_a_handler_that_crashes_its_process_is_dead_lettered_without_a_crash_loop(env, app):
    """The handler sleeps for key 'boom'; the test kills the worker (SIGKILL: a crash of the server)
    each time it sleeps there.  After outbox.inbox_max_attempts = 3 crashes inside that record it is
    a dead letter and the worker goes on; the other records of its batch are applied once."""
    conn = app
    topic = new_topic(env, "crash")
    mail_handler(conn, "it_mail_x", "it_handle_x",
                 extra_sql="IF e.key = 'boom' THEN PERFORM pg_sleep(120); END IF;")
    set_conf(conn, inbox_max_attempts=3)
    subscribe(conn, "it_x", [topic], "it_handle_x")
    wait_until(lambda: query(conn, "SELECT 1 FROM outbox.inbox_status WHERE subscription = 'it_x'"
                                   " AND state = 'running'"), TIMEOUT_S, "the partition assigned")
    produce(env, topic, records(("a", 1), ("boom", 1), ("b", 1)), partition=0)
    kills = 0
    killed = set()
    watcher = LogWatcher(env)

    def sleeping_or_done():
        b = inbox_backend(env)
        # a killed worker shows in pg_stat_activity until the postmaster reinitializes
        if b is not None and b[1] == "PgSleep" and b[0] not in killed:
            return b[0]
        c = pg_connect(env)
        try:
            if query(c, "SELECT 1 FROM outbox.inbox_dead WHERE subscription = 'it_x'"):
                return "done"
        finally:
            c.close()
        return None
    while True:
        got = wait_until(sleeping_or_done, 120, f"the handler to sleep in 'boom' (kills so far {kills})",
                         interval=0.1)
        if got == "done":
            break
        os.kill(got, signal.SIGKILL)
        killed.add(got)
        kills += 1
        assert kills <= 3, "the worker called the handler again after 3 crashes"
        start_pg_after_crash(env) if not os.path.exists(os.path.join(env.pg_dir, "data", "postmaster.pid")) else None
    c = pg_connect(env)
    try:
        wait_until(lambda: query(c, "SELECT next_offset FROM outbox.inbox_offsets WHERE subscription = 'it_x'") == [(3,)],
                   TIMEOUT_S, "the partition to move past the batch")
        assert kills == 3
        assert applied(c, "it_mail_x") == [("a", 1), ("b", 1)]
        d = dead(c, "it_x")
        assert [(x[0], x[3], x[4]) for x in d] == [("boom", "XX000", 3)], d
        assert "crashed" in query_one(c, "SELECT error FROM outbox.inbox_dead WHERE subscription = 'it_x'")[0]
        st = query_one(c, "SELECT attempt_offset, attempts FROM outbox.inbox_offsets WHERE subscription = 'it_x'")
        assert st == (None, 0), "the attempt mark is cleared with the offset"
        assert any("that record is applied alone" in ln for ln in watcher.new_lines())
    finally:
        c.close()


def test_an_offset_kafka_no_longer_has_stalls_the_partition(env, app, tmp_path):
    conn = app
    topic = new_topic(env, "range")
    mail_handler(conn, "it_mail_r", "it_handle_r")
    subscribe(conn, "it_r", [topic], "it_handle_r")
    produce(env, topic, records(("k", 0), ("k", 1), ("k", 2)), partition=0)
    settled(conn, "it_r", 3)
    as_app(conn, "SELECT outbox.pause_subscription('it_r')")
    wait_until(lambda: status(conn, "it_r")[0]["state"] == "paused", TIMEOUT_S, "paused")
    produce(env, topic, records(*[("k", n) for n in range(3, 10)]), partition=0)
    # retention passes offsets 3..5: Kafka keeps 6..9
    spec = tmp_path / "delete.json"
    spec.write_text(json.dumps({"version": 1, "partitions": [{"topic": topic, "partition": 0, "offset": 6}]}))
    subprocess.run(["bash", str(KAFKA_SH), "cli", "org.apache.kafka.tools.DeleteRecordsCommand",
                    "--bootstrap-server", env.bootstrap, "--offset-json-file", str(spec)],
                   env=env.script_env(), check=True, capture_output=True, timeout=120)
    as_app(conn, "SELECT outbox.resume_subscription('it_r')")
    wait_until(lambda: status(conn, "it_r")[0]["state"] == "stalled", TIMEOUT_S, "the partition to stall")
    st = status(conn, "it_r")[0]
    assert st["next_offset"] == 3 and "no longer has offset 3" in st["last_error"], st
    assert applied(conn, "it_mail_r") == [("k", 0), ("k", 1), ("k", 2)], "nothing applied or skipped"
    assert as_app(conn, "SELECT outbox.inbox_seek('it_r', %s, 0, 6::bigint)", (topic,))[0][0] == 1
    settled(conn, "it_r", 10)
    assert applied(conn, "it_mail_r")[3:] == [("k", n) for n in range(6, 10)]
    wait_until(lambda: status(conn, "it_r")[0]["state"] == "running", TIMEOUT_S, "running again")


def test_a_dropped_handler_shows_an_error_until_it_exists_again(env, app):
    conn = app
    topic = new_topic(env, "gone")
    mail_handler(conn, "it_mail_g", "it_handle_g")
    subscribe(conn, "it_g", [topic], "it_handle_g")
    produce(env, topic, records(("k", 1)), partition=0)
    settled(conn, "it_g", 1)
    query(conn, "DROP FUNCTION it_handle_g(outbox.inbox_event)")
    produce(env, topic, records(("k", 2)), partition=0)
    wait_until(lambda: status(conn, "it_g")[0]["state"] == "error", TIMEOUT_S, "the error state")
    assert "does not exist" in status(conn, "it_g")[0]["last_error"]
    assert query_one(conn, "SELECT count(*) FROM outbox.inbox_dead WHERE subscription = 'it_g'")[0] == 0, \
        "a missing handler holds the partition, it makes no dead letters"
    mail_handler(conn, "it_mail_g2", "it_handle_g")
    settled(conn, "it_g", 2)
    assert applied(conn, "it_mail_g2") == [("k", 2)]
