r"""
Security with a running relay, reloads and the server log (the SQL privileges themselves are
covered by test/pgtap/security.sql):

(a) outbox.allowed_topics: emit() and capture() accept only the listed topics (42501, nothing
    written), the allowed ones are delivered.
(b) secrets in outbox.kafka_properties never show: not in the server log (whole file, also with
    log_statement = 'all'), not in SHOW / current_setting() / pg_settings (superuser and a
    pg_read_all_settings member), not in outbox.status, not in error messages; nor any part of
    a secret with a ';' and a backslash (written \; and \\), nor of one whose ';' was not escaped.
(c) a role granted ALTER SYSTEM on outbox.kafka_properties cannot make the server load code or
    run commands (22023, nothing in postgresql.auto.conf).
(d) outbox.role: the relay connects as that role with exactly README's grants; a missing grant is
    a logged error with backoff, no worker exit, nothing lost; a missing role is waited for.
(e) search_path attack: functions and operators planted in public with the database's
    search_path set to public first are never called by the relay worker.
"""
import dataclasses
import os
import time
from pathlib import Path

import psycopg2
import pytest

from conftest import (create_topics, event_rows, message_problems, new_aggregate_type,
                      pg_connect, pg_sh, query, query_one, relay_status, report,
                      server_major, topic_prefix, unique_messages, wait_relay_ready, wait_until)
from helpers_security import (Log, alter_system, drop_role, emit_many, entries, full_error,
                              lines_of_pid, pending_count, reload, safe_unlink,
                              set_system, status, unique, wait_counts, wait_session_shows,
                              wait_shown, wait_state, whole_log, worker_exits)

SECRET = "S3cr3t-Pa55"
SECRET_PROPS = f"sasl.username=u1;sasl.password={SECRET};linger.ms=2"
SECRET_SHOWN = "sasl.username=********;sasl.password=********;linger.ms=2"
# an OAuth endpoint URL may carry user:password@ too (Debian's librdkafka refuses the property:
# built without libcurl; the relay reports config_error, which is all this needs)
SECRET_URL_PROPS = f"sasl.oauthbearer.token.endpoint.url=https://u1:{SECRET}@idp.invalid/token"
SECRET_URL_SHOWN = "sasl.oauthbearer.token.endpoint.url=********"
SECRET_NEWER_PROPS = (f"sasl.oauthbearer.assertion.private.key.passphrase={SECRET};"
                      f"sasl.oauthbearer.assertion.private.key.pem={SECRET};SASL.PASSWORD={SECRET};"
                      f"ssl.Key.Pem={SECRET};linger.ms=2")
# a secret with a ';' and a backslash, written with the escapes \; and \\; none of its parts
# may show
SEMI_SECRET_PARTS = ("Sc1Part", "Sc2Part", "Sc3Part")
SEMI_SECRET_PROPS = "sasl.username=u1;sasl.password=Sc1Part\\;Sc2Part\\\\Sc3Part;linger.ms=2"
SECRETS = (SECRET,) + SEMI_SECRET_PARTS


def has_secret(text: str) -> bool:
    return any(s in text for s in SECRETS)


SECRET_NEWER_SHOWN = ("sasl.oauthbearer.assertion.private.key.passphrase=********;"
                      "sasl.oauthbearer.assertion.private.key.pem=********;SASL.PASSWORD=********;"
                      "ssl.Key.Pem=********;linger.ms=2")


# --------------------------------------------------------------------------- (a) topics

def test_allowed_topics_limit_emit_and_capture(env, prefix, reader_factory):
    tag = unique("t")
    allowed = f"allowed.it.{tag}"
    exact = "exact.topic"
    create_topics(env, [allowed, exact])
    reader = reader_factory([allowed, exact])
    conn = pg_connect(env)
    agg = new_aggregate_type("allow")
    table_ok, table_bad = f"{tag}_cap_ok", f"{tag}_cap_bad"
    try:
        set_system(conn, {"outbox.allowed_topics": "allowed.*, exact.topic"})
        wait_session_shows(conn, "outbox.allowed_topics", "allowed.*, exact.topic")

        ok = [query_one(conn, "SELECT outbox.emit(%s, 'a1', 'allow.ok', '{\"n\": 1}', NULL, %s)::text",
                        (agg, allowed))[0],
              query_one(conn, "SELECT outbox.emit(%s, 'a2', 'allow.ok', '{\"n\": 2}', NULL, %s)::text",
                        (agg, exact))[0]]

        refused = {}
        for topic in ("notallowed.x", f"allowedx.{tag}", "allowed", "exact.topic2", "exact.topi",
                      None):
            bad_agg = new_aggregate_type("refused")
            with pytest.raises(psycopg2.errors.InsufficientPrivilege) as e:
                query(conn, "SELECT outbox.emit(%s, 'b', 'allow.bad', '{}', NULL, %s)", (bad_agg, topic))
            name = topic or prefix + bad_agg
            msg = e.value.diag.message_primary or ""
            assert e.value.pgcode == "42501"
            assert f'topic "{name}" is not allowed' in msg, full_error(e.value)
            assert "allowed.*, exact.topic" in (e.value.diag.message_detail or ""), full_error(e.value)
            assert query_one(conn, "SELECT count(*) FROM outbox.events WHERE aggregate_type = %s",
                             (bad_agg,))[0] == 0, f"an event to {name} was written"
            refused[name] = msg

        # capture() obeys it too: an allowed explicit topic works, a routed one is refused
        query(conn, f"""
            CREATE TABLE public.{table_ok} (id int PRIMARY KEY, v text);
            CREATE TRIGGER c AFTER INSERT OR UPDATE OR DELETE ON public.{table_ok}
                FOR EACH ROW EXECUTE FUNCTION outbox.capture('{agg}', 'id', '{allowed}');
            CREATE TABLE public.{table_bad} (id int PRIMARY KEY, v text);
            CREATE TRIGGER c AFTER INSERT OR UPDATE OR DELETE ON public.{table_bad}
                FOR EACH ROW EXECUTE FUNCTION outbox.capture('{agg}_routed', 'id');""")
        query(conn, f"INSERT INTO public.{table_ok} VALUES (1, 'x')")
        with pytest.raises(psycopg2.errors.InsufficientPrivilege) as e:
            query(conn, f"INSERT INTO public.{table_bad} VALUES (1, 'x')")
        msg = e.value.diag.message_primary or ""
        assert f'trigger "c" on table "{table_bad}"' in msg and \
            f'topic "{prefix}{agg}_routed" is not allowed' in msg, full_error(e.value)
        assert query_one(conn, f"SELECT count(*) FROM public.{table_bad}")[0] == 0
        assert query_one(conn, "SELECT count(*) FROM outbox.events WHERE aggregate_type = %s",
                         (agg + "_routed",))[0] == 0
        rows = event_rows(conn, agg)
        assert len(rows) == 3, rows

        counts = wait_counts(reader, {e: 1 for e in rows}, timeout=60, extra=1)
        mine = {e: c for e, c in counts.items() if e in rows}
        assert mine == {e: 1 for e in rows}, mine
        for m in unique_messages(reader.snapshot()):
            if m.event_id in rows:
                r = rows[m.event_id]
                want_topic = r["topic"]
                assert m.topic == want_topic, (m.topic, want_topic)
        report(f"OUTBOX ALLOWED TOPICS: 2 emits + 1 capture to allowed topics delivered; {len(refused)}"
               f" emits and 1 capture refused with 42501, nothing written")
    finally:
        query(conn, f"DROP TABLE IF EXISTS public.{table_ok}, public.{table_bad}")
        set_system(conn, {"outbox.allowed_topics": None})
        wait_session_shows(conn, "outbox.allowed_topics", "")
        conn.close()


