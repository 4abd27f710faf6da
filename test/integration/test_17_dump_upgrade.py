"""
pg_dump / pg_restore and ALTER EXTENSION outbox UPDATE.

(a) pg_dump -Fc of the relay's database (main cluster) holding published and pending events,
    pg_restore into a fresh database of a throw-away cluster (env.pg_dir-restore, port +26)
    whose relay serves it: pending events keep their ids and are delivered, published ones are
    not sent again, and emit() works right after the restore (identity sequence restored).
(b) every ALTER EXTENSION UPDATE path (UPGRADE_PATHS) gives exactly the catalog of a fresh install
    (two scratch databases on the main cluster): objects, storage parameters, comments, privileges,
    initial privileges (pg_init_privs), dependencies, role dependencies.  The same comparison also
    runs over users' privileges that exist before CREATE EXTENSION (a schema outbox made first,
    default privileges): the fresh install must reset pg_init_privs as the update path does.
(c) The same update done under a running relay while events flow (throw-away cluster, port
    +27): same worker, every event delivered once, in order.
(d) A monitoring query of outbox.status that overlaps the update must neither fail nor make the
    update fail (no lock-order deadlock between the script and the view's readers).
(e) Users' grants survive pg_dump/pg_restore after ALTER EXTENSION UPDATE from 1.1 and after DROP
    and CREATE EXTENSION over the schema outbox the DROP left behind: scripts that GRANT/REVOKE on
    existing objects made PostgreSQL record the users' grants in pg_init_privs as the extension's
    own, so pg_dump left them out (and a role dropped later broke pg_restore).  Scratch databases
    and roles on the main cluster.
"""
import collections
import contextlib
import subprocess
import threading
import time
import uuid
from pathlib import Path

import psycopg2
import pytest

from conftest import (LogWatcher, create_topics, delivery_errors, emit_round_robin,
                      new_aggregate_type, order_problems, pg_connect, query, query_one,
                      relay_cpu_while_idle, relay_status, report, topic_prefix, unique_messages,
                      wait_relay_ready, wait_until)
from helpers_lifecycle import (PG_BINDIR, Emitter, connect_db, count_check, error_lines_of,
                               extra_cluster, id_counts, order_violations,
                               relay_exit_lines, relay_pids, server_crashes, set_system, timed)
from helpers_faults import wait_setting
from helpers_security import unique

RESTORE_DB = "outbox_restored"


