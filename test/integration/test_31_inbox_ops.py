"""
Operating the inbox (issue 30, step 5), in the test cluster's database:
- security: the handler runs as the subscribing role under SECURITY_RESTRICTED_OPERATION (a
  trigger it fires runs as that role too; temporary objects and SET ROLE are refused); losing
  EXECUTE on the handler stops the subscription with a visible error; a superuser subscription
  only while outbox.inbox_superuser_subscriptions is on;
- settings: consumer properties the inbox reserves or that would run code are refused, secrets
  are masked, outbox.inbox_bootstrap_servers overrides the relay's servers (broker_down while it
  names no broker);
- status for a pg_monitor-only role: outbox.inbox_status, the inbox rows of
  outbox.cluster_status() and the postgres_exporter queries of sql/monitoring/;
- pause, resume and seek (to an offset, a time, the first offset, the end);
- a batch whose offset moves while its handler runs (a seek, or a second applier that committed
  first) rolls back: nothing is applied twice.
"""
import json
import threading
import time
import uuid

import psycopg2
import pytest

from conftest import create_topics, pg_connect, query, query_one, set_conf, wait_until
from helpers_inbox import (APP_ROLE, as_app, mail_handler, produce, relay_headers, setup_app_role,
                           status, subscribe, unsubscribe_all)
from test_25_launcher import exporter_queries, run_exporter_query

TIMEOUT_S = 60


@pytest.fixture
def app(env, conn):
    setup_app_role(conn)
    yield conn
    c = pg_connect(env)
    try:
        unsubscribe_all(c)
        set_conf(c, inbox_superuser_subscriptions=None, inbox_bootstrap_servers=None,
                 inbox_kafka_properties=None)
    finally:
        c.close()


def new_topic(env, tag, partitions=1):
    topic = f"it_inbox_{tag}_{uuid.uuid4().hex[:8]}"
    create_topics(env, [topic], partitions=partitions)
    return topic


def records(*pairs):
    return [(k, json.dumps({"n": n}).encode(), relay_headers(str(uuid.uuid4()))) for k, n in pairs]


def next_offset(conn, sub):
    rows = query(conn, "SELECT next_offset FROM outbox.inbox_offsets WHERE subscription = %s"
                       " AND kafka_partition = 0", (sub,))
    return rows[0][0] if rows else None


def settled(conn, sub, n):
    wait_until(lambda: next_offset(conn, sub) == n, TIMEOUT_S, f"{n} records of {sub} settled")


def applied(conn, table):
    return [(r[0], r[1]) for r in query(conn, f"SELECT key, (payload->>'n')::int FROM {table} ORDER BY id")]


def test_the_handler_runs_restricted_as_the_subscriber(env, app):
    conn = app
    topic = new_topic(env, "sec")
    mail_handler(conn, "it_mail_sec", "it_handle_sec", extra_sql=(
        "IF e.key = 'temp' THEN CREATE TEMP TABLE it_t (i int); END IF;"
        "IF e.key = 'role' THEN SET ROLE NONE; END IF;"))
    query(conn, "CREATE TABLE IF NOT EXISTS it_audit (who name, outer_who name)")
    query(conn, f"ALTER TABLE it_audit OWNER TO {APP_ROLE}")
    query(conn, "CREATE OR REPLACE FUNCTION it_audit_trg() RETURNS trigger LANGUAGE plpgsql AS"
                " $$ BEGIN INSERT INTO public.it_audit VALUES (current_user, session_user); RETURN NEW; END $$")
    query(conn, f"ALTER FUNCTION it_audit_trg() OWNER TO {APP_ROLE}")
    query(conn, "CREATE TRIGGER it_audit AFTER INSERT ON it_mail_sec FOR EACH ROW EXECUTE FUNCTION it_audit_trg()")
    subscribe(conn, "it_sec", [topic], "it_handle_sec")
    produce(env, topic, records(("ok", 1), ("temp", 1), ("role", 1)), partition=0)
    settled(conn, "it_sec", 3)
    assert applied(conn, "it_mail_sec") == [("ok", 1)]
    assert query(conn, "SELECT DISTINCT who FROM it_audit") == [(APP_ROLE,)], "triggers run as the subscriber"
    dead = {r[0]: r[1:] for r in query(conn, "SELECT key, sqlstate, error FROM outbox.inbox_dead"
                                              " WHERE subscription = 'it_sec'")}
    assert dead["temp"] == ("42501", "cannot create temporary table within security-restricted operation"), dead
    assert dead["role"][0] == "42501" and "cannot set parameter \"role\"" in dead["role"][1], dead

    # EXECUTE taken away: a visible error, no dead letters; given back: applied
    query(conn, "REVOKE EXECUTE ON FUNCTION it_handle_sec(outbox.inbox_event) FROM PUBLIC")
    query(conn, f"ALTER FUNCTION it_handle_sec(outbox.inbox_event) OWNER TO postgres")
    produce(env, topic, records(("ok", 2)), partition=0)
    wait_until(lambda: status(conn, "it_sec")[0]["state"] == "error", TIMEOUT_S, "the error state")
    assert "may not execute" in status(conn, "it_sec")[0]["last_error"]
    assert next_offset(conn, "it_sec") == 3
    query(conn, f"GRANT EXECUTE ON FUNCTION it_handle_sec(outbox.inbox_event) TO {APP_ROLE}")
    settled(conn, "it_sec", 4)
    assert applied(conn, "it_mail_sec")[-1] == ("ok", 2)