# --------------------------------------------------------------------------- (b) secrets

def _all_visible(conn) -> dict:
    """Everything a session can read about outbox.kafka_properties and the relay."""
    out = {}
    try:
        out["SHOW"] = query_one(conn, "SHOW outbox.kafka_properties")[0]
    except psycopg2.Error as e:
        out["SHOW error"] = full_error(e)
    try:
        out["current_setting"] = query_one(conn, "SELECT current_setting('outbox.kafka_properties')")[0]
    except psycopg2.Error as e:
        out["current_setting error"] = full_error(e)
    with conn.cursor() as cur:
        cur.execute("SELECT * FROM pg_settings WHERE name = 'outbox.kafka_properties'")
        cols = [d[0] for d in cur.description]
        for row in cur.fetchall():
            for col, v in zip(cols, row):
                out[f"pg_settings.{col}"] = "" if v is None else str(v)
    try:
        out["outbox.status"] = repr(relay_status(conn))
    except psycopg2.Error as e:
        out["outbox.status error"] = full_error(e)
    return out


def test_secrets_never_leak(env, prefix, reader_factory):
    conn = pg_connect(env)
    reader_role = unique("it_settings_reader")
    conf = Path(env.pg_dir) / "data" / "postgresql.conf"
    original_conf = conf.read_text()
    leaks = []
    agg = new_aggregate_type("secret")
    topic = prefix + agg
    create_topics(env, [topic])
    reader = reader_factory([topic])

    def check_views(where: str, expect_shown: str):
        vis = _all_visible(conn)
        if vis.get("SHOW") != expect_shown:
            leaks.append(f"{where}: SHOW as superuser gives {vis.get('SHOW')!r}, expected {expect_shown!r}")
        query(conn, f'SET ROLE "{reader_role}"')
        try:
            vis_r = _all_visible(conn)
        finally:
            query(conn, "RESET ROLE")
        for who, v in (("superuser", vis), ("pg_read_all_settings member", vis_r)):
            for k, text in v.items():
                if has_secret(text):
                    leaks.append(f"{where}: {k} as {who} shows the secret: {text}")
        return vis, vis_r

    try:
        query(conn, f'CREATE ROLE "{reader_role}" IN ROLE pg_read_all_settings')

        # 1. ALTER SYSTEM + reload: the relay accepts the properties with PLAINTEXT and delivers
        log = Log(env)
        pid = status(conn)["pid"]
        set_system(conn, {"outbox.kafka_properties": SECRET_PROPS})
        wait_session_shows(conn, "outbox.kafka_properties", SECRET_SHOWN)
        wait_until(lambda: "Kafka settings changed" in log.text(), 20, "the relay to apply the properties")
        eids = [e for e, _, _ in emit_many(conn, agg, ["s1"], 3, tag="secret")]
        counts = wait_counts(reader, {e: 1 for e in eids}, timeout=60, extra=0.5)
        assert set(eids) <= set(counts), "not delivered with sasl.* properties over PLAINTEXT"
        st = status(conn)
        assert st["state"] in ("idle", "publishing") and st["pid"] == pid, st
        _, vis_r = check_views("ALTER SYSTEM", SECRET_SHOWN)
        if vis_r.get("SHOW") != SECRET_SHOWN:
            leaks.append(f"pg_read_all_settings member: SHOW gives {vis_r.get('SHOW')!r}")

        # 2. errors: a statement setting it with an invalid companion property, in a session,
        #    and a value librdkafka refuses (the relay's log line and outbox.status)
        for value in (f"sasl.password={SECRET};acks=1", f"sasl.password={SECRET};garbage",
                      f"sasl.password={SECRET};ssl.engine.location=/x.so",
                      # a ';' of the secret not escaped: refused, never quoted
                      "sasl.password=Sc1Part;Sc2Part", "sasl.password=Sc1Part;;Sc2Part=Sc3Part"):
            with pytest.raises(psycopg2.errors.InvalidParameterValue) as e:
                query(conn, "ALTER SYSTEM SET outbox.kafka_properties = %s", (value,))
            if has_secret(full_error(e.value)):
                leaks.append(f"ALTER SYSTEM error message: {full_error(e.value)}")
        with pytest.raises(psycopg2.Error) as e:
            query(conn, "SET outbox.kafka_properties = %s", (f"sasl.password={SECRET}",))
        if has_secret(full_error(e.value)):
            leaks.append(f"SET error message: {full_error(e.value)}")
        log2 = Log(env)
        set_system(conn, {"outbox.kafka_properties": f"sasl.password={SECRET};linger.ms=not-a-number"})
        wait_state(conn, "config_error", 20)
        st = status(conn)
        assert 'librdkafka property "linger.ms"' in (st["last_error"] or ""), st
        if SECRET in repr(st):
            leaks.append(f"outbox.status with a refused property: {st}")
        refused = [ln for ln in log2.lines() if "cannot create its Kafka producer" in ln]
        assert len(refused) == 1 and "linger.ms" in refused[0], refused
        check_views("refused by librdkafka", "sasl.password=********;linger.ms=not-a-number")
        set_system(conn, {"outbox.kafka_properties": SECRET_URL_PROPS})
        wait_session_shows(conn, "outbox.kafka_properties", SECRET_URL_SHOWN)
        check_views("an endpoint URL with a password", SECRET_URL_SHOWN)
        # a newer librdkafka's secret properties (2.0.2 refuses them: config_error) and a
        # mistyped name in upper case: masked all the same (a trial saw them in clear)
        set_system(conn, {"outbox.kafka_properties": SECRET_NEWER_PROPS})
        wait_session_shows(conn, "outbox.kafka_properties", SECRET_NEWER_SHOWN)
        check_views("newer or mistyped secret properties", SECRET_NEWER_SHOWN)
        # a secret with ';' and a backslash, escaped: masked whole, the relay runs with it
        set_system(conn, {"outbox.kafka_properties": SEMI_SECRET_PROPS})
        wait_session_shows(conn, "outbox.kafka_properties", SECRET_SHOWN)
        wait_state(conn, ("idle", "publishing"), 20)
        check_views("a secret with ';' and a backslash", SECRET_SHOWN)

        # 3. postgresql.conf + reload (ALTER SYSTEM's value removed first)
        alter_system(conn, "outbox.kafka_properties", None)
        conf.write_text(original_conf + f"\noutbox.kafka_properties = '{SECRET_PROPS.replace('=2', '=3')}'\n")
        reload(conn)
        wait_session_shows(conn, "outbox.kafka_properties", SECRET_SHOWN.replace("=2", "=3"))
        wait_state(conn, ("idle", "publishing"), 20)
        check_views("postgresql.conf", SECRET_SHOWN.replace("=2", "=3"))
        # a malformed value in the file: the reload refuses it without quoting it
        log3 = Log(env)
        conf.write_text(original_conf + f"\noutbox.kafka_properties = 'sasl.password={SECRET};oops'\n")
        reload(conn)
        wait_until(lambda: "item 2 is not of the form key=value" in log3.text(), 20,
                   "the reload to refuse the malformed value")
        conf.write_text(original_conf)
        reload(conn)
        wait_session_shows(conn, "outbox.kafka_properties", "")

        # 4. log_statement = 'all' (and log_min_duration_statement = 0): statements setting it
        marker = unique("obx_marker")
        for setting, value in (("log_statement", "all"), ("log_min_duration_statement", "0")):
            set_system(conn, {setting: value})
            wait_shown(env, setting, value if setting == "log_statement" else "0")
            c2 = pg_connect(env)
            try:
                query(c2, f"SELECT '{marker}_{setting}'")
                query(c2, "ALTER SYSTEM SET outbox.kafka_properties = %s", (SECRET_PROPS,))
                query(c2, f"alter system set OUTBOX.Kafka_Properties to '{SECRET_PROPS}'")
                query(c2, "ALTER SYSTEM SET outbox.kafka_properties = %s", (SEMI_SECRET_PROPS,))
                # run by a function (refused: ALTER SYSTEM cannot run there): the error's CONTEXT
                # line would quote the inner statement in the log
                inner = f"ALTER SYSTEM SET outbox.kafka_properties = '{SECRET_PROPS}'".replace("'", "''")
                with pytest.raises(psycopg2.Error) as e:
                    query(c2, f"DO $$BEGIN EXECUTE '{inner}'; END$$")
                if has_secret(full_error(e.value)):
                    leaks.append(f"error of a DO block: {full_error(e.value)}")
                query(c2, "ALTER SYSTEM RESET outbox.kafka_properties")
            finally:
                c2.close()
            set_system(conn, {setting: None})
            assert f"{marker}_{setting}" in whole_log(env), \
                f"{setting} = {value} did not log the marker statement: the check could not fail"

        # 5. outbox.status after all this
        if has_secret(repr(relay_status(conn))):
            leaks.append(f"outbox.status: {relay_status(conn)}")
    finally:
        conf.write_text(original_conf)
        set_system(conn, {"outbox.kafka_properties": None, "log_statement": None,
                          "log_min_duration_statement": None})
        drop_role(conn, reader_role)
        wait_state(conn, ("idle", "publishing"), 30)
        conn.close()

    # the whole server log, from the cluster's start
    text = whole_log(env)
    for ln in text.splitlines():
        if has_secret(ln):
            leaks.append(f"server log: {ln}")
    report(f"OUTBOX SECRETS: '{SECRET_PROPS.replace(SECRET, '<secret>')}' accepted with PLAINTEXT and"
           f" delivered; {len(leaks)} place(s) showed the secret"
           + (": " + "; ".join(sorted({l.split(' shows the secret')[0][:100] for l in leaks})) if leaks else ""))
    assert not leaks, f"the secret {SECRET!r} leaked in {len(leaks)} place(s):\n  " + "\n  ".join(leaks[:20])