def pg_tool(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([f"{PG_BINDIR}/{args[0]}", *args[1:]], capture_output=True, text=True,
                          timeout=timeout)


def test_dump_restore_keeps_pending_events(env, conn, prefix, reader_factory):
    agg_type = new_aggregate_type("dump")
    topic = prefix + agg_type
    dump_dir = Path(env.pg_dir + "-dump")
    with extra_cluster(env, "restore", 26, database=RESTORE_DB) as target:
        # pg.sh creates the database after the server started: the worker finds it within ~10 s;
        # meanwhile the source side is prepared
        create_topics(env, [topic])
        reader = reader_factory([topic])
        reader.settle_env = target      # the restored events come from that cluster's relay
        conn.autocommit = False
        published = emit_round_robin(conn, agg_type, 5, 4, "d")
        conn.autocommit = True
        count_check(id_counts(reader.read_until(len(published), timeout=30, extra=0)),
                    [e for e, _, _ in published], "events published before the dump")
        wait_until(lambda: query_one(conn, "SELECT count(*) FROM outbox.events WHERE aggregate_type = %s"
                                           " AND NOT outbox.published(events)", (agg_type,))[0] == 0,
                   20, "published_at on the source")
        try:
            set_system(conn, "outbox.bootstrap_servers", "")
            wait_until(lambda: relay_status(conn)[0]["state"] == "not_configured", 20, "relay idle")
            conn.autocommit = False
            pending = emit_round_robin(conn, agg_type, 5, 6, "d")
            conn.autocommit = True
            pending = [(e, a, s + 4) for e, a, s in pending]
            source = {r[0]: r[1:] for r in query(
                conn, "SELECT event_id::text, id, outbox.published(events) FROM outbox.events"
                      " WHERE aggregate_type = %s", (agg_type,))}
            source_seq = query_one(conn, "SELECT last_value FROM outbox.events_id_seq")[0]
            dump_dir.mkdir(exist_ok=True)
            dump_file = dump_dir / f"{uuid.uuid4().hex[:8]}.dump"
            t0 = time.monotonic()
            d = pg_tool("pg_dump", "-Fc", "-h", env.pg_host, "-p", str(env.pg_port), "-U", env.pg_user,
                        "-d", env.pg_database, "-f", str(dump_file))
            dump_s = time.monotonic() - t0
            assert d.returncode == 0, f"pg_dump failed ({d.returncode}):\n{d.stderr}"
        finally:
            # the pending events now belong to the restored copy: the source must not send them too
            query(conn, "DELETE FROM outbox.events WHERE aggregate_type = %s AND NOT outbox.published(events)",
                  (agg_type,))
            set_system(conn, "outbox.bootstrap_servers", None)
        toc = pg_tool("pg_restore", "-l", str(dump_file)).stdout
        assert "TABLE DATA outbox events" in toc and "SEQUENCE SET outbox events_id_seq" in toc, toc

        tc = pg_connect(target)
        wait_until(lambda: query_one(tc, "SELECT count(*) FROM pg_stat_activity WHERE backend_type ="
                                         " 'outbox relay' AND datname = %s", (RESTORE_DB,))[0] == 1,
                   30, f"the target's relay connected to {RESTORE_DB}")
        t0 = time.monotonic()
        r = pg_tool("pg_restore", "-h", target.pg_host, "-p", str(target.pg_port), "-U", target.pg_user,
                    "-d", RESTORE_DB, str(dump_file))
        restore_s = time.monotonic() - t0
        restore_errors = [ln for ln in r.stderr.splitlines() if "error" in ln.lower()]
        assert r.returncode == 0, f"pg_restore failed ({r.returncode}):\n{r.stderr}"

        # emit at once: the id sequence must be past the restored ids
        tconn = pg_connect(target, autocommit=False)
        more = emit_round_robin(tconn, agg_type, 5, 2, "d")
        tconn.autocommit = True
        more = [(e, a, s + 10) for e, a, s in more]
        restored = {row[0]: row[1:] for row in query(
            tconn, "SELECT event_id::text, id FROM outbox.events WHERE aggregate_type = %s", (agg_type,))}
        for eid, (sid, _) in source.items():
            assert restored.get(eid, (None,))[0] == sid, f"event {eid}: id {restored.get(eid)} after restore, {sid} before"
        new_ids = [restored[e][0] for e, _, _ in more]
        assert min(new_ids) > source_seq, (new_ids, source_seq)

        expected = {e: (a, s) for e, a, s in published + pending + more}
        raw = reader.read_until(len(expected), timeout=60, extra=3)
        counts = id_counts(raw)
        count_check(counts, list(expected), "published + pending + post-restore events")
        assert set(counts) == set(expected), sorted(set(counts) - set(expected))[:5]
        probs = order_problems(unique_messages(raw), expected)
        assert not probs, "per-aggregate order broken:\n  " + "\n  ".join(probs[:10])
        wait_until(lambda: query_one(tconn, "SELECT count(*) FROM outbox.events WHERE aggregate_type = %s"
                                            " AND NOT outbox.published(events)", (agg_type,))[0] == 0,
                   20, "the restored events marked published")
        st = relay_status(tconn)[0]
        assert st["database"] == RESTORE_DB and st["published"] >= len(pending) + len(more), st
        report(f"OUTBOX DUMP/RESTORE: pg_dump -Fc {dump_s:.2f}s ({dump_file.stat().st_size} bytes),"
               f" pg_restore {restore_s:.2f}s, {len(restore_errors)} error line(s);"
               f" {len(pending)} pending events kept their ids and were delivered once,"
               f" {len(published)} already published were not re-sent; {len(more)} emitted right"
               f" after the restore got ids {min(new_ids)}..{max(new_ids)} (sequence was at {source_seq})")
        tconn.close()
        tc.close()
    for f in dump_dir.glob("*.dump"):
        f.unlink()
    dump_dir.rmdir()


# --------------------------------------------------------------------------- catalog comparison

CATALOG_QUERIES = {
    "extension": """
        SELECT e.extname, e.extversion, e.extrelocatable, e.extnamespace::regnamespace::text,
               e.extowner::regrole::text,
               ARRAY(SELECT c::regclass::text FROM unnest(e.extconfig) WITH ORDINALITY AS u(c, o) ORDER BY o),
               e.extcondition
          FROM pg_extension e WHERE e.extname = 'outbox'""",
    "member": """
        SELECT pg_describe_object(d.classid, d.objid, d.objsubid)
          FROM pg_depend d JOIN pg_extension e ON d.refclassid = 'pg_extension'::regclass
                                             AND d.refobjid = e.oid
         WHERE e.extname = 'outbox' AND d.deptype = 'e'""",
    "schema": """
        SELECT n.nspname, n.nspowner::regrole::text, n.nspacl::text, obj_description(n.oid, 'pg_namespace')
          FROM pg_namespace n WHERE n.nspname = 'outbox'""",
    "relation": """
        SELECT c.relname, c.relkind, c.relpersistence, c.relowner::regrole::text, c.relacl::text,
               c.reloptions::text, c.relnatts, c.relchecks, c.relhasindex, c.relhasrules,
               c.relhastriggers, c.relrowsecurity, c.relforcerowsecurity, c.relreplident,
               c.relispartition, c.reloftype::regtype::text, c.relam::regclass::text,
               obj_description(c.oid, 'pg_class')
          FROM pg_class c WHERE c.relnamespace = 'outbox'::regnamespace""",
    "column": """
        SELECT c.relname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               pg_get_expr(ad.adbin, ad.adrelid), a.attidentity, a.attgenerated, a.attisdropped,
               a.attcollation::regcollation::text, a.attacl::text,
               -- this server build stamps attoptions with a pg_attver=<n> entry of its own
               ARRAY(SELECT o FROM unnest(a.attoptions) AS o WHERE o NOT LIKE 'pg_attver=%')::text,
               a.attstorage, a.attcompression, a.attstattarget, a.attislocal, a.attinhcount,
               col_description(c.oid, a.attnum)
          FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
          LEFT JOIN pg_attrdef ad ON ad.adrelid = a.attrelid AND ad.adnum = a.attnum
         WHERE c.relnamespace = 'outbox'::regnamespace AND a.attnum > 0""",
    "index": """
        SELECT ic.relname, pg_get_indexdef(i.indexrelid), i.indisunique, i.indisprimary,
               i.indisexclusion, i.indimmediate, i.indisclustered, i.indisvalid, i.indisready,
               i.indislive, i.indisreplident, i.indnullsnotdistinct
          FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid
         WHERE ic.relnamespace = 'outbox'::regnamespace""",
    "constraint": """
        SELECT co.conname, co.conrelid::regclass::text, co.contype, pg_get_constraintdef(co.oid),
               co.condeferrable, co.condeferred, co.convalidated, co.conindid::regclass::text,
               obj_description(co.oid, 'pg_constraint')
          FROM pg_constraint co WHERE co.connamespace = 'outbox'::regnamespace""",
    "sequence": """
        SELECT s.seqrelid::regclass::text, s.seqtypid::regtype::text, s.seqstart, s.seqincrement,
               s.seqmax, s.seqmin, s.seqcache, s.seqcycle,
               (SELECT pg_describe_object(d.refclassid, d.refobjid, d.refobjsubid) || ' ' || d.deptype::text
                  FROM pg_depend d WHERE d.classid = 'pg_class'::regclass AND d.objid = s.seqrelid
                   AND d.refclassid = 'pg_class'::regclass)
          FROM pg_sequence s JOIN pg_class c ON c.oid = s.seqrelid
         WHERE c.relnamespace = 'outbox'::regnamespace""",
    "function": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid), pg_get_function_arguments(p.oid),
               pg_get_function_result(p.oid), l.lanname, p.prokind, p.provolatile, p.proisstrict,
               p.prosecdef, p.proparallel, p.proleakproof, p.procost, p.prorows, p.proretset,
               p.prosrc, p.probin, p.proconfig::text, p.proacl::text, p.proowner::regrole::text,
               obj_description(p.oid, 'pg_proc')
          FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
         WHERE p.pronamespace = 'outbox'::regnamespace""",
    "view": """
        SELECT c.relname, pg_get_viewdef(c.oid, true), c.relacl::text
          FROM pg_class c WHERE c.relnamespace = 'outbox'::regnamespace AND c.relkind IN ('v', 'm')""",
    "type": """
        SELECT t.typname, t.typtype, t.typrelid::regclass::text, t.typowner::regrole::text,
               t.typacl::text, obj_description(t.oid, 'pg_type')
          FROM pg_type t WHERE t.typnamespace = 'outbox'::regnamespace""",
    "trigger/rule/policy": """
        SELECT 'trigger', tgname, tgrelid::regclass::text, pg_get_triggerdef(oid) FROM pg_trigger
         WHERE tgrelid IN (SELECT oid FROM pg_class WHERE relnamespace = 'outbox'::regnamespace)
        UNION ALL
        SELECT 'rule', rulename, ev_class::regclass::text, pg_get_ruledef(oid) FROM pg_rewrite
         WHERE ev_class IN (SELECT oid FROM pg_class WHERE relnamespace = 'outbox'::regnamespace)
        UNION ALL
        SELECT 'policy', polname, polrelid::regclass::text, NULL FROM pg_policy
         WHERE polrelid IN (SELECT oid FROM pg_class WHERE relnamespace = 'outbox'::regnamespace)""",
    "comment": """
        SELECT pg_describe_object(d.classoid, d.objoid, d.objsubid), d.description
          FROM pg_description d
         WHERE (pg_identify_object(d.classoid, d.objoid, d.objsubid)).schema = 'outbox'
            OR (d.classoid = 'pg_extension'::regclass
                AND d.objoid = (SELECT oid FROM pg_extension WHERE extname = 'outbox'))
            OR (d.classoid = 'pg_namespace'::regclass AND d.objoid = 'outbox'::regnamespace)""",
    "uncommented member": """
        SELECT pg_describe_object(d.classid, d.objid, d.objsubid)
          FROM pg_depend d JOIN pg_extension e ON d.refclassid = 'pg_extension'::regclass
                                             AND d.refobjid = e.oid
         WHERE e.extname = 'outbox' AND d.deptype = 'e'
           AND obj_description(d.objid, (SELECT relname FROM pg_class WHERE oid = d.classid)) IS NULL
        UNION ALL
        SELECT 'column ' || a.attname || ' of ' || c.relname
          FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
         WHERE c.relnamespace = 'outbox'::regnamespace AND c.relkind = 'r' AND a.attnum > 0
           AND NOT a.attisdropped AND col_description(c.oid, a.attnum) IS NULL""",
    # what pg_dump treats as the extension's own privileges (it dumps only changes to these)
    "initial privileges": """
        SELECT pg_describe_object(ip.classoid, ip.objoid, ip.objsubid), ip.privtype, ip.initprivs::text
          FROM pg_init_privs ip
         WHERE (ip.classoid, ip.objoid) IN
               (SELECT d.classid, d.objid
                  FROM pg_depend d JOIN pg_extension e ON d.refclassid = 'pg_extension'::regclass
                                                     AND d.refobjid = e.oid
                 WHERE e.extname = 'outbox' AND d.deptype = 'e')
            -- objects in the schema that are no members (the identity sequence), and schema outbox
            -- itself: no member either (DROP EXTENSION leaves it), but the scripts grant on it
            OR (pg_identify_object(ip.classoid, ip.objoid, ip.objsubid)).schema = 'outbox'
            OR (ip.classoid = 'pg_namespace'::regclass AND ip.objoid = 'outbox'::regnamespace)""",
    # every dependency of or on the objects in schema outbox and the extension (toast tables are
    # named after their OID)
    "dependency": """
        SELECT regexp_replace(pg_describe_object(d.classid, d.objid, d.objsubid), 'pg_toast_[0-9]+', 'pg_toast_N'),
               regexp_replace(pg_describe_object(d.refclassid, d.refobjid, d.refobjsubid),
                              'pg_toast_[0-9]+', 'pg_toast_N'),
               d.deptype
          FROM pg_depend d
         WHERE (pg_identify_object(d.classid, d.objid, d.objsubid)).schema = 'outbox'
            OR (pg_identify_object(d.refclassid, d.refobjid, d.refobjsubid)).schema = 'outbox'
            OR (d.classid = 'pg_namespace'::regclass AND d.objid = 'outbox'::regnamespace)
            OR (d.refclassid = 'pg_namespace'::regclass AND d.refobjid = 'outbox'::regnamespace)
            OR (d.classid = 'pg_extension'::regclass
                AND d.objid = (SELECT oid FROM pg_extension WHERE extname = 'outbox'))
            OR (d.refclassid = 'pg_extension'::regclass
                AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'outbox'))""",
    # the roles the objects depend on: owners, grantees, and (PostgreSQL 17 on) the roles named in
    # their pg_init_privs (deptype 'i'); pinned roles (the bootstrap superuser, pg_monitor) have none
    "role dependency": """
        SELECT pg_describe_object(s.classid, s.objid, s.objsubid), s.refobjid::regrole::text, s.deptype
          FROM pg_shdepend s
         WHERE s.dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND ((pg_identify_object(s.classid, s.objid, s.objsubid)).schema = 'outbox'
                OR (s.classid = 'pg_namespace'::regclass AND s.objid = 'outbox'::regnamespace)
                OR (s.classid = 'pg_extension'::regclass
                    AND s.objid = (SELECT oid FROM pg_extension WHERE extname = 'outbox')))"""
}


def test_data_only_restore_into_a_relayed_database_loses_nothing(env, prefix, reader_factory):
    """pg_restore --data-only into a database of the same cluster whose relay already ran: the
    restored events' xids are older than its progress, which never had them to send.  A user's
    try saw all 5 pending ones counted as published at once, never sent, then deleted by the
    retention.  Now each restored event is sent unless every progress row covers it."""
    agg_type = new_aggregate_type("dataonly")
    topic = prefix + agg_type
    dump_file = Path(env.pg_dir + "-dataonly.dump")
    with extra_cluster(env, "dataonly", 30, database="postgres") as other:
        c = wait_until(lambda: pg_connect(other), 30, "a connection")
        query(c, "CREATE DATABASE dataonly_src")
        create_topics(env, [topic])
        reader = reader_factory([topic])
        reader.settle_env = other       # its events come from that cluster's relay
        # the source is not relayed: its 5 events stay pending
        s = connect_db(other, "dataonly_src")
        query(s, "CREATE EXTENSION outbox")
        pending = [query_one(s, "SELECT outbox.emit(%s, 'p' || %s, 'it.pending', '{}', NULL, %s)::text",
                             (agg_type, i, topic))[0] for i in range(5)]
        s.close()
        # the target's relay publishes its own events after those, then they are purged (their ids
        # would collide with the restored ones)
        query(c, "CREATE EXTENSION outbox")
        wait_relay_ready(other)
        own = [query_one(c, "SELECT outbox.emit(%s, 'o' || %s, 'it.own', '{}', NULL, %s)::text",
                         (agg_type, i, topic))[0] for i in range(3)]
        wait_until(lambda: query_one(c, "SELECT count(*) FROM outbox.events e WHERE NOT outbox.published(e)")[0] == 0,
                   30, "the target's own events published")
        query(c, "SELECT outbox.purge('0')")
        d = pg_tool("pg_dump", "-Fc", "-h", other.pg_host, "-p", str(other.pg_port), "-U", other.pg_user,
                    "-d", "dataonly_src", "-f", str(dump_file))
        assert d.returncode == 0, d.stderr
        r = pg_tool("pg_restore", "--data-only", "--single-transaction", "-h", other.pg_host,
                    "-p", str(other.pg_port), "-U", other.pg_user, "-d", "postgres", str(dump_file))
        dump_file.unlink()
        assert r.returncode == 0, r.stderr
        got = {m.event_id for m in reader.read_until(len(own) + len(pending), timeout=30, extra=1)}
        missing = set(pending) - got
        report(f"OUTBOX RESTORE data-only into a relayed database of the same cluster: {len(pending)} restored"
               f" pending events, {len(pending) - len(missing)} arrived; the target's own {len(own)}"
               f" arrived {len(set(own) & got)}")
        assert not missing, f"{len(missing)} of {len(pending)} restored pending events never sent"
        c.close()

def test_data_only_restore_from_another_cluster_keeps_the_targets_pending_events(env, conn, prefix,
                                                                                 reader_factory):
    """pg_restore --data-only of another cluster's dump into a database whose own relay already
    ran: the restored progress row is another cluster's, and the conversion judged every event by
    it alone, the target's own pending events too (issue 27, finding 2). A busier source's
    snapshot covers every xid of a new cluster, so those events were marked published at once
    and never sent. The dump here holds only the main cluster's progress row, which is enough:
    the events it would bring convert the same way."""
    agg_type = new_aggregate_type("foreign")
    topic = prefix + agg_type
    dump_file = Path(env.pg_dir + "-foreign.dump")
    # the finding is the snapshot relay's: on the majors whose clusters run relay_mode = row
    # (test/run.sh), both clusters of this test switch to snapshot for it
    configured = query_one(conn, "SHOW outbox.relay_mode")[0]
    try:
        source_snapshot = snapshot_progress(env, conn, agg_type, topic)
        foreign_restore_check(env, agg_type, topic, dump_file, source_snapshot, reader_factory)
    finally:
        set_system(conn, "outbox.relay_mode", None)
        wait_setting(conn, "relay_mode", configured)


def snapshot_progress(env, conn, agg_type: str, topic: str) -> str:
    """The snapshot of this cluster's progress row, with relay_mode = snapshot: an event emitted
    after the switch makes the relay record one (row mode leaves the column NULL)."""
    set_system(conn, "outbox.relay_mode", "snapshot")
    wait_setting(conn, "relay_mode", "snapshot")
    create_topics(env, [topic])
    # a busier source: its snapshot must cover every xid the new cluster will use (a cluster
    # that ran only this test is as young as the other one)
    query(conn, "DO $$ BEGIN WHILE pg_current_xact_id()::text::bigint < 5000 LOOP COMMIT; END LOOP; END $$")

    def recorded():
        c = pg_connect(env)
        try:
            query_one(c, "SELECT outbox.emit(%s, 'src', 'it.src', '{}', NULL, %s)", (agg_type, topic))
            rows = query(c, "SELECT snapshot::text FROM outbox.relay_progress"
                            " WHERE pg_snapshot_xmin(snapshot)::text::bigint >= 5000")
            return rows[0] if rows else None
        finally:
            c.close()
    return wait_until(recorded, 60, "this cluster's relay to record a snapshot progress", interval=2)[0]


def foreign_restore_check(env, agg_type, topic, dump_file, source_snapshot, reader_factory):
    d = pg_tool("pg_dump", "-Fc", "--data-only", "-t", "outbox.relay_progress", "-h", env.pg_host,
                "-p", str(env.pg_port), "-U", env.pg_user, "-d", env.pg_database, "-f", str(dump_file))
    assert d.returncode == 0, d.stderr
    with extra_cluster(env, "foreign", 30, database="postgres") as other:
        c = wait_until(lambda: pg_connect(other), 30, "a connection")
        set_system(c, "outbox.relay_mode", "snapshot")
        wait_setting(c, "relay_mode", "snapshot")
        c.close()
        c = pg_connect(other)       # a session that has the setting for its emit()
        query(c, "CREATE EXTENSION outbox")
        wait_relay_ready(other)
        reader = reader_factory([topic])
        first = query_one(c, "SELECT outbox.emit(%s, 'f0', 'it.own', '{}', NULL, %s)::text", (agg_type, topic))[0]
        wait_until(lambda: query_one(c, "SELECT snapshot IS NOT NULL FROM outbox.relay_progress")[0]
                   and query_one(c, "SELECT count(*) FROM outbox.events e WHERE NOT outbox.published(e)")[0] == 0,
                   30, "the target's relay to publish its first event")
        query(c, "SELECT outbox.pause()")
        own = [query_one(c, "SELECT outbox.emit(%s, 'f' || %s, 'it.own', '{}', NULL, %s)::text",
                         (agg_type, i, topic))[0] for i in range(1, 6)]
        # without this the test could not fail: the source's snapshot must cover the target's xids
        assert query_one(c, "SELECT bool_and(pg_visible_in_snapshot(e.xid, %s::pg_snapshot))"
                            "  FROM outbox.events e WHERE e.event_id::text = ANY(%s)",
                         (source_snapshot, own))[0], "the source's snapshot does not cover the target's events"
        r = pg_tool("pg_restore", "--data-only", "-h", other.pg_host, "-p", str(other.pg_port),
                    "-U", other.pg_user, "-d", "postgres", str(dump_file))
        dump_file.unlink()
        assert r.returncode == 0, r.stderr
        assert query_one(c, "SELECT count(*) FROM outbox.relay_progress")[0] == 2
        query(c, "SELECT outbox.resume()")
        got = {m.event_id for m in reader.read_until(len(own) + 1, timeout=30, extra=1)}
        missing = set(own) - got
        report(f"OUTBOX RESTORE data-only from another cluster into a relayed database: {len(own)} of the"
               f" target's own pending events, {len(own) - len(missing)} arrived")
        assert not missing, f"{len(missing)} of {len(own)} of the target's own pending events never sent"
        assert first in got
        wait_until(lambda: query_one(c, "SELECT count(*) FROM outbox.events e WHERE NOT outbox.published(e)")[0] == 0,
                   30, "the target's events marked published")
        c.close()


def catalog_snapshot(conn) -> dict:
    return {k: sorted(tuple("NULL" if v is None else str(v) for v in row) for row in query(conn, sql))
            for k, sql in CATALOG_QUERIES.items()}


def catalog_differences(updated: dict, fresh: dict, version: str = "1.1") -> list:
    out = []
    for k in CATALOG_QUERIES:
        a, b = collections.Counter(updated[k]), collections.Counter(fresh[k])
        for row in sorted(a - b):
            out.append(f"{k}: only after UPDATE: {row}")
        for row in sorted(b - a):
            out.append(f"{k}: only in fresh {version}:  {row}")
    return out


# every upgrade path a user can take, ending at each version: the current one is the default
UPGRADE_PATHS = [("1.0", "1.1"), ("1.1", "1.2"), ("1.0", "1.2"), ("1.2", "1.3"), ("1.1", "1.3"), ("1.0", "1.3"),
                 ("1.3", "1.4"), ("1.2", "1.4"), ("1.1", "1.4"), ("1.0", "1.4"),
                 ("1.4", "1.5"), ("1.3", "1.5"), ("1.0", "1.5"),
                 ("1.5", "1.6"), ("1.4", "1.6"), ("1.3", "1.6"), ("1.0", "1.6"),
                 ("1.6", "1.7"), ("1.5", "1.7"), ("1.3", "1.7"), ("1.0", "1.7"),
                 ("1.7", "1.8"), ("1.6", "1.8"), ("1.4", "1.8"), ("1.3", "1.8"), ("1.0", "1.8"),
                 ("1.8", "1.9"), ("1.7", "1.9"), ("1.0", "1.9")]


@pytest.mark.parametrize("old,new", UPGRADE_PATHS, ids=[f"{a}-{b}" for a, b in UPGRADE_PATHS])
def test_update_matches_fresh_install(env, conn, old, new):
    tag = uuid.uuid4().hex[:8]
    upd_db, fresh_db = f"obx_upd_{tag}", f"obx_fresh_{tag}"
    opened = []
    try:
        for db in (upd_db, fresh_db):
            query(conn, f'CREATE DATABASE "{db}"')
        u = connect_db(env, upd_db)
        opened.append(u)
        f = connect_db(env, fresh_db)
        opened.append(f)
        query(u, f"CREATE EXTENSION outbox VERSION '{old}'")
        assert query_one(u, "SELECT extversion FROM pg_extension WHERE extname = 'outbox'")[0] == old
        v10_rows = len(catalog_snapshot(u)["member"])
        query(u, f"ALTER EXTENSION outbox UPDATE TO '{new}'")
        query(f, f"CREATE EXTENSION outbox VERSION '{new}'")
        a, b = catalog_snapshot(u), catalog_snapshot(f)
        # columns added by ALTER TABLE carry their default as a "missing value" (storage detail)
        missing = query(u, "SELECT attname FROM pg_attribute WHERE attrelid = 'outbox.events'::regclass"
                           " AND atthasmissing ORDER BY attnum")
    finally:
        for x in opened:
            x.close()
        for db in (upd_db, fresh_db):
            query(conn, f'DROP DATABASE IF EXISTS "{db}"')
    diffs = catalog_differences(a, b, new)
    print("\n".join(diffs))
    sizes = ", ".join(f"{k} {len(b[k])}" for k in CATALOG_QUERIES)
    report(f"OUTBOX UPGRADE catalog: {old} ({v10_rows} members) + ALTER EXTENSION UPDATE TO {new} vs fresh {new}"
           f" compared ({sizes} rows); {len(diffs)} difference(s); columns with a missing-value default"
           f" after the update (not compared, storage only): {[r[0] for r in missing]}; objects"
           f" without a comment (both): {[r[0] for r in b['uncommented member']]}")
    assert not diffs, f"{len(diffs)} catalog difference(s) between updated and fresh {new}:\n  " + "\n  ".join(diffs)


def test_update_while_the_relay_runs(env, reader_factory):
    agg_type = new_aggregate_type("upgrade")
    with extra_cluster(env, "upgrade", 27, database="postgres") as other:
        c = pg_connect(other)
        query(c, "CREATE EXTENSION outbox VERSION '1.0'")
        st = wait_relay_ready(other)
        pid = st["pid"]
        assert "delivery_errors" not in st, st       # the 1.0 status view
        topic = topic_prefix(c) + agg_type
        create_topics(env, [topic])
        reader = reader_factory([topic])
        reader.settle_env = other       # its events come from that cluster's relay
        watcher = LogWatcher(other)

        e = pg_connect(other, autocommit=False)
        first = emit_round_robin(e, agg_type, 6, 3, "u")
        e.close()
        count_check(id_counts(reader.read_until(len(first), timeout=30, extra=0)),
                    [x for x, _, _ in first], "events relayed with the 1.0 schema")
        # with nothing to send, a relay of the 1.0 schema sleeps (its every claim is empty)
        idle_cpu = relay_cpu_while_idle(c)
        assert idle_cpu < 1.0, f"an idle relay of the 1.0 schema used {idle_cpu:.2f} s of CPU in 5 s"

        em = Emitter(other, agg_type, 6, "u")
        # continue the seq numbers of first
        em.start()
        try:
            em.wait_count(150)
            em.phase = "updating"
            update_s = timed(query, c, "ALTER EXTENSION outbox UPDATE")    # to the current version
            em.phase = "after"
            em.wait_count(150, phase="after")
        finally:
            events = em.stop()
        assert query_one(c, "SELECT extversion FROM pg_extension WHERE extname = 'outbox'")[0] == \
            query_one(c, "SELECT default_version FROM pg_available_extensions WHERE name = 'outbox'")[0]
        assert em.errors == [], f"emit() failed during the update: {em.errors[:5]}"

        # first used seqs 1..3 of aggregates u-0..u-5, the emitter restarts at 1: offset them
        expected = {x: (a, s) for x, a, s in first}
        expected.update({x[0]: (x[1], x[2] + 3) for x in events})
        raw = reader.read_until(len(expected), timeout=60, extra=2)
        counts = id_counts(raw)
        count_check(counts, list(expected), "events around ALTER EXTENSION UPDATE")
        assert set(counts) == set(expected)
        probs = order_violations(raw, expected)
        assert not probs, "per-aggregate order broken:\n  " + "\n  ".join(probs[:10])

        st = relay_status(c)[0]
        assert st["pid"] == pid and relay_pids(c) == [pid], f"worker {pid} replaced: {st}"
        assert st["state"] in ("idle", "publishing") and delivery_errors(st) == 0, st
        wait_until(lambda: query_one(c, "SELECT count(*) FROM outbox.events WHERE NOT outbox.published(events)")[0] == 0,
                   20, "every event marked published")
        assert query_one(c, "SELECT count(*) FROM outbox.events WHERE failed_at IS NOT NULL"
                            " OR permanent_failures <> 0")[0] == 0
        lines = watcher.new_lines()
        errs = error_lines_of(lines, [pid])
        assert errs == [] and relay_exit_lines(lines) == [] and server_crashes(lines) == [], \
            "\n".join(lines[-40:])
        n_updating = sum(1 for x in events if x[3] == "updating")
        report(f"OUTBOX UPGRADE live: ALTER EXTENSION outbox UPDATE (1.0 -> current) took {update_s:.2f}s"
               f" with the relay running and events flowing; worker {pid} kept, {len(expected)} events"
               f" ({len(first)} before, {len(events)} around/after, {n_updating} committed during the"
               f" update) delivered once each, in order; 0 emit errors; idle with the 1.0 schema"
               f" it used {idle_cpu:.2f} s of CPU in 5 s")
        c.close()


def test_update_does_not_deadlock_with_status_readers(env, conn):
    """The update script locks outbox.events (ALTER TABLE) and later drops outbox.status; a reader
    of outbox.status locks the view first, then outbox.events.  Made deterministic by holding a
    lock on outbox.events so that the update waits before its ALTER TABLE while a status reader
    arrives; then the lock is released."""
    db = f"obx_updlock_{uuid.uuid4().hex[:8]}"
    opened = []
    results = {}

    def run(name, c, sql):
        try:
            results[name] = ("ok", query(c, sql))
        except psycopg2.Error as e:
            results[name] = ("error", f"{e.pgcode}: {str(e).strip()}")

    def waiting(pid):
        return query_one(conn, "SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT granted", (pid,))[0] > 0

    query(conn, f'CREATE DATABASE "{db}"')
    try:
        u, r, h = (connect_db(env, db) for _ in range(3))
        opened += [u, r, h]
        query(u, "CREATE EXTENSION outbox VERSION '1.0'")
        h.autocommit = False
        query(h, "LOCK TABLE outbox.events IN ACCESS SHARE MODE")     # e.g. a long report query
        ut = threading.Thread(target=run, args=("update", u, "ALTER EXTENSION outbox UPDATE"), daemon=True)
        ut.start()
        wait_until(lambda: waiting(u.get_backend_pid()), 10, "the update to wait for outbox.events")
        rt = threading.Thread(target=run, args=("status", r, "SELECT count(*) FROM outbox.status"), daemon=True)
        rt.start()
        wait_until(lambda: waiting(r.get_backend_pid()), 10, "the status reader to wait")
        h.commit()
        ut.join(30)
        rt.join(30)
        version = query_one(u, "SELECT extversion FROM pg_extension WHERE extname = 'outbox'")[0]
        current = query_one(u, "SELECT default_version FROM pg_available_extensions WHERE name = 'outbox'")[0]
    finally:
        for x in opened:
            x.close()
        query(conn, f'DROP DATABASE IF EXISTS "{db}"')
    report(f"OUTBOX UPGRADE vs status readers: update -> {results.get('update', ('running',))[0]},"
           f" concurrent SELECT FROM outbox.status -> {results.get('status', ('running',))[0]}"
           f" {results.get('status', ('', ''))[1] if results.get('status', ('',))[0] == 'error' else ''}")
    assert results.get("update", ("?",))[0] == "ok" and version == current, f"ALTER EXTENSION UPDATE: {results}"
    assert results.get("status", ("?",))[0] == "ok", \
        f"a reader of outbox.status failed while ALTER EXTENSION outbox UPDATE ran: {results['status'][1]}"


# --------------------------------------------------------------------------- users' grants

# every privilege on the objects in schema outbox and on the schema, one row per aclitem privilege
# (a NULL ACL counted as the default one): a set, so that the order of the items does not matter
ACL_SQL = """
    WITH obj(what, acl) AS (
        SELECT 'schema outbox', coalesce(n.nspacl, acldefault('n', n.nspowner))
          FROM pg_namespace n WHERE n.nspname = 'outbox'
        UNION ALL
        SELECT c.oid::regclass::text,
               coalesce(c.relacl, acldefault(CASE c.relkind WHEN 'S' THEN 's' ELSE 'r' END::"char", c.relowner))
          FROM pg_class c WHERE c.relnamespace = 'outbox'::regnamespace AND c.relkind IN ('r', 'v', 'S')
        UNION ALL
        SELECT a.attrelid::regclass::text || '.' || a.attname, a.attacl
          FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
         WHERE c.relnamespace = 'outbox'::regnamespace AND a.attacl IS NOT NULL
        UNION ALL
        SELECT p.oid::regprocedure::text, coalesce(p.proacl, acldefault('f', p.proowner))
          FROM pg_proc p WHERE p.pronamespace = 'outbox'::regnamespace)
    SELECT o.what, CASE x.grantee WHEN 0 THEN 'PUBLIC' ELSE x.grantee::regrole::text END,
           x.grantor::regrole::text, x.privilege_type, x.is_grantable
      FROM obj o, aclexplode(o.acl) x"""

# pg_init_privs items naming a role (by name, or the OID of a role dropped since)
INIT_PRIVS_ROLES_SQL = """
    SELECT DISTINCT pg_describe_object(ip.classoid, ip.objoid, ip.objsubid) || ': ' || ip.initprivs::text
      FROM pg_init_privs ip, aclexplode(ip.initprivs) x
     WHERE x.grantee = ANY (%s::oid[]) OR (x.grantee <> 0 AND NOT EXISTS
           (SELECT 1 FROM pg_roles r WHERE r.oid = x.grantee))"""


def acl_rows(c) -> list:
    return sorted(query(c, ACL_SQL))


def init_privs(c) -> list:
    return sorted(query(c, CATALOG_QUERIES["initial privileges"]))


def as_role_emit(c, role: str) -> str:
    """SET ROLE role; SELECT outbox.emit(...): '' if it worked, else the error."""
    try:
        query(c, f'SET ROLE "{role}"')
        query(c, "SELECT outbox.emit('obx_grants', '1', 'grants.checked', '{}')")
        return ""
    except psycopg2.Error as e:
        return f"{e.pgcode}: {str(e).strip().splitlines()[0]}"
    finally:
        query(c, "RESET ROLE")


def dump_restore(env, src_db: str, dst_db: str, dump_file: Path):
    """pg_dump -Fc src_db, pg_restore into dst_db (a new, empty database; ACLs included)."""
    t0 = time.monotonic()
    d = pg_tool("pg_dump", "-Fc", "-h", env.pg_host, "-p", str(env.pg_port), "-U", env.pg_user,
                "-d", src_db, "-f", str(dump_file))
    assert d.returncode == 0, f"pg_dump failed ({d.returncode}):\n{d.stderr}"
    r = pg_tool("pg_restore", "-h", env.pg_host, "-p", str(env.pg_port), "-U", env.pg_user,
                "-d", dst_db, str(dump_file))
    return r, time.monotonic() - t0


def grant_problems(src, dst, restore: subprocess.CompletedProcess, role_oids: list, checks: list,
                   app: str) -> list:
    """Everything that shows users' grants lost or mangled by the dump/restore."""
    out = []
    if restore.returncode != 0 or "error" in restore.stderr.lower():
        out.append(f"pg_restore exited {restore.returncode}: {restore.stderr.strip()}")
    a, b = acl_rows(src), acl_rows(dst)
    out += [f"privilege lost by dump/restore: {r}" for r in a if r not in b]
    out += [f"privilege added by dump/restore: {r}" for r in b if r not in a]
    for fn, args in checks:
        if not query_one(dst, f"SELECT {fn}({', '.join(['%s'] * len(args))})", args)[0]:
            out.append(f"restored: {fn}{args} is false")
    err = as_role_emit(dst, app)
    if err:
        out.append(f"restored: {app} cannot call outbox.emit(): {err}")
    out += [f"pg_init_privs names a user's role: {r[0]}" for r in query(src, INIT_PRIVS_ROLES_SQL, (role_oids,))]
    ia, ib = init_privs(src), init_privs(dst)       # dst: a fresh CREATE EXTENSION plus the dump's GRANTs
    out += [f"pg_init_privs only in the source: {r}" for r in ia if r not in ib]
    out += [f"pg_init_privs only in the fresh install: {r}" for r in ib if r not in ia]
    return out