def test_a_superuser_subscription_only_when_allowed(env, app):
    conn = app
    topic = new_topic(env, "su")
    mail_handler(conn, "it_mail_su", "it_handle_su", role="postgres")
    set_conf(conn, inbox_superuser_subscriptions="on")
    wait_until(lambda: query_one(pg_connect(env), "SHOW outbox.inbox_superuser_subscriptions")[0] == "on",
               10, "the setting")
    query(conn, "SELECT outbox.subscribe('it_su', %s, 'it_handle_su(outbox.inbox_event)')", ([topic],))
    produce(env, topic, records(("k", 1)), partition=0)
    settled(conn, "it_su", 1)
    assert query(conn, "SELECT applied_by FROM it_mail_su") == [("postgres",)]
    set_conf(conn, inbox_superuser_subscriptions=None)
    # the reload reaches the worker asynchronously: a record produced before it had read the new
    # setting could still be applied (CI saw it).  It shows the refusal once it has.
    wait_until(lambda: status(conn, "it_su")[0]["state"] == "error", TIMEOUT_S, "refused")
    assert "superuser" in status(conn, "it_su")[0]["last_error"]
    # a witness: a subscription of an ordinary role on the same topic, served by the same worker;
    # once it has applied record 2, the worker has read it from Kafka, and the refused one must not
    mail_handler(conn, "it_mail_su_w", "it_handle_su_w")
    subscribe(conn, "it_su_witness", [topic], "it_handle_su_w")
    produce(env, topic, records(("k", 2)), partition=0)
    settled(conn, "it_su_witness", 2)
    assert status(conn, "it_su")[0]["state"] == "error"
    assert next_offset(conn, "it_su") == 1, "nothing applied as a superuser once refused"
    assert query(conn, "SELECT count(*) FROM it_mail_su")[0][0] == 1


def test_settings(env, app):
    conn = app
    for bad in ("enable.auto.commit=true", "auto.offset.reset=earliest", "isolation.level=read_uncommitted",
                "group.id=x", "plugin.library.paths=/tmp/x.so", "nonsense"):
        with pytest.raises(psycopg2.Error) as e:
            query(conn, "ALTER SYSTEM SET outbox.inbox_kafka_properties = %s", (bad,))
        assert e.value.pgcode == "22023", (bad, e.value.pgcode)
        assert "x.so" not in str(e.value)
    set_conf(conn, inbox_kafka_properties="sasl.password=hunter2;fetch.wait.max.ms=100")
    wait_until(lambda: query_one(pg_connect(env), "SHOW outbox.inbox_kafka_properties")[0]
               == "sasl.password=********;fetch.wait.max.ms=100", 10, "the masked value")
    other = pg_connect(env)
    try:
        query(other, "ALTER SYSTEM SET outbox.inbox_kafka_properties = 'sasl.password=hunter3'")
        seen = query_one(conn, "SELECT query FROM pg_stat_activity WHERE pid = %s",
                         (other.get_backend_pid(),))[0]
        assert "hunter3" not in seen and "outbox.inbox_kafka_properties = '(not shown)'" in seen, seen
    finally:
        other.close()
    log = open(env.server_log, errors="replace").read()
    assert "hunter2" not in log and "hunter3" not in log, "a secret in the server log"
    set_conf(conn, inbox_kafka_properties="fetch.wait.max.ms=100")

    topic = new_topic(env, "set")
    mail_handler(conn, "it_mail_set", "it_handle_set")
    set_conf(conn, inbox_bootstrap_servers="127.0.0.1:1")
    subscribe(conn, "it_set", [topic], "it_handle_set")
    wait_until(lambda: query(conn, "SELECT 1 FROM outbox.cluster_status() WHERE kind = 'inbox'"
                                   " AND state = 'broker_down'"), TIMEOUT_S, "broker_down")
    produce(env, topic, records(("k", 1)), partition=0)
    set_conf(conn, inbox_bootstrap_servers=env.bootstrap)
    settled(conn, "it_set", 1)
    wait_until(lambda: query(conn, "SELECT 1 FROM outbox.cluster_status() WHERE kind = 'inbox'"
                                   " AND state = 'running'"), TIMEOUT_S, "running again")


