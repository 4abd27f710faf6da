/*
 * outbox--1.7--1.8.sql: outbox.status counts every pending event (issue
 * 27), event ids are time-ordered (issue 31), and the inbox (issue 30),
 * the receiving side.
 *
 * 1. The pending count (and oldest_pending_age) of outbox.status missed an
 *    event tracked by snapshot whose id is at most the progress's id floor
 *    and whose transaction got its xid at or after the progress snapshot's
 *    xmax: a transaction running when the relay took its snapshot, but not
 *    in its xip list.  Such an event was pending while the view said 0.
 *    CREATE OR REPLACE VIEW keeps the view and its grants.
 * 2. New events get a time-ordered id (UUID version 7, outbox.uuidv7(), C
 *    on every major): each insert then goes to the rightmost page of the
 *    unique index on event_id instead of a random one (bench/README.md,
 *    section 1).  The events already written keep their random ids;
 *    nothing sorts by event_id.  The view is replaced first, then the
 *    table altered: the order its readers lock them in (rule 3 of
 *    sql/outbox.sql).
 * 3. The inbox: the subscriptions, their Kafka offsets, the seen event ids,
 *    the queue-mode inbox and the dead letters, the functions to manage them
 *    and outbox.inbox_status; outbox.cluster_status() shows inbox workers.
 *
 * The script ends by resetting pg_init_privs to what a fresh install
 * records (rule 4 of outbox.sql): the new objects' privileges may come
 * from default privileges, which a fresh install resets too.
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
 * The inbox (schema 1.8): the receiving side.  An inbox worker, started by
 * the launcher in each covered database that has subscriptions, consumes
 * Kafka topics and applies each event once: it calls the subscription's
 * handler (or, without one, queues the event in outbox.inbox) in the same
 * transaction that advances the subscription's Kafka offsets here, by
 * compare-and-set, and records the event's id among the seen ones.
 */

/* what a handler receives, one event at a time */
CREATE TYPE outbox.inbox_event AS (
    subscription    text,
    topic           text,
    kafka_partition integer,
    kafka_offset    bigint,
    key             text,
    event_id        uuid,
    event_type      text,
    aggregate_type  text,
    headers         jsonb,
    payload         jsonb,
    payload_bytes   bytea,
    kafka_timestamp timestamptz
);

COMMENT ON TYPE outbox.inbox_event IS
'One Kafka record as an inbox handler receives it: subscription, topic, kafka_partition, kafka_offset; key (the message key as text, NULL if none); event_id (the "id" header of outbox''s Debezium format, or "ce_id" of CloudEvents binary mode, as a uuid; an id that is no uuid is hashed into one; NULL when the record has neither); event_type ("event_type" or "ce_type") and aggregate_type ("aggregate_type") headers; headers (every header as a JSON object of strings); payload (the value when it is valid JSON, else NULL) and payload_bytes (the value when it is not JSON, else NULL; a tombstone has both NULL); kafka_timestamp.';

/*
 * Subscriptions.  A handler is kept as its signature text (resolved by the
 * worker with to_regprocedure), not as a regprocedure: a function's OID
 * does not survive pg_dump and restore, and pg_upgrade refuses tables with
 * regprocedure columns.  system_identifier, database_oid and database_name
 * tell a restored copy (another cluster, or another database of this one)
 * from the database that subscribed: a copy applies nothing until
 * outbox.resume_subscription() adopts it.
 */
CREATE TABLE outbox.subscriptions (
    name            text PRIMARY KEY,
    owner           regrole NOT NULL,
    topics          text[] NOT NULL,
    handler         text,
    on_failed_event text NOT NULL DEFAULT 'hold',
    dedupe          boolean NOT NULL DEFAULT true,
    start_from      text NOT NULL DEFAULT 'earliest',
    started         boolean NOT NULL DEFAULT false,
    paused          boolean NOT NULL DEFAULT false,
    system_identifier bigint NOT NULL,
    database_oid    oid NOT NULL,
    database_name   name NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT pg_catalog.now(),
    CONSTRAINT subscriptions_on_failed_event_check CHECK (on_failed_event IN ('hold', 'skip'))
);
SELECT pg_catalog.pg_extension_config_dump('outbox.subscriptions', '');

