"""
The launcher and its per-database relays (issue 11, phase 1), on a throw-away cluster
(env.pg_dir-launcher, port env.pg_port+28; +29 for the slots test) with outbox.databases = '*':

- five databases with the extension, eight sessions emitting across them (one transaction in ten
  rolled back), and while they run: CREATE EXTENSION in a sixth database (its first event arrives
  within a few seconds), DROP DATABASE ... WITH (FORCE) of the fifth (returns quickly, no relay
  is started into it again, the other databases' arrivals do not stall), kill -9 of one relay,
  then of the launcher (each a crash restart of the server: every relay comes back, not
  doubled); every committed event of the databases that stay arrives, none rolled back does,
  per-aggregate order holds; then a plain DROP DATABASE;
- a reload of outbox.databases to a list stops the relays of the databases left out;
- RENAME, ALLOW_CONNECTIONS false/true, IS_TEMPLATE true/false of a relayed database and CREATE
  DATABASE ... TEMPLATE it: never held up, relays stop and start accordingly;
- outbox.max_workers smaller than the databases: one WARNING naming the unserved database,
  outbox.cluster_status() and its outbox.status say waiting_for_slot, and the postgres_exporter
  queries (sql/monitoring/postgres_exporter.yaml) and the alert query of doc/operations.md tell healthy,
  paused and unserved relays apart, run as a role that is only in pg_monitor;
- max_worker_processes short of the relays: every covered database gets its first relay before
  any gets a second, also in the order the workers start, and one left without a relay gets a
  worker from another database's extra relays within seconds.

The 1.x configuration (outbox.database only) is what every other test runs on.
"""
import dataclasses
import time
from decimal import Decimal
from pathlib import Path

import pytest

from conftest import (LogWatcher, create_topics, emit, new_aggregate_type, pg_connect, pg_sh,
                      query, query_one, report, topic_prefix, wait_until)
from helpers_crash import EmitLoad, LightReader, assert_delivered, delivery_check, kill9
from helpers_lifecycle import (connect_db, db_env, extra_cluster, relay_exit_lines, server_crashes,
                               set_system)

DBS = ["lx_a", "lx_b", "lx_c"]
MISSING_DB = "lx_missing"        # listed, never created
LOAD_DBS = ["lx_a", "lx_b", "lx_c", "lx_d", "lx_e"]
SESSIONS = [2, 2, 2, 1, 1]      # eight emitting sessions across LOAD_DBS
NEW_DB = "lx_f"                 # CREATE EXTENSION while the load runs
THINK_S = 0.01                  # per session between transactions: a load, not a benchmark
ROLLBACK_SHARE = 0.1
PER_DB = 20                     # events per database and round
# The limits are the product's own time scales, not guesses at this machine's speed (the measured
# figures are reported):
# - what waits for the launcher to notice a change by itself waits up to its nap
#   (LAUNCHER_NAP_MS in src/launcher.c): DROP DATABASE [WITH (FORCE)], RENAME and CREATE DATABASE
#   ... TEMPLATE of a relayed database must not, nor may the other databases' arrivals stall
#   that long around a DROP (their relays are not restarted either: checked by pid);
LAUNCHER_NAP_S = 10.0
DROP_LIMIT_S = LAUNCHER_NAP_S
DROP_UNDER_LOAD_LIMIT_S = LAUNCHER_NAP_S
STALL_LIMIT_S = LAUNCHER_NAP_S
# - a database the launcher found without the extension is probed again after ABSENT_REPROBE_MS
#   (src/launcher.h, 5 minutes): CREATE EXTENSION's hook must start its relay long before
ABSENT_REPROBE_S = 300.0
START_LIMIT_S = ABSENT_REPROBE_S / 5
NO_EXTENSION_LINE = 'outbox relay for database "{}" exits: the database has no extension outbox'
DELIVERY_TIMEOUT_S = 60


def relays_by_db(conn):
    """{datname: [pid, ...]} of the running relay workers."""
    out = {}
    for pid, db in query(conn, "SELECT pid, datname FROM pg_stat_activity"
                               " WHERE backend_type = 'outbox relay' ORDER BY pid"):
        out.setdefault(db, []).append(pid)
    return out


def relay_dbs(conn):
    """The databases of the running relays, sorted; a relay that has not connected yet shows as
    None (sorted last), so a comparison with a list of names waits for it."""
    return sorted(relays_by_db(conn), key=lambda d: (d is None, d or ""))


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


