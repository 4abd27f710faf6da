/*
 * outbox--1.8--1.9.sql: the inbox runs a worker per subscription (issue
 * 36: one slow or failing handler no longer stops the others; issue 37:
 * outbox.inbox_workers_per_subscription workers share a subscription's
 * partitions), and its status tells the truth.
 *
 * 1. outbox.inbox_status reads the new rows of
 *    outbox.inbox_worker_partitions() (one for the database's inbox
 *    launcher, one per inbox worker, one per partition), shows the states
 *    failing and waiting_for_worker, the pid of the worker that applies
 *    each partition, and lag = high_watermark - next_offset in every state
 *    (it was NULL while paused and clamped at 0 for a stalled partition).
 *    Same columns: CREATE OR REPLACE VIEW keeps the view and its grants.
 * 2. The comments of the view, of inbox_worker_partitions() and of
 *    cluster_status() (kind inbox_launcher) say so.
 * 5. Queue mode drains a hot key (issue 37): outbox.inbox_keys, one row
 *    per key with pending events, filled from outbox.inbox here;
 *    inbox_take() locks key rows instead of walking the backlog.
 * 4. subscribe() takes a batch handler, h(events outbox.inbox_event[])
 *    (issue 37): its comment says so.
 * 3. outbox.inbox_offsets gets a witness per partition (offset and
 *    fingerprint of the last applied record) that tells a topic deleted
 *    and created again from the old one (issue 36, item 2).  Added at the
 *    end, as a fresh install has them.
 */

\echo Use "ALTER EXTENSION outbox UPDATE TO '1.9'" to load this file. \quit

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
                        AND x.kafka_partition = r.kafka_partition) AS
COMMENT ON VIEW outbox.inbox_status IS
'Inbox health, one row per subscription, topic and partition (kafka_partition NULL for a topic that does not exist yet): next_offset (NULL until the first record of a partition placed at its start or end), high_watermark from Kafka and lag = high_watermark - next_offset in every state (paused and stalled included; negative when next_offset is beyond the end), records applied and duplicates dropped in total, dead_letters (handler failed) and held (waiting behind one), state (starting, running, paused, stalled: Kafka no longer has next_offset, see outbox.inbox_seek(); failing: the subscription''s last 10 or more events all became dead letters; waiting_for_topic, waiting_for_worker: outbox.inbox_max_workers or max_worker_processes used up, restored_copy, not_running, not_configured, config_error, broker_down, error) with the last error, the last apply and the pid of the inbox worker that applies the partition.';
COMMENT ON FUNCTION outbox.inbox_worker_partitions() IS
'What the inbox of this database shows in shared memory (schema 1.9): one row for its inbox launcher (subscription and topic NULL: state running, or waiting_for_worker when a subscription has no worker), one per inbox worker (subscription set, topic NULL: state starting, running, paused, failing, not_configured, config_error, broker_down, error or waiting_for_worker with pid NULL) and one per partition a worker applies (high watermark, state running, paused, stalled or error, last error, last apply); kafka_partition -1 for a topic that does not exist yet (state waiting_for_topic). No rows when no inbox launcher runs. Executable by pg_monitor.';
COMMENT ON FUNCTION outbox.cluster_status() IS
'The whole server, read from shared memory, from any database. First row: kind launcher, state running (not_running, pid NULL, while the postmaster restarts it), started_at. Then kind relay, one row per relay worker of every database, with the columns of outbox.worker_status() (counters since that worker started). Then kind relay, state waiting_for_slot, pid NULL, for each database covered by outbox.databases that has no relay because outbox.max_workers or max_worker_processes is used up (last_error says which, last_error_at since when; the first 256 such databases). Then kind inbox_launcher, one row per database inbox launcher (schema 1.9: state running, or waiting_for_worker), and kind inbox, one row per inbox worker, one or more per subscription (schema 1.8): published = records it applied, failed = dead letters, delivery_errors = failed handler calls, last_publish_at = its last apply, since it started; state starting, running, paused, failing, not_configured, config_error, broker_down, error, or waiting_for_worker with pid NULL (per partition: outbox.inbox_status). No rows when the library is not in shared_preload_libraries. Executable by pg_monitor.';

COMMENT ON FUNCTION outbox.subscribe(text, text[], regprocedure, text, boolean, text) IS
'Subscribes this database to Kafka topics (exact names) when the calling transaction commits. handler(e outbox.inbox_event) is called once per event, or handler(events outbox.inbox_event[]) once per batch with the batch''s new events in arrival order (schema 1.9), as the calling role, in the transaction that records the events'' Kafka offsets; NULL queues the events in outbox.inbox for outbox.inbox_take(). on_failed_event: hold (later events of a failed event''s key wait) or skip; dedupe: drop events whose event_id was applied within outbox.inbox_dedupe_window; start_from: earliest, latest or a timestamp. The caller needs EXECUTE on the handler; a superuser may subscribe only when outbox.inbox_superuser_subscriptions is on. Errors: 22023 bad name, topics, option or start_from; 42710 a subscription of that name exists; 42P13 the handler is not a function of one outbox.inbox_event argument; 42501 no EXECUTE on the handler, or a superuser not allowed.';

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
