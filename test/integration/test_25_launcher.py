"""
The launcher and its per-database relays (issue 11, phase 1), on a throw-away cluster
(env.pg_dir-launcher, port env.pg_port+28; +29 for the slots test) with outbox.databases = '*':

- three databases with the extension: one relay each, every event of each arrives once;
- CREATE EXTENSION in a fourth database while the server runs: its relay starts and an event
  emitted right after the CREATE EXTENSION arrives within a few seconds;
- DROP DATABASE ... WITH (FORCE) of a relayed database returns quickly, no relay is started
  into it again, and the other databases keep publishing; a plain DROP DATABASE too;
- kill -9 of one relay, then of the launcher (each a crash restart of the server): every relay
  comes back, nothing lost;
- a reload of outbox.databases to a list stops the relays of the databases left out;
- outbox.max_workers smaller than the databases: one WARNING naming the unserved database,
  outbox.cluster_status() and its outbox.status say waiting_for_slot, and the postgres_exporter
  queries (sql/monitoring/postgres_exporter.yaml) and the README's alert query tell healthy,
  paused and unserved relays apart, run as a role that is only in pg_monitor.

The 1.x configuration (outbox.database only) is what every other test runs on.
"""
import dataclasses
import time
from decimal import Decimal
from pathlib import Path

from conftest import (LogWatcher, create_topics, emit, new_aggregate_type, pg_connect, pg_sh,
                      query, query_one, report, topic_prefix, unique_messages, wait_until)
from helpers_crash import kill9
from helpers_lifecycle import (connect_db, db_env, extra_cluster, relay_exit_lines, server_crashes,
                               set_system)

DBS = ["lx_a", "lx_b", "lx_c"]
LATE_DB = "lx_d"
PER_DB = 20                     # events per database and round
START_LIMIT_S = 5.0             # CREATE EXTENSION -> its event on Kafka
DROP_LIMIT_S = 3.0              # DROP DATABASE [WITH (FORCE)] of a relayed database
DELIVERY_TIMEOUT_S = 60


def relays_by_db(conn):
    """{datname: [pid, ...]} of the running relay workers."""
    out = {}
    for pid, db in query(conn, "SELECT pid, datname FROM pg_stat_activity"
                               " WHERE backend_type = 'outbox relay' ORDER BY pid"):
        out.setdefault(db, []).append(pid)
    return out


def relays_fresh(other):
    """relays_by_db over a new connection: after a kill -9 a connection made before the
    postmaster noticed the crash dies with it."""
    c = pg_connect(other)
    try:
        return relays_by_db(c), query_one(c, "SELECT count(*) FROM pg_stat_activity"
                                             " WHERE backend_type = 'outbox launcher'")[0]
    finally:
        c.close()


def all_back(other, dbs, old_pids):
    """Every database of dbs has exactly one relay, none of old_pids, and one launcher runs.  A
    relay that has not connected yet shows no database (None): not back yet."""
    by_db, launchers = relays_fresh(other)
    return (None not in by_db and sorted(by_db) == sorted(dbs) and all(len(p) == 1 for p in by_db.values())
            and not set(old_pids) & {p for ps in by_db.values() for p in ps} and launchers == 1)


def ready_in(other, db):
    """The relay of db is idle or publishing, per that database's outbox.status."""
    c = connect_db(other, db)
    try:
        rows = query(c, "SELECT database, state FROM outbox.status")
        return len(rows) == 1 and rows[0][0] == db and rows[0][1] in ("idle", "publishing")
    finally:
        c.close()


def emit_in(other, db, agg, n, tag):
    """n events in database db, one transaction; returns their event ids."""
    c = connect_db(other, db, autocommit=False)
    try:
        with c.cursor() as cur:
            ids = [emit(cur, agg, f"{db}-{i % 4}", "lx.event", {"db": db, "i": i, "tag": tag})
                   for i in range(n)]
        c.commit()
        return ids
    finally:
        c.close()


def received_ids(reader):
    return {m.event_id for m in unique_messages(reader.snapshot())}


def wait_received(reader, ids, timeout, what):
    ids = set(ids)

    def done():
        reader.poll(0.2)
        return ids <= received_ids(reader)
    wait_until(done, timeout, what, interval=0)


