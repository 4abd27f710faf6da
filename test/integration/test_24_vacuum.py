"""
The relay's own VACUUM of outbox.events (outbox.vacuum_interval): after the retention deleted
rows, the relay starts a short-lived background worker ("outbox vacuum") that runs
VACUUM (SKIP_LOCKED) on the table, so that the space of deleted events is reused without waiting
for autovacuum's next visit (autovacuum_naptime, 1 min by default).

To see the relay's VACUUM alone, autovacuum is turned off for the table during the test
(ALTER TABLE ... SET (autovacuum_enabled = off), reset at the end); outbox.retention is 1 s and
outbox.vacuum_interval 1 s (its default is 5 s).  The test runs in the cluster's relay mode: in
row mode the retention deletes a run over several passes, as its rows reach their age batch by
batch, and the tail deleted after the relay's last VACUUM must be vacuumed too (a "wave" of
deletes ended).

- Two runs of 30,000 events: each is published, deleted by the retention, and then vacuumed by
  the relay (pg_stat_user_tables.vacuum_count grows; autovacuum_count does not) until the run's
  space is in the free space map (pg_freespacemap) or cut off the heap's end (the wait fails if
  neither happens); the second run fits into the space of the first (without the relay's VACUUM
  the heap grows by the whole run again).
- outbox.vacuum_interval = 0: the retention deletes, and no VACUUM is started.
"""
import time

from conftest import (LogWatcher, create_topics, new_aggregate_type, pg_connect, query, query_one,
                      relay_status, report, wait_relay_ready, wait_until)
from helpers_lifecycle import connect_db, db_env, extra_cluster, set_system

N_EVENTS = 30_000
# the second run's heap growth may be at most this share of the first run's, plus 1 MB
REUSE_LIMIT = 0.25
SLACK = 1048576

EMIT_SQL = ("SELECT count(outbox.emit(%s, (g %% 100)::text, 'it.vacuum',"
            " jsonb_build_object('n', g, 'pad', repeat('x', 200)))) FROM generate_series(1, %s) AS g")


def vacuum_counts(conn):
    return query_one(conn, "SELECT vacuum_count, autovacuum_count FROM pg_stat_user_tables"
                           " WHERE relid = 'outbox.events'::regclass")


def heap_size(conn) -> int:
    return query_one(conn, "SELECT pg_relation_size('outbox.events')")[0]


def reclaimed(conn, peak) -> int:
    """Bytes of the run's space that new rows can have again: what the free space map offers
    (recorded by VACUUM), plus what VACUUM gave back by truncating the heap below its peak."""
    free, size = query_one(conn, "SELECT coalesce(sum(avail), 0), pg_relation_size('outbox.events')"
                                 "  FROM pg_freespace('outbox.events')")
    return free + max(0, peak - size)


def remaining(conn, agg_type) -> int:
    return query_one(conn, "SELECT count(*) FROM outbox.events WHERE aggregate_type = %s", (agg_type,))[0]


def one_run(conn, agg_type):
    """Emit N_EVENTS in one transaction; wait until they are published and deleted.  Returns the
    heap size right after the commit and the vacuum counts before it."""
    counts_before = vacuum_counts(conn)
    assert query_one(conn, EMIT_SQL, (agg_type, N_EVENTS))[0] == N_EVENTS
    peak = heap_size(conn)
    wait_until(lambda: remaining(conn, agg_type) == 0, 120,
               f"the relay to publish and the retention to delete {N_EVENTS} events", interval=0.5)
    return peak, counts_before