def test_status_for_pg_monitor_and_the_exporter_queries(env, app):
    conn = app
    topic = new_topic(env, "mon", partitions=2)
    mail_handler(conn, "it_mail_mon", "it_handle_mon",
                 extra_sql="IF e.key = 'bad' THEN RAISE EXCEPTION 'bad'; END IF;")
    subscribe(conn, "it_mon", [topic, "it_inbox_not_yet_" + uuid.uuid4().hex[:6]], "it_handle_mon")
    produce(env, topic, records(("a", 1), ("bad", 1), ("bad", 2), ("b", 1)))
    wait_until(lambda: query_one(conn, "SELECT sum(applied) + sum(dead_letters) + sum(held) FROM outbox.inbox_status"
                                       " WHERE subscription = 'it_mon'")[0] == 4, TIMEOUT_S, "settled")
    if not query(conn, "SELECT 1 FROM pg_roles WHERE rolname = 'it_mon'"):
        query(conn, "CREATE ROLE it_mon LOGIN IN ROLE pg_monitor")
    import dataclasses
    mon = pg_connect(dataclasses.replace(env, pg_user="it_mon"))
    try:
        rows = query(mon, "SELECT topic, kafka_partition, state, applied, dead_letters, held, lag"
                          " FROM outbox.inbox_status WHERE subscription = 'it_mon' ORDER BY 1, 2")
        missing = [r for r in rows if r[1] is None]
        assert len(missing) == 1 and missing[0][2] == "waiting_for_topic", rows
        parts = [r for r in rows if r[1] is not None]
        assert len(parts) == 2 and all(r[2] == "running" and r[6] in (0, None) for r in parts), rows
        assert sum(r[3] for r in parts) == 2 and sum(r[4] for r in parts) == 1 and sum(r[5] for r in parts) == 1
        cs = query(mon, "SELECT database, state, published, failed FROM outbox.cluster_status() WHERE kind = 'inbox'")
        assert len(cs) == 1 and cs[0][0] == env.pg_database and cs[0][1] == "running", cs
        spec = exporter_queries()
        inbox = run_exporter_query(mon, "outbox_inbox", spec["outbox_inbox"])
        mine = [r for r in inbox if r["subscription"] == "it_mon"]
        assert len(mine) == 3 and sum(r["applied"] for r in mine) == 2, mine
        states = run_exporter_query(mon, "outbox_inbox_state", spec["outbox_inbox_state"])
        assert {r["state"] for r in states if r["subscription"] == "it_mon"} == {"running", "waiting_for_topic"}
        cluster = run_exporter_query(mon, "outbox_cluster", spec["outbox_cluster"])
        assert [r for r in cluster if r["kind"] == "inbox" and r["up"] == 1], cluster
    finally:
        mon.close()