def relayed_databases(env, other, dbs, agg=None):
    """CREATE DATABASE and CREATE EXTENSION outbox for each of dbs in cluster other.  Returns a
    connection to its postgres database and, if agg is given, a LightReader assigned to the
    topic of that aggregate type (created first), else None."""
    c = pg_connect(other)
    for d in dbs:
        query(c, f"CREATE DATABASE {d}")
        dc = connect_db(other, d)
        query(dc, "CREATE EXTENSION outbox")
        dc.close()
    if agg is None:
        return c, None
    topic = topic_prefix(c) + agg
    create_topics(env, [topic])
    reader = LightReader(other, [topic])
    reader.wait_assigned()
    return c, reader


def create_probed_database(c, other, name):
    """CREATE DATABASE name, then wait until the launcher's probe relay (outbox.databases = '*')
    found no extension there: from then on only CREATE EXTENSION's hook (or ABSENT_REPROBE_MS)
    starts a relay in it.  The probe says so at DEBUG1: the database is created closed, given
    log_min_messages = debug1, then opened (which wakes the launcher)."""
    query(c, f"CREATE DATABASE {name} ALLOW_CONNECTIONS false")
    query(c, f"ALTER DATABASE {name} SET log_min_messages = 'debug1'")
    w = LogWatcher(other)
    query(c, f"ALTER DATABASE {name} ALLOW_CONNECTIONS true")
    wait_until(lambda: any(NO_EXTENSION_LINE.format(name) in ln for ln in w.new_lines()), 60,
               f"the launcher's probe to find no extension in {name}")
    query(c, f"ALTER DATABASE {name} RESET log_min_messages")


def longest_gap(times, start, end):
    """The longest time between consecutive arrivals (sorted times) that overlaps [start, end]."""
    gaps = [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end]
    return max(gaps, default=0.0)


def kill_and_wait(other, loads, victim, live, old_pids, what):
    """kill -9 victim (a crash restart of the whole server), then wait until every database of
    live has a new relay and one launcher runs and every load committed again.  Returns the
    seconds until the relays were back."""
    for load in loads.values():
        load.epoch += 1
    kill9(victim)
    t0 = time.monotonic()
    wait_until(lambda: all_back(other, live, old_pids), 60, f"every relay back after {what}")
    back = time.monotonic() - t0
    for d in live:
        loads[d].wait_progress(5, 60, f"{d}: every session after {what}")
    return back


