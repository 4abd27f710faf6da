/*
 * outbox--1.7--1.8.sql: outbox.status counts every pending event.
 *
 * The pending count (and oldest_pending_age) of outbox.status missed an
 * event tracked by snapshot whose id is at most the progress's id floor
 * and whose transaction got its xid at or after the progress snapshot's
 * xmax: a transaction running when the relay took its snapshot, but not in
 * its xip list (issue 27).  Such an event was pending while the view said
 * 0.  CREATE OR REPLACE VIEW keeps the view and its grants.
 */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION outbox UPDATE TO '1.8'" to load this file. \quit

CREATE OR REPLACE VIEW outbox.status AS
SELECT w.database,
       w.pid,
       w.state,
       CASE WHEN w.database = pg_catalog.current_database() THEN p.pending END AS pending,
       CASE WHEN w.database = pg_catalog.current_database() THEN p.failed_events END AS failed_events,
       CASE WHEN w.database = pg_catalog.current_database()
            THEN pg_catalog.clock_timestamp() - p.oldest_pending_at END AS oldest_pending_age,
       w.published,
       w.failed,
       w.delivery_errors,
       w.last_publish_at,
       w.last_error,
       w.last_error_at,
       w.started_at,
       b.worker,
       b.workers,
       b.buckets
  FROM outbox.worker_status() AS w
  LEFT JOIN outbox.worker_buckets() AS b ON b.pid = w.pid AND b.worker IS NOT NULL
 CROSS JOIN LATERAL (
       SELECT pg_catalog.count(*) FILTER (WHERE e.failed_at IS NULL) AS pending,
              pg_catalog.count(*) FILTER (WHERE e.failed_at IS NOT NULL) AS failed_events,
              pg_catalog.min(e.created_at) FILTER (WHERE e.failed_at IS NULL) AS oldest_pending_at
         FROM (SELECT r.failed_at, r.created_at
                 FROM outbox.events AS r
                WHERE r.published_at IS NULL AND r.xid IS NULL
               UNION ALL
               -- tracked by snapshot and not covered by the relay's progress: above its id
               -- floor (primary key), or at most the floor in a transaction its snapshot
               -- did not show as committed (events_xid_idx); each through an index, never
               -- the table
               SELECT NULL, s.created_at
                 FROM (SELECT p.* FROM outbox.relay_progress AS p
                        WHERE p.system_identifier =
                              (SELECT c.system_identifier FROM pg_catalog.pg_control_system() AS c)
                        ORDER BY p.id_floor DESC LIMIT 1) AS g
                CROSS JOIN LATERAL (
                      SELECT a.id, a.xid, a.created_at
                        FROM outbox.events AS a
                       WHERE a.id > g.id_floor AND a.xid IS NOT NULL
                      UNION ALL
                      SELECT b.id, b.xid, b.created_at
                        FROM pg_catalog.pg_snapshot_xip(g.snapshot) AS x(xid)
                        JOIN outbox.events AS b
                          ON b.xid = x.xid AND b.xid IS NOT NULL AND b.id <= g.id_floor
                      UNION ALL
                      -- at most the floor in a transaction that got its xid at or after the
                      -- snapshot's xmax (running when it was taken, but not in its xip list)
                      SELECT c.id, c.xid, c.created_at
                        FROM outbox.events AS c
                       WHERE c.xid >= pg_catalog.pg_snapshot_xmax(g.snapshot) AND c.id <= g.id_floor
                     ) AS s
                WHERE NOT COALESCE(pg_catalog.pg_visible_in_snapshot(s.xid, g.snapshot), false)
                  AND NOT COALESCE(s.id <= g.batch_last_id
                                   AND pg_catalog.pg_visible_in_snapshot(s.xid, g.batch_snapshot), false)
              ) AS e) AS p;
