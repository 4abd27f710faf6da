/*
 * outbox--1.8--1.9.sql: the inbox for producers and operators that are not
 * the relay (issue 36), a worker per subscription, and its speed (issue 37).
 *
 * 1. One set of positions: outbox.inbox_seek(subscription, topic,
 *    kafka_partition, position text) takes what subscribe()'s start_from
 *    takes (earliest, latest, an offset, a timestamp; '-infinity' and
 *    'infinity' as earliest and latest), so that
 *    inbox_seek(name, topic, NULL, 'latest') resolves to one function.
 * 2. Role outbox_subscriber (NOLOGIN, made unless it exists: roles belong to
 *    the cluster) carries every grant a subscribing role needs, as
 *    pg_monitor does for monitoring: GRANT outbox_subscriber TO app.
 * 3. Row-level security on outbox.subscriptions and outbox.inbox_dead: a
 *    subscriber reads the rows of the subscriptions whose owner's privileges
 *    it has.  The extension's functions, its worker and outbox.inbox_status
 *    read them as the tables' owner or a superuser, whom no policy binds.
 * 4. unsubscribe() keeps the subscription's seen ids for the dedupe window
 *    (the library's change); its comment and subscribe()'s say what a
 *    subscription of the same name does then.
 * 5. outbox.inbox_status reads the new rows of
 *    outbox.inbox_worker_partitions() (one for the database's inbox
 *    launcher, one per inbox worker, one per partition), shows the states
 *    failing and waiting_for_worker, the pid of the worker that applies
 *    each partition, and lag = high_watermark - next_offset in every state
 *    (it was NULL while paused and clamped at 0 for a stalled partition).
 *    Same columns: CREATE OR REPLACE VIEW keeps the view and its grants.
 * 6. The comments of the view, of inbox_worker_partitions() and of
 *    cluster_status() (kind inbox_launcher) say so.
 * 7. outbox.inbox_offsets gets a witness per partition (offset and
 *    fingerprint of the last applied record) that tells a topic deleted
 *    and created again from the old one (issue 36, item 2).  Added at the
 *    end, as a fresh install has them.
 * 8. subscribe() takes a batch handler, h(events outbox.inbox_event[])
 *    (issue 37): its comment says so.
 * 9. Queue mode drains a hot key (issue 37): outbox.inbox_keys, one row
 *    per key with pending events, filled from outbox.inbox here;
 *    inbox_take() locks key rows instead of walking the backlog.
 *
 * The script ends by resetting pg_init_privs to what a fresh install
 * records (rule 4 of outbox.sql), with outbox_subscriber's grants beside
 * pg_monitor's.
 */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION outbox UPDATE TO '1.9'" to load this file. \quit

DO $role$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'outbox_subscriber') THEN
        CREATE ROLE outbox_subscriber NOLOGIN;
    END IF;
END
$role$;
COMMENT ON ROLE outbox_subscriber IS
'Made by CREATE EXTENSION outbox (1.9): may use the inbox''s SQL API and read outbox.inbox_status, and the rows of outbox.subscriptions and outbox.inbox_dead of the subscriptions whose owner''s privileges the reader has. GRANT outbox_subscriber TO a role that subscribes.';

CREATE FUNCTION outbox.inbox_seek(subscription text, topic text, kafka_partition integer,
                                  start_from text)
RETURNS bigint
AS 'MODULE_PATHNAME', 'outbox_inbox_seek_position'
LANGUAGE C VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.inbox_seek(text, text, integer, text) IS
'As outbox.inbox_seek(text, text, integer, bigint), to start_from, a position written as subscribe()''s start_from is: earliest (or ''-infinity''), latest (or ''infinity''), an offset, or a timestamp (the first record at or after it). Errors 22023 a negative offset, a topic the subscription does not consume or a partition it does not know; 22007 anything else that is no timestamp.';

COMMENT ON FUNCTION outbox.inbox_seek(text, text, integer, bigint) IS
'Moves a partition''s next offset to kafka_offset (kafka_partition NULL: every known partition of the topic) when the calling transaction commits; a batch the worker is applying meanwhile rolls back (compare-and-set) and the worker goes on from the new offset. The way out of state stalled. Records skipped are not applied, records passed again are (dedupe still drops ids seen within the window); an offset past the end stalls the partition until it is sought again. Returns the partitions moved. Same rights as outbox.unsubscribe(); errors 42704 no such subscription, 22023 a negative offset, a topic the subscription does not consume, or a partition it does not know (the hint lists those it knows).';