def test_launcher_relays_every_database(env):
    """Five databases, eight sessions emitting across them (one transaction in ten rolled back)
    while: CREATE EXTENSION in a sixth, DROP DATABASE ... WITH (FORCE) of the fifth, kill -9 of a
    relay and of the launcher.  Every committed event of the databases that stay arrives, nothing
    rolled back does, per-aggregate order holds; then a plain DROP DATABASE and a reload to a
    list."""
    agg = new_aggregate_type("lx")
    figures = {}
    with extra_cluster(env, "launcher", 28, database="postgres") as other:
        c, reader = relayed_databases(env, other, LOAD_DBS, agg)
        watcher = LogWatcher(other)
        set_system(c, "outbox.databases", "*")
        for d in LOAD_DBS:
            wait_until(lambda: ready_in(other, d), 30, f"the relay of {d}")
        # postgres has no extension: its probe relay exits at once
        wait_until(lambda: relay_dbs(c) == LOAD_DBS, 15, "one relay per database with the extension")
        by_db = relays_by_db(c)
        assert all(len(p) == 1 for p in by_db.values()), by_db

        def load_for(d, sessions, seed):
            return EmitLoad(db_env(other, d), agg, sessions=sessions, aggregates=8 * sessions,
                            tag=d, seed=seed, think_s=THINK_S, rollback_share=ROLLBACK_SHARE)
        loads = {d: load_for(d, n, k) for k, (d, n) in enumerate(zip(LOAD_DBS, SESSIONS))}
        dropped = LOAD_DBS[-1]
        late = []
        try:
            for load in loads.values():
                load.start()
            for d in LOAD_DBS:
                loads[d].wait_progress(20, 60, f"{d}: every session")

            # CREATE EXTENSION in a sixth database under load: its first event arrives quickly.
            # The launcher probes the new database first and finds no extension (else its next
            # look could start the relay without the hook, and this step would test less)
            create_probed_database(c, other, NEW_DB)
            lc = connect_db(other, NEW_DB)
            t0 = time.monotonic()
            query(lc, "CREATE EXTENSION outbox")
            late = emit_in(other, NEW_DB, agg, 1, "late")
            assert not reader.wait_for(late, 30, extra=0), f"the first event of {NEW_DB}"
            figures["create_extension_to_kafka_s"] = time.monotonic() - t0
            lc.close()
            assert figures["create_extension_to_kafka_s"] < START_LIMIT_S, figures
            loads[NEW_DB] = load_for(NEW_DB, 1, len(LOAD_DBS))
            loads[NEW_DB].start()

            # DROP DATABASE ... WITH (FORCE) of a relayed database under load
            loads[dropped].stop()
            w_drop = LogWatcher(other)
            pids_before = relays_by_db(c)
            t0 = time.monotonic()
            query(c, f"DROP DATABASE {dropped} WITH (FORCE)")
            t1 = time.monotonic()
            figures["drop_force_s"] = t1 - t0
            assert figures["drop_force_s"] < DROP_UNDER_LOAD_LIMIT_S, figures
            live = LOAD_DBS[:-1] + [NEW_DB]
            for d in live:
                loads[d].wait_progress(20, 60, f"{d}: every session after the DROP")
            time.sleep(1)       # arrivals after the drop, and a relay started into it would show
            gaps = {d: longest_gap(reader.arrivals(set(loads[d].snapshot()[0])), t0, t1 + 0.5)
                    for d in LOAD_DBS[:-1]}
            figures["stall_s"] = max(gaps.values())
            assert figures["stall_s"] < STALL_LIMIT_S, gaps
            pids_after = relays_by_db(c)
            restarted_others = {d: (pids_before.get(d), pids_after.get(d)) for d in LOAD_DBS[:-1]
                                if pids_before.get(d) != pids_after.get(d)}
            assert not restarted_others, f"DROP DATABASE {dropped} restarted other relays: {restarted_others}"
            assert dropped not in relays_by_db(c), relays_by_db(c)
            restarted = [ln for ln in w_drop.new_lines()
                         if f'outbox relay started for database "{dropped}"' in ln]
            assert restarted == [], restarted

            # kill -9 of one relay, then of the launcher: every relay comes back, not doubled
            victim = relays_by_db(c)[LOAD_DBS[0]][0]
            c.close()
            old_pids = [p for ps in relays_fresh(other)[0].values() for p in ps]
            figures["back_after_relay_kill_s"] = kill_and_wait(other, loads, victim, live, old_pids,
                                                               "kill -9 of a relay")
            c = pg_connect(other)
            launcher = query_one(c, "SELECT pid FROM pg_stat_activity"
                                    " WHERE backend_type = 'outbox launcher'")[0]
            old_pids = [p for ps in relays_by_db(c).values() for p in ps] + [launcher]
            c.close()
            figures["back_after_launcher_kill_s"] = kill_and_wait(
                other, loads, launcher, live, old_pids, "kill -9 of the launcher")
        finally:
            for load in loads.values():
                load.stop()

        # every committed event of the databases that stayed arrives once in order, nothing rolled
        # back arrives; events of the dropped database and unknown outcomes may arrive
        present, absent, maybe = {}, set(), {}
        for d, load in loads.items():
            committed, unknown = load.snapshot()
            absent |= load.rolled_back
            (maybe if d == dropped else present).update(committed)
            maybe.update({e: v[:2] for e, v in unknown.items()})
        missing = reader.wait_for(present, DELIVERY_TIMEOUT_S, extra=2)
        assert not missing, f"{len(missing)} of {len(present)} committed events never arrived"
        arrived = reader.received_ids()
        present.update({e: v for e, v in maybe.items() if e in arrived})
        check = delivery_check([r for r in reader.snapshot() if r[4] not in late], present, absent)
        assert_delivered(check, "five databases under load")

        # a plain DROP DATABASE of a relayed database is not blocked either
        c = pg_connect(other)
        t0 = time.monotonic()
        query(c, f"DROP DATABASE {LOAD_DBS[1]}")
        figures["drop_plain_s"] = time.monotonic() - t0
        assert figures["drop_plain_s"] < DROP_LIMIT_S, figures

        # reload to a list: the relays of the databases left out stop
        set_system(c, "outbox.databases", LOAD_DBS[0])
        wait_until(lambda: relay_dbs(c) == [LOAD_DBS[0]], 15,
                   "only the listed database's relay")
        last = emit_in(other, LOAD_DBS[0], agg, PER_DB, "list")
        assert not reader.wait_for(last, DELIVERY_TIMEOUT_S, extra=0), "events of the listed database"
        reader.close()

        # ' * ' is '*' (a user's try saw it refused: '"*" must be the only item'), and relays
        # come back for every database with the extension
        set_system(c, "outbox.databases", " * ")
        wait_until(lambda: len(relay_dbs(c)) > 1, 15, "every database's relay again after ' * '")
        shown = query_one(c, "SHOW outbox.databases")[0]
        assert shown == "*", shown

        crashes = server_crashes(watcher.new_lines())
        report(f"OUTBOX LAUNCHER under load: 5 databases, {sum(SESSIONS)} sessions (+1 in {NEW_DB}),"
               f" {len(present)} committed events arrived (of them {len(maybe)} of uncertain outcome"
               f" or of the dropped {dropped} counted only if they arrived), {len(absent)} rolled back"
               f" never arrived, {check.reorderings} reorderings, {check.duplicates} duplicates"
               f" ({len(crashes)} crash line(s) from the two kill -9); CREATE EXTENSION -> first"
               f" event on Kafka {figures['create_extension_to_kafka_s']:.2f}s; DROP DATABASE WITH"
               f" (FORCE) {figures['drop_force_s']:.2f}s, longest gap in another database's"
               f" arrivals around it {figures['stall_s']:.2f}s; plain DROP"
               f" {figures['drop_plain_s']:.2f}s; relays back"
               f" {figures['back_after_relay_kill_s']:.1f}s after kill -9 of a relay,"
               f" {figures['back_after_launcher_kill_s']:.1f}s after kill -9 of the launcher")
        c.close()