def test_pause_resume_and_seek(env, app):
    conn = app
    topic = new_topic(env, "seek")
    mail_handler(conn, "it_mail_sk", "it_handle_sk")
    subscribe(conn, "it_sk", [topic], "it_handle_sk", dedupe=False)
    acks = produce(env, topic, records(("k", 0), ("k", 1), ("k", 2)), partition=0)
    settled(conn, "it_sk", 3)
    # a canary subscription shows that the worker ran passes after the paused one's records came
    canary = new_topic(env, "canary")
    mail_handler(conn, "it_mail_cn", "it_handle_cn")
    subscribe(conn, "it_cn", [canary], "it_handle_cn")
    as_app(conn, "SELECT outbox.pause_subscription('it_sk')")
    wait_until(lambda: status(conn, "it_sk")[0]["state"] == "paused", TIMEOUT_S, "paused")
    # its worker fetches nothing while paused; it only shows the partition (and its lag)
    wait_until(lambda: query(conn, "SELECT state FROM outbox.inbox_worker_partitions()"
                                   " WHERE subscription = 'it_sk' AND topic IS NOT NULL") == [("paused",)],
               TIMEOUT_S, "the worker to take the pause up")
    t_mid = query_one(conn, "SELECT clock_timestamp()")[0]
    time.sleep(0.01)            # the next record's timestamp is later than t_mid
    produce(env, topic, records(("k", 3), ("k", 4)), partition=0)
    produce(env, canary, records(("c", 1)), partition=0)
    settled(conn, "it_cn", 1)
    assert next_offset(conn, "it_sk") == 3, "a paused subscription applies nothing"
    as_app(conn, "SELECT outbox.resume_subscription('it_sk')")
    settled(conn, "it_sk", 5)
    assert [n for _, n in applied(conn, "it_mail_sk")] == [0, 1, 2, 3, 4]

    assert as_app(conn, "SELECT outbox.inbox_seek('it_sk', %s, 0, 1::bigint)", (topic,))[0][0] == 1
    settled(conn, "it_sk", 5)
    wait_until(lambda: len(applied(conn, "it_mail_sk")) == 9, TIMEOUT_S, "records 1..4 applied again")
    assert [n for _, n in applied(conn, "it_mail_sk")][5:] == [1, 2, 3, 4]
    as_app(conn, "SELECT outbox.inbox_seek('it_sk', %s, 0, %s::timestamptz)", (topic, t_mid))
    wait_until(lambda: len(applied(conn, "it_mail_sk")) == 11, TIMEOUT_S, "records from the time applied")
    assert [n for _, n in applied(conn, "it_mail_sk")][9:] == [3, 4]
    as_app(conn, "SELECT outbox.inbox_seek('it_sk', %s, NULL, '-infinity'::timestamptz)", (topic,))
    wait_until(lambda: len(applied(conn, "it_mail_sk")) == 16, TIMEOUT_S, "every record from the first")
    as_app(conn, "SELECT outbox.pause_subscription('it_sk')")
    produce(env, topic, records(("k", 5)), partition=0)
    as_app(conn, "SELECT outbox.inbox_seek('it_sk', %s, 0, 'infinity'::timestamptz)", (topic,))
    as_app(conn, "SELECT outbox.resume_subscription('it_sk')")
    # the worker places the partition at the end Kafka has when it takes the seek up: after 5
    settled(conn, "it_sk", acks[-1][1] + 4)
    produce(env, topic, records(("k", 6)), partition=0)
    settled(conn, "it_sk", acks[-1][1] + 5)
    assert [n for _, n in applied(conn, "it_mail_sk")][16:] == [6], "the end: what came after the seek"