COMMENT ON FUNCTION outbox.unsubscribe(text) IS
'Drops a subscription with its offsets, queued events and dead letters (a WARNING counts the events and dead letters dropped). Its seen event ids stay until outbox.inbox_dedupe_window has passed: subscribing again with the same name starts the offsets again from the start_from given, skips the events whose ids were applied within the window, and applies again the events without an id. The caller must be the owner or a member of it, or a superuser. Error 42704 if there is no such subscription.';

COMMENT ON COLUMN outbox.subscriptions.start_from IS
'Where partitions known at the first start begin: earliest, latest, an offset or a timestamp. Partitions and topics that appear later always begin at their first offset.';

COMMENT ON TABLE outbox.inbox_seen IS
'Event ids the inbox applied, per subscription name, in two slots (partitions) that take turns: ids are kept at least outbox.inbox_dedupe_window and are dropped a slot at a time, never row by row, also after outbox.unsubscribe() (a subscription of the same name still skips them). Written by the inbox worker only.';

/* row-level security: a subscriber reads its own subscriptions and dead letters */
ALTER TABLE outbox.subscriptions ENABLE ROW LEVEL SECURITY;
CREATE POLICY subscriptions_of_the_owner ON outbox.subscriptions FOR SELECT
    USING (pg_catalog.pg_has_role(owner::pg_catalog.oid, 'USAGE'));
COMMENT ON POLICY subscriptions_of_the_owner ON outbox.subscriptions IS
'A reader sees the subscriptions whose owner''s privileges it has (those it may manage). Superusers and the table''s owner (the extension''s functions and worker) see all.';

ALTER TABLE outbox.inbox_dead ENABLE ROW LEVEL SECURITY;
CREATE POLICY dead_letters_of_the_owner ON outbox.inbox_dead FOR SELECT
    USING (EXISTS (SELECT 1 FROM outbox.subscriptions AS s
                    WHERE s.name = inbox_dead.subscription
                      AND pg_catalog.pg_has_role(s.owner::pg_catalog.oid, 'USAGE')));
COMMENT ON POLICY dead_letters_of_the_owner ON outbox.inbox_dead IS
'A reader sees the dead letters of the subscriptions whose owner''s privileges it has. Superusers and the table''s owner (the extension''s functions and worker) see all.';

COMMENT ON TABLE outbox.subscriptions IS
'Inbox subscriptions of this database, one row each: written by outbox.subscribe(), outbox.unsubscribe(), outbox.pause_subscription() and outbox.resume_subscription(), never directly. A reader other than a superuser sees the rows whose owner''s privileges it has (row-level security). pg_dump keeps them.';
COMMENT ON TABLE outbox.inbox_dead IS
'Inbox dead letters: events whose handler failed (held false: error, sqlstate, attempts) and, with on_failed_event = hold, later events of the same topic and key that wait behind them (held true). outbox.inbox_retry() applies them again in id order. A reader other than a superuser sees those of the subscriptions whose owner''s privileges it has (row-level security).';

REVOKE ALL ON FUNCTION outbox.inbox_seek(text, text, integer, text) FROM PUBLIC;

/* outbox_subscriber: what a subscribing role needs, as pg_monitor has the status */
GRANT USAGE ON SCHEMA outbox TO outbox_subscriber;
GRANT EXECUTE ON FUNCTION outbox.subscribe(text, text[], regprocedure, text, boolean, text),
      outbox.unsubscribe(text), outbox.pause_subscription(text), outbox.resume_subscription(text),
      outbox.inbox_seek(text, text, integer, bigint), outbox.inbox_seek(text, text, integer, timestamptz),
      outbox.inbox_seek(text, text, integer, text), outbox.inbox_retry(text, text),
      outbox.inbox_take(text, integer), outbox.inbox_worker_partitions() TO outbox_subscriber;
GRANT SELECT ON TABLE outbox.inbox_status, outbox.subscriptions, outbox.inbox_dead TO outbox_subscriber;