def test_rename_close_template_and_copy_of_relayed_databases(env):
    """With outbox.databases = '*': ALTER DATABASE ... RENAME of a relayed database is not held up
    by its relay, which comes back under the new name; ALLOW_CONNECTIONS false and IS_TEMPLATE
    true stop its relay, and their reverse start it again; CREATE DATABASE ... TEMPLATE a relayed
    database succeeds at once, and the copy gets a relay of its own.  After each step an event
    emitted there arrives.  default_transaction_read_only set for a relayed database does not
    bind its relay; a database without the extension gets a waiting relay once listed, also if
    '*' probed it before."""
    a, b, b2, copy = "lr_a", "lr_b", "lr_b2", "lr_copy"
    agg = new_aggregate_type("lr")
    figures = {}
    with extra_cluster(env, "launcher-rename", 29, database="postgres") as other:
        c, reader = relayed_databases(env, other, [a, b], agg)
        set_system(c, "outbox.databases", "*")

        def served(dbs, what):
            t0 = time.monotonic()
            wait_until(lambda: relay_dbs(c) == sorted(dbs), 30, what)
            for d in dbs:
                wait_until(lambda: ready_in(other, d), 30, f"the relay of {d} ready ({what})")
            ids = [i for d in dbs for i in emit_in(other, d, agg, 2, what)]
            assert not reader.wait_for(ids, DELIVERY_TIMEOUT_S, extra=0), f"events after: {what}"
            return time.monotonic() - t0

        served([a, b], "both relayed")
        t0 = time.monotonic()
        query(c, f"ALTER DATABASE {b} RENAME TO {b2}")
        figures["rename_s"] = time.monotonic() - t0
        assert figures["rename_s"] < DROP_LIMIT_S, figures
        figures["renamed_served_s"] = served([a, b2], "after RENAME")

        query(c, f"ALTER DATABASE {b2} ALLOW_CONNECTIONS false")
        wait_until(lambda: relay_dbs(c) == [a], 30, "no relay in a closed database")
        query(c, f"ALTER DATABASE {b2} ALLOW_CONNECTIONS true")
        figures["reopened_served_s"] = served([a, b2], "after ALLOW_CONNECTIONS true")

        query(c, f"ALTER DATABASE {b2} IS_TEMPLATE true")
        wait_until(lambda: relay_dbs(c) == [a], 30, "no relay in a template")
        # emit() there warns that no relay publishes it (a user's try: silent under '*')
        tc = connect_db(other, b2, autocommit=False)
        query(tc, "SELECT outbox.emit('lr_tmpl', 't', 'lr.event', '{}')")
        tc.rollback()           # nothing left behind to publish later
        warned = [n for n in tc.notices if "are not published" in n and "template" in n]
        tc.close()
        assert warned, "no WARNING from emit() in a template database"
        query(c, f"ALTER DATABASE {b2} IS_TEMPLATE false")
        query(c, f"ALTER DATABASE {b2} IS_TEMPLATE false")
        served([a, b2], "after IS_TEMPLATE false")

        t0 = time.monotonic()
        query(c, f"CREATE DATABASE {copy} TEMPLATE {a}")
        figures["copy_s"] = time.monotonic() - t0
        assert figures["copy_s"] < DROP_LIMIT_S, figures
        figures["copy_served_s"] = served([a, b2, copy], "after CREATE DATABASE ... TEMPLATE")

        # default_transaction_read_only set for a database is for its clients, not its relay:
        # once made read-only, the relay recorded nothing and sent the same batch at every retry
        query(c, f"ALTER DATABASE {a} SET default_transaction_read_only = on")
        old = relays_by_db(c)[a][0]
        query(c, "SELECT pg_terminate_backend(%s)", (old,))
        wait_until(lambda: relays_by_db(c).get(a, [old])[0] != old, 30, "a new relay for the read-only database")
        wait_until(lambda: ready_in(other, a), 30, "the new relay ready")
        rc = connect_db(other, a)
        query(rc, "SET default_transaction_read_only = off")
        with rc.cursor() as cur:
            ro_id = emit(cur, agg, "ro", "lr.event", {"read_only": True})
        rc.close()
        assert not reader.wait_for([ro_id], DELIVERY_TIMEOUT_S, extra=3), "the event of the read-only database"
        copies = sum(1 for r in reader.snapshot() if r[4] == ro_id)
        state = query_one(connect_db(other, a), "SELECT state, last_error FROM outbox.status")
        assert copies == 1 and state[0] in ("idle", "publishing"), (copies, state)
        query(c, f"ALTER DATABASE {a} RESET default_transaction_read_only")

        # '*' probed a database without the extension; listed, it gets a relay that waits for it
        # the probe has found no extension (else this step tests less)
        create_probed_database(c, other, "lr_noext")
        set_system(c, "outbox.databases", f"{a}, {b2}, {copy}, lr_noext")
        wait_until(lambda: "lr_noext" in relays_by_db(c), 15, "a relay waiting in the listed database")
        nc = connect_db(other, "lr_noext")
        query(nc, "CREATE EXTENSION outbox")
        nc.close()
        served([a, b2, copy, "lr_noext"], "after CREATE EXTENSION in the listed database")
        reader.close()
        report(f"OUTBOX LAUNCHER lifecycle ('*'): RENAME of a relayed database {figures['rename_s']:.2f}s,"
               f" relay back under the new name and an event delivered {figures['renamed_served_s']:.2f}s"
               f" later; ALLOW_CONNECTIONS false/IS_TEMPLATE true stopped the relay, their reverse"
               f" started it again (served {figures['reopened_served_s']:.2f}s after reopening);"
               f" CREATE DATABASE ... TEMPLATE a relayed database {figures['copy_s']:.2f}s, the copy"
               f" served {figures['copy_served_s']:.2f}s later; read-only database: its event arrived"
               f" {copies} time(s), relay {state[0]}; a listed database the '*' probe had found"
               f" without the extension got a waiting relay")
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