@contextlib.contextmanager
def scratch(env, conn, tag: str, roles: tuple):
    """Two new databases (source, restore target) and new NOLOGIN roles, all dropped at the end."""
    t = uuid.uuid4().hex[:8]
    dbs = (f"obx_{tag}_{t}", f"obx_{tag}_restored_{t}")
    names = {r: unique(f"obx_{r}") for r in roles}
    opened = []
    try:
        for db in dbs:
            query(conn, f'CREATE DATABASE "{db}"')
        for name in names.values():
            query(conn, f'CREATE ROLE "{name}" NOLOGIN')
        for db in dbs:
            opened.append(connect_db(env, db))
        yield dbs, opened, names
    finally:
        for x in opened:
            x.close()
        for db in dbs:
            query(conn, f'DROP DATABASE IF EXISTS "{db}"')
        for name in names.values():
            query(conn, f'DROP ROLE IF EXISTS "{name}"')


def test_grants_survive_update_and_dump(env, conn, tmp_path):
    """1.1 + the README's grants + ALTER EXTENSION UPDATE, then pg_dump -Fc / pg_restore."""
    with scratch(env, conn, "grants", ("app", "ops", "relay", "gone")) as (dbs, (s, t), r):
        query(s, "CREATE EXTENSION outbox VERSION '1.1'")
        # the README's grants, as far as the objects exist in 1.1, a column grant and a role that
        # is dropped after the update
        query(s, f"""
            GRANT USAGE ON SCHEMA outbox TO "{r['app']}", "{r['ops']}", "{r['relay']}", "{r['gone']}";
            GRANT EXECUTE ON FUNCTION outbox.emit(text, text, text, jsonb, jsonb, text) TO "{r['app']}", "{r['gone']}";
            GRANT EXECUTE ON FUNCTION outbox.retry_failed(), outbox.retry_failed(uuid) TO "{r['ops']}";
            GRANT SELECT (id, failed_at) ON outbox.events TO "{r['ops']}";
            GRANT SELECT, UPDATE, DELETE ON outbox.events TO "{r['relay']}", "{r['gone']}";""")
        update_s = timed(query, s, "ALTER EXTENSION outbox UPDATE")
        version = query_one(s, "SELECT extversion FROM pg_extension WHERE extname = 'outbox'")[0]
        # what the README says to grant after the update (objects new in 1.2)
        query(s, f"""
            GRANT EXECUTE ON FUNCTION outbox.capture() TO "{r['app']}";
            GRANT EXECUTE ON FUNCTION outbox.pause(), outbox.resume(), outbox.replay(timestamptz),
                  outbox.replay(bigint, bigint), outbox.purge(interval) TO "{r['ops']}";
            GRANT SELECT ON outbox.relay TO "{r['relay']}";
            DROP OWNED BY "{r['gone']}";
            DROP ROLE "{r['gone']}";""")
        role_oids = [x[0] for x in query(s, "SELECT oid::bigint FROM pg_roles WHERE rolname = ANY (%s)",
                                         (list(r.values()),))]
        dump_file = tmp_path / "grants.dump"
        restore, dr_s = dump_restore(env, dbs[0], dbs[1], dump_file)
        emit_fn = "outbox.emit(text, text, text, jsonb, jsonb, text)"
        checks = [("has_schema_privilege", (r["app"], "outbox", "USAGE")),
                  ("has_function_privilege", (r["app"], emit_fn, "EXECUTE")),
                  ("has_function_privilege", (r["app"], "outbox.capture()", "EXECUTE")),
                  ("has_schema_privilege", (r["ops"], "outbox", "USAGE")),
                  ("has_function_privilege", (r["ops"], "outbox.retry_failed(uuid)", "EXECUTE")),
                  ("has_function_privilege", (r["ops"], "outbox.pause()", "EXECUTE")),
                  ("has_column_privilege", (r["ops"], "outbox.events", "failed_at", "SELECT")),
                  ("has_schema_privilege", (r["relay"], "outbox", "USAGE")),
                  ("has_table_privilege", (r["relay"], "outbox.events", "SELECT, UPDATE, DELETE")),
                  ("has_table_privilege", (r["relay"], "outbox.relay", "SELECT"))]
        probs = grant_problems(s, t, restore, role_oids, checks, r["app"])
        # least privilege is kept: the app role still cannot read the events
        if query_one(t, "SELECT has_table_privilege(%s, 'outbox.events', 'SELECT')", (r["app"],))[0]:
            probs.append(f"restored: {r['app']} can read outbox.events")
        dump_file.unlink()
    report(f"OUTBOX GRANTS after UPDATE: 1.1 + grants to 4 roles, ALTER EXTENSION UPDATE ({version},"
           f" {update_s:.3f}s), one role dropped, pg_dump -Fc + pg_restore {dr_s:.2f}s;"
           f" {len(probs)} problem(s)")
    assert not probs, f"{len(probs)} problem(s) with users' grants:\n  " + "\n  ".join(probs)