/* the workers per subscription, the witness, batch handlers, queue keys (issue 36, 37) */
ALTER TABLE outbox.inbox_offsets
    ADD COLUMN witness_offset bigint,
    ADD COLUMN witness_hash bigint;
COMMENT ON COLUMN outbox.inbox_offsets.witness_offset IS
'The offset of the last record applied from this partition (schema 1.9), or NULL (none yet, or a seek moved the offset): before a batch that goes on right after it commits, the inbox reads the record at this offset from Kafka again and stalls the partition if it is another one (the topic was deleted and created again).';
COMMENT ON COLUMN outbox.inbox_offsets.witness_hash IS
'A fingerprint (timestamp, key, value) of the record at witness_offset (schema 1.9).';

CREATE OR REPLACE VIEW outbox.inbox_status AS
WITH live AS MATERIALIZED (SELECT * FROM outbox.inbox_worker_partitions())
SELECT r.subscription,
       r.topic,
       r.kafka_partition,
       CASE WHEN r.next_offset >= 0 THEN r.next_offset END AS next_offset,
       p.high_watermark,
       CASE WHEN r.next_offset >= 0 AND p.high_watermark IS NOT NULL
            THEN p.high_watermark - r.next_offset END AS lag,
       r.applied,
       r.duplicates,
       COALESCE(d.dead_letters, 0) AS dead_letters,
       COALESCE(d.held, 0) AS held,
       CASE WHEN r.copy THEN 'restored_copy'
            WHEN l.state IS NULL THEN 'not_running'
            WHEN w.state IS NULL AND l.state = 'waiting_for_worker' THEN 'waiting_for_worker'
            WHEN w.state IS NULL THEN CASE WHEN r.paused THEN 'paused' ELSE 'starting' END
            WHEN r.paused THEN 'paused'
            WHEN w.state IN ('broker_down', 'config_error', 'not_configured', 'waiting_for_worker', 'failing') THEN w.state
            WHEN p.state IS NOT NULL THEN p.state
            WHEN w.state <> 'running' THEN w.state
            ELSE 'starting' END AS state,
       CASE WHEN r.copy THEN 'restored from another cluster or database: SELECT outbox.resume_subscription(' ||
                             pg_catalog.quote_literal(r.subscription) || ') applies events here'
            WHEN w.state IS NULL THEN l.last_error
            WHEN w.state IN ('broker_down', 'config_error', 'not_configured', 'waiting_for_worker', 'failing') THEN w.last_error
            ELSE COALESCE(p.last_error, w.last_error) END AS last_error,
       CASE WHEN w.state IS NULL THEN l.last_error_at
            WHEN w.state IN ('broker_down', 'config_error', 'not_configured', 'waiting_for_worker', 'failing') OR p.last_error IS NULL
            THEN w.last_error_at ELSE p.last_error_at END AS last_error_at,
       p.last_applied_at,
       COALESCE(p.pid, w.pid) AS pid
  FROM (SELECT s.name AS subscription, o.topic, o.kafka_partition, o.next_offset, o.applied,
               o.duplicates, s.paused, c.copy
          FROM outbox.subscriptions AS s
          JOIN outbox.inbox_offsets AS o ON o.subscription = s.name
         CROSS JOIN LATERAL (SELECT s.system_identifier <>
                                    (SELECT x.system_identifier FROM pg_catalog.pg_control_system() AS x)
                                    OR (s.database_oid <> (SELECT b.oid FROM pg_catalog.pg_database AS b
                                                            WHERE b.datname = pg_catalog.current_database())
                                        AND s.database_name <> pg_catalog.current_database()) AS copy) AS c
        UNION ALL
        SELECT s.name, t.topic, NULL, NULL, 0, 0, s.paused, c.copy
          FROM outbox.subscriptions AS s
         CROSS JOIN LATERAL pg_catalog.unnest(s.topics) AS t(topic)
         CROSS JOIN LATERAL (SELECT s.system_identifier <>
                                    (SELECT x.system_identifier FROM pg_catalog.pg_control_system() AS x)
                                    OR (s.database_oid <> (SELECT b.oid FROM pg_catalog.pg_database AS b
                                                            WHERE b.datname = pg_catalog.current_database())
                                        AND s.database_name <> pg_catalog.current_database()) AS copy) AS c
         WHERE NOT EXISTS (SELECT 1 FROM outbox.inbox_offsets AS o
                            WHERE o.subscription = s.name AND o.topic = t.topic)) AS r
  LEFT JOIN (SELECT x.state, x.last_error, x.last_error_at
               FROM live AS x WHERE x.subscription IS NULL) AS l ON true
  LEFT JOIN live AS p
         ON p.subscription = r.subscription AND p.topic = r.topic
        AND p.kafka_partition = COALESCE(r.kafka_partition, -1)
  LEFT JOIN LATERAL (SELECT x.pid, x.state, x.last_error, x.last_error_at
                       FROM live AS x
                      WHERE x.subscription = r.subscription AND x.topic IS NULL
                      ORDER BY x.pid IS NOT DISTINCT FROM p.pid DESC, x.state = 'running'
                      LIMIT 1) AS w ON true
  LEFT JOIN LATERAL (SELECT pg_catalog.count(*) FILTER (WHERE NOT x.held) AS dead_letters,
                            pg_catalog.count(*) FILTER (WHERE x.held) AS held
                       FROM outbox.inbox_dead AS x
                      WHERE x.subscription = r.subscription AND x.topic = r.topic
                        AND x.kafka_partition = r.kafka_partition) AS d ON true;