def documented_alert(conn):
    from test_20_capture_ops import documented_alert_query
    return query_one(conn, documented_alert_query())[0]


def test_max_workers_leaves_databases_unserved(env):
    """outbox.max_workers = 2, three listed databases: the third gets no relay, one WARNING names
    it, outbox.cluster_status() (as a pg_monitor-only role) and its own outbox.status say
    waiting_for_slot, and the postgres_exporter queries of sql/monitoring/ and the documented alert
    query tell healthy, paused and unserved relays apart."""
    with extra_cluster(env, "launcher-slots", 29, database="postgres") as other:
        c, _ = relayed_databases(env, other, DBS)
        query(c, "CREATE ROLE lx_mon LOGIN IN ROLE pg_monitor")
        # outbox.max_workers needs a restart; the list leaves postgres (no extension) out
        query(c, "ALTER SYSTEM SET outbox.max_workers = 2")
        # a listed database that does not exist comes first: it must not keep a relay's slot
        query(c, "ALTER SYSTEM SET outbox.databases = %s", (",".join([MISSING_DB] + DBS),))
        c.close()
        watcher = LogWatcher(other)
        pg_sh(other, "restart")
        c = wait_until(lambda: pg_connect(other), 30, "a connection after the restart")
        wait_until(lambda: relay_dbs(c) == DBS[:2], 30, "the first two relays")
        for d in DBS[:2]:
            wait_until(lambda: ready_in(other, d), 30, f"the relay of {d}")
        mon = {d: pg_connect(dataclasses.replace(db_env(other, d), pg_user="lx_mon")) for d in DBS}

        # cluster_status() from any database with the extension, as pg_monitor; the missing
        # database's row moves from a slot to the list of databases without one within a pass
        cs = wait_until(lambda: (lambda r: r if any(x[1] == MISSING_DB and x[2] is None for x in r)
                                 else None)(query(mon[DBS[0]], "SELECT kind, database, pid, state,"
                                                  " last_error FROM outbox.cluster_status()")),
                        15, "the missing database listed without a slot")
        assert cs[0][0] == "launcher" and cs[0][1] is None and cs[0][2] and cs[0][3] == "running", cs
        relays = {r[1]: r for r in cs[1:]}
        assert sorted(relays) == sorted(DBS + [MISSING_DB]) and all(r[0] == "relay" for r in cs[1:]), cs
        missing = relays[MISSING_DB]
        assert missing[2] is None and missing[3] == "waiting_for_database", missing
        assert f'"{MISSING_DB}" does not exist' in missing[4], missing
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
        states = run_exporter_query(mon[DBS[0]], "outbox_cluster_state", spec["outbox_cluster_state"])
        assert all(r["current"] == 1 for r in states), states
        assert "state" not in metrics[""], "state must not be a label of the counters"
        for r in states:
            metrics[r["database"]]["state"] = r["state"]
        assert metrics[""]["kind"] == "launcher" and metrics[""]["up"] == 1, metrics
        assert metrics[DBS[0]]["state"] in ("idle", "publishing") and metrics[DBS[0]]["up"] == 1, metrics
        assert metrics[DBS[1]]["state"] == "paused" and metrics[DBS[1]]["up"] == 1, metrics
        assert metrics[DBS[2]]["state"] == "waiting_for_slot" and metrics[DBS[2]]["up"] == 0, metrics
        assert metrics[MISSING_DB]["state"] == "waiting_for_database" and metrics[MISSING_DB]["up"] == 0, \
            metrics
        backlog = run_exporter_query(mon[DBS[2]], "outbox_backlog", spec["outbox_backlog"])
        assert [(b["database"], b["pending"]) for b in backlog] == [(DBS[2], 3)], backlog
        assert backlog[0]["oldest_pending_age_seconds"] > 0, backlog

        # the alert query of doc/operations.md, run in each database
        alerts = {d: documented_alert(mon[d]) for d in DBS}
        assert alerts[DBS[0]] is None, alerts
        assert alerts[DBS[1]].startswith("relay paused"), alerts
        assert alerts[DBS[2]].startswith("relay waiting_for_slot: outbox.max_workers (2)"), alerts
        query(connect_db(other, DBS[1]), "SELECT outbox.resume()")

        lines = watcher.new_lines()
        warned = [ln for ln in lines if "database(s) have no relay" in ln]
        assert len(warned) == 1 and f'1 database(s) have no relay: "{DBS[2]}"' in warned[0], warned
        assert relay_dbs(c) == DBS[:2], relays_by_db(c)
        report(f"OUTBOX LAUNCHER slots: outbox.max_workers = 2, 3 databases: 2 relays, one WARNING"
               f" naming {DBS[2]}; cluster_status() as pg_monitor: launcher running, {DBS[2]}"
               f" waiting_for_slot ({unserved[4]!r}); exporter queries {sorted(spec)}:"
               f" states {sorted((d, m['state'], m['up']) for d, m in metrics.items())}, backlog of"
               f" {DBS[2]} pending {backlog[0]['pending']}; alert query: {alerts}")
        for m in mon.values():
            m.close()
        c.close()