COMMENT ON TABLE outbox.subscriptions IS
'Inbox subscriptions of this database, one row each: written by outbox.subscribe(), outbox.unsubscribe(), outbox.pause_subscription() and outbox.resume_subscription(), never directly. pg_dump keeps them.';
COMMENT ON COLUMN outbox.subscriptions.name IS
'The subscription''s name (1 to 63 bytes), unique in the database.';
COMMENT ON COLUMN outbox.subscriptions.owner IS
'The role that subscribed: the handler runs as this role, never as a superuser unless outbox.inbox_superuser_subscriptions allows it.';
COMMENT ON COLUMN outbox.subscriptions.topics IS
'The Kafka topics consumed, exact names. A topic that does not exist yet is picked up once it appears, from its first offset.';
COMMENT ON COLUMN outbox.subscriptions.handler IS
'Signature of the handler function, handler(outbox.inbox_event), schema-qualified; NULL: queue mode (events land in outbox.inbox for outbox.inbox_take()).';
COMMENT ON COLUMN outbox.subscriptions.on_failed_event IS
'hold: an event whose handler failed becomes a dead letter and later events of its key wait behind it (also in outbox.inbox_dead, held) until outbox.inbox_retry(); skip: later events of the key go on.';
COMMENT ON COLUMN outbox.subscriptions.dedupe IS
'True: an event whose event_id was applied within outbox.inbox_dedupe_window is dropped as a duplicate. Events without an id are covered by the offsets alone.';
COMMENT ON COLUMN outbox.subscriptions.start_from IS
'Where partitions known at the first start begin: earliest, latest or a timestamp. Partitions and topics that appear later always begin at their first offset.';
COMMENT ON COLUMN outbox.subscriptions.started IS
'True once the worker placed the partitions of the first start (start_from no longer applies).';
COMMENT ON COLUMN outbox.subscriptions.paused IS
'True while outbox.pause_subscription() holds the subscription: nothing is consumed until outbox.resume_subscription().';
COMMENT ON COLUMN outbox.subscriptions.system_identifier IS
'System identifier of the cluster that subscribed (pg_control_system()). In another cluster (a restored dump, a pg_upgrade) the subscription applies nothing until outbox.resume_subscription().';
COMMENT ON COLUMN outbox.subscriptions.database_oid IS
'OID of the database that subscribed; with database_name, tells a copy in another database of the same cluster.';
COMMENT ON COLUMN outbox.subscriptions.database_name IS
'Name of the database that subscribed. A copy whose database has another OID and another name applies nothing until outbox.resume_subscription().';
COMMENT ON COLUMN outbox.subscriptions.created_at IS
'When outbox.subscribe() committed.';

/*
 * The Kafka position of each (subscription, topic, partition): the next
 * offset to apply.  The worker advances it in the transaction that applies
 * the events, WHERE next_offset = the value it read (compare-and-set), so
 * a second applier (a seek, a zombie worker) makes one of them roll back.
 * One HOT update per partition per batch (no indexed column changes).
 */
CREATE TABLE outbox.inbox_offsets (
    subscription    text NOT NULL,
    topic           text NOT NULL,
    kafka_partition integer NOT NULL,
    next_offset     bigint NOT NULL,
    seek_time       timestamptz,
    applied         bigint NOT NULL DEFAULT 0,
    duplicates      bigint NOT NULL DEFAULT 0,
    attempt_offset  bigint,
    attempts        integer NOT NULL DEFAULT 0,
    PRIMARY KEY (subscription, topic, kafka_partition)
) WITH (fillfactor = 50);
SELECT pg_catalog.pg_extension_config_dump('outbox.inbox_offsets', '');

