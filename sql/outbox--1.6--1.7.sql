/*
 * outbox--1.6--1.7.sql: key-partitioned relays (issue 11).
 *
 * outbox.workers_per_database relays can share a database's events by key
 * bucket.  Adds outbox.worker_buckets(), which says which buckets each relay
 * serves, and appends its worker, workers and buckets columns to
 * outbox.status (CREATE OR REPLACE VIEW keeps the view and its grants).
 * The relays need nothing else of the schema: an event's bucket is a hash of
 * its aggregate_type and aggregate_id.
 */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION outbox UPDATE TO '1.7'" to load this file. \quit

CREATE FUNCTION outbox.worker_buckets(
    OUT pid integer,
    OUT worker integer,
    OUT workers integer,
    OUT buckets int4range)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'outbox_worker_buckets'
LANGUAGE C VOLATILE
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.worker_buckets() IS
'One row per running relay worker of the server, read from shared memory: its pid, worker = its number (1 .. workers), workers = how many relays share the database (outbox.workers_per_database, fewer while outbox.max_workers is short, 1 with exactly_once), and buckets = the key buckets it serves, [first,last+1) of 0..255. An event''s bucket is hashtextextended(aggregate_id, hashtextextended(aggregate_type, 0)) & 255: one relay serves all events of an aggregate. Rows the launcher holds for a database it waits for have NULL worker, workers and buckets. Executable by pg_monitor.';

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
               -- showed running (events_xid_idx); each through an index, never the table
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
                     ) AS s
                WHERE NOT COALESCE(pg_catalog.pg_visible_in_snapshot(s.xid, g.snapshot), false)
                  AND NOT COALESCE(s.id <= g.batch_last_id
                                   AND pg_catalog.pg_visible_in_snapshot(s.xid, g.batch_snapshot), false)
              ) AS e) AS p;

COMMENT ON VIEW outbox.status IS
'Relay health: the worker''s state and counters since it started (from shared memory: published, failed = events marked failed, delivery_errors = failed attempts) with its table: pending events, the age of the oldest one, and failed_events (marked failed, waiting for outbox.retry_failed()); the table columns are NULL when queried from another database than the worker''s. State waiting_for_slot (no pid): this database has no relay because every worker slot is taken. With outbox.workers_per_database = k, one row per relay: worker (1 .. workers) and the key buckets it serves (see outbox.worker_buckets()); pending, failed_events and oldest_pending_age are the database''s, repeated on each row. Empty when no relay worker runs.';

REVOKE ALL ON FUNCTION outbox.worker_buckets() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.worker_buckets() TO pg_monitor;

/*
 * Initial privileges (rule 4 of outbox.sql).  The GRANT and REVOKE above
 * stored the new function's ACL in pg_init_privs: the owner's items and
 * pg_monitor's, unless the installing role has default privileges (ALTER
 * DEFAULT PRIVILEGES).  So reset them, as every update path to this version
 * does: the owner's items, and pg_monitor's USAGE on the schema, EXECUTE on
 * worker_status(), worker_buckets() and cluster_status() and SELECT on
 * status; no user's, no PUBLIC's.
 */
DO $$
DECLARE
    r record;
    acl pg_catalog.aclitem[];
    keep pg_catalog.oid[];
