/*
 * outbox--1.3--1.4.sql: events tracked by commit snapshot (Relay v2).
 *
 * Adds the xid column (NULL for every event written before: they stay
 * tracked row by row, as in 1.3), outbox.relay_progress, outbox.published()
 * and a status view that counts both kinds of pending events.  Nothing
 * changes for the relay until outbox.relay_mode = snapshot.
 */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION outbox UPDATE TO '1.4'" to load this file. \quit

-- the view reads both tables: lock it first, in its readers' order (rule 3)
LOCK TABLE outbox.status, outbox.events IN ACCESS EXCLUSIVE MODE;

ALTER TABLE outbox.events ADD COLUMN xid pg_catalog.xid8;
COMMENT ON COLUMN outbox.events.xid IS
'Writing (top-level) transaction of an event tracked by snapshot (outbox.relay_mode = snapshot): the relay publishes it in the batch whose commit snapshot first shows that transaction, and never writes the row; published_at stays NULL, outbox.published(e) tells. NULL for an event tracked row by row (published_at, attempts, failed_at), as every event was before 1.4; replayed, failed and restored events are tracked row by row.';

/* row-tracked pending events only: events tracked by snapshot are never marked */
DROP INDEX outbox.events_pending_idx;
CREATE INDEX events_pending_idx ON outbox.events (id)
    WHERE published_at IS NULL AND xid IS NULL;

/*
 * The relay's batches find the events of late committers by transaction,
 * each transaction's in id order.  Row-tracked events (xid NULL) are left
 * out: in row mode the index stays empty and costs emit() nothing.
 */
CREATE INDEX events_xid_idx ON outbox.events (xid, id) WHERE xid IS NOT NULL;

/*
 * The relay's progress through events tracked by snapshot (snapshot.c): the
 * commit snapshot up to which every such event is published, and the id
 * floor read just before it was taken; batch_* describe a batch published
 * in chunks, up to batch_last_id.  One row, written by the relay in the
 * transaction of each batch.  pg_dump keeps it, with the system identifier
 * of the cluster it was written in: restored into another cluster (where
 * transaction ids mean something else), it tells the relay which restored
 * events were published; the relay then tracks them row by row and writes
 * a new row for this cluster.
 */
CREATE TABLE outbox.relay_progress (
    system_identifier bigint NOT NULL,
    snapshot        pg_catalog.pg_snapshot,
    id_floor        bigint NOT NULL DEFAULT 0,
    batch_snapshot  pg_catalog.pg_snapshot,
    batch_id_floor  bigint,
    batch_last_id   bigint
);
INSERT INTO outbox.relay_progress (system_identifier)
SELECT system_identifier FROM pg_catalog.pg_control_system();
SELECT pg_catalog.pg_extension_config_dump('outbox.relay_progress', '');

COMMENT ON TABLE outbox.relay_progress IS
'Relay progress through events tracked by snapshot (outbox.relay_mode = snapshot): one row per cluster the database was written in, normally one. Written by the relay only.';
COMMENT ON COLUMN outbox.relay_progress.system_identifier IS
'System identifier (pg_control_system()) of the cluster whose transaction ids snapshot refers to.';
COMMENT ON COLUMN outbox.relay_progress.snapshot IS
'Every event whose xid is visible in this commit snapshot is published. NULL before the first batch.';
COMMENT ON COLUMN outbox.relay_progress.id_floor IS
'Highest event id handed out before snapshot was taken: later events not visible in it have higher ids.';
COMMENT ON COLUMN outbox.relay_progress.batch_snapshot IS
'Snapshot of the batch being published in chunks; NULL between batches.';
COMMENT ON COLUMN outbox.relay_progress.batch_id_floor IS
'id_floor of batch_snapshot; NULL between batches.';
COMMENT ON COLUMN outbox.relay_progress.batch_last_id IS
'Events of the batch up to this id are published; NULL between batches.';

/*
 * outbox.published(e): whether an event is published, however it is
 * tracked.  An event tracked by snapshot has no published_at.
 */
CREATE FUNCTION outbox.published(e outbox.events)
RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
SELECT CASE WHEN e.xid IS NULL THEN e.published_at IS NOT NULL
       ELSE COALESCE((SELECT pg_catalog.pg_visible_in_snapshot(e.xid, p.snapshot)
                             OR (e.id <= p.batch_last_id
                                 AND pg_catalog.pg_visible_in_snapshot(e.xid, p.batch_snapshot))
                        FROM outbox.relay_progress AS p
                       WHERE p.system_identifier =
                             (SELECT c.system_identifier FROM pg_catalog.pg_control_system() AS c)
                       ORDER BY p.id_floor DESC LIMIT 1), false)
       END
$$;

COMMENT ON FUNCTION outbox.published(outbox.events) IS
'True if Kafka acknowledged the event: published_at is set (events tracked row by row), or the relay''s progress covers its transaction (events tracked by snapshot, which have no published_at). Call it as outbox.published(e) on a row e of outbox.events. Runs as the extension owner: callers need EXECUTE only (not granted to PUBLIC).';

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
       w.started_at
  FROM outbox.worker_status() AS w
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

COMMENT ON TABLE outbox.events IS
'Transactional outbox: one row per event, written in the producing transaction by outbox.emit() and relayed to Kafka in id order by the outbox relay worker. Rows are deleted outbox.retention after they were published (events tracked by snapshot: once published and created more than outbox.retention ago). Events Kafka refused outbox.max_attempts times are marked failed (failed_at) and wait for outbox.retry_failed(). outbox.published(e) tells whether an event is published.';
COMMENT ON COLUMN outbox.events.published_at IS
'When Kafka acknowledged the event (acks=all); NULL while it is not yet published, and always NULL for an event tracked by snapshot (xid set): outbox.published(e) tells.';
COMMENT ON FUNCTION outbox.replay(timestamptz) IS
'Publishes again every event created at or after since that is still kept (published, not yet deleted by outbox.retention): marks them unpublished (tracked row by row from then on), so the relay sends them again in id order with their original event ids. Returns the number of events requeued.';
COMMENT ON FUNCTION outbox.purge(interval) IS
'Deletes now the published events published more than older_than ago (''0'' = all published events); for events tracked by snapshot, which have no published_at, created more than older_than ago. Pending and failed events are never deleted. Returns the number deleted. Error 22023 for a negative interval.';

REVOKE ALL ON TABLE outbox.relay_progress FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.published(outbox.events) FROM PUBLIC;

/*
 * Initial privileges (rule 4 above).  The GRANTs and REVOKEs above stored
 * each object's ACL in pg_init_privs.  For objects this script created that is
 * the owner's items and pg_monitor's, unless the installing role has default
 * privileges (ALTER DEFAULT PRIVILEGES), which every new object gets.  And
 * schema outbox may exist before CREATE EXTENSION (DROP EXTENSION leaves it,
 * with the users' grants, and pg_restore creates it first).  So reset them,
 * as every update path to this version does: the owner's items, and
 * pg_monitor's USAGE on the schema, EXECUTE on worker_status() and SELECT on
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