COMMENT ON TABLE outbox.inbox_offsets IS
'Kafka offsets of the inbox, one row per subscription, topic and partition, advanced in the transaction that applies the events (compare-and-set). pg_dump keeps them; after a restore, a promotion or a point-in-time recovery the inbox resumes from them.';
COMMENT ON COLUMN outbox.inbox_offsets.subscription IS
'The subscription (outbox.subscriptions.name).';
COMMENT ON COLUMN outbox.inbox_offsets.topic IS
'The Kafka topic.';
COMMENT ON COLUMN outbox.inbox_offsets.kafka_partition IS
'The Kafka partition.';
COMMENT ON COLUMN outbox.inbox_offsets.next_offset IS
'Offset of the next record to apply: every record below it is applied, none at or above it. -2: the partition''s first offset, -1: its end, both resolved by the first record read.';
COMMENT ON COLUMN outbox.inbox_offsets.seek_time IS
'Set by outbox.inbox_seek(..., timestamptz): the worker moves next_offset to the first record at or after this time, then clears it.';
COMMENT ON COLUMN outbox.inbox_offsets.applied IS
'Records applied (handler called or queued), in total.';
COMMENT ON COLUMN outbox.inbox_offsets.duplicates IS
'Records dropped because their event_id was seen within outbox.inbox_dedupe_window, in total.';
COMMENT ON COLUMN outbox.inbox_offsets.attempt_offset IS
'Offset of a record the worker handles one at a time after a crash; NULL otherwise.';
COMMENT ON COLUMN outbox.inbox_offsets.attempts IS
'Times the worker started to apply the record at attempt_offset and did not finish (it crashed); at outbox.inbox_max_attempts the record becomes a dead letter without another call.';

/*
 * Event ids applied, for the de-duplication window.  Two slots, partitions
 * of one table: new ids go into the current slot, a probe looks in both.
 * When the current slot is outbox.inbox_dedupe_window old, the other one
 * is emptied whole (TRUNCATE) and becomes current, so an id is kept at
 * least the window, at most twice it, and no row is ever deleted one by
 * one (no dead tuples, no vacuum).
 */