def test_launcher_relays_every_database(env, reader_factory):
    agg = new_aggregate_type("lx")
    figures = {}
    with extra_cluster(env, "launcher", 28, database="postgres") as other:
        c = pg_connect(other)
        for d in DBS:
            query(c, f"CREATE DATABASE {d}")
            dc = connect_db(other, d)
            query(dc, "CREATE EXTENSION outbox")
            dc.close()
        topic = topic_prefix(c) + agg
        create_topics(env, [topic])
        reader = reader_factory([topic])
        watcher = LogWatcher(other)
        set_system(c, "outbox.databases", "*")
        for d in DBS:
            wait_until(lambda: ready_in(other, d), 30, f"the relay of {d}")
        # postgres has no extension: its probe relay exits at once
        by_db = wait_until(lambda: (lambda r: r if sorted(r) == DBS else None)(relays_by_db(c)),
                           15, "one relay per database with the extension")
        assert all(len(p) == 1 for p in by_db.values()), by_db

        # every database publishes its events
        sent = {d: emit_in(other, d, agg, PER_DB, "round1") for d in DBS}
        wait_received(reader, [i for ids in sent.values() for i in ids], DELIVERY_TIMEOUT_S,
                      "round 1 from every database")

        # CREATE EXTENSION in a fourth database while the server runs
        query(c, f"CREATE DATABASE {LATE_DB}")
        lc = connect_db(other, LATE_DB)
        t0 = time.monotonic()
        query(lc, "CREATE EXTENSION outbox")
        late = emit_in(other, LATE_DB, agg, 1, "late")
        wait_received(reader, late, 30, f"the first event of {LATE_DB}")
        figures["create_extension_to_kafka_s"] = time.monotonic() - t0
        lc.close()
        sent[LATE_DB] = late
        assert figures["create_extension_to_kafka_s"] < START_LIMIT_S, figures

        # DROP DATABASE ... WITH (FORCE) of a relayed database returns quickly
        dropped = DBS[2]
        w_drop = LogWatcher(other)
        t0 = time.monotonic()
        query(c, f"DROP DATABASE {dropped} WITH (FORCE)")
        figures["drop_force_s"] = time.monotonic() - t0
        assert figures["drop_force_s"] < DROP_LIMIT_S, figures
        more = {d: emit_in(other, d, agg, PER_DB, "after_drop") for d in (DBS[0], DBS[1], LATE_DB)}
        wait_received(reader, [i for ids in more.values() for i in ids], DELIVERY_TIMEOUT_S,
                      "the other databases after the DROP")
        time.sleep(2)           # a relay started into the dropped database would show by now
        assert dropped not in relays_by_db(c), relays_by_db(c)
        restarted = [ln for ln in w_drop.new_lines()
                     if f'outbox relay started for database "{dropped}"' in ln]
        assert restarted == [], restarted

        # kill -9 of one relay: the server restarts every process, every relay comes back
        victim = relays_by_db(c)[DBS[0]][0]
        c.close()
        before_kill = {d: emit_in(other, d, agg, PER_DB, "before_kill")
                       for d in (DBS[0], DBS[1], LATE_DB)}
        old_pids = [p for ps in relays_fresh(other)[0].values() for p in ps]
        kill9(victim)
        t0 = time.monotonic()
        wait_until(lambda: all_back(other, [DBS[0], DBS[1], LATE_DB], old_pids), 60,
                   "every relay back after kill -9")
        figures["relays_back_after_kill_s"] = time.monotonic() - t0

        # kill -9 of the launcher: the same, and the relays it had are not doubled
        c = pg_connect(other)
        launcher = query_one(c, "SELECT pid FROM pg_stat_activity"
                                " WHERE backend_type = 'outbox launcher'")[0]
        old_pids = [p for ps in relays_by_db(c).values() for p in ps] + [launcher]
        c.close()
        kill9(launcher)
        t0 = time.monotonic()
        wait_until(lambda: all_back(other, [DBS[0], DBS[1], LATE_DB], old_pids), 60,
                   "a new launcher and every relay back after its kill -9")
        figures["relays_back_after_launcher_kill_s"] = time.monotonic() - t0
        c = pg_connect(other)
        after_kill = {d: emit_in(other, d, agg, PER_DB, "after_kill")
                      for d in (DBS[0], DBS[1], LATE_DB)}
        wait_received(reader, [i for x in (before_kill, after_kill) for ids in x.values()
                               for i in ids], DELIVERY_TIMEOUT_S, "every event around the kill")

        # a plain DROP DATABASE of a relayed database is not blocked either
        t0 = time.monotonic()
        query(c, f"DROP DATABASE {DBS[1]}")
        figures["drop_plain_s"] = time.monotonic() - t0
        assert figures["drop_plain_s"] < DROP_LIMIT_S, figures

        # reload to a list: the relay of the database left out stops
        set_system(c, "outbox.databases", DBS[0])
        wait_until(lambda: sorted(relays_by_db(c)) == [DBS[0]], 15,
                   "only the listed database's relay")
        last = emit_in(other, DBS[0], agg, PER_DB, "list")
        wait_received(reader, last, DELIVERY_TIMEOUT_S, "events of the listed database")

        lines = watcher.new_lines()
        all_sent = [i for x in (sent, more, before_kill, after_kill) for ids in x.values()
                    for i in ids] + last
        got = received_ids(reader)
        missing = set(all_sent) - got
        assert not missing, f"{len(missing)} of {len(all_sent)} events never arrived"
        crashes = server_crashes(lines)
        report(f"OUTBOX LAUNCHER: 4 databases under outbox.databases='*', {len(all_sent)} events"
               f" all received; CREATE EXTENSION -> first event on Kafka"
               f" {figures['create_extension_to_kafka_s']:.2f}s; DROP DATABASE WITH (FORCE)"
               f" {figures['drop_force_s']:.2f}s, plain DROP {figures['drop_plain_s']:.2f}s;"
               f" relays back {figures['relays_back_after_kill_s']:.1f}s after kill -9 of a relay,"
               f" {figures['relays_back_after_launcher_kill_s']:.1f}s after kill -9 of the launcher"
               f" ({len(crashes)} crash line(s)); relay exits logged {len(relay_exit_lines(lines))}")
        c.close()