@pytest.mark.full_only
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
        query(c, "CREATE EXTENSION IF NOT EXISTS outbox")     # for cluster_status() (not relayed)
        time.sleep(observe_s)
        exits = relay_exit_lines(watcher.new_lines())
        # 1 + 2 + 4 s of delay fit into 12 s with the starts: 3 to 5 exits, not dozens
        assert 2 <= len(exits) <= 6, exits
        # between the tries the database is shown waiting, with the reason (a user's try found no
        # row for it in cluster_status(): its events waited unseen)
        row = wait_until(lambda: query(c, "SELECT state, last_error FROM outbox.cluster_status()"
                                          " WHERE database = %s AND state = 'waiting_for_database'",
                                       (DBS[0],)), 20, "the refused database in cluster_status()")[0]
        assert "could not connect" in row[1] and "lx_relay" in row[1], row
        query(c, f"GRANT CONNECT ON DATABASE {DBS[0]} TO lx_relay")
        wait_until(lambda: relays_by_db(c).get(DBS[0]), 40, "the relay once it may connect")
        report(f"OUTBOX LAUNCHER backoff: a relay refused by its database exited {len(exits)} time(s)"
               f" in {observe_s}s (delays 1, 2, 4, ... s), shown meanwhile as {row[0]}: {row[1]!r};"
               f" then ran once CONNECT was granted")
        c.close()