CREATE TABLE outbox.inbox_seen (
    slot            smallint NOT NULL,
    subscription    text NOT NULL,
    event_id        uuid NOT NULL,
    PRIMARY KEY (slot, subscription, event_id)
) PARTITION BY LIST (slot);
CREATE TABLE outbox.inbox_seen_0 PARTITION OF outbox.inbox_seen FOR VALUES IN (0);
CREATE TABLE outbox.inbox_seen_1 PARTITION OF outbox.inbox_seen FOR VALUES IN (1);
SELECT pg_catalog.pg_extension_config_dump('outbox.inbox_seen_0', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.inbox_seen_1', '');

COMMENT ON TABLE outbox.inbox_seen IS
'Event ids the inbox applied, per subscription, in two slots (partitions) that take turns: ids are kept at least outbox.inbox_dedupe_window and are dropped a slot at a time, never row by row. Written by the inbox worker only.';
COMMENT ON COLUMN outbox.inbox_seen.slot IS
'0 or 1: the partition; outbox.inbox_seen_window says which one new ids go into.';
COMMENT ON COLUMN outbox.inbox_seen.subscription IS
'The subscription that applied the event.';
COMMENT ON COLUMN outbox.inbox_seen.event_id IS
'The event id applied.';
COMMENT ON TABLE outbox.inbox_seen_0 IS
'Slot 0 of outbox.inbox_seen.';
COMMENT ON TABLE outbox.inbox_seen_1 IS
'Slot 1 of outbox.inbox_seen.';

CREATE TABLE outbox.inbox_seen_window (
    singleton       boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    current_slot    smallint NOT NULL DEFAULT 0 CHECK (current_slot IN (0, 1)),
    since           timestamptz NOT NULL DEFAULT pg_catalog.now()
);
INSERT INTO outbox.inbox_seen_window DEFAULT VALUES;

COMMENT ON TABLE outbox.inbox_seen_window IS
'Which slot of outbox.inbox_seen takes new event ids, and since when (one row). Written by the inbox worker only. Not dumped: a restored database starts a new window, which keeps every restored id at least outbox.inbox_dedupe_window.';
COMMENT ON COLUMN outbox.inbox_seen_window.singleton IS
'Always true: keeps the table at one row.';
COMMENT ON COLUMN outbox.inbox_seen_window.current_slot IS
'The slot new event ids go into.';
COMMENT ON COLUMN outbox.inbox_seen_window.since IS
'When current_slot became current; once outbox.inbox_dedupe_window has passed, the other slot is emptied and takes over.';

/*
 * Queue mode (a subscription without a handler): the worker inserts each
 * event here in the offset's transaction; outbox.inbox_take() hands them
 * out inside the application's own transaction.
 */
CREATE TABLE outbox.inbox (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    subscription    text NOT NULL,
    topic           text NOT NULL,
    kafka_partition integer NOT NULL,
    kafka_offset    bigint NOT NULL,
    key             text,
    event_id        uuid,
    event_type      text,
    aggregate_type  text,
    headers         jsonb,
    payload         jsonb,
    payload_bytes   bytea,
    kafka_timestamp timestamptz,
    received_at     timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp()
);
CREATE INDEX inbox_key_idx ON outbox.inbox (subscription, topic, key, id);
CREATE INDEX inbox_subscription_idx ON outbox.inbox (subscription, id);
SELECT pg_catalog.pg_extension_config_dump('outbox.inbox', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.inbox_id_seq', '');

COMMENT ON TABLE outbox.inbox IS
'Queue mode: events of subscriptions without a handler, inserted by the inbox worker in the transaction that advances the offsets, taken (deleted) by outbox.inbox_take() in the application''s transaction.';
COMMENT ON COLUMN outbox.inbox.id IS
'Arrival order; outbox.inbox_take() hands out the lowest pending id of each key first.';
COMMENT ON COLUMN outbox.inbox.subscription IS
'The subscription.';
COMMENT ON COLUMN outbox.inbox.topic IS
'The Kafka topic.';
COMMENT ON COLUMN outbox.inbox.kafka_partition IS
'The Kafka partition.';
COMMENT ON COLUMN outbox.inbox.kafka_offset IS
'The record''s Kafka offset.';
COMMENT ON COLUMN outbox.inbox.key IS
'The message key as text; NULL if none. Events of one key (and topic) are handed out one at a time, in order.';
COMMENT ON COLUMN outbox.inbox.event_id IS
'As outbox.inbox_event.event_id.';
COMMENT ON COLUMN outbox.inbox.event_type IS
'As outbox.inbox_event.event_type.';
COMMENT ON COLUMN outbox.inbox.aggregate_type IS
'As outbox.inbox_event.aggregate_type.';
COMMENT ON COLUMN outbox.inbox.headers IS
'As outbox.inbox_event.headers.';
COMMENT ON COLUMN outbox.inbox.payload IS
'As outbox.inbox_event.payload.';
COMMENT ON COLUMN outbox.inbox.payload_bytes IS
'As outbox.inbox_event.payload_bytes.';
COMMENT ON COLUMN outbox.inbox.kafka_timestamp IS
'As outbox.inbox_event.kafka_timestamp.';
COMMENT ON COLUMN outbox.inbox.received_at IS
'When the inbox worker inserted the event.';
COMMENT ON SEQUENCE outbox.inbox_id_seq IS
'Identity sequence of outbox.inbox.id; pg_dump keeps its position.';

/*
 * Dead letters: events whose handler failed (error and SQLSTATE kept), and
 * with on_failed_event = hold the later events of their key (held).
 */
CREATE TABLE outbox.inbox_dead (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    subscription    text NOT NULL,
    topic           text NOT NULL,
    kafka_partition integer NOT NULL,
    kafka_offset    bigint NOT NULL,
    key             text,
    event_id        uuid,
    event_type      text,
    aggregate_type  text,
    headers         jsonb,
    payload         jsonb,
    payload_bytes   bytea,
    kafka_timestamp timestamptz,
    held            boolean NOT NULL DEFAULT false,
    error           text,
    sqlstate        text,
    attempts        integer NOT NULL DEFAULT 0,
    failed_at       timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    retry           boolean NOT NULL DEFAULT false
);
CREATE INDEX inbox_dead_key_idx ON outbox.inbox_dead (subscription, topic, key, id);
SELECT pg_catalog.pg_extension_config_dump('outbox.inbox_dead', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.inbox_dead_id_seq', '');
COMMENT ON SEQUENCE outbox.inbox_dead_id_seq IS
'Identity sequence of outbox.inbox_dead.id; pg_dump keeps its position.';

COMMENT ON TABLE outbox.inbox_dead IS
'Inbox dead letters: events whose handler failed (held false: error, sqlstate, attempts) and, with on_failed_event = hold, later events of the same topic and key that wait behind them (held true). outbox.inbox_retry() applies them again in id order.';
COMMENT ON COLUMN outbox.inbox_dead.id IS
'Arrival order; a retry applies dead letters in this order.';
COMMENT ON COLUMN outbox.inbox_dead.subscription IS
'The subscription.';
COMMENT ON COLUMN outbox.inbox_dead.topic IS
'The Kafka topic.';
COMMENT ON COLUMN outbox.inbox_dead.kafka_partition IS
'The Kafka partition.';
COMMENT ON COLUMN outbox.inbox_dead.kafka_offset IS
'The record''s Kafka offset (the partition''s offset moved past it).';
COMMENT ON COLUMN outbox.inbox_dead.key IS
'As outbox.inbox_event.key.';
COMMENT ON COLUMN outbox.inbox_dead.event_id IS
'As outbox.inbox_event.event_id.';
COMMENT ON COLUMN outbox.inbox_dead.event_type IS
'As outbox.inbox_event.event_type.';
COMMENT ON COLUMN outbox.inbox_dead.aggregate_type IS
'As outbox.inbox_event.aggregate_type.';
COMMENT ON COLUMN outbox.inbox_dead.headers IS
'As outbox.inbox_event.headers.';
COMMENT ON COLUMN outbox.inbox_dead.payload IS
'As outbox.inbox_event.payload.';
COMMENT ON COLUMN outbox.inbox_dead.payload_bytes IS
'As outbox.inbox_event.payload_bytes.';
COMMENT ON COLUMN outbox.inbox_dead.kafka_timestamp IS
'As outbox.inbox_event.kafka_timestamp.';
COMMENT ON COLUMN outbox.inbox_dead.held IS
'True: the handler was not called; the event waits behind a failed event of its key (on_failed_event = hold).';
COMMENT ON COLUMN outbox.inbox_dead.error IS
'The handler''s error message (its last one); NULL for a held event.';
COMMENT ON COLUMN outbox.inbox_dead.sqlstate IS
'SQLSTATE of the handler''s error; NULL for a held event.';
COMMENT ON COLUMN outbox.inbox_dead.attempts IS
'Calls of the handler that failed, retries included (a crash of the worker counts).';
COMMENT ON COLUMN outbox.inbox_dead.failed_at IS
'When the event became a dead letter (or last failed again).';
COMMENT ON COLUMN outbox.inbox_dead.retry IS
'Set by outbox.inbox_retry(): the worker applies the event again, then deletes the row; cleared when it fails again.';

/* the SQL API */
CREATE FUNCTION outbox.subscribe(name text,
                                 topics text[],
                                 handler regprocedure DEFAULT NULL,
                                 on_failed_event text DEFAULT 'hold',
                                 dedupe boolean DEFAULT true,
                                 start_from text DEFAULT 'earliest')
RETURNS void
AS 'MODULE_PATHNAME', 'outbox_subscribe'
LANGUAGE C VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.subscribe(text, text[], regprocedure, text, boolean, text) IS
'Subscribes this database to Kafka topics (exact names) when the calling transaction commits. handler(e outbox.inbox_event) is called once per event, as the calling role, in the transaction that records the event''s Kafka offset; NULL queues the events in outbox.inbox for outbox.inbox_take(). on_failed_event: hold (later events of a failed event''s key wait) or skip; dedupe: drop events whose event_id was applied within outbox.inbox_dedupe_window; start_from: earliest, latest or a timestamp. The caller needs EXECUTE on the handler; a superuser may subscribe only when outbox.inbox_superuser_subscriptions is on. Errors: 22023 bad name, topics, option or start_from; 42710 a subscription of that name exists; 42P13 the handler is not a function of one outbox.inbox_event argument; 42501 no EXECUTE on the handler, or a superuser not allowed.';

CREATE FUNCTION outbox.unsubscribe(name text)
RETURNS void
AS 'MODULE_PATHNAME', 'outbox_unsubscribe'
LANGUAGE C VOLATILE STRICT PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.unsubscribe(text) IS
'Drops a subscription with its offsets, seen ids, queued events and dead letters (a WARNING counts the events and dead letters dropped). The caller must be the owner or a member of it, or a superuser. Error 42704 if there is no such subscription.';

CREATE FUNCTION outbox.pause_subscription(name text)
RETURNS void
AS 'MODULE_PATHNAME', 'outbox_pause_subscription'
LANGUAGE C VOLATILE STRICT PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.pause_subscription(text) IS
'Pauses a subscription when the calling transaction commits: the batch in flight finishes, then nothing is consumed (outbox.inbox_status state paused) until outbox.resume_subscription(). Survives restarts. Same rights and errors as outbox.unsubscribe().';

CREATE FUNCTION outbox.resume_subscription(name text)
RETURNS void
AS 'MODULE_PATHNAME', 'outbox_resume_subscription'
LANGUAGE C VOLATILE STRICT PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.resume_subscription(text) IS
'Resumes a paused subscription when the calling transaction commits. On a restored copy (state restored_copy: the subscription was made in another cluster or database) it also adopts the subscription here: from then on this database applies events, from the restored offsets. Same rights and errors as outbox.unsubscribe().';

CREATE FUNCTION outbox.inbox_seek(subscription text, topic text, kafka_partition integer,
                                  kafka_offset bigint)
RETURNS bigint
AS 'MODULE_PATHNAME', 'outbox_inbox_seek_offset'
LANGUAGE C VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.inbox_seek(text, text, integer, bigint) IS
'Moves a partition''s next offset to kafka_offset (kafka_partition NULL: every known partition of the topic) when the calling transaction commits; a batch the worker is applying meanwhile rolls back (compare-and-set) and the worker goes on from the new offset. The way out of state stalled. Records skipped are not applied, records passed again are (dedupe still drops ids seen within the window). Returns the partitions moved. Same rights as outbox.unsubscribe(); errors 42704 no such subscription, 22023 a negative offset or a topic the subscription does not consume.';

CREATE FUNCTION outbox.inbox_seek(subscription text, topic text, kafka_partition integer,
                                  kafka_timestamp timestamptz)
RETURNS bigint
AS 'MODULE_PATHNAME', 'outbox_inbox_seek_time'
LANGUAGE C VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.inbox_seek(text, text, integer, timestamptz) IS
'As outbox.inbox_seek(text, text, integer, bigint), to the first record at or after kafka_timestamp (looked up by the worker in Kafka); ''-infinity'' is the partition''s first offset, ''infinity'' its end.';

CREATE FUNCTION outbox.inbox_retry(subscription text, key text DEFAULT NULL)
RETURNS bigint
AS 'MODULE_PATHNAME', 'outbox_inbox_retry'
LANGUAGE C VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.inbox_retry(text, text) IS
'Applies the subscription''s dead letters again (those of one key, or all when key is NULL) when the calling transaction commits: the worker calls the handler for each in id order, so a key''s events keep their order, deletes those applied and marks again the first that fails (the key''s later ones stay held behind it). Returns the dead letters requeued. Same rights and errors as outbox.unsubscribe().';

CREATE FUNCTION outbox.inbox_take(subscription text, max integer DEFAULT 100)
RETURNS SETOF outbox.inbox
AS 'MODULE_PATHNAME', 'outbox_inbox_take'
LANGUAGE C VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.inbox_take(text, integer) IS
'Queue mode: deletes and returns up to max events of the subscription from outbox.inbox, in id order, inside the calling transaction: only the first pending event of each topic and key, skipping rows other transactions took and have not committed. A rolled-back take gives them back; a committed one applied them exactly once. The caller must be the owner or a member of it, or a superuser. Errors: 42704 no such subscription, 22023 max below 1, or a subscription with a handler (its events are applied, not queued).';

/* status: shared memory of the inbox worker, with the tables */
CREATE FUNCTION outbox.inbox_worker_partitions(
    OUT pid integer,
    OUT subscription text,
    OUT topic text,
    OUT kafka_partition integer,
    OUT high_watermark bigint,
    OUT state text,
    OUT last_error text,
    OUT last_error_at timestamptz,
    OUT last_applied_at timestamptz)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'outbox_inbox_worker_partitions'
LANGUAGE C VOLATILE
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.inbox_worker_partitions() IS
'What the inbox worker of this database shows in shared memory: one row for the worker (subscription NULL: state running, not_configured, config_error, broker_down or error) and one per partition it consumes (high watermark, state running, stalled or error, last error, last apply); kafka_partition -1 for a topic that does not exist yet (state waiting_for_topic). No rows when no inbox worker runs. Executable by pg_monitor.';

CREATE VIEW outbox.inbox_status AS
SELECT r.subscription,
       r.topic,
       r.kafka_partition,
       CASE WHEN r.next_offset >= 0 THEN r.next_offset END AS next_offset,
       p.high_watermark,
       CASE WHEN r.next_offset >= 0 AND p.high_watermark IS NOT NULL
            THEN GREATEST(p.high_watermark - r.next_offset, 0) END AS lag,
       r.applied,
       r.duplicates,
       COALESCE(d.dead_letters, 0) AS dead_letters,
       COALESCE(d.held, 0) AS held,
       CASE WHEN r.copy THEN 'restored_copy'
            WHEN r.paused THEN 'paused'
            WHEN w.pid IS NULL THEN 'not_running'
            WHEN w.state IN ('broker_down', 'config_error', 'not_configured') THEN w.state
            WHEN p.state IS NOT NULL THEN p.state
            WHEN w.state <> 'running' THEN w.state
            ELSE 'starting' END AS state,
       CASE WHEN r.copy THEN 'restored from another cluster or database: SELECT outbox.resume_subscription(' ||
                             pg_catalog.quote_literal(r.subscription) || ') applies events here'
            WHEN w.state IN ('broker_down', 'config_error', 'not_configured') THEN w.last_error
            ELSE COALESCE(p.last_error, w.last_error) END AS last_error,
       CASE WHEN w.state IN ('broker_down', 'config_error', 'not_configured') OR p.last_error IS NULL
            THEN w.last_error_at ELSE p.last_error_at END AS last_error_at,
       p.last_applied_at,
       w.pid
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
  LEFT JOIN (SELECT x.pid, x.state, x.last_error, x.last_error_at
               FROM outbox.inbox_worker_partitions() AS x WHERE x.subscription IS NULL) AS w ON true
  LEFT JOIN outbox.inbox_worker_partitions() AS p
         ON p.subscription = r.subscription AND p.topic = r.topic
        AND p.kafka_partition = COALESCE(r.kafka_partition, -1)
  LEFT JOIN LATERAL (SELECT pg_catalog.count(*) FILTER (WHERE NOT x.held) AS dead_letters,
                            pg_catalog.count(*) FILTER (WHERE x.held) AS held
                       FROM outbox.inbox_dead AS x
                      WHERE x.subscription = r.subscription AND x.topic = r.topic
                        AND x.kafka_partition = r.kafka_partition) AS d ON true;

COMMENT ON VIEW outbox.inbox_status IS
'Inbox health, one row per subscription, topic and partition (kafka_partition NULL for a topic that does not exist yet): next_offset (NULL until the first record of a partition placed at its start or end), high_watermark and lag from Kafka, records applied and duplicates dropped in total, dead_letters (handler failed) and held (waiting behind one), state (starting, running, paused, stalled: Kafka no longer has next_offset, see outbox.inbox_seek(); waiting_for_topic, restored_copy, not_running, not_configured, config_error, broker_down, error) with the last error, the last apply and the worker''s pid.';

/* outbox.cluster_status() shows the inbox workers too (kind inbox) */
COMMENT ON FUNCTION outbox.cluster_status() IS
'The whole server, read from shared memory, from any database. First row: kind launcher, state running (not_running, pid NULL, while the postmaster restarts it), started_at. Then kind relay, one row per relay worker of every database, with the columns of outbox.worker_status() (counters since that worker started). Then kind relay, state waiting_for_slot, pid NULL, for each database covered by outbox.databases that has no relay because outbox.max_workers or max_worker_processes is used up (last_error says which, last_error_at since when; the first 256 such databases). Then kind inbox, one row per inbox worker (schema 1.8): published = records it applied, failed = dead letters, delivery_errors = failed handler calls, last_publish_at = its last apply, since it started; state running, not_configured, config_error, broker_down or error (per partition: outbox.inbox_status). No rows when the library is not in shared_preload_libraries. Executable by pg_monitor.';

/* least privilege, as in outbox.sql */
REVOKE ALL ON FUNCTION outbox.subscribe(text, text[], regprocedure, text, boolean, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.unsubscribe(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.pause_subscription(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.resume_subscription(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.inbox_seek(text, text, integer, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.inbox_seek(text, text, integer, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.inbox_retry(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.inbox_take(text, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.inbox_worker_partitions() FROM PUBLIC;
REVOKE ALL ON TABLE outbox.subscriptions FROM PUBLIC;
REVOKE ALL ON TABLE outbox.inbox_offsets FROM PUBLIC;
REVOKE ALL ON TABLE outbox.inbox_seen FROM PUBLIC;
REVOKE ALL ON TABLE outbox.inbox_seen_0 FROM PUBLIC;
REVOKE ALL ON TABLE outbox.inbox_seen_1 FROM PUBLIC;
REVOKE ALL ON TABLE outbox.inbox_seen_window FROM PUBLIC;
REVOKE ALL ON TABLE outbox.inbox FROM PUBLIC;
REVOKE ALL ON TABLE outbox.inbox_dead FROM PUBLIC;
REVOKE ALL ON TABLE outbox.inbox_status FROM PUBLIC;

GRANT EXECUTE ON FUNCTION outbox.inbox_worker_partitions() TO pg_monitor;
GRANT SELECT ON TABLE outbox.inbox_status TO pg_monitor;

/* initial privileges: as at the end of outbox.sql */
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
                            ('pg_catalog.pg_class', 'outbox.status'::pg_catalog.regclass, 'SELECT'),
                            ('pg_catalog.pg_proc', 'outbox.inbox_worker_partitions()'::pg_catalog.regprocedure, 'EXECUTE'),
                            ('pg_catalog.pg_class', 'outbox.inbox_status'::pg_catalog.regclass, 'SELECT'))
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