def test_a_batch_whose_offset_moves_while_it_runs_rolls_back(env, app):
    """The handler sleeps for key 'slow'.  While it sleeps, (1) another session advances the
    offset as a second applier would (a zombie worker that committed the same batch first), then
    (2) a seek moves it: each time the worker's compare-and-set finds another value, the batch
    rolls back, and nothing is applied twice."""
    conn = app
    topic = new_topic(env, "race")
    query(conn, "DROP TABLE IF EXISTS it_slow")
    query(conn, "CREATE TABLE it_slow (n int)")
    query(conn, f"ALTER TABLE it_slow OWNER TO {APP_ROLE}")
    mail_handler(conn, "it_mail_rc", "it_handle_rc", extra_sql=(
        "IF e.key = 'slow' AND EXISTS (SELECT 1 FROM it_slow WHERE n = (e.payload->>'n')::int) THEN"
        " PERFORM pg_sleep(3); END IF;"))
    subscribe(conn, "it_rc", [topic], "it_handle_rc")
    produce(env, topic, records(("k", 0)), partition=0)
    settled(conn, "it_rc", 1)

    def inbox_sleeping():
        return query(conn, "SELECT 1 FROM pg_stat_activity WHERE backend_type = 'outbox inbox'"
                           " AND wait_event = 'PgSleep'")

    # (1) a second applier commits offset 2 while the worker applies records 1..1
    query(conn, "INSERT INTO it_slow VALUES (1)")
    produce(env, topic, records(("slow", 1)), partition=0)
    wait_until(inbox_sleeping, TIMEOUT_S, "the handler asleep in record 1")
    query(conn, "UPDATE outbox.inbox_offsets SET next_offset = 2 WHERE subscription = 'it_rc' AND next_offset = 1")
    wait_until(lambda: not inbox_sleeping(), TIMEOUT_S, "the handler awake")
    produce(env, topic, records(("k", 2)), partition=0)
    settled(conn, "it_rc", 3)
    assert applied(conn, "it_mail_rc") == [("k", 0), ("k", 2)], \
        "record 1, committed by the other applier, is not applied by the worker too"

    # (2) a seek back to 1 while the worker sleeps in record 3: the batch rolls back, the worker
    # applies from 1 (records 1 and 2 again, 1 for the first time here, 2 dropped as a copy)
    query(conn, "INSERT INTO it_slow VALUES (3)")
    produce(env, topic, records(("slow", 3)), partition=0)
    wait_until(inbox_sleeping, TIMEOUT_S, "the handler asleep in record 3")
    query(conn, "DELETE FROM it_slow")
    as_app(conn, "SELECT outbox.inbox_seek('it_rc', %s, 0, 1::bigint)", (topic,))
    settled(conn, "it_rc", 4)
    got = applied(conn, "it_mail_rc")
    assert got == [("k", 0), ("k", 2), ("slow", 1), ("slow", 3)], got
    st = status(conn, "it_rc")[0]
    assert st["duplicates"] == 1, st


def test_librdkafka_errors_of_the_inbox_never_show_a_masked_value(env, app):
    """As the relay's (test_21): SHOW masks a secret property, but librdkafka's own error text may
    quote its value ("Failed to open ssl.keystore.location: /nonexistent/<secret>").  The inbox
    showed such a text in outbox.inbox_status.last_error (readable by pg_monitor) and in the log;
    now every librdkafka text of the inbox is scrubbed of secret values before it is shown."""
    conn = app
    secret = f"KSSECRET{uuid.uuid4().hex[:8]}"
    topic = new_topic(env, "scrub")
    mail_handler(conn, "it_mail_scrub", "it_handle_scrub")
    set_conf(conn, inbox_kafka_properties=f"security.protocol=SSL;ssl.keystore.location=/nonexistent/{secret};"
                                          f"ssl.keystore.password=pw-{secret}")
    wait_until(lambda: "ssl.keystore" in query_one(pg_connect(env), "SHOW outbox.inbox_kafka_properties")[0],
               10, "the setting")
    start = open(env.server_log, errors="replace").read().count("\n")
    subscribe(conn, "it_scrub", [topic], "it_handle_scrub")

    def refused():
        rows = [r for r in status(conn, "it_scrub") if r["last_error"]]
        rows += [{"last_error": e} for (e,) in query(conn, "SELECT last_error FROM outbox.cluster_status()"
                                                           " WHERE kind = 'inbox' AND last_error IS NOT NULL")]
        return [r["last_error"] for r in rows if "keystore" in r["last_error"]]
    errors = wait_until(refused, TIMEOUT_S, "the inbox to refuse the keystore")
    log = open(env.server_log, errors="replace").read().splitlines()[start:]
    assert not [e for e in errors if secret in e], f"inbox last_error shows the masked value: {errors}"
    assert not [ln for ln in log if secret in ln], \
        f"the server log shows the masked value: {[ln for ln in log if secret in ln][:3]}"


