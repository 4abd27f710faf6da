"""
Key-partitioned relays (issue 11): outbox.workers_per_database = k relays share one database's
events by key bucket, on the suite's cluster (relay_mode snapshot, or row where the run says so).

- k = 1 -> 4 -> 2 on reload while eight sessions emit (one transaction in ten rolled back) and
  two sessions keep committing events of one aggregate out of id order: every committed event
  arrives exactly once (no crash here, so no duplicate either), nothing rolled back arrives, per
  aggregate order holds, nothing committed out of id order is skipped; outbox.status shows one
  row per relay with its bucket range, the ranges cover 0..255 without overlap, and new events
  are tracked row by row while k > 1;
- with k = 2: a dead letter holds only its aggregate (hold mode), pause() stops every relay and
  resume() starts them all, replay() re-sends through the relay that owns the bucket, and the
  retention deletes the published events of every bucket (worker 0 runs it); the
  postgres_exporter queries keep one series per relay;
- the setting's range (1 to 32, reloadable; 22023 otherwise);
- outbox.max_workers short of k: the log says so once, the database runs fewer relays, and it
  gets k once slots are free (an extra cluster).
"""
import collections
import threading
import time

import psycopg2
import pytest

from conftest import (LogWatcher, create_topics, emit, new_aggregate_type, pg_connect, pg_sh,
                      query, query_one, relay_status, report, wait_until)
from helpers_crash import EmitLoad, LightReader, assert_delivered, delivery_check
from helpers_lifecycle import connect_db, extra_cluster, set_system

RESIZES = [4, 2]
LOAD_SECONDS_PER_K = 3.0
DELIVERY_TIMEOUT_S = 90


def relay_rows(env):
    """(worker, workers, buckets, pid, state) of the database's relays, over a new connection."""
    c = pg_connect(env)
    try:
        return query(c, "SELECT worker, workers, buckets::text, pid, state FROM outbox.status"
                        " WHERE pid IS NOT NULL ORDER BY worker")
    finally:
        c.close()


def bucket_bounds(text):
    lo, hi = text.strip("[)").split(",")
    return int(lo), int(hi)


def running_k(env, k, old_pids=()):
    """The database has exactly k relays, numbered 1..k, of the new generation, and their
    bucket ranges tile 0..255."""
    rows = relay_rows(env)
    if len(rows) != k or any(r[1] != k or r[4] == "starting" or r[3] in old_pids for r in rows):
        return False
    assert [r[0] for r in rows] == list(range(1, k + 1)), rows
    edges = [bucket_bounds(r[2]) for r in rows]
    assert edges[0][0] == 0 and edges[-1][1] == 256, rows
    assert all(a[1] == b[0] for a, b in zip(edges, edges[1:])), rows
    return True


def set_workers(env, conn, k, timeout=30.0):
    """Reload outbox.workers_per_database = k; returns seconds until k new relays run."""
    old = {r[3] for r in relay_rows(env)}
    t0 = time.monotonic()
    set_system(conn, "outbox.workers_per_database", k)
    wait_until(lambda: running_k(env, k, old if k != len(old) else ()), timeout,
               f"{k} relays after the reload", interval=0.05)
    return time.monotonic() - t0


@pytest.fixture
def workers(env, conn):
    """Set k for the test; back to 1 afterwards."""
    yield lambda k: set_workers(env, conn, k)
    set_system(conn, "outbox.workers_per_database", None)
    wait_until(lambda: running_k(env, 1), 30, "one relay again")


class OutOfOrderCommits(threading.Thread):
    """Two sessions emit an event of one aggregate each; the later id commits first.  Repeats
    until stopped; records both events of each round."""

    def __init__(self, env, agg_type):
        super().__init__(daemon=True, name="out-of-order")
        self.env, self.agg_type = env, agg_type
        self.events = []
        self.error = None
        self._stop_evt = threading.Event()

    def run(self):
        a = pg_connect(self.env, autocommit=False)
        b = pg_connect(self.env, autocommit=False)
        try:
            n = 0
            while not self._stop_evt.is_set():
                n += 1
                with a.cursor() as ca, b.cursor() as cb:
                    first = emit(ca, self.agg_type, "ooo", "ooo.first", {"round": n})
                    second = emit(cb, self.agg_type, "ooo", "ooo.second", {"round": n})
                b.commit()              # the higher id commits first
                time.sleep(0.02)
                a.commit()
                self.events += [first, second]
                time.sleep(0.01)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            a.close()
            b.close()

    def stop(self):
        self._stop_evt.set()
        self.join(30)