COMMENT ON VIEW outbox.inbox_status IS
'Inbox health, one row per subscription, topic and partition (kafka_partition NULL for a topic that does not exist yet): next_offset (NULL until the first record of a partition placed at its start or end), high_watermark from Kafka and lag = high_watermark - next_offset in every state (paused and stalled included; negative when next_offset is beyond the end), records applied and duplicates dropped in total, dead_letters (handler failed) and held (waiting behind one), state (starting, running, paused, stalled: Kafka no longer has next_offset, see outbox.inbox_seek(); failing: the subscription''s last 10 or more events all became dead letters; waiting_for_topic, waiting_for_worker: outbox.inbox_max_workers or max_worker_processes used up, restored_copy, not_running, not_configured, config_error, broker_down, error) with the last error, the last apply and the pid of the inbox worker that applies the partition.';
COMMENT ON FUNCTION outbox.inbox_worker_partitions() IS
'What the inbox of this database shows in shared memory (schema 1.9): one row for its inbox launcher (subscription and topic NULL: state running, or waiting_for_worker when a subscription has no worker), one per inbox worker (subscription set, topic NULL: state starting, running, paused, failing, not_configured, config_error, broker_down, error or waiting_for_worker with pid NULL) and one per partition a worker applies (high watermark, state running, paused, stalled or error, last error, last apply); kafka_partition -1 for a topic that does not exist yet (state waiting_for_topic). No rows when no inbox launcher runs. Executable by pg_monitor.';
COMMENT ON FUNCTION outbox.cluster_status() IS
'The whole server, read from shared memory, from any database. First row: kind launcher, state running (not_running, pid NULL, while the postmaster restarts it), started_at. Then kind relay, one row per relay worker of every database, with the columns of outbox.worker_status() (counters since that worker started). Then kind relay, state waiting_for_slot, pid NULL, for each database covered by outbox.databases that has no relay because outbox.max_workers or max_worker_processes is used up (last_error says which, last_error_at since when; the first 256 such databases). Then kind inbox_launcher, one row per database inbox launcher (schema 1.9: state running, or waiting_for_worker), and kind inbox, one row per inbox worker, one or more per subscription (schema 1.8): published = records it applied, failed = dead letters, delivery_errors = failed handler calls, last_publish_at = its last apply, since it started; state starting, running, paused, failing, not_configured, config_error, broker_down, error, or waiting_for_worker with pid NULL (per partition: outbox.inbox_status). No rows when the library is not in shared_preload_libraries. Executable by pg_monitor.';