def exporter_queries():
    """{name: (sql, master, [(column, usage)])} of sql/monitoring/postgres_exporter.yaml."""
    import yaml
    path = Path(__file__).resolve().parents[2] / "sql" / "monitoring" / "postgres_exporter.yaml"
    out = {}
    for name, q in yaml.safe_load(path.read_text()).items():
        cols = [(col, spec["usage"]) for m in q["metrics"] for col, spec in m.items()]
        out[name] = (q["query"], bool(q.get("master")), cols)
    return out


def run_exporter_query(conn, name, spec):
    """Run one exporter query as the caller of conn; check that it returns exactly the declared
    columns, labels as non-NULL text and counters and gauges as numbers.  Returns the rows as
    dicts."""
    sql, _, cols = spec
    with conn.cursor() as cur:
        cur.execute(sql)
        names = [d[0] for d in cur.description]
        rows = cur.fetchall()
    assert names == [c for c, _ in cols], (name, names, cols)
    for row in rows:
        for value, (col, usage) in zip(row, cols):
            if usage == "LABEL":
                assert isinstance(value, str), (name, col, row)
            else:
                assert usage in ("GAUGE", "COUNTER") and isinstance(value, (int, float, Decimal)) \
                    and not isinstance(value, bool), (name, col, usage, row)
    return [dict(zip(names, r)) for r in rows]


def readme_alert(conn):
    from test_20_capture_ops import readme_monitoring_query
    return query_one(conn, readme_monitoring_query())[0]