def test_workers_resize_under_load(env, conn, prefix, workers):
    agg = new_aggregate_type("kpart")
    ooo_agg = new_aggregate_type("kpartooo")
    topics = [prefix + agg, prefix + ooo_agg]
    create_topics(env, topics)
    reader = LightReader(env, topics)
    reader.wait_assigned()
    load = EmitLoad(env, agg, sessions=8, aggregates=64, tag="kp", seed=29, think_s=0.005,
                    rollback_share=0.1)
    ooo = OutOfOrderCommits(env, ooo_agg)
    times, windows = {}, {}
    row_from = None
    try:
        load.start()
        ooo.start()
        load.wait_progress(20, 60)
        for k in RESIZES:
            t0 = time.monotonic()
            times[k] = workers(k)
            windows[k] = (t0, time.monotonic())
            if row_from is None:
                # every session has reloaded by the time it emitted again, a second later; ids
                # are handed out at emit() (the sequence), committed or not
                time.sleep(1)
                row_from = query_one(conn, "SELECT last_value FROM outbox.events_id_seq")[0]
            load.wait_progress(20, 60, f"every session at k = {k}")
            time.sleep(LOAD_SECONDS_PER_K)
    finally:
        load.stop()
        ooo.stop()
    assert ooo.error is None, ooo.error
    assert not load.unexpected_errors, load.unexpected_errors[:3]
    committed, unknown = load.snapshot()
    present = dict(committed)
    present.update({e: ("ooo", i) for i, e in enumerate(ooo.events)})
    missing = reader.wait_for(present, DELIVERY_TIMEOUT_S, extra=2)
    arrived = reader.received_ids()
    present.update({e: v[:2] for e, v in unknown.items() if e in arrived})
    rows = reader.snapshot()
    reader_times = reader.arrivals(set(present))
    reader.close()
    assert not missing, f"{len(missing)} of {len(present)} committed events never arrived"
    # the out-of-order pairs are checked for presence only: which commits first decides
    check = delivery_check([r for r in rows if r[4] not in set(ooo.events)],
                           {e: v for e, v in present.items() if e not in set(ooo.events)},
                           load.rolled_back)
    assert_delivered(check, "k = 1 -> 4 -> 2 under load")
    assert check.duplicates == 0, f"{check.duplicates} duplicates without any crash"
    ooo_counts = collections.Counter(r[4] for r in {(r[0], r[1], r[2]): r for r in rows}.values()
                                     if r[4] in set(ooo.events))
    assert set(ooo_counts) == set(ooo.events) and max(ooo_counts.values()) == 1, \
        f"out-of-order commits: {len(set(ooo.events) - set(ooo_counts))} skipped"

    # while k > 1 new events are tracked row by row (one claim per relay, by bucket)
    by_row, total = query_one(conn, "SELECT count(*) FILTER (WHERE xid IS NULL), count(*)"
                                    "  FROM outbox.events WHERE aggregate_type = %s AND id > %s",
                              (agg, row_from))
    assert total > 0 and by_row == total, f"{total - by_row} of {total} events tracked by snapshot with k > 1"
    stalls = {k: longest_gap(reader_times, a - 0.5, b + 0.5) for k, (a, b) in windows.items()}
    report(f"OUTBOX KEY-PARTITIONED RELAYS: outbox.workers_per_database 1 -> 4 -> 2 on reload under"
           f" 8 sessions (+2 committing one aggregate out of id order): {len(present)} committed"
           f" events arrived once, {len(load.rolled_back)} rolled back never arrived,"
           f" {check.reorderings} reorderings, {check.duplicates} duplicates,"
           f" {len(ooo.events)} out-of-order commits, none skipped; reload -> k new relays running:"
           f" {', '.join(f'k={k} {t:.2f}s' for k, t in times.items())}; longest gap in arrivals"
           f" around it: {', '.join(f'k={k} {g:.2f}s' for k, g in stalls.items())};"
           f" {total} events written with k > 1 all tracked row by row")


def longest_gap(times, start, end):
    """The longest time between consecutive arrivals (sorted times) that overlaps [start, end]."""
    gaps = [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end]
    return max(gaps, default=0.0)