def test_secret_not_in_pg_stat_statements_or_pg_stat_activity(env):
    """ALTER SYSTEM SET outbox.kafka_properties carries the value in its text: pg_stat_activity
    (an idle session keeps showing its last statement) and pg_stat_statements (outbox listed
    after it in shared_preload_libraries, as the README says) show it masked to pg_monitor."""
    conn = pg_connect(env)
    monitor = unique("it_monitor")
    leaks = []
    try:
        # the wrong order first: pg_stat_statements' hook would run before ours; the server
        # says so when it starts (a trial found it silent)
        # (a list: two quoted items; one quoted string would name a single library)
        query(conn, "ALTER SYSTEM SET shared_preload_libraries = 'outbox', 'pg_stat_statements'")
        conn.close()
        log = Log(env)
        pg_sh(env, "restart")
        conn = wait_until(lambda: pg_connect(env), 30, "a connection after the restart")
        order_warnings = [ln for ln in log.lines()
                          if "outbox is listed before pg_stat_statements in shared_preload_libraries" in ln]
        assert len(order_warnings) == 1 and "WARNING" in order_warnings[0], order_warnings
        query(conn, "ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements', 'outbox'")
        conn.close()
        log = Log(env)
        pg_sh(env, "restart")
        conn = wait_until(lambda: pg_connect(env), 30, "a connection after the restart")
        assert not [ln for ln in log.lines() if "is listed before pg_stat_statements" in ln]
        query(conn, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        query(conn, f'CREATE ROLE "{monitor}" IN ROLE pg_monitor')
        setter = pg_connect(env)
        try:
            query(setter, "ALTER SYSTEM SET outbox.kafka_properties = %s", (SECRET_PROPS,))
            query(setter, f"alter system set OUTBOX.Kafka_Properties to '{SECRET_PROPS}'")
            query(setter, "ALTER SYSTEM SET outbox.kafka_properties = %s", (SEMI_SECRET_PROPS,))
            query(conn, f'SET ROLE "{monitor}"')
            try:
                activity = query_one(conn, "SELECT query FROM pg_stat_activity WHERE pid = %s",
                                     (setter.get_backend_pid(),))[0]
                statements = [r[0] for r in query(conn, "SELECT query FROM pg_stat_statements"
                                                        " WHERE query ILIKE '%kafka_properties%'")]
            finally:
                query(conn, "RESET ROLE")
        finally:
            query(setter, "ALTER SYSTEM RESET outbox.kafka_properties")
            setter.close()
        # the check could not fail if the monitor saw nothing at all
        assert "kafka_properties" in activity, activity
        # PostgreSQL 18's pg_stat_statements replaces the constants of utility statements by
        # $1 itself; before 18 it keeps the text our hook masked
        major = server_major(conn)
        masked = "= $1" if major >= 18 else "(not shown)"
        assert any(masked in q for q in statements), statements
        for where, text in [("pg_stat_activity", activity)] + [("pg_stat_statements", q) for q in statements]:
            if has_secret(text):
                leaks.append(f"{where}: {text}")
    finally:
        c = wait_until(lambda: pg_connect(env), 30, "a connection")
        query(c, "DROP EXTENSION IF EXISTS pg_stat_statements")
        query(c, "ALTER SYSTEM RESET shared_preload_libraries")
        drop_role(c, monitor)
        c.close()
        pg_sh(env, "restart")
        wait_relay_ready(env)
    report(f"OUTBOX SECRETS (statements): ALTER SYSTEM SET outbox.kafka_properties as seen by pg_monitor:"
           f" pg_stat_activity {activity!r}, pg_stat_statements {statements!r}")
    assert not leaks, "\n".join(leaks)


# --------------------------------------------------------------------------- (c) no code loading

FORBIDDEN = [
    ("plugin.library.paths=/tmp/obx-evil.so", "plugin.library.paths"),
    ("PLUGIN.LIBRARY.PATHS=/tmp/obx-evil.so", "PLUGIN.LIBRARY.PATHS"),
    ("linger.ms=5; plugin.library.paths = /tmp/obx-evil.so", "plugin.library.paths"),
    ("ssl.engine.location=/tmp/obx-evil.so", "ssl.engine.location"),
    ("ssl.engine.id=obx-evil", "ssl.engine.id"),
    ("ssl.providers=obx-evil", "ssl.providers"),
    ("sasl.kerberos.kinit.cmd=touch /tmp/obx-evil", "sasl.kerberos.kinit.cmd"),
    ("interceptors=obx-evil", "interceptors"),
    # would let librdkafka run its kinit shell command (the relay pins it to 0)
    ("sasl.kerberos.min.time.before.relogin=60000", "sasl.kerberos.min.time.before.relogin"),
]


def test_kafka_properties_cannot_load_code(env):
    conn = pg_connect(env)
    role = unique("it_kprops_admin")
    auto_conf = Path(env.pg_dir) / "data" / "postgresql.auto.conf"
    marker = f"/tmp/obx-kinit-{role}"
    problems = []
    reloaded = False
    try:
        query(conn, f'CREATE ROLE "{role}"')
        query(conn, f'GRANT ALTER SYSTEM ON PARAMETER outbox.kafka_properties TO "{role}"')
        r = pg_connect(env)
        try:
            query(r, f'SET ROLE "{role}"')
            # the grant works: a harmless property is accepted, then reset
            query(r, "ALTER SYSTEM SET outbox.kafka_properties = 'linger.ms=5'")
            assert "linger.ms=5" in auto_conf.read_text()
            query(r, "ALTER SYSTEM RESET outbox.kafka_properties")
            for value, key in FORBIDDEN:
                try:
                    query(r, "ALTER SYSTEM SET outbox.kafka_properties = %s", (value,))
                    problems.append(f"{value!r} was accepted")
                    query(r, "ALTER SYSTEM RESET outbox.kafka_properties")
                except psycopg2.Error as e:
                    text = full_error(e)
                    if e.pgcode != "22023":
                        problems.append(f"{value!r}: SQLSTATE {e.pgcode}, expected 22023: {text}")
                    elif f'"{key}"' not in text:
                        problems.append(f"{value!r}: the message does not name {key!r}: {text}")
                conf_text = auto_conf.read_text()
                if "obx-evil" in conf_text:
                    problems.append(f"{value!r} is in postgresql.auto.conf")

            # librdkafka's default sasl.kerberos.kinit.cmd is a shell command with
            # sasl.kerberos.principal and sasl.kerberos.keytab pasted in unquoted: those
            # values must not be able to run a command either
            safe_unlink(marker)
            gssapi = ("security.protocol=SASL_PLAINTEXT;sasl.mechanisms=GSSAPI;"
                      f"sasl.kerberos.keytab=/nonexistent;sasl.kerberos.principal=x$(touch {marker})")
            try:
                query(r, "ALTER SYSTEM SET outbox.kafka_properties = %s", (gssapi,))
                accepted = True
            except psycopg2.Error as e:
                accepted = False
                if e.pgcode != "22023":
                    problems.append(f"GSSAPI principal with $(...): SQLSTATE {e.pgcode}: {full_error(e)}")
        finally:
            r.close()
        if accepted:
            # accepted: then the relay must not run the command when it applies the value
            reloaded = True
            reload(conn)
            wait_until(lambda: os.path.exists(marker) or
                       (relay_status(conn) and relay_status(conn)[0]["state"] in
                        ("broker_down", "config_error")), 20, "the relay to apply the GSSAPI settings")
            time.sleep(2)
            if os.path.exists(marker):
                owner = Path(marker).owner()
                problems.append(
                    "a role granted ALTER SYSTEM on outbox.kafka_properties ran a shell command in the"
                    f" server: sasl.mechanisms=GSSAPI with sasl.kerberos.principal='x$(touch {marker})'"
                    f" was accepted, and after the reload {marker} exists (owner {owner}):"
                    " librdkafka ran its default sasl.kerberos.kinit.cmd with the principal pasted in")
    finally:
        query(conn, "ALTER SYSTEM RESET outbox.kafka_properties")
        if reloaded:
            reload(conn)
            wait_state(conn, ("idle", "publishing"), 30)
        safe_unlink(marker)
        query(conn, f'REVOKE ALTER SYSTEM ON PARAMETER outbox.kafka_properties FROM "{role}"')
        drop_role(conn, role)
        conn.close()
    report(f"OUTBOX NO CODE LOADING: {len(FORBIDDEN)} forbidden property values tried by a role granted"
           f" ALTER SYSTEM on the parameter, plus a GSSAPI kinit injection; {len(problems)} problem(s)")
    assert not problems, "\n  ".join(["code loading not refused:"] + problems)


# --------------------------------------------------------------------------- (d) outbox.role

RELAY_ROLE = "outbox_relay"
RELAY_GRANTS = f"""
    CREATE ROLE {RELAY_ROLE} LOGIN;
    GRANT USAGE ON SCHEMA outbox TO {RELAY_ROLE};
    GRANT SELECT, UPDATE, DELETE ON outbox.events TO {RELAY_ROLE};
    GRANT SELECT ON outbox.relay TO {RELAY_ROLE};
    GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.relay_progress TO {RELAY_ROLE};
    GRANT SELECT ON outbox.events_id_seq TO {RELAY_ROLE};
"""
WAIT_OBSERVE_S = 12            # time a missing role is watched for a crash loop
REVOKE_OBSERVE_S = 10          # time a missing grant is watched
MAX_PERMISSION_ERRORS = 7      # backoff 1, 2, 4, 8 s: about 4 in 10 s (no backoff: 40)
CLEANUP_OBSERVE_S = 4           # retention's cleanup runs every second
REVOKE_EMIT_EVERY_S = 0.25     # commits during that time (each one wakes the relay)


def _relay_backend(conn):
    return query(conn, "SELECT pid, usename FROM pg_stat_activity WHERE backend_type = 'outbox relay'")


@pytest.mark.full_only
def test_relay_role(env, prefix, reader_factory):
    agg = new_aggregate_type("role")
    topic = prefix + agg
    create_topics(env, [topic])
    reader = reader_factory([topic])
    conn = pg_connect(env)
    emitted = []
    figures = {}
    problems = []
    try:
        drop_role(conn, RELAY_ROLE)
        # the role does not exist yet: the relay waits for it, no crash loop.  The grants below
        # are tested with the relay that marks rows (relay_mode = row); the snapshot relay's own
        # grant (UPDATE on outbox.relay_progress) at the end
        alter_system(conn, "outbox.role", RELAY_ROLE)
        alter_system(conn, "outbox.relay_mode", "row")
        log = Log(env)
        conn.close()
        pg_sh(env, "restart")
        conn = wait_until(lambda: pg_connect(env), 30, "a connection after the restart")
        st = wait_state(conn, "waiting_for_database", 60, "state waiting_for_database for a missing role")
        wpid = st["pid"]
        t_wait = time.monotonic()
        emitted += emit_many(conn, agg, ["r1", "r2"], 2, tag="missing_role")
        time.sleep(WAIT_OBSERVE_S)
        st = status(conn)
        assert st["state"] == "waiting_for_database" and st["pid"] == wpid, st
        lines = log.lines()
        # only the new server's lines (the old one's relay exits when it shuts down); the
        # first worker may exit once on the missing role, then it must wait, not loop
        starts = [i for i, ln in enumerate(lines) if "postmaster LOG:  starting PostgreSQL" in ln]
        assert starts, "no server start in the log after pg.sh restart"
        lines = lines[starts[-1]:]
        exits = worker_exits(lines)
        assert len(exits) <= 1, "crash loop while the role is missing:\n" + "\n".join(exits)
        # the log line and the status name the role as the obstacle, not the database (a DBA
        # trial found "waiting for database" and an empty last_error)
        obstacle = f'role "{RELAY_ROLE}" (outbox.role) does not exist'
        waiting = [e for e in entries(lines) if "outbox relay is waiting: " in e]
        assert len(waiting) == 1, waiting
        assert obstacle in waiting[0], f"the LOG line does not name the role: {waiting[0]}"
        assert st["last_error"] == obstacle, st
        assert pending_count(conn, agg) == len(emitted)
        figures["missing_role_exits"] = len(exits)

        # CREATE ROLE with README's grants: the relay connects as it
        query(conn, RELAY_GRANTS)
        t_created = time.monotonic()
        st = wait_state(conn, ("idle", "publishing"), 60, "the relay to connect as the new role")
        figures["connect_after_create_s"] = time.monotonic() - t_created
        backends = _relay_backend(conn)
        assert backends == [(st["pid"], RELAY_ROLE)], backends
        emitted += emit_many(conn, agg, ["r1", "r2"], 3, tag="as_role")
        counts = wait_counts(reader, {e: 1 for e, _, _ in emitted}, timeout=60, extra=0.5)
        assert {e for e, _, _ in emitted} <= set(counts)
        pid = st["pid"]

        # one missing grant, then another: the status must show the error of the moment, not the
        # first one (a DBA trial saw "permission denied for schema outbox" stay while the
        # relay failed on the table)
        log_all = Log(env)
        query(conn, f"REVOKE USAGE ON SCHEMA outbox FROM {RELAY_ROLE}")
        no_schema = emit_many(conn, agg, ["r1"], 1, tag="no_schema")
        emitted += no_schema
        st = wait_until(lambda: (lambda s: s if "permission denied for schema outbox" in (s["last_error"] or "")
                                 else None)(status(conn)), 30, "last_error: permission denied for schema")
        assert st["state"] == "error", st
        # nor does retention warn that publishing goes on without it (a user's try saw that
        # WARNING, hint "grant DELETE", while the relay could not publish at all): a few more
        # passes of the loop (backoff 1, 2 s), each of which would run the cleanup
        time.sleep(4)
        misleading = [ln for ln in log_all.lines() if "cannot delete published events" in ln]
        assert not misleading, misleading
        first_error_at = st["last_error_at"]
        query(conn, f"BEGIN; GRANT USAGE ON SCHEMA outbox TO {RELAY_ROLE};"
                    f" REVOKE UPDATE ON outbox.events FROM {RELAY_ROLE}; COMMIT")
        st = wait_until(lambda: (lambda s: s if "permission denied for table events" in (s["last_error"] or "")
                                 else None)(status(conn)), 30,
                        "last_error to follow the new error (permission denied for table events)")
        assert st["state"] == "error" and st["last_error_at"] > first_error_at, st

        # a missing grant: logged errors with backoff, no exit, nothing lost.  Events keep being
        # committed all the time (each commit wakes the relay): the backoff must still bound
        # the log lines
        log2 = Log(env)
        held = []
        t_rev = time.monotonic()
        i = 0
        while time.monotonic() - t_rev < REVOKE_OBSERVE_S:
            held += emit_many(conn, agg, [f"r{i % 3 + 1}"], 1, tag=f"revoked{i}")
            i += 1
            time.sleep(REVOKE_EMIT_EVERY_S)
        st = status(conn)
        lines2 = log2.lines()
        errors = [ln for ln in lines_of_pid(lines2, pid) if " ERROR: " in ln]
        assert st["pid"] == pid, f"the relay worker was replaced: {st}"
        assert not worker_exits(lines2), worker_exits(lines2)
        assert "permission denied" in (st["last_error"] or ""), st
        assert errors, f"no ERROR line of the relay (pid {pid}) in {REVOKE_OBSERVE_S}s without UPDATE"
        assert all("permission denied for table events" in ln for ln in errors), errors
        assert pending_count(conn, agg) == len(held) + len(no_schema)
        figures["permission_errors"] = len(errors)
        figures["revoked_commits"] = len(held)
        if len(errors) > MAX_PERMISSION_ERRORS:
            stamps = [ln[11:23] for ln in errors]
            problems.append(
                f"no backoff: {len(errors)} ERROR lines of the relay in {REVOKE_OBSERVE_S}s while"
                f" {len(held)} events were committed (at most {MAX_PERMISSION_ERRORS} expected:"
                f" backoff 1, 2, 4, 8 s); at {', '.join(stamps[:12])}{' ...' if len(stamps) > 12 else ''}")

        # grant again: recovers without a restart
        query(conn, f"GRANT UPDATE ON outbox.events TO {RELAY_ROLE}")
        t_grant = time.monotonic()
        emitted += held
        emitted += emit_many(conn, agg, ["r1"], 1, tag="regranted")
        counts = wait_counts(reader, {e: 1 for e, _, _ in emitted}, timeout=90, extra=1)
        missing = {e for e, _, _ in emitted} - set(counts)
        assert not missing, f"{len(missing)} events lost"
        figures["recover_s"] = time.monotonic() - t_grant
        wait_until(lambda: pending_count(conn, agg) == 0, 30, "all rows published")
        assert status(conn)["pid"] == pid
        rows = event_rows(conn, agg)
        msgs = [m for m in unique_messages(reader.snapshot()) if m.event_id in rows]
        probs = []
        for m in msgs:
            r = rows[m.event_id]
            probs += message_problems(m, event_id=m.event_id, aggregate_type=agg,
                                      aggregate_id=r["aggregate_id"], event_type=r["event_type"],
                                      payload=r["payload"], headers=None, topic=topic,
                                      created_ms=r["created_ms"])
        assert not probs, "\n".join(probs[:10])

        # the missing grants above also failed retention's cleanup; it is retried every 10 s
        if any("outbox relay cannot delete published events" in ln for ln in log_all.lines()):
            wait_until(lambda: any("outbox relay deletes published events again" in ln
                                   for ln in log_all.lines()), 30, "the cleanup to work again")

        # without DELETE, retention's cleanup fails: one WARNING, and publishing goes on (a DBA
        # trial saw delivery stop altogether)
        log3 = Log(env)
        query(conn, f"REVOKE DELETE ON outbox.events FROM {RELAY_ROLE}")
        no_delete = emit_many(conn, agg, ["r1", "r2"], 3, tag="no_delete")
        emitted += no_delete
        counts = wait_counts(reader, {e: 1 for e, _, _ in emitted}, timeout=60, extra=0.5)
        assert {e for e, _, _ in no_delete} <= set(counts), "events held back by a failing cleanup"
        wait_until(lambda: pending_count(conn, agg) == 0, 30, "all rows marked published without DELETE")
        time.sleep(CLEANUP_OBSERVE_S)       # the cleanup runs every second
        st = status(conn)
        assert st["state"] in ("idle", "publishing") and st["pid"] == pid, st
        assert "cannot delete published events" in (st["last_error"] or ""), st
        warnings = [e for e in entries(log3.lines()) if "outbox relay cannot delete published events" in e]
        assert len(warnings) == 1, warnings
        figures["cleanup_warnings"] = len(warnings)

        # with retention 0 an acknowledged event is deleted, not marked: without DELETE nothing
        # may be sent (else every batch went out again after each failed DELETE)
        set_system(conn, {"outbox.retention": "0"})
        wait_session_shows(conn, "outbox.retention", "0")
        held0 = emit_many(conn, agg, ["r3"], 3, tag="retention0")
        st = wait_until(lambda: (lambda s: s if s["state"] == "error" and "permission denied for table events"
                                 in (s["last_error"] or "") else None)(status(conn)), 30,
                        "state error: retention 0 without DELETE")
        sent = set(wait_counts(reader, {}, timeout=1, extra=CLEANUP_OBSERVE_S)) & {e for e, _, _ in held0}
        assert not sent, f"{len(sent)} of {len(held0)} events sent although they could not be deleted"
        assert pending_count(conn, agg) == len(held0)
        query(conn, f"GRANT DELETE ON outbox.events TO {RELAY_ROLE}")
        emitted += held0
        counts = wait_counts(reader, {e: 1 for e, _, _ in emitted}, timeout=60, extra=0.5)
        assert {e for e, _, _ in held0} <= set(counts)
        dups = {e: n for e, n in counts.items() if e in {x for x, _, _ in held0} and n > 1}
        assert not dups, dups
        wait_until(lambda: query_one(conn, "SELECT count(*) FROM outbox.events WHERE aggregate_type = %s"
                                           " AND payload->>'tag' = 'retention0'", (agg,))[0] == 0,
                   30, "acknowledged events deleted with retention 0")
        set_system(conn, {"outbox.retention": None})

        # the snapshot relay writes outbox.relay_progress: without UPDATE on it, an error with
        # backoff, nothing sent twice or lost; GRANT again and everything goes out once
        set_system(conn, {"outbox.relay_mode": "snapshot"})
        wait_session_shows(conn, "outbox.relay_mode", "snapshot")
        wait_until(lambda: query_one(conn, "SELECT xid IS NOT NULL FROM outbox.events WHERE event_id = %s",
                                     (emit_many(conn, agg, ["r1"], 1, tag="probe")[0][0],))[0],
                   30, "a new event tracked by snapshot")
        wait_until(lambda: pending_count(conn, agg) == 0, 30, "the probes published")
        query(conn, f"REVOKE UPDATE ON outbox.relay_progress FROM {RELAY_ROLE}")
        held_s = emit_many(conn, agg, ["r1", "r2"], 2, tag="no_progress")
        st = wait_until(lambda: (lambda s: s if s["state"] == "error" and "permission denied for table relay_progress"
                                 in (s["last_error"] or "") else None)(status(conn)), 30,
                        "state error: no UPDATE on outbox.relay_progress")
        assert st["pid"] == pid, st
        assert pending_count(conn, agg) == len(held_s)
        query(conn, f"GRANT UPDATE ON outbox.relay_progress TO {RELAY_ROLE}")
        wait_until(lambda: pending_count(conn, agg) == 0, 60, "the held snapshot events published")
        counts = wait_counts(reader, {e: 1 for e, _, _ in held_s}, timeout=60, extra=0.5)
        assert {e for e, _, _ in held_s} <= set(counts), "snapshot events lost"
        figures["snapshot_copies"] = sum(counts[e] for e, _, _ in held_s)
        assert status(conn)["pid"] == pid
    finally:
        c = wait_until(lambda: pg_connect(env), 30, "a connection")
        query(c, "ALTER SYSTEM RESET outbox.relay_mode")
        query(c, "ALTER SYSTEM RESET outbox.retention")
        query(c, "ALTER SYSTEM RESET outbox.role")
        c.close()
        conn.close()
        pg_sh(env, "restart")
        wait_relay_ready(env)
        c = pg_connect(env)
        try:
            figures["reset_user"] = _relay_backend(c)
            drop_role(c, RELAY_ROLE)
        finally:
            c.close()
    assert [u for _, u in figures["reset_user"]] == [env.pg_user], \
        f"after RESET outbox.role and a restart the relay runs as {figures['reset_user']}"
    report(f"OUTBOX RELAY ROLE: missing role waited for ({figures['missing_role_exits']} worker exit(s)"
           f" in {WAIT_OBSERVE_S}s), connected as {RELAY_ROLE} {figures['connect_after_create_s']:.1f}s"
           f" after CREATE ROLE; REVOKE UPDATE: {figures['permission_errors']} ERROR lines in"
           f" {REVOKE_OBSERVE_S}s with {figures['revoked_commits']} commits, same worker, nothing lost;"
           f" after GRANT all delivered in {figures['recover_s']:.1f}s without a restart;"
           f" REVOKE DELETE: {figures['cleanup_warnings']} cleanup WARNING, publishing went on;"
           f" retention 0 without DELETE: nothing sent until GRANT DELETE; snapshot relay without"
           f" UPDATE on relay_progress: state error, after GRANT {len(held_s)} events arrived"
           f" ({figures['snapshot_copies']} copies)")
    assert not problems, "\n  ".join(["outbox.role:"] + problems)


# --------------------------------------------------------------------------- (e) search_path

PLANT = """
    CREATE TABLE public.{log} (what text, at timestamptz DEFAULT pg_catalog.clock_timestamp());
    GRANT INSERT, SELECT ON public.{log} TO PUBLIC;
    CREATE FUNCTION public.now() RETURNS timestamptz LANGUAGE sql
        AS $$ INSERT INTO public.{log} (what) VALUES ('now') RETURNING '1999-01-01'::timestamptz $$;
    CREATE FUNCTION public.clock_timestamp() RETURNS timestamptz LANGUAGE sql
        AS $$ INSERT INTO public.{log} (what) VALUES ('clock_timestamp') RETURNING '1999-01-01'::timestamptz $$;
    CREATE FUNCTION public.gen_random_uuid() RETURNS uuid LANGUAGE sql
        AS $$ INSERT INTO public.{log} (what) VALUES ('gen_random_uuid')
              RETURNING '00000000-0000-0000-0000-000000000001'::uuid $$;
    CREATE FUNCTION public.evil_eq_int8(bigint, bigint) RETURNS boolean LANGUAGE sql
        AS $$ INSERT INTO public.{log} (what) VALUES ('= bigint') RETURNING true $$;
    CREATE OPERATOR public.= (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = public.evil_eq_int8);
    CREATE FUNCTION public.evil_eq_text(text, text) RETURNS boolean LANGUAGE sql
        AS $$ INSERT INTO public.{log} (what) VALUES ('= text') RETURNING true $$;
    CREATE OPERATOR public.= (LEFTARG = text, RIGHTARG = text, FUNCTION = public.evil_eq_text);
    CREATE FUNCTION public.evil_le_ts(timestamptz, timestamptz) RETURNS boolean LANGUAGE sql
        AS $$ INSERT INTO public.{log} (what) VALUES ('<= timestamptz') RETURNING true $$;
    CREATE OPERATOR public.<= (LEFTARG = timestamptz, RIGHTARG = timestamptz, FUNCTION = public.evil_le_ts);
    CREATE FUNCTION public.evil_lt_ts(timestamptz, timestamptz) RETURNS boolean LANGUAGE sql
        AS $$ INSERT INTO public.{log} (what) VALUES ('< timestamptz') RETURNING true $$;
    CREATE OPERATOR public.< (LEFTARG = timestamptz, RIGHTARG = timestamptz, FUNCTION = public.evil_lt_ts);
    CREATE FUNCTION public.evil_gt_ts(timestamptz, timestamptz) RETURNS boolean LANGUAGE sql
        AS $$ INSERT INTO public.{log} (what) VALUES ('> timestamptz') RETURNING true $$;
    CREATE OPERATOR public.> (LEFTARG = timestamptz, RIGHTARG = timestamptz, FUNCTION = public.evil_gt_ts);
    CREATE FUNCTION public.unnest(bigint[]) RETURNS SETOF bigint LANGUAGE sql
        AS $$ INSERT INTO public.{log} (what) VALUES ('unnest') RETURNING 0::bigint $$;
    CREATE FUNCTION public.count() RETURNS bigint LANGUAGE sql
        AS $$ INSERT INTO public.{log} (what) VALUES ('count') RETURNING 0::bigint $$;
"""


def test_search_path_attack_on_relay(env, prefix, reader_factory):
    agg = new_aggregate_type("spath")
    topic = prefix + agg
    create_topics(env, [topic])
    reader = reader_factory([topic])
    attacker = unique("it_attacker")
    logt = f"attack_log_{attacker}"
    conn = pg_connect(env)          # opened before the database's search_path changes
    try:
        query(conn, f'CREATE ROLE "{attacker}"')
        query(conn, f'GRANT USAGE, CREATE ON SCHEMA public TO "{attacker}"')
        query(conn, f'SET ROLE "{attacker}"')
        query(conn, PLANT.format(log=logt))
        query(conn, "RESET ROLE")
        query(conn, f'ALTER DATABASE "{env.pg_database}" SET search_path = public, pg_catalog')
        query(conn, "ALTER SYSTEM SET outbox.retention = '1'")     # the cleanup runs too
        reload(conn)

        # the attack works on a session that does not pin its search_path (so this test can fail)
        probe = pg_connect(env)
        try:
            assert query_one(probe, "SHOW search_path")[0] == "public, pg_catalog"
            query(probe, "SELECT now()")
        finally:
            probe.close()
        assert query(conn, f"SELECT what FROM public.{logt}") == [("now",)]
        query(conn, f"TRUNCATE public.{logt}")

        # a new relay worker process, so that it connects with the database's search_path
        old = status(conn)["pid"]
        query(conn, "SELECT pg_terminate_backend(%s)", (old,))
        wait_until(lambda: (lambda r: r and r[0]["pid"] != old and r[0]["state"] in ("idle", "publishing"))(
            relay_status(conn)), 60, "a new relay worker")

        emitted = emit_many(conn, agg, ["p1", "p2", "p3"], 3, tag="spath")
        rows = event_rows(conn, agg)
        counts = wait_counts(reader, {e: 1 for e, _, _ in emitted}, timeout=60, extra=0.5)
        assert {e for e, _, _ in emitted} <= set(counts)
        wait_until(lambda: query_one(conn, "SELECT count(*) FROM outbox.events WHERE aggregate_type = %s",
                                     (agg,))[0] == 0, 30, "retention to delete the published rows")
        probs = []
        for m in unique_messages(reader.snapshot()):
            r = rows[m.event_id]
            probs += message_problems(m, event_id=m.event_id, aggregate_type=agg,
                                      aggregate_id=r["aggregate_id"], event_type=r["event_type"],
                                      payload=r["payload"], headers=None, topic=topic,
                                      created_ms=r["created_ms"])
        assert not probs, "\n".join(probs[:10])
        called = query(conn, f"SELECT what, count(*) FROM public.{logt} GROUP BY 1 ORDER BY 1")
        assert not called, f"objects planted in public were called: {called}"
        report(f"OUTBOX SEARCH_PATH: relay worker restarted with database search_path = public, pg_catalog"
               f" and 10 planted functions/operators: {len(emitted)} events delivered correctly and"
               f" deleted by retention, planted objects called 0 times")
    finally:
        query(conn, "RESET ROLE")
        query(conn, f'ALTER DATABASE "{env.pg_database}" RESET search_path')
        query(conn, "ALTER SYSTEM RESET outbox.retention")
        reload(conn)
        drop_role(conn, attacker)
        conn.close()


def test_relay_touches_only_the_extensions_own_table(env):
    """An outbox.events that is not the extension's member (here: taken out of it with ALTER
    EXTENSION ... DROP TABLE, as a database owner's look-alike in a database without the
    extension would be) is not relayed: the relay, a superuser, would otherwise run the triggers
    someone put on it or on outbox.relay_progress.  Back in the extension, the same events flow
    and the trigger fires: the control that the trap was armed."""
    from helpers_lifecycle import extra_cluster
    with extra_cluster(env, "sec-member", 29, database="postgres") as other:
        c = pg_connect(other)
        query(c, "CREATE EXTENSION outbox")
        wait_relay_ready(other)
        query(c, "CREATE TABLE public.fired (who text, superuser text, op text)")
        query(c, "CREATE FUNCTION public.note() RETURNS trigger LANGUAGE plpgsql AS $$"
                 " BEGIN INSERT INTO public.fired VALUES (current_user, current_setting('is_superuser'),"
                 " TG_TABLE_NAME || ' ' || TG_OP); RETURN NULL; END $$")
        query(c, "ALTER EXTENSION outbox DROP TABLE outbox.events")
        query(c, "CREATE TRIGGER trap AFTER UPDATE OR DELETE ON outbox.events"
                 " FOR EACH STATEMENT EXECUTE FUNCTION public.note()")
        query(c, "CREATE TRIGGER trap AFTER INSERT OR UPDATE ON outbox.relay_progress"
                 " FOR EACH STATEMENT EXECUTE FUNCTION public.note()")
        topic = topic_prefix(c) + "sec_member"
        create_topics(env, [topic])
        ids = [r[0] for r in query(c, "SELECT outbox.emit('sec_member', 'a', 'it.member', jsonb_build_object('n', g))"
                                      " FROM generate_series(1, 10) g")]
        wait_state(c, "waiting_for_extension", 30, "the relay to refuse the table the extension does not own")
        # it stays so over further passes of its loop (poll_interval 1 s)
        time.sleep(2)
        st = relay_status(c)[0]
        fired = query(c, "SELECT * FROM public.fired")
        pending = query_one(c, "SELECT count(*) FROM outbox.events e WHERE NOT outbox.published(e)")[0]
        assert st["state"] == "waiting_for_extension", st
        assert not fired, f"the relay fired a trigger on a table the extension does not own: {fired}"
        assert pending == len(ids), f"{len(ids) - pending} events relayed from a foreign table"

        query(c, "ALTER EXTENSION outbox ADD TABLE outbox.events")
        wait_until(lambda: query_one(c, "SELECT count(*) FROM outbox.events e"
                                        " WHERE NOT outbox.published(e)")[0] == 0, 60,
                   "the relay to publish once the table is the extension's again")
        wait_until(lambda: query_one(c, "SELECT count(*) FROM public.fired")[0] > 0, 30,
                   "the trigger to fire (the control)")
        report(f"OUTBOX SECURITY extension membership: a table outside the extension was not relayed"
               f" (state {st['state']}, 0 triggers fired, {pending} pending); back in the extension"
               f" it was, and the trigger fired: {query(c, 'SELECT DISTINCT * FROM public.fired')}")
        c.close()


def test_drop_extension_count_ignores_the_callers_operators(env):
    """DROP EXTENSION outbox counts the events it discards (lifecycle.c) in the caller's session,
    under the caller's search_path. Its operators were unqualified (issue 27, finding 4): with
    search_path = public, pg_catalog, a role that can create in public planted an operator that
    the superuser's DROP then ran, with the superuser's rights. Every operator is qualified now."""
    db = unique("it_dropcount")
    attacker = unique("it_attacker")
    logt = f"attack_log_{attacker}"
    conn = pg_connect(env)
    try:
        query(conn, f'CREATE DATABASE "{db}"')
        d = pg_connect(dataclasses.replace(env, pg_database=db))
        try:
            query(d, "CREATE EXTENSION outbox")
            query(d, "SELECT outbox.emit('it_dropcount', 'a', 'e', '{}')")
            query(d, f'CREATE ROLE "{attacker}"')
            query(d, f'GRANT USAGE, CREATE ON SCHEMA public TO "{attacker}"')
            query(d, f'SET ROLE "{attacker}"')
            query(d, PLANT.format(log=logt))
            for i, (op, typ) in enumerate(((">", "bigint"), ("<=", "bigint"), ("=", "xid8"), (">=", "xid8"))):
                name = f"evil_drop_count_{i}"
                query(d, f"CREATE FUNCTION public.{name}({typ}, {typ}) RETURNS boolean LANGUAGE sql"
                         f" AS $$ INSERT INTO public.{logt} (what) VALUES ('{op} {typ}') RETURNING true $$;"
                         f" CREATE OPERATOR public.{op} (LEFTARG = {typ}, RIGHTARG = {typ}, FUNCTION = public.{name})")
            query(d, "RESET ROLE")
            query(d, "SET search_path = public, pg_catalog")
            # the planted operators do work in this session (so this test can fail)
            assert query_one(d, "SELECT 1::bigint > 2::bigint")[0] is True
            query(d, f"TRUNCATE public.{logt}")
            query(d, "DROP EXTENSION outbox")
            warned = [n for n in d.notices if "DROP EXTENSION outbox discarded" in n]
            called = query(d, f"SELECT what, pg_catalog.count(*) FROM public.{logt} GROUP BY 1 ORDER BY 1")
        finally:
            d.close()
        assert not called, f"DROP EXTENSION ran operators the caller's search_path put first: {called}"
        assert any("discarded 1 event never published" in n for n in warned), warned
    finally:
        query(conn, f'DROP DATABASE IF EXISTS "{db}"')
        drop_role(conn, attacker)
        conn.close()


def test_librdkafka_errors_never_show_a_masked_value(env):
    """SHOW masks the value of a secret property, but librdkafka's own error text may quote it: a
    fresh user saw "could not create the Kafka producer: Failed to open ssl.keystore.location:
    /nonexistent/KSSECRET" in outbox.status.last_error (readable by pg_monitor) and in the log.
    Every librdkafka text is now scrubbed of the secret values before it is shown."""
    conn = pg_connect(env)
    secret = unique("KSSECRET")
    props = f"security.protocol=SSL;ssl.keystore.location=/nonexistent/{secret};ssl.keystore.password=pw-{secret}"
    log = Log(env)
    try:
        alter_system(conn, "outbox.kafka_properties", props)
        reload(conn)
        st = wait_state(conn, ("config_error", "broker_down"), 60, "the relay to refuse the keystore")
        assert st["last_error"], st
        assert "ssl.keystore.location" in st["last_error"], st      # the error is still useful
        shown = [t for t in (st["last_error"],) if secret in t]
        logged = [ln for ln in log.lines() if secret in ln]
        assert not shown, f"outbox.status.last_error shows the masked value: {shown}"
        assert not logged, f"the server log shows the masked value: {logged[:3]}"
    finally:
        alter_system(conn, "outbox.kafka_properties", None)
        reload(conn)
        wait_relay_ready(env)
        conn.close()
