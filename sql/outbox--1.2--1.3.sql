/*
 * outbox--1.2--1.3.sql: autovacuum settings that keep outbox.events small.
 * A fresh 1.3 install runs sql/outbox.sql instead (built as outbox--1.3.sql);
 * test/integration/test_17_dump_upgrade.py checks that both give the same
 * catalog.
 */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION outbox UPDATE TO '1.3'" to load this file. \quit

/*
 * Every event is written twice (the INSERT of emit() and the UPDATE that
 * marks it published; that UPDATE cannot be HOT, published_at being in the
 * partial indexes' predicates) and deleted once by the retention.  With the
 * default thresholds (20% of the table) autovacuum comes ever later as the
 * table grows, and the space of deleted events is reused late.  Vacuum this
 * table whenever 10,000 rows are dead, without cost-based throttling: its
 * dead rows are the oldest, and the table is small when vacuumed often.
 */
ALTER TABLE outbox.events SET (
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_cost_delay = 0
);

/*
 * The states outbox.worker_status() shows, with those added since 1.0.
 */
COMMENT ON FUNCTION outbox.worker_status() IS
'One row per running relay worker, read from shared memory: database, pid, state (starting, waiting_for_database, waiting_for_extension, not_configured, config_error, idle, publishing, broker_down, paused, error), events published, events marked failed and failed delivery attempts since the worker started, time of the last acknowledged event, last error text and time, and when the worker started. No rows when the library is not in shared_preload_libraries.';

/*
 * Initial privileges.  While an extension script runs, every GRANT or REVOKE
 * stores the object's whole ACL in pg_init_privs, and pg_dump dumps only what
 * differs from it.  outbox--1.1--1.2.sql revokes and grants on objects that
 * existed before it ran, and CREATE EXTENSION grants on schema outbox, which
 * DROP EXTENSION leaves behind with its grants: the users' grants found there
 * became "the extension's own", pg_dump left them out (a restored database
 * lacked them), and roles dropped later stayed there as OIDs that break
 * pg_restore.  So on every path to 1.3, reset them to what a fresh install
 * grants: the owner's items, and pg_monitor's USAGE on the schema, EXECUTE on
 * worker_status() and SELECT on status; no user's, no PUBLIC's.  Any later
 * update script that GRANTs or REVOKEs on existing objects must end with this
 * again (with its own list): rule 4 of "Rules for update scripts" at the top
 * of sql/outbox.sql, which ends with the same block.
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