def test_dead_letter_pause_replay_and_retention_with_two_workers(env, conn, prefix, workers,
                                                                reader_factory):
    workers(2)
    agg = new_aggregate_type("kpartdl")
    topic = prefix + agg
    create_topics(env, [topic])
    reader = reader_factory([topic])
    # aggregates of both relays' buckets
    ids = [f"k{i}" for i in range(40)]
    owners = dict(query(conn, "SELECT x, (pg_catalog.hashtextextended(x, pg_catalog.hashtextextended(%s, 0))"
                              " & 255) >= 128 FROM unnest(%s::text[]) AS x", (agg, ids)))
    assert set(owners.values()) == {False, True}, owners

    conn.autocommit = False
    with conn.cursor() as cur:
        poison = emit(cur, agg, ids[0], "t.big", {"blob": "x" * 1_100_000})
        held = emit(cur, agg, ids[0], "t.after_big", {"n": 1})
        others = [emit(cur, agg, i, "t.ok", {"n": 2}) for i in ids[1:]]
    conn.commit()
    conn.autocommit = True
    try:
        got = reader.read_until(len(others), timeout=30, extra=2)
        arrived = {m.event_id for m in got}
        assert set(others) <= arrived, f"{len(set(others) - arrived)} of the other aggregates' events missing"
        assert held not in arrived and poison not in arrived
    finally:
        query(conn, "DELETE FROM outbox.events WHERE event_id = %s", (poison,))
    got = reader.read_until(len(others) + 1, timeout=30, extra=1)
    assert held in {m.event_id for m in got}, "the held event after its blocker went"

    # pause stops both relays; resume starts both
    query(conn, "SELECT outbox.pause()")
    wait_until(lambda: [r[4] for r in relay_rows(env)] == ["paused", "paused"], 15, "both relays paused")
    paused_ids = []
    with conn.cursor() as cur:
        for i in ids:
            paused_ids.append(emit(cur, agg, i, "t.paused", {"n": 3}))
    time.sleep(2)
    reader.poll(0.5)
    assert not set(paused_ids) & {m.event_id for m in reader.snapshot()}, "an event went out while paused"
    query(conn, "SELECT outbox.resume()")
    got = reader.read_until(len(others) + 1 + len(paused_ids), timeout=30, extra=1)
    assert set(paused_ids) <= {m.event_id for m in got}, "events emitted while paused, after resume()"

    # replay re-sends through the relays that own the buckets
    wait_until(lambda: relay_status(conn)[0]["pending"] == 0, 30, "an empty backlog")
    first, last = query_one(conn, "SELECT min(id), max(id) FROM outbox.events WHERE event_id = ANY(%s::uuid[])",
                            (paused_ids,))
    replayed = query_one(conn, "SELECT outbox.replay(%s, %s)", (first, last))[0]
    assert replayed >= len(paused_ids), replayed
    want = len(others) + 1 + 2 * len(paused_ids)
    got = reader.read_until(want, timeout=30, extra=1)
    counts = collections.Counter(m.event_id for m in got)
    assert all(counts[e] == 2 for e in paused_ids), "each replayed event once more"

    # retention (worker 0) deletes published events of every bucket
    set_system(conn, "outbox.retention", 1)
    try:
        wait_until(lambda: query_one(conn, "SELECT count(*) FROM outbox.events WHERE aggregate_type = %s",
                                     (agg,))[0] == 0, 30, "the retention to delete both relays' events")
    finally:
        set_system(conn, "outbox.retention", None)
    published = {r[0]: r[1] for r in query(conn, "SELECT worker, published FROM outbox.status")}

    # the postgres_exporter queries keep one series per relay (a duplicate label set is an
    # error of the exporter's)
    from test_25_launcher import exporter_queries, run_exporter_query
    for name, spec in exporter_queries().items():
        rows = run_exporter_query(conn, name, spec)
        labels = [tuple(r[c] for c, usage in spec[2] if usage == "LABEL") for r in rows]
        # the inbox's queries have rows only where there are subscriptions (none here)
        assert (labels or name.startswith("outbox_inbox")) and len(labels) == len(set(labels)), \
            (name, labels)
    workers_label = sorted(r["worker"] for r in run_exporter_query(conn, "outbox_cluster",
                                                                    exporter_queries()["outbox_cluster"])
                           if r["kind"] == "relay" and r["database"] == env.pg_database)
    assert workers_label == ["1", "2"], workers_label
    report(f"OUTBOX KEY-PARTITIONED RELAYS k=2: a dead letter held only its aggregate while"
           f" {len(others)} events of {len(ids) - 1} aggregates in both relays' buckets went out;"
           f" pause() -> both paused, resume() -> {len(paused_ids)} sent; replay() of"
           f" {replayed} re-sent each once; retention deleted both relays' events; published per"
           f" relay {published}")


def test_workers_per_database_setting(conn):
    """The setting: 1 to 32, reloadable; anything else refused with 22023, the old value kept."""
    row = query_one(conn, "SELECT setting, boot_val, min_val, max_val, context, unit FROM pg_settings"
                          " WHERE name = 'outbox.workers_per_database'")
    assert row == ("1", "1", "1", "32", "sighup", None), row
    for bad in ("0", "33", "-1", "two"):
        with pytest.raises(psycopg2.Error) as e:
            query(conn, f"ALTER SYSTEM SET outbox.workers_per_database = '{bad}'")
        assert e.value.pgcode == "22023", (bad, e.value.pgcode, e.value.pgerror)
    assert query_one(conn, "SHOW outbox.workers_per_database")[0] == "1"