def test_a_handler_leaves_no_settings_locks_or_stale_clock_behind(env, app):
    """A fresh user's findings: a handler's set_config(..., false) reached the next handler, of
    another role (a setting may carry a tenant for row-level security); a session advisory lock
    a handler took stayed with the worker; now() in every handler was the worker's start time
    (its transactions never got a statement start time).  Now each call's settings and session
    advisory locks are undone, and each transaction has its own now()."""
    conn = app
    setup_app_role(conn, "inbox_other")
    topic = new_topic(env, "leak")
    mail_handler(conn, "it_mail_leak", "it_handle_leak", extra_sql=(
        "PERFORM set_config('work_mem', '64kB', false);"
        " PERFORM set_config('myapp.tenant', 'leaked', false);"
        " PERFORM pg_advisory_lock(424242);"))
    subscribe(conn, "it_leak", [topic], "it_handle_leak")
    produce(env, topic, records(("k", 1)), partition=0)
    settled(conn, "it_leak", 1)
    assert query_one(conn, "SELECT pg_try_advisory_lock(424242)")[0], \
        "the handler's session advisory lock is still held by the inbox worker"
    query(conn, "SELECT pg_advisory_unlock(424242)")

    query(conn, "DROP TABLE IF EXISTS it_seen_leak")
    query(conn, "CREATE TABLE it_seen_leak (tenant text, work_mem text, now timestamptz)")
    query(conn, "ALTER TABLE it_seen_leak OWNER TO inbox_other")
    query(conn, """CREATE FUNCTION it_handle_seen(e outbox.inbox_event) RETURNS void
        LANGUAGE sql SET search_path = public, pg_temp AS $$
        INSERT INTO it_seen_leak VALUES (current_setting('myapp.tenant', true),
                                         current_setting('work_mem'), now()) $$""")
    query(conn, "ALTER FUNCTION it_handle_seen(outbox.inbox_event) OWNER TO inbox_other")
    worker_pid = query_one(conn, "SELECT pid FROM outbox.inbox_worker_partitions() WHERE subscription IS NULL")[0]
    before = query_one(conn, "SELECT clock_timestamp()")[0]
    subscribe(conn, "it_seen", [topic], "it_handle_seen", role="inbox_other")
    settled(conn, "it_seen", 1)
    tenant, work_mem, now = query_one(conn, "SELECT tenant, work_mem, now FROM it_seen_leak")
    assert query_one(conn, "SELECT pid FROM outbox.inbox_worker_partitions() WHERE subscription IS NULL")[0] \
        == worker_pid, "the worker restarted: the test proves nothing"
    assert tenant in (None, ""), f"another role's handler saw the setting the first one left: {tenant!r}"
    assert work_mem != "64kB", "work_mem set by one handler stayed for the next"
    assert now >= before, f"now() in the handler is {now}, older than the subscription ({before})"


def test_subscribe_refuses_too_many_topics_and_takes_an_infinite_start(env, app):
    """100,000 topics ran the host out of memory (a quadratic check); 'infinity' as start_from
    failed with a NOT NULL violation of the extension's own INSERT, then was refused; since 1.9
    '-infinity' and 'infinity' are earliest and latest (one set of positions, issue 36 #10)."""
    conn = app
    mail_handler(conn, "it_mail_lim", "it_handle_lim")
    with pytest.raises(psycopg2.Error) as e:
        subscribe(conn, "it_lim", [f"t{i}" for i in range(1001)], "it_handle_lim")
    assert e.value.pgcode == "54000", e.value.pgerror
    for value, stored in (("infinity", "latest"), ("-infinity", "earliest"), ("Latest", "latest")):
        subscribe(conn, "it_lim", ["t1"], "it_handle_lim", start_from=value)
        assert query(conn, "SELECT start_from FROM outbox.subscriptions WHERE name = 'it_lim'") == [(stored,)]
        as_app(conn, "SELECT outbox.unsubscribe('it_lim')")
    with pytest.raises(psycopg2.Error) as e:
        subscribe(conn, "it_lim", ["t1"], "it_handle_lim", start_from="tomorrow-ish")
    assert e.value.pgcode == "22007", e.value.pgerror
    subscribe(conn, "it_lim", [f"t{i}" for i in range(1000)], "it_handle_lim")


def test_a_reload_of_inbox_kafka_properties_logs_its_own_name(env, app):
    """The log said 'parameter "outbox.kafka_properties" changed' for the inbox's setting."""
    conn = app
    start = len(open(env.server_log, errors="replace").read())
    set_conf(conn, inbox_kafka_properties="fetch.wait.max.ms=101")
    line = 'parameter "outbox.inbox_kafka_properties" changed (value not logged)'
    wait_until(lambda: line in open(env.server_log, errors="replace").read()[start:], 20, "the log line")
    assert 'parameter "outbox.kafka_properties" changed' not in open(env.server_log, errors="replace").read()[start:]