def test_grants_survive_drop_create_extension(env, conn, tmp_path):
    """DROP EXTENSION leaves schema outbox and its grants; CREATE EXTENSION again over it; dump/restore."""
    with scratch(env, conn, "regrant", ("app", "ops", "relay")) as (dbs, (s, t), r):
        query(s, "CREATE EXTENSION outbox")
        grants = f"""
            GRANT EXECUTE ON FUNCTION outbox.emit(text, text, text, jsonb, jsonb, text) TO "{r['app']}";
            GRANT EXECUTE ON FUNCTION outbox.pause(), outbox.resume() TO "{r['ops']}";
            GRANT SELECT, UPDATE, DELETE ON outbox.events TO "{r['relay']}";
            GRANT SELECT ON outbox.relay TO "{r['relay']}";"""
        query(s, f'GRANT USAGE ON SCHEMA outbox TO "{r["app"]}", "{r["relay"]}";' + grants)
        query(s, "DROP EXTENSION outbox")
        left = query(s, "SELECT nspacl::text FROM pg_namespace WHERE nspname = 'outbox'")
        assert left and r["app"] in left[0][0], f"schema outbox after DROP EXTENSION: {left}"
        query(s, f'GRANT USAGE ON SCHEMA outbox TO "{r["ops"]}"')
        query(s, "CREATE EXTENSION outbox")
        query(s, grants)                     # the objects are new: their grants are made again
        role_oids = [x[0] for x in query(s, "SELECT oid::bigint FROM pg_roles WHERE rolname = ANY (%s)",
                                         (list(r.values()),))]
        dump_file = tmp_path / "regrant.dump"
        restore, dr_s = dump_restore(env, dbs[0], dbs[1], dump_file)
        checks = [("has_schema_privilege", (r[x], "outbox", "USAGE")) for x in ("app", "ops", "relay")]
        checks += [("has_function_privilege", (r["app"], "outbox.emit(text, text, text, jsonb, jsonb, text)",
                                               "EXECUTE")),
                   ("has_function_privilege", (r["ops"], "outbox.resume()", "EXECUTE")),
                   ("has_table_privilege", (r["relay"], "outbox.events", "SELECT, UPDATE, DELETE"))]
        probs = grant_problems(s, t, restore, role_oids, checks, r["app"])
        dump_file.unlink()
    report(f"OUTBOX GRANTS after DROP/CREATE EXTENSION: schema outbox left with its grants, CREATE"
           f" EXTENSION over it, pg_dump -Fc + pg_restore {dr_s:.2f}s; {len(probs)} problem(s)")
    assert not probs, f"{len(probs)} problem(s) with users' grants:\n  " + "\n  ".join(probs)


