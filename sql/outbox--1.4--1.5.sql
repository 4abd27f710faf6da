/*
 * outbox--1.4--1.5.sql: the launcher's view of the server (issue 11).
 *
 * Adds outbox.cluster_status() for operators (pg_monitor): the launcher,
 * every relay of every database and the databases waiting for a worker
 * slot.  worker_status() and the status view keep their columns; they show
 * a waiting_for_slot row for a database the launcher cannot serve, which
 * their comments now say.  No table changes.
 */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION outbox UPDATE TO '1.5'" to load this file. \quit

/*
 * outbox.cluster_status(): the whole server for operators (pg_monitor), from
 * any database: the launcher, every relay of every database, and the
 * databases waiting for a worker slot.  Shared memory only: never blocks a
 * relay, never reads a table.
 */
CREATE FUNCTION outbox.cluster_status(
    OUT kind text,
    OUT database name,
    OUT pid integer,
    OUT state text,
    OUT published bigint,
    OUT failed bigint,
    OUT delivery_errors bigint,
    OUT last_publish_at timestamptz,
    OUT last_error text,
    OUT last_error_at timestamptz,
    OUT started_at timestamptz)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'outbox_cluster_status'
LANGUAGE C VOLATILE
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.cluster_status() IS
'The whole server, read from shared memory, from any database. First row: kind launcher, state running (not_running, pid NULL, while the postmaster restarts it), started_at. Then kind relay, one row per relay worker of every database, with the columns of outbox.worker_status() (counters since that worker started). Then kind relay, state waiting_for_slot, pid NULL, for each database covered by outbox.databases that has no relay because outbox.max_workers or max_worker_processes is used up (last_error says which, last_error_at since when; the first 256 such databases). No rows when the library is not in shared_preload_libraries. Executable by pg_monitor.';

COMMENT ON FUNCTION outbox.worker_status() IS
'One row per running relay worker of this database (of any database while outbox.databases is empty), read from shared memory: database, pid, state (starting, waiting_for_database, waiting_for_extension, not_configured, config_error, idle, publishing, broker_down, paused, error), events published, events marked failed and failed delivery attempts since the worker started, time of the last acknowledged event, last error text and time, and when the worker started. A database the launcher has no worker slot for has one row with state waiting_for_slot, no pid, and last_error saying which limit (outbox.max_workers or max_worker_processes) is used up since last_error_at. No rows when the library is not in shared_preload_libraries.';

COMMENT ON VIEW outbox.status IS
'Relay health: the worker''s state and counters since it started (from shared memory: published, failed = events marked failed, delivery_errors = failed attempts) with its table: pending events, the age of the oldest one, and failed_events (marked failed, waiting for outbox.retry_failed()); the table columns are NULL when queried from another database than the worker''s. State waiting_for_slot (no pid): this database has no relay because every worker slot is taken. Empty when no relay worker runs.';

REVOKE ALL ON FUNCTION outbox.cluster_status() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.cluster_status() TO pg_monitor;

/*
 * Initial privileges (rule 4 of outbox.sql).  The GRANTs and REVOKEs above
 * stored each object's ACL in pg_init_privs.  For the function this script
 * created that is the owner's items and pg_monitor's, unless the installing
 * role has default privileges (ALTER DEFAULT PRIVILEGES).  And
 * schema outbox may exist before CREATE EXTENSION (DROP EXTENSION leaves it,
 * with the users' grants, and pg_restore creates it first).  So reset them,
 * as every update path to this version does: the owner's items, and
 * pg_monitor's USAGE on the schema, EXECUTE on worker_status() and
 * cluster_status() and SELECT on status; no user's, no PUBLIC's.
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
