/*
 * outbox--1.7--1.8.sql: outbox.status counts every pending event; event ids
 * are time-ordered (outbox.uuidv7()).
 *
 * The pending count (and oldest_pending_age) of outbox.status missed an
 * event tracked by snapshot whose id is at most the progress's id floor
 * and whose transaction got its xid at or after the progress snapshot's
 * xmax: a transaction running when the relay took its snapshot, but not in
 * its xip list (issue 27).  Such an event was pending while the view said
 * 0.  CREATE OR REPLACE VIEW keeps the view and its grants.
 *
 * New events get a time-ordered id (UUID version 7, outbox.uuidv7(), C on
 * every major): each insert then goes to the rightmost page of the unique
 * index on event_id instead of a random one (bench/README.md, section 1).
 * The events already written keep their random ids; nothing sorts by
 * event_id.  The view is replaced first, then the table altered: the order
 * its readers lock them in (rule 3 of sql/outbox.sql).
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

CREATE FUNCTION outbox.uuidv7()
RETURNS uuid
AS 'MODULE_PATHNAME', 'outbox_uuidv7'
LANGUAGE C VOLATILE PARALLEL SAFE;

COMMENT ON FUNCTION outbox.uuidv7() IS
'Returns a new time-ordered UUID (version 7, RFC 9562): 48 bits of Unix time in milliseconds, 12 bits of the millisecond''s fraction, 62 random bits. The ids of one session increase strictly; across sessions they are ordered by time to within the clocks'' resolution. The default of outbox.events.event_id (since 1.8). Callers need EXECUTE (not granted to PUBLIC).';

REVOKE ALL ON FUNCTION outbox.uuidv7() FROM PUBLIC;

ALTER TABLE outbox.events ALTER COLUMN event_id SET DEFAULT outbox.uuidv7();

COMMENT ON COLUMN outbox.events.event_id IS
'Globally unique event id, sent as the Kafka header "id"; consumers de-duplicate on it (delivery is at-least-once). Time-ordered (UUID version 7, outbox.uuidv7()) since 1.8; events written before are random (version 4).';

/*
 * Initial privileges (rule 4 of outbox.sql).  The REVOKE above stored the
 * new function's ACL in pg_init_privs: the owner's items, and any role's
 * the installing role's default privileges (ALTER DEFAULT PRIVILEGES) gave
 * it.  So reset them, as every update path to this version
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