COMMENT ON FUNCTION outbox.subscribe(text, text[], regprocedure, text, boolean, text) IS
'Subscribes this database to Kafka topics (exact names) when the calling transaction commits. handler(e outbox.inbox_event) is called once per event, or handler(events outbox.inbox_event[]) once per batch with the batch''s new events in arrival order (schema 1.9), as the calling role, in the transaction that records the events'' Kafka offsets; NULL queues the events in outbox.inbox for outbox.inbox_take(). on_failed_event: hold (later events of a failed event''s key wait) or skip; dedupe: drop events whose event_id was applied within outbox.inbox_dedupe_window, also by a former subscription of the same name (a NOTICE says when there is one); start_from: earliest (or ''-infinity''), latest (or ''infinity''), an offset or a timestamp. The caller needs EXECUTE on the handler; a superuser may subscribe only when outbox.inbox_superuser_subscriptions is on. Errors: 22023 bad name, topics, option or start_from (22007: a start_from that is no timestamp); 42710 a subscription of that name exists; 42P13 the handler is not a function of one outbox.inbox_event or outbox.inbox_event[] argument; 42501 no EXECUTE on the handler, or a superuser not allowed.';

CREATE TABLE outbox.inbox_keys (
    subscription    text NOT NULL,
    topic           text NOT NULL,
    key             text NOT NULL,
    first_id        bigint NOT NULL,
    pending         bigint NOT NULL,
    PRIMARY KEY (subscription, topic, key)
) WITH (fillfactor = 50);
CREATE INDEX inbox_keys_first_idx ON outbox.inbox_keys (subscription, first_id);
CREATE INDEX inbox_nokey_idx ON outbox.inbox (subscription, id) WHERE key IS NULL;
SELECT pg_catalog.pg_extension_config_dump('outbox.inbox_keys', '');

COMMENT ON TABLE outbox.inbox_keys IS
'Queue mode: one row per subscription, topic and key that has pending events in outbox.inbox, with the lowest pending id (schema 1.9); outbox.inbox_take() locks these rows so that one taker drains a key while the others skip it.';
COMMENT ON COLUMN outbox.inbox_keys.subscription IS
'The subscription.';
COMMENT ON COLUMN outbox.inbox_keys.topic IS
'The Kafka topic.';
COMMENT ON COLUMN outbox.inbox_keys.key IS
'The message key (events without a key have no row: they have no order to keep).';
COMMENT ON COLUMN outbox.inbox_keys.first_id IS
'The lowest outbox.inbox.id of the key''s pending events: keys are taken oldest first.';
COMMENT ON COLUMN outbox.inbox_keys.pending IS
'How many events of the key are pending: a take locks keys until they hold the events it may return.';
REVOKE ALL ON TABLE outbox.inbox_keys FROM PUBLIC;
INSERT INTO outbox.inbox_keys (subscription, topic, key, first_id, pending)
SELECT subscription, topic, key, pg_catalog.min(id), pg_catalog.count(*) FROM outbox.inbox
 WHERE key IS NOT NULL GROUP BY subscription, topic, key;

COMMENT ON FUNCTION outbox.inbox_take(text, integer) IS
'Queue mode: deletes and returns up to max events of the subscription from outbox.inbox, in id order, inside the calling transaction: several events of a key in key order, from the keys with the oldest pending events, skipping keys (and key-less events) other transactions took and have not committed, so that two takers never reorder a key (schema 1.9; each call costs what it returns). A rolled-back take gives them back; a committed one applied them exactly once. The caller must be the owner or a member of it, or a superuser. Errors: 42704 no such subscription, 22023 max below 1, or a subscription with a handler (its events are applied, not queued).';

/* initial privileges: as at the end of outbox.sql */
DO $$
DECLARE
    r record;
    acl pg_catalog.aclitem[];
    keep pg_catalog.oid[];
