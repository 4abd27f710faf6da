"""
The library loaded without shared_preload_libraries: CREATE EXTENSION and emit() work (the
session's first event warns that it will not be published), and no relay worker starts (a second, throw-away cluster, so the main one keeps its worker).
"""
import dataclasses
from pathlib import Path

from conftest import pg_connect, pg_sh, query, query_one


def test_without_preload_emit_works_and_no_worker_starts(env):
    other = dataclasses.replace(env, pg_dir=env.pg_dir + "-nopreload", pg_port=env.pg_port + 7)
    pg_sh(other, "reset")
    try:
        pg_sh(other, "start")
        conf = Path(other.pg_dir) / "data" / "postgresql.conf"
        conf.write_text(conf.read_text().replace("shared_preload_libraries = 'outbox'",
                                                 "shared_preload_libraries = ''"))
        pg_sh(other, "restart")
        c = pg_connect(other)
        assert query_one(c, "SHOW shared_preload_libraries")[0] == ""
        query(c, "CREATE EXTENSION outbox")
        eid = query_one(c, "SELECT outbox.emit('order', '1', 'order.created', '{\"a\": 1}')")[0]
        assert eid
        # stored, and the first event of the session says it will not be published
        warned = [n for n in c.notices if "not in shared_preload_libraries" in n]
        assert len(warned) == 1 and warned[0].startswith("WARNING:"), c.notices
        query(c, "SELECT outbox.emit('order', '1b', 'order.created', NULL)")
        assert len([n for n in c.notices if "shared_preload_libraries" in n]) == 1, \
            f"warned more than once per session: {c.notices}"
        query(c, "DELETE FROM outbox.events WHERE aggregate_id = '1b'")
        assert query_one(c, "SELECT count(*) FROM outbox.events WHERE NOT outbox.published(events)")[0] == 1
        # the settings exist (the library defines them when loaded on demand)
        assert query_one(c, "SHOW outbox.topic_prefix")[0] == "outbox.event."
        assert query(c, "SELECT * FROM outbox.status") == []
        assert query_one(c, "SELECT count(*) FROM pg_stat_activity"
                            " WHERE backend_type = 'outbox relay'")[0] == 0
        query(c, "LOAD 'outbox'")
        assert query_one(c, "SELECT count(*) FROM pg_stat_activity"
                            " WHERE backend_type = 'outbox relay'")[0] == 0
        # a rolled-back emit leaves nothing, as with the worker
        c.autocommit = False
        with c.cursor() as cur:
            cur.execute("SELECT outbox.emit('order', '2', 'order.created', NULL)")
        c.rollback()
        c.autocommit = True
        assert query_one(c, "SELECT count(*) FROM outbox.events")[0] == 1
        c.close()
    finally:
        pg_sh(other, "reset", check=False)