def test_slots_and_background_workers_short_of_k(env):
    """outbox.max_workers = 3 and k = 3: one database runs 3 relays; a second one listed on reload
    gets one at once and the first gives one up (one relay for each database first); alone again,
    the second grows to 3.  Then max_worker_processes leaves 2 background workers: the database
    runs 2 relays whose buckets tile 0..255, and every event goes out (a helper's try: relays 1-6
    of 8 ran, buckets 192-255 had none, their events stayed pending)."""
    with extra_cluster(env, "kslots", 31, database="postgres") as other:
        c = pg_connect(other)
        for d in ("kp_a", "kp_b"):
            query(c, f"CREATE DATABASE {d}")
            dc = connect_db(other, d)
            query(dc, "CREATE EXTENSION outbox")
            dc.close()
        set_system(c, "outbox.max_workers", 3)
        set_system(c, "outbox.databases", "kp_a")
        set_system(c, "outbox.workers_per_database", 3)
        c.close()
        pg_sh(other, "restart")
        conns = {d: connect_db(other, d) for d in ("kp_a", "kp_b")}
        c = conns["kp_a"]

        def per_db():
            """{database: (relays running, their k, bucket ranges tile 0..255)}."""
            out = {}
            for d, dc in conns.items():
                rows = query(dc, "SELECT workers, buckets::text FROM outbox.status"
                                 " WHERE worker IS NOT NULL ORDER BY worker")
                if rows:
                    edges = [bucket_bounds(r[1]) for r in rows]
                    tiled = (edges[0][0] == 0 and edges[-1][1] == 256
                             and all(x[1] == y[0] for x, y in zip(edges, edges[1:])))
                    out[d] = (len(rows), sorted({r[0] for r in rows}), tiled)
            return out

        def drained(d, n=60):
            dc = conns[d]
            query(dc, "SELECT outbox.emit('kpslots', 'a' || g, 'e', '{}') FROM generate_series(1, %s) g", (n,))
            wait_until(lambda: query_one(dc, "SELECT count(*) FROM outbox.events e"
                                             " WHERE NOT outbox.published(e)")[0] == 0, 30,
                       f"every event of {d} published (all its buckets served)")

        wait_until(lambda: per_db() == {"kp_a": (3, [3], True)}, 30, "kp_a runs 3 relays")
        watcher = LogWatcher(other)
        set_system(c, "outbox.databases", "kp_a, kp_b")
        wait_until(lambda: per_db() == {"kp_a": (2, [2], True), "kp_b": (1, [1], True)}, 30,
                   "kp_b gets a relay, kp_a gives one up")
        drained("kp_a")
        drained("kp_b")
        time.sleep(1)
        lines = watcher.new_lines()
        short = sorted(ln.split("WARNING:")[-1].strip() for ln in lines if "relays for database" in ln)
        assert short == ['outbox launcher runs 1 of 3 relays for database "kp_b"',
                         'outbox launcher runs 2 of 3 relays for database "kp_a"'], \
            "\n".join(ln for ln in lines if "outbox" in ln)
        set_system(c, "outbox.databases", "kp_b")
        wait_until(lambda: per_db() == {"kp_b": (3, [3], True)}, 30, "kp_b grows to 3 relays")
        drained("kp_b")

        # 4 background workers: PostgreSQL's logical replication launcher, ours, 2 relays
        set_system(c, "max_worker_processes", 4)
        for dc in conns.values():
            dc.close()
        watcher = LogWatcher(other)
        pg_sh(other, "restart")
        conns = {"kp_b": connect_db(other, "kp_b")}
        wait_until(lambda: per_db() == {"kp_b": (2, [2], True)}, 30, "2 relays of 3 that tile the buckets")
        drained("kp_b", 200)
        lines = watcher.new_lines()
        capped = [ln for ln in lines if "runs 2 of 3 relays" in ln]
        assert capped and "max_worker_processes" in "".join(lines), "\n".join(ln for ln in lines if "outbox" in ln)
        report("OUTBOX KEY-PARTITIONED RELAYS: max_workers 3, k 3: a database listed on reload got a"
               " relay at once (the other went from 3 to 2, one WARNING each); alone again it grew to"
               " 3; with 2 background workers for relays it ran 2 whose buckets tile 0..255, and"
               " every event was published")
        for dc in conns.values():
            dc.close()
