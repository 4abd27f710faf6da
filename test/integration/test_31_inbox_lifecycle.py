"""
The inbox over a database's life (issue 30, step 5):
- on a hot standby nothing is applied (no inbox worker); after promotion the inbox resumes from
  the offsets the standby replayed: every record applied exactly once across the two servers;
- pg_dump/pg_restore keeps subscriptions, offsets, seen ids and dead letters.  A restored copy in
  another database of the cluster, or in another cluster, applies nothing (state restored_copy)
  until outbox.resume_subscription() adopts it; then it applies from the restored offsets: the
  records after the dump, none before.

Throw-away clusters: primary +34 and standby +35; the restore cluster +33 (outbox.databases =
'*'); the other cluster of the restore is the test cluster.
"""
import dataclasses
import json
import subprocess
import uuid
from pathlib import Path

from conftest import LogWatcher, create_topics, pg_connect, pg_sh, query, query_one, wait_until
from helpers_inbox import (APP_ROLE, mail_handler, produce, relay_headers, setup_app_role, status,
                           subscribe)
from helpers_lifecycle import PG_BINDIR, connect_db, extra_cluster, other_cluster, set_system

TIMEOUT_S = 90


def records(*ns):
    return [("k", json.dumps({"n": n}).encode(), relay_headers(str(uuid.uuid4()))) for n in ns]


def ns(conn, table):
    return [r[0] for r in query(conn, f"SELECT (payload->>'n')::int FROM {table} ORDER BY id")]


def next_offset(conn, sub):
    rows = query(conn, "SELECT next_offset FROM outbox.inbox_offsets WHERE subscription = %s", (sub,))
    return rows[0][0] if rows else None


def inbox_workers(conn):
    return query(conn, "SELECT pid FROM pg_stat_activity WHERE backend_type = 'outbox inbox'")


def test_standby_applies_nothing_and_promotion_resumes_from_the_offsets(env):
    primary = other_cluster(env, "inbox-primary", 34, database="postgres")
    standby = other_cluster(env, "inbox-standby", 35, database="postgres")
    for c in (standby, primary):
        pg_sh(c, "reset", check=False)
    topic = f"it_inbox_sb_{uuid.uuid4().hex[:8]}"
    create_topics(env, [topic], partitions=1)
    try:
        pg_sh(primary, "start")
        pc = pg_connect(primary)
        query(pc, "CREATE EXTENSION outbox")
        setup_app_role(pc)
        mail_handler(pc, "it_mail_sb", "it_handle_sb")
        subscribe(pc, "it_sb", [topic], "it_handle_sb")
        produce(env, topic, records(0, 1, 2), partition=0)
        wait_until(lambda: next_offset(pc, "it_sb") == 3, TIMEOUT_S, "3 records on the primary")

        data = Path(standby.pg_dir) / "data"
        pg_sh(standby, "run", "mkdir", "-p", standby.pg_dir)
        pg_sh(primary, "run", f"{PG_BINDIR}/pg_basebackup", "-h", "127.0.0.1", "-p", str(primary.pg_port),
              "-U", "postgres", "-D", str(data), "-R", "-X", "stream", "-c", "fast")
        conf = data / "postgresql.conf"
        conf.write_text(conf.read_text() + "\n# --- standby (test_31) ---\n"
                        f"port = {standby.pg_port}\nunix_socket_directories = '{standby.pg_dir}'\n"
                        "hot_standby = on\n")
        pg_sh(standby, "start")
        sc = pg_connect(standby)
        assert query_one(sc, "SELECT pg_is_in_recovery()")[0] is True

        # the primary goes on applying, the standby replays it and applies nothing itself
        produce(env, topic, records(3, 4), partition=0)
        wait_until(lambda: next_offset(pc, "it_sb") == 5, TIMEOUT_S, "5 records on the primary")
        wait_until(lambda: next_offset(sc, "it_sb") == 5, TIMEOUT_S, "the standby to replay them")
        assert inbox_workers(sc) == [], "no inbox worker on a standby"
        assert {r["state"] for r in status(sc, "it_sb")} == {"not_running"}
        assert ns(sc, "it_mail_sb") == [0, 1, 2, 3, 4]
        pc.close()
        pg_sh(primary, "stop")

        produce(env, topic, records(5, 6, 7), partition=0)
        assert query_one(sc, "SELECT pg_promote()")[0] is True
        wait_until(lambda: next_offset(sc, "it_sb") == 8, TIMEOUT_S, "the promoted server to apply the rest")
        assert ns(sc, "it_mail_sb") == list(range(8)), "each record applied once across the two servers"
        assert len(inbox_workers(sc)) == 1
        sc.close()
    finally:
        for c in (standby, primary):
            pg_sh(c, "reset", check=False)