BGW_DBS = ["lx_a", "lx_b", "lx_c"]
BGW_LATE_DB = "lx_d"            # listed on reload, part 2
BGW_BARE_DB = "lx_e"            # no extension, part 3 (like the user's "shop")


def relays_per_db(other, dbs):
    """{database: (relays running, their k, bucket ranges tile 0..255)} from each database's own
    outbox.status; a database without a running relay is left out."""
    out = {}
    for d in dbs:
        dc = connect_db(other, d)
        try:
            rows = query(dc, "SELECT workers, buckets::text FROM outbox.status"
                             " WHERE worker IS NOT NULL AND pid IS NOT NULL ORDER BY worker")
        finally:
            dc.close()
        if rows:
            edges = [tuple(int(x) for x in r[1].strip("[)").split(",")) for r in rows]
            tiled = (edges[0][0] == 0 and edges[-1][1] == 256
                     and all(x[1] == y[0] for x, y in zip(edges, edges[1:])))
            out[d] = (len(rows), sorted({r[0] for r in rows}), tiled)
    return out


def every_db_served(other, dbs, relays):
    """Every database of dbs runs a whole generation (k = relays running, buckets tiled), and
    together they run `relays` relays; returns {database: relays} then."""
    per = relays_per_db(other, dbs)
    ok = (sorted(per) == sorted(dbs) and all(k == [n] and tiled for n, k, tiled in per.values())
          and sum(n for n, _, _ in per.values()) == relays)
    return {d: n for d, (n, _, _) in per.items()} if ok else None


def wait_served(other, dbs, relays, what):
    """Wait (30 s) until every_db_served; the failure shows each database's relays."""
    try:
        return wait_until(lambda: every_db_served(other, dbs, relays), 30, what)
    except AssertionError as e:
        raise AssertionError(f"{e}; relays (running, k, tiled): {relays_per_db(other, dbs)}") from None


def unserved_rows(other):
    """outbox.cluster_status()'s rows of databases without a relay (read in lx_a)."""
    dc = connect_db(other, BGW_DBS[0])
    try:
        return query(dc, "SELECT database, state, last_error FROM outbox.cluster_status()"
                         " WHERE kind = 'relay' AND pid IS NULL")
    finally:
        dc.close()


def drain(other, db, n=60):
    """n events in db, all published (every bucket of the database has its relay)."""
    emit_in(other, db, new_aggregate_type("lxbgw"), n, "bgw")
    dc = connect_db(other, db)
    try:
        wait_until(lambda: query_one(dc, "SELECT count(*) FROM outbox.events e"
                                         " WHERE NOT outbox.published(e)")[0] == 0, 30,
                   f"every event of {db} published")
    finally:
        dc.close()