BEGIN
    FOR r IN
        SELECT ip.classoid, ip.objoid, ip.objsubid, ip.initprivs, m.priv,
               CASE ip.classoid
                   WHEN 'pg_catalog.pg_class'::pg_catalog.regclass THEN
                       (SELECT c.relowner FROM pg_catalog.pg_class c WHERE c.oid = ip.objoid)
                   WHEN 'pg_catalog.pg_proc'::pg_catalog.regclass THEN
                       (SELECT p.proowner FROM pg_catalog.pg_proc p WHERE p.oid = ip.objoid)
                   WHEN 'pg_catalog.pg_namespace'::pg_catalog.regclass THEN
                       (SELECT n.nspowner FROM pg_catalog.pg_namespace n WHERE n.oid = ip.objoid)
               END AS owner
          FROM pg_catalog.pg_init_privs ip
          LEFT JOIN (VALUES ('pg_catalog.pg_namespace'::pg_catalog.regclass,
                             'outbox'::pg_catalog.regnamespace::pg_catalog.oid, 'USAGE'),
                            ('pg_catalog.pg_proc', 'outbox.worker_status()'::pg_catalog.regprocedure, 'EXECUTE'),
                            ('pg_catalog.pg_proc', 'outbox.cluster_status()'::pg_catalog.regprocedure, 'EXECUTE'),
                            ('pg_catalog.pg_proc', 'outbox.worker_buckets()'::pg_catalog.regprocedure, 'EXECUTE'),
                            ('pg_catalog.pg_class', 'outbox.status'::pg_catalog.regclass, 'SELECT'))
                 AS m(classoid, objoid, priv)
            ON m.classoid = ip.classoid AND m.objoid = ip.objoid AND ip.objsubid = 0
         WHERE (ip.classoid, ip.objoid) IN
               (SELECT d.classid, d.objid FROM pg_catalog.pg_depend d
                 WHERE d.refclassid = 'pg_catalog.pg_extension'::pg_catalog.regclass
                   AND d.refobjid = (SELECT e.oid FROM pg_catalog.pg_extension e
                                      WHERE e.extname = 'outbox')
                   AND d.deptype = 'e')
            OR (ip.classoid = 'pg_catalog.pg_namespace'::pg_catalog.regclass
                AND ip.objoid = 'outbox'::pg_catalog.regnamespace)
    LOOP
        -- the owner's items, in their order (columns have none: their rows go)
        acl := ARRAY(SELECT u.a FROM pg_catalog.unnest(r.initprivs) WITH ORDINALITY AS u(a, n)
                      WHERE (SELECT x.grantee FROM pg_catalog.aclexplode(ARRAY[u.a]) AS x LIMIT 1) = r.owner
                      ORDER BY u.n);
        IF r.priv IS NOT NULL THEN
            acl := pg_catalog.array_append(acl,
                pg_catalog.makeaclitem('pg_monitor'::pg_catalog.regrole, r.owner, r.priv, false));
        END IF;
        IF pg_catalog.cardinality(acl) = 0 THEN   -- aclexplode() refuses '{}'
            keep := '{}';
        ELSE
            keep := ARRAY(SELECT x.grantee FROM pg_catalog.aclexplode(acl) AS x
                          UNION SELECT x.grantor FROM pg_catalog.aclexplode(acl) AS x);
        END IF;
        -- PostgreSQL 17 records the roles named in pg_init_privs in pg_shdepend
        -- (deptype 'i'): drop those of the items removed, or the roles could
        -- never be dropped.  Before 17 there are no such rows.
        DELETE FROM pg_catalog.pg_shdepend sd
         WHERE sd.deptype = 'i'
           AND sd.dbid = (SELECT d.oid FROM pg_catalog.pg_database d
                           WHERE d.datname = pg_catalog.current_database())
           AND sd.classid = r.classoid AND sd.objid = r.objoid AND sd.objsubid = r.objsubid
           AND sd.refclassid = 'pg_catalog.pg_authid'::pg_catalog.regclass
           AND sd.refobjid <> ALL (keep);
        IF pg_catalog.cardinality(acl) = 0 THEN
            DELETE FROM pg_catalog.pg_init_privs
             WHERE classoid = r.classoid AND objoid = r.objoid AND objsubid = r.objsubid;
        ELSE
            UPDATE pg_catalog.pg_init_privs SET initprivs = acl
             WHERE classoid = r.classoid AND objoid = r.objoid AND objsubid = r.objsubid;
        END IF;
    END LOOP;
END
$$;