def test_dump_and_restore_keep_the_inbox_and_a_copy_waits_to_be_adopted(env, tmp_path):
    topic = f"it_inbox_dump_{uuid.uuid4().hex[:8]}"
    create_topics(env, [topic], partitions=1)
    with extra_cluster(env, "inbox-restore", 33, database="postgres") as other:
        admin = pg_connect(other)
        set_system(admin, "outbox.databases", "*")
        query(admin, "CREATE DATABASE it_shop")
        shop = connect_db(other, "it_shop")
        query(shop, "CREATE EXTENSION outbox")
        setup_app_role(shop)
        mail_handler(shop, "it_mail_dump", "it_handle_dump",
                     extra_sql="IF (e.payload->>'n')::int = 1 THEN RAISE EXCEPTION 'bad one'; END IF;")
        subscribe(shop, "it_dump", [topic], "it_handle_dump", on_failed_event="skip")
        produce(env, topic, records(0, 1, 2), partition=0)
        wait_until(lambda: next_offset(shop, "it_dump") == 3, TIMEOUT_S, "3 records settled")
        assert ns(shop, "it_mail_dump") == [0, 2]

        dump = Path(other.pg_dir) / "shop.dump"       # the cluster's owner writes it
        pg_sh(other, "run", f"{PG_BINDIR}/pg_dump", "-h", "127.0.0.1", "-p", str(other.pg_port), "-U", "postgres",
              "-Fc", "-f", str(dump), "it_shop")
        query(admin, "CREATE DATABASE it_shop_copy")
        pg_sh(other, "run", f"{PG_BINDIR}/pg_restore", "-h", "127.0.0.1", "-p", str(other.pg_port),
              "-U", "postgres", "-d", "it_shop_copy", "--exit-on-error", str(dump))
        copy = connect_db(other, "it_shop_copy")
        assert query(copy, "SELECT name, owner::text FROM outbox.subscriptions") == [("it_dump", APP_ROLE)]
        assert next_offset(copy, "it_dump") == 3
        assert query(copy, "SELECT (payload->>'n')::int, error FROM outbox.inbox_dead") == [(1, "bad one")]
        assert query_one(copy, "SELECT count(*) FROM outbox.inbox_seen WHERE subscription = 'it_dump'")[0] == 2
        st = status(copy, "it_dump")
        assert [r["state"] for r in st] == ["restored_copy"] and "resume_subscription" in st[0]["last_error"], st

        # the original goes on; the copy applies nothing
        produce(env, topic, records(3, 4), partition=0)
        wait_until(lambda: next_offset(shop, "it_dump") == 5, TIMEOUT_S, "the original to apply 3, 4")
        assert next_offset(copy, "it_dump") == 3 and ns(copy, "it_mail_dump") == [0, 2]

        # adopted: it applies from the restored offsets, nothing twice
        query(copy, "SELECT outbox.resume_subscription('it_dump')")
        wait_until(lambda: next_offset(copy, "it_dump") == 5, TIMEOUT_S, "the copy to apply 3, 4")
        assert ns(copy, "it_mail_dump") == [0, 2, 3, 4]
        assert [r["state"] for r in status(copy, "it_dump")] == ["running"]

        # in another cluster (the test cluster), the restored subscription is a copy too
        main = pg_connect(env)
        db = f"it_restored_{uuid.uuid4().hex[:6]}"
        try:
            query(main, f"CREATE DATABASE {db}")
            if not query(main, "SELECT 1 FROM pg_roles WHERE rolname = %s", (APP_ROLE,)):
                query(main, f"CREATE ROLE {APP_ROLE} LOGIN")
            subprocess.run([f"{PG_BINDIR}/pg_restore", "-h", "127.0.0.1", "-p", str(env.pg_port), "-U",
                            "postgres", "-d", db, "--exit-on-error", str(dump)], check=True,
                           capture_output=True, timeout=120)
            rc = connect_db(env, db)
            assert [r["state"] for r in status(rc, "it_dump")] == ["restored_copy"]
            rc.close()
        finally:
            query(main, f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
            main.close()
        # DROP EXTENSION ends the copy's inbox worker
        assert query(admin, "SELECT 1 FROM pg_stat_activity WHERE backend_type = 'outbox inbox'"
                            " AND datname = 'it_shop_copy'")
        query(copy, "DROP EXTENSION outbox CASCADE")
        wait_until(lambda: not query(admin, "SELECT 1 FROM pg_stat_activity WHERE backend_type = 'outbox inbox'"
                                            " AND datname = 'it_shop_copy'"), TIMEOUT_S,
                   "the copy's inbox worker to exit")
        for c in (shop, copy, admin):
            c.close()