def test_background_workers_short_first_relay_for_every_database(env):
    """max_worker_processes = 8 leaves 6 background workers for relays (PostgreSQL's logical
    replication launcher and ours take 2); outbox.max_workers = 8 and k = 3.  Every covered
    database gets its first relay before any gets a second, also in the order the workers start
    (a user's try: two databases got 3 relays, the third none for 3m45s, with "runs 2 of 3 relays
    for database db3" logged just before "cannot start a relay for database db3"):
    1. at start, listed lx_a, lx_b, lx_c run 3, 2 and 1 relays; none is ever without one;
    2. a fourth database listed on reload gets a relay within seconds: lx_b gives one up;
    3. the user's steps: '*' (two databases without the extension) with k = 1, then k = 3 on
       reload: every database runs a relay again within seconds.
    Every event of every database is published."""
    with extra_cluster(env, "launcher-bgw", 29, database="postgres") as other:
        c, _ = relayed_databases(env, other, BGW_DBS)
        query(c, "ALTER SYSTEM SET max_worker_processes = 8")
        query(c, "ALTER SYSTEM SET outbox.max_workers = 8")
        query(c, "ALTER SYSTEM SET outbox.workers_per_database = 3")
        query(c, "ALTER SYSTEM SET outbox.databases = %s", (", ".join(BGW_DBS),))
        c.close()
        watcher = LogWatcher(other)
        pg_sh(other, "restart")
        c = wait_until(lambda: pg_connect(other), 30, "a connection after the restart")
        others = query(c, "SELECT backend_type FROM pg_stat_activity WHERE backend_type IN"
                          " ('logical replication launcher', 'outbox launcher') ORDER BY 1")
        assert [r[0] for r in others] == ["logical replication launcher", "outbox launcher"], others

        # 1. at start: first relays first, then the rest of each k in order
        start = wait_served(other, BGW_DBS, 6, "6 relays, each database with a whole generation")
        assert start == {"lx_a": 3, "lx_b": 2, "lx_c": 1}, start
        for d in BGW_DBS:
            drain(other, d)
        lines = watcher.new_lines()
        outbox_lines = "\n".join(ln for ln in lines if "outbox" in ln)
        assert not [ln for ln in lines if "have no relay" in ln or "cannot start a relay for" in ln], \
            outbox_lines
        short = sorted(ln.split("WARNING:")[-1].strip() for ln in lines if "relays for database" in ln)
        assert short == ['outbox launcher runs 1 of 3 relays for database "lx_c"',
                         'outbox launcher runs 2 of 3 relays for database "lx_b"'], outbox_lines

        # 2. a fourth database: lx_b, the last one with more than one relay, gives one up
        query(c, f"CREATE DATABASE {BGW_LATE_DB}")
        dc = connect_db(other, BGW_LATE_DB)
        query(dc, "CREATE EXTENSION outbox")
        dc.close()
        watcher = LogWatcher(other)
        t0 = time.monotonic()
        set_system(c, "outbox.databases", ", ".join(BGW_DBS + [BGW_LATE_DB]))
        late = wait_served(other, BGW_DBS + [BGW_LATE_DB], 6, f"{BGW_LATE_DB} gets a relay, 6 in all")
        late_s = time.monotonic() - t0
        assert late == {"lx_a": 3, "lx_b": 1, "lx_c": 1, "lx_d": 1}, late
        for d in BGW_DBS + [BGW_LATE_DB]:
            drain(other, d)
        lines = watcher.new_lines()
        assert any(f'gives a background worker of database "lx_b" to database "{BGW_LATE_DB}"' in ln
                   for ln in lines), "\n".join(ln for ln in lines if "outbox" in ln)
        assert unserved_rows(other) == [], unserved_rows(other)

        # 3. the user's steps: '*' with k = 1, then k = 3 on reload
        query(c, f"DROP DATABASE {BGW_LATE_DB} WITH (FORCE)")
        query(c, f"CREATE DATABASE {BGW_BARE_DB}")
        query(c, "ALTER SYSTEM SET outbox.databases = '*'")
        query(c, "ALTER SYSTEM SET outbox.workers_per_database = 1")
        c.close()
        pg_sh(other, "restart")
        c = wait_until(lambda: pg_connect(other), 30, "a connection after the restart")
        wait_until(lambda: relay_dbs(c) == BGW_DBS, 30,
                   "one relay per database with the extension (the probes of the others exited)")
        watcher = LogWatcher(other)
        t0 = time.monotonic()
        set_system(c, "outbox.workers_per_database", 3)
        grown = wait_served(other, BGW_DBS, 6, "6 relays, each database with a whole generation, after k = 3")
        grown_s = time.monotonic() - t0
        for d in BGW_DBS:
            drain(other, d)
        assert every_db_served(other, BGW_DBS, 6), relays_per_db(other, BGW_DBS)
        assert unserved_rows(other) == [], unserved_rows(other)
        lines = watcher.new_lines()
        report(f"OUTBOX LAUNCHER background workers: max_worker_processes 8 (6 for relays), k 3:"
               f" at start {start} with no database ever without a relay; a fourth database listed"
               f" on reload ran a relay after {late_s:.1f}s ({late}); '*' with k 1 -> 3 on reload:"
               f" {grown} after {grown_s:.1f}s; every event published. Log of step 3:"
               f" {[ln.split('] ')[-1][:120] for ln in lines if 'outbox launcher' in ln and ('WARNING:' in ln or 'LOG:' in ln)]}")
        c.close()