def test_relay_vacuums_after_retention(env, conn, prefix):
    agg_type = new_aggregate_type("vacuum")
    create_topics(env, [prefix + agg_type])
    pid = relay_status(conn)[0]["pid"]
    try:
        query(conn, "CREATE EXTENSION IF NOT EXISTS pg_freespacemap")
        query(conn, "ALTER TABLE outbox.events SET (autovacuum_enabled = off)")
        set_system(conn, "outbox.retention", 1)
        set_system(conn, "outbox.vacuum_interval", 1)
        # the published rows of earlier tests go first, and the test compacts the table itself
        # (VACUUM FULL), so that run 1 starts from a table without reusable space: after
        # test_18's millions a plain VACUUM left 340 MB free (its truncation needs a lock the
        # relay's batches keep taking), run 1 fitted into it, and the test proved nothing
        wait_until(lambda: query_one(conn, "SELECT count(*) FROM outbox.events e WHERE outbox.published(e)")[0] == 0,
                   120, "the retention to delete the earlier tests' published events", interval=0.5)
        wait_until(lambda: query_one(conn, "SELECT count(*) FROM pg_stat_activity"
                                           " WHERE backend_type = 'outbox vacuum'")[0] == 0, 60,
                   "a VACUUM worker started for the earlier tests' events to finish")
        query(conn, "VACUUM FULL outbox.events")
        base_counts = vacuum_counts(conn)
        start = heap_size(conn)
        peaks, counts = [], []
        for run in (1, 2):
            peak, before = one_run(conn, agg_type)
            wait_until(lambda: vacuum_counts(conn)[0] > before[0], 60,
                       f"run {run}: the relay's VACUUM of outbox.events after the retention", interval=0.5)
            # the run was deleted in one or more passes; its space counts as reused only once a
            # VACUUM after the last of them recorded it (row mode: the tail of the wave)
            wanted = (1 - REUSE_LIMIT) * (peak - start)
            wait_until(lambda: reclaimed(conn, peak) >= wanted, 60,
                       f"run {run}: VACUUM to make {wanted / 1048576:.1f}MB of the run's space reusable",
                       interval=0.5)
            peaks.append(peak)
            counts.append(vacuum_counts(conn))
    finally:
        query(conn, "ALTER TABLE outbox.events RESET (autovacuum_enabled)")
        query(conn, "DROP EXTENSION IF EXISTS pg_freespacemap")
        set_system(conn, "outbox.retention", None)
        set_system(conn, "outbox.vacuum_interval", None)

    grow1, grow2 = peaks[0] - start, peaks[1] - peaks[0]
    report(f"OUTBOX VACUUM: heap {start / 1048576:.1f}MB at start, {peaks[0] / 1048576:.1f}MB after"
           f" run 1's {N_EVENTS} events, {peaks[1] / 1048576:.1f}MB after run 2's; (vacuum_count,"
           f" autovacuum_count) {base_counts} at start, {counts[0]} after run 1, {counts[1]} after run 2")
    assert relay_status(conn)[0]["pid"] == pid, "the relay worker restarted"
    assert counts[1][1] == base_counts[1], "autovacuum ran although it was off for the table"
    assert grow1 > 4 * SLACK, f"run 1 grew the heap by {grow1} bytes only: the test proves nothing"
    assert grow2 <= grow1 * REUSE_LIMIT + SLACK, \
        f"run 2 grew the heap by {grow2 / 1048576:.1f}MB after run 1's {grow1 / 1048576:.1f}MB: space not reused"


def test_vacuum_interval_zero_leaves_the_table_to_autovacuum(env, conn, prefix):
    agg_type = new_aggregate_type("novacuum")
    create_topics(env, [prefix + agg_type])
    try:
        query(conn, "ALTER TABLE outbox.events SET (autovacuum_enabled = off)")
        set_system(conn, "outbox.retention", 1)
        set_system(conn, "outbox.vacuum_interval", 0)
        # a VACUUM the relay started before the reload may still be finishing
        wait_until(lambda: query_one(conn, "SELECT count(*) FROM pg_stat_activity"
                                           " WHERE backend_type = 'outbox vacuum'")[0] == 0, 60,
                   "an earlier VACUUM worker to finish")
        _, before = one_run(conn, agg_type)
        # the retention deleted the run; a relay that ignored the setting would start its VACUUM
        # at its next pass (every second): give it three
        time.sleep(3)
        after = vacuum_counts(conn)
        workers = query_one(conn, "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'outbox vacuum'")[0]
    finally:
        query(conn, "ALTER TABLE outbox.events RESET (autovacuum_enabled)")
        set_system(conn, "outbox.retention", None)
        set_system(conn, "outbox.vacuum_interval", None)
    report(f"OUTBOX VACUUM interval 0: (vacuum_count, autovacuum_count) {before} -> {after},"
           f" {workers} VACUUM workers running")
    assert after == before and workers == 0, "the relay started a VACUUM with outbox.vacuum_interval = 0"


def test_drop_database_stops_the_relays_vacuum(env):
    """DROP DATABASE, RENAME and TEMPLATE stop a database's relays first (PostgreSQL refuses them
    while another session is connected), but not the relay's VACUUM worker, which is connected to
    the database too (issue 27, finding 4): a plain DROP DATABASE during that VACUUM failed with
    "database ... is being accessed by other users" after 5 s. The relay's fault hook holds the
    VACUUM worker right after it connected, for longer than DROP DATABASE waits."""
    db = "vacuum_drop"
    with extra_cluster(env, "vacuumdrop", 29, database="postgres") as other:
        c = wait_until(lambda: pg_connect(other), 30, "a connection")
        query(c, f"CREATE DATABASE {db}")
        d = connect_db(other, db)
        query(d, "CREATE EXTENSION outbox")
        set_system(c, "outbox.retention", "1s")
        set_system(c, "outbox.vacuum_interval", "1s")
        set_system(c, "outbox.databases", db)
        wait_relay_ready(db_env(other, db))
        watcher = LogWatcher(other)
        with open(f"{other.pg_dir}/data/outbox_crash_vacuum_start", "w") as f:
            f.write("sleep 60000 pass")
        agg = new_aggregate_type("vacdrop")
        assert query_one(d, EMIT_SQL, (agg, 2000))[0] == 2000
        d.close()
        wait_until(lambda: any('going on at "vacuum_start"' in ln for ln in watcher.new_lines()), 60,
                   "the relay's VACUUM worker to start and hold")
        assert query_one(c, "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'outbox vacuum'"
                            " AND datname = %s", (db,))[0] == 1
        t0 = time.monotonic()
        query(c, f"DROP DATABASE {db}")
        drop_s = time.monotonic() - t0
        report(f"OUTBOX VACUUM DROP DATABASE: a plain DROP DATABASE while the relay's VACUUM worker held"
               f" a connection returned in {drop_s:.2f}s")
        c.close()