BEGIN
    FOR r IN
        WITH granted(classoid, objoid, grantee, priv, n) AS (
            VALUES ('pg_catalog.pg_namespace'::pg_catalog.regclass,
                    'outbox'::pg_catalog.regnamespace::pg_catalog.oid, 'pg_monitor'::pg_catalog.regrole, 'USAGE', 1),
                   ('pg_catalog.pg_proc', 'outbox.worker_status()'::pg_catalog.regprocedure, 'pg_monitor', 'EXECUTE', 1),
                   ('pg_catalog.pg_proc', 'outbox.cluster_status()'::pg_catalog.regprocedure, 'pg_monitor', 'EXECUTE', 1),
                   ('pg_catalog.pg_proc', 'outbox.worker_buckets()'::pg_catalog.regprocedure, 'pg_monitor', 'EXECUTE', 1),
                   ('pg_catalog.pg_class', 'outbox.status'::pg_catalog.regclass, 'pg_monitor', 'SELECT', 1),
                   ('pg_catalog.pg_proc', 'outbox.inbox_worker_partitions()'::pg_catalog.regprocedure, 'pg_monitor', 'EXECUTE', 1),
                   ('pg_catalog.pg_class', 'outbox.inbox_status'::pg_catalog.regclass, 'pg_monitor', 'SELECT', 1),
                   ('pg_catalog.pg_namespace', 'outbox'::pg_catalog.regnamespace, 'outbox_subscriber', 'USAGE', 2),
                   ('pg_catalog.pg_proc', 'outbox.subscribe(text, text[], regprocedure, text, boolean, text)'::pg_catalog.regprocedure, 'outbox_subscriber', 'EXECUTE', 2),
                   ('pg_catalog.pg_proc', 'outbox.unsubscribe(text)'::pg_catalog.regprocedure, 'outbox_subscriber', 'EXECUTE', 2),
                   ('pg_catalog.pg_proc', 'outbox.pause_subscription(text)'::pg_catalog.regprocedure, 'outbox_subscriber', 'EXECUTE', 2),
                   ('pg_catalog.pg_proc', 'outbox.resume_subscription(text)'::pg_catalog.regprocedure, 'outbox_subscriber', 'EXECUTE', 2),
                   ('pg_catalog.pg_proc', 'outbox.inbox_seek(text, text, integer, bigint)'::pg_catalog.regprocedure, 'outbox_subscriber', 'EXECUTE', 2),
                   ('pg_catalog.pg_proc', 'outbox.inbox_seek(text, text, integer, timestamptz)'::pg_catalog.regprocedure, 'outbox_subscriber', 'EXECUTE', 2),
                   ('pg_catalog.pg_proc', 'outbox.inbox_seek(text, text, integer, text)'::pg_catalog.regprocedure, 'outbox_subscriber', 'EXECUTE', 2),
                   ('pg_catalog.pg_proc', 'outbox.inbox_retry(text, text)'::pg_catalog.regprocedure, 'outbox_subscriber', 'EXECUTE', 2),
                   ('pg_catalog.pg_proc', 'outbox.inbox_take(text, integer)'::pg_catalog.regprocedure, 'outbox_subscriber', 'EXECUTE', 2),
                   ('pg_catalog.pg_proc', 'outbox.inbox_worker_partitions()'::pg_catalog.regprocedure, 'outbox_subscriber', 'EXECUTE', 2),
                   ('pg_catalog.pg_class', 'outbox.inbox_status'::pg_catalog.regclass, 'outbox_subscriber', 'SELECT', 2),
                   ('pg_catalog.pg_class', 'outbox.subscriptions'::pg_catalog.regclass, 'outbox_subscriber', 'SELECT', 2),
                   ('pg_catalog.pg_class', 'outbox.inbox_dead'::pg_catalog.regclass, 'outbox_subscriber', 'SELECT', 2))
        SELECT ip.classoid, ip.objoid, ip.objsubid, ip.initprivs, o.owner,
               ARRAY(SELECT pg_catalog.makeaclitem(g.grantee, o.owner, g.priv, false)
                       FROM granted AS g
                      WHERE g.classoid = ip.classoid AND g.objoid = ip.objoid AND ip.objsubid = 0
                      ORDER BY g.n) AS extra
          FROM pg_catalog.pg_init_privs ip
         CROSS JOIN LATERAL (SELECT CASE ip.classoid
                   WHEN 'pg_catalog.pg_class'::pg_catalog.regclass THEN
                       (SELECT c.relowner FROM pg_catalog.pg_class c WHERE c.oid = ip.objoid)
                   WHEN 'pg_catalog.pg_proc'::pg_catalog.regclass THEN
                       (SELECT p.proowner FROM pg_catalog.pg_proc p WHERE p.oid = ip.objoid)
                   WHEN 'pg_catalog.pg_namespace'::pg_catalog.regclass THEN
                       (SELECT n.nspowner FROM pg_catalog.pg_namespace n WHERE n.oid = ip.objoid)
               END AS owner) AS o
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
        -- then pg_monitor's and outbox_subscriber's, in the order they were granted
        acl := acl || r.extra;
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