# users' privileges that exist before CREATE EXTENSION: a schema outbox made first (pg_restore makes it
# before CREATE EXTENSION, DROP EXTENSION leaves it behind) with a user's grant, and the installing
# role's default privileges, which every new object gets
PRIOR_PRIVILEGES = {
    "schema made first": ['CREATE SCHEMA outbox', 'GRANT USAGE, CREATE ON SCHEMA outbox TO "{app}"'],
    "default privileges": ['ALTER DEFAULT PRIVILEGES GRANT EXECUTE ON FUNCTIONS TO "{app}"',
                           'ALTER DEFAULT PRIVILEGES GRANT SELECT, INSERT ON TABLES TO "{app}"',
                           'ALTER DEFAULT PRIVILEGES GRANT USAGE ON SEQUENCES TO "{app}"',
                           'ALTER DEFAULT PRIVILEGES GRANT USAGE ON SCHEMAS TO "{app}"'],
}


@pytest.mark.parametrize("prior", list(PRIOR_PRIVILEGES), ids=[p.replace(" ", "_") for p in PRIOR_PRIVILEGES])
def test_fresh_install_over_prior_grants_matches_update(env, conn, prior):
    """CREATE EXTENSION outbox over users' privileges gives the catalog of 1.0 + ALTER EXTENSION UPDATE
    over the same privileges, and neither names the user's role in pg_init_privs: the scripts' GRANTs
    and REVOKEs store whole ACLs there, users' items included, and both paths must reset them."""
    with scratch(env, conn, "prior", ("app",)) as ((upd_db, fresh_db), (u, f), r):
        for c in (u, f):
            for sql in PRIOR_PRIVILEGES[prior]:
                query(c, sql.format(app=r["app"]))
        query(u, "CREATE EXTENSION outbox VERSION '1.0'")
        query(u, "ALTER EXTENSION outbox UPDATE")
        query(f, "CREATE EXTENSION outbox")
        version = query_one(f, "SELECT extversion FROM pg_extension WHERE extname = 'outbox'")[0]
        a, b = catalog_snapshot(u), catalog_snapshot(f)
        role_oids = [x[0] for x in query(f, "SELECT oid::bigint FROM pg_roles WHERE rolname = %s", (r["app"],))]
        named = {db: [x[0] for x in query(c, INIT_PRIVS_ROLES_SQL, (role_oids,))]
                 for db, c in (("update", u), ("fresh", f))}
        app_acls = len([x for x in acl_rows(f) if x[1] == r["app"]])
    diffs = catalog_differences(a, b, version)
    diffs += [f"pg_init_privs after the {p} names {r['app']}: {x}" for p, rows in named.items() for x in rows]
    print("\n".join(diffs))
    report(f"OUTBOX FRESH vs UPDATE over {prior}: 1.0 + ALTER EXTENSION UPDATE vs fresh {version}"
           f" ({app_acls} privileges of the user's role on the fresh objects; initial privileges"
           f" {len(b['initial privileges'])}, role dependency {len(b['role dependency'])},"
           f" dependency {len(b['dependency'])} rows); {len(diffs)} difference(s)")
    assert not diffs, f"{len(diffs)} difference(s) over {prior}:\n  " + "\n  ".join(diffs)