def test_max_workers_leaves_databases_unserved(env):
    """outbox.max_workers = 2, three listed databases: the third gets no relay, one WARNING names
    it, outbox.cluster_status() (as a pg_monitor-only role) and its own outbox.status say
    waiting_for_slot, and the postgres_exporter queries of sql/monitoring/ and the README's alert
    query tell healthy, paused and unserved relays apart."""
    with extra_cluster(env, "launcher-slots", 29, database="postgres") as other:
        c = pg_connect(other)
        for d in DBS:
            query(c, f"CREATE DATABASE {d}")
            dc = connect_db(other, d)
            query(dc, "CREATE EXTENSION outbox")
            dc.close()
        query(c, "CREATE ROLE lx_mon LOGIN IN ROLE pg_monitor")
        # outbox.max_workers needs a restart; the list leaves postgres (no extension) out
        query(c, "ALTER SYSTEM SET outbox.max_workers = 2")
        query(c, "ALTER SYSTEM SET outbox.databases = %s", (",".join(DBS),))
        c.close()
        watcher = LogWatcher(other)
        pg_sh(other, "restart")
        c = wait_until(lambda: pg_connect(other), 30, "a connection after the restart")
        wait_until(lambda: sorted(relays_by_db(c)) == DBS[:2], 30, "the first two relays")
        for d in DBS[:2]:
            wait_until(lambda: ready_in(other, d), 30, f"the relay of {d}")
        mon = {d: pg_connect(dataclasses.replace(db_env(other, d), pg_user="lx_mon")) for d in DBS}

        # cluster_status() from any database with the extension, as pg_monitor
        cs = query(mon[DBS[0]], "SELECT kind, database, pid, state, last_error"
                                " FROM outbox.cluster_status()")
        assert cs[0][0] == "launcher" and cs[0][1] is None and cs[0][2] and cs[0][3] == "running", cs
        relays = {r[1]: r for r in cs[1:]}
        assert sorted(relays) == DBS and all(r[0] == "relay" for r in cs[1:]), cs
        assert all(relays[d][2] and relays[d][3] in ("idle", "publishing") for d in DBS[:2]), cs
        unserved = relays[DBS[2]]
        assert unserved[2] is None and unserved[3] == "waiting_for_slot", unserved
        assert "outbox.max_workers (2)" in unserved[4], unserved

        # the unserved database's own status says so; its emit() still works
        own = query(mon[DBS[2]], "SELECT database, pid, state FROM outbox.status")
        assert own == [(DBS[2], None, "waiting_for_slot")], own
        emit_in(other, DBS[2], new_aggregate_type("lx"), 3, "unserved")

        # the exporter's queries: healthy, paused and unserved relays, and the backlog
        spec = exporter_queries()
        query(connect_db(other, DBS[1]), "SELECT outbox.pause()")
        wait_until(lambda: query_one(mon[DBS[1]], "SELECT state FROM outbox.status")[0] == "paused",
                   15, f"{DBS[1]} paused")
        metrics = {r["database"]: r for r in
                   run_exporter_query(mon[DBS[0]], "outbox_cluster", spec["outbox_cluster"])}
        assert metrics[""]["kind"] == "launcher" and metrics[""]["up"] == 1, metrics
        assert metrics[DBS[0]]["state"] in ("idle", "publishing") and metrics[DBS[0]]["up"] == 1, metrics
        assert metrics[DBS[1]]["state"] == "paused" and metrics[DBS[1]]["up"] == 1, metrics
        assert metrics[DBS[2]]["state"] == "waiting_for_slot" and metrics[DBS[2]]["up"] == 0, metrics
        backlog = run_exporter_query(mon[DBS[2]], "outbox_backlog", spec["outbox_backlog"])
        assert [(b["database"], b["pending"]) for b in backlog] == [(DBS[2], 3)], backlog
        assert backlog[0]["oldest_pending_age_seconds"] > 0, backlog

        # the README's alert query, run in each database
        alerts = {d: readme_alert(mon[d]) for d in DBS}
        assert alerts[DBS[0]] is None, alerts
        assert alerts[DBS[1]].startswith("relay paused"), alerts
        assert alerts[DBS[2]].startswith("relay waiting_for_slot: outbox.max_workers (2)"), alerts
        query(connect_db(other, DBS[1]), "SELECT outbox.resume()")

        lines = watcher.new_lines()
        warned = [ln for ln in lines if "database(s) have no relay" in ln]
        assert len(warned) == 1 and f'"{DBS[2]}"' in warned[0], warned
        assert sorted(relays_by_db(c)) == DBS[:2], relays_by_db(c)
        report(f"OUTBOX LAUNCHER slots: outbox.max_workers = 2, 3 databases: 2 relays, one WARNING"
               f" naming {DBS[2]}; cluster_status() as pg_monitor: launcher running, {DBS[2]}"
               f" waiting_for_slot ({unserved[4]!r}); exporter queries {sorted(spec)}:"
               f" states {sorted((d, m['state'], m['up']) for d, m in metrics.items())}, backlog of"
               f" {DBS[2]} pending {backlog[0]['pending']}; README alert: {alerts}")
        for m in mon.values():
            m.close()
        c.close()


def test_relay_refused_by_its_database_is_restarted_with_backoff(env):
    """A relay whose connection is refused (FATAL: no CONNECT privilege) is started again after
    1, 2, 4, ... s, not in a loop; GRANT CONNECT back and it runs."""
    observe_s = 12
    with extra_cluster(env, "launcher-backoff", 28, database="postgres") as other:
        c = pg_connect(other)
        query(c, f"CREATE DATABASE {DBS[0]}")
        query(c, "CREATE ROLE lx_relay LOGIN")
        query(c, f"REVOKE CONNECT ON DATABASE {DBS[0]} FROM PUBLIC")
        query(c, "ALTER SYSTEM SET outbox.role = 'lx_relay'")
        query(c, "ALTER SYSTEM SET outbox.databases = %s", (DBS[0],))
        c.close()
        watcher = LogWatcher(other)
        pg_sh(other, "restart")
        c = wait_until(lambda: pg_connect(other), 30, "a connection after the restart")
        time.sleep(observe_s)
        exits = relay_exit_lines(watcher.new_lines())
        # 1 + 2 + 4 s of delay fit into 12 s with the starts: 3 to 5 exits, not dozens
        assert 2 <= len(exits) <= 6, exits
        query(c, f"GRANT CONNECT ON DATABASE {DBS[0]} TO lx_relay")
        wait_until(lambda: relays_by_db(c).get(DBS[0]), 40, "the relay once it may connect")
        report(f"OUTBOX LAUNCHER backoff: a relay refused by its database exited {len(exits)} time(s)"
               f" in {observe_s}s (delays 1, 2, 4, ... s), then ran once CONNECT was granted")
        c.close()