def test_inbox_take_refuses_a_subscription_with_a_handler(env, app):
    """A fresh user took from a subscription with a handler and got 0 rows, forever: it looks like
    an empty queue.  Now it is an error that says why."""
    conn = app
    topic = new_topic(env, "takeh")
    mail_handler(conn, "it_mail_takeh", "it_handle_takeh")
    subscribe(conn, "it_takeh", [topic], "it_handle_takeh")
    with pytest.raises(psycopg2.Error) as e:
        as_app(conn, "SELECT * FROM outbox.inbox_take('it_takeh', 10)")
    assert e.value.pgcode == "22023", e.value.pgerror
    assert "has a handler" in e.value.pgerror


def test_subscription_names_without_control_characters(env, app):
    """A name with a newline, or of spaces only, was accepted and broke psql's listings."""
    conn = app
    mail_handler(conn, "it_mail_nm", "it_handle_nm")
    for bad in ("a\nb", "tab\there", " ", "   "):
        with pytest.raises(psycopg2.Error) as e:
            subscribe(conn, bad, ["t1"], "it_handle_nm")
        assert e.value.pgcode == "22023", (bad, e.value.pgerror)
    subscribe(conn, "it nm ok", ["t1"], "it_handle_nm")


def test_a_stop_during_a_handler_call_is_not_a_crash(env, app):
    """With outbox.inbox_max_attempts = 1, a fresh user's `pg_ctl restart -m fast` while a
    handler slept made that healthy record a dead letter (XX000, "the inbox worker ended 1
    times while it applied this record").  A stop that SIGTERM asks for (a fast shutdown,
    pg_terminate_backend()) is not a crash inside the call: the record is applied after it."""
    conn = app
    topic = new_topic(env, "stop")
    mail_handler(conn, "it_mail_stop", "it_handle_stop", extra_sql="PERFORM pg_sleep(3);")
    set_conf(conn, inbox_max_attempts=1)
    try:
        subscribe(conn, "it_stop", [topic], "it_handle_stop")
        produce(env, topic, records(("k", 1)), partition=0)
        sleeping = wait_until(lambda: query(conn, "SELECT pid FROM pg_stat_activity WHERE wait_event = 'PgSleep'"
                                                  " AND backend_type = 'outbox inbox'"), TIMEOUT_S,
                              "the handler to sleep in the inbox worker")
        query(conn, "SELECT pg_terminate_backend(%s)", (sleeping[0][0],))
        settled(conn, "it_stop", 1)
        assert query_one(conn, "SELECT count(*) FROM outbox.inbox_dead WHERE subscription = 'it_stop'")[0] == 0, \
            query(conn, "SELECT error FROM outbox.inbox_dead WHERE subscription = 'it_stop'")
        assert applied(conn, "it_mail_stop") == [("k", 1)]
    finally:
        set_conf(conn, inbox_max_attempts=None)


def test_broker_down_shows_on_every_partition_row(env, app):
    """A fresh user stopped Kafka under a running subscription: every row of inbox_status kept
    saying running (the partition's own state won over the worker's broker_down)."""
    conn = app
    topic = new_topic(env, "down", partitions=2)
    mail_handler(conn, "it_mail_down", "it_handle_down")
    subscribe(conn, "it_down", [topic], "it_handle_down")
    produce(env, topic, records(("a", 1), ("b", 2)))
    wait_until(lambda: sum(r["applied"] for r in status(conn, "it_down")) == 2
               and all(r["state"] == "running" for r in status(conn, "it_down")), TIMEOUT_S, "running")
    set_conf(conn, inbox_bootstrap_servers="127.0.0.1:1")
    try:
        rows = wait_until(lambda: (lambda rs: rs if rs and all(r["state"] == "broker_down" for r in rs) else None)(
            status(conn, "it_down")), TIMEOUT_S, "every row broker_down")
        assert all(r["last_error"] for r in rows), rows
    finally:
        set_conf(conn, inbox_bootstrap_servers=None)
    wait_until(lambda: all(r["state"] == "running" for r in status(conn, "it_down")), TIMEOUT_S, "running again")
