/*
 * outbox.sql: the current schema of the outbox extension, in one file.
 *
 * make copies it to sql/outbox--$(EXTVERSION).sql, the script a fresh
 * CREATE EXTENSION outbox runs (EXTVERSION is set in the Makefile).  Edit
 * this file, never the generated one.  Older versions are installed from the
 * frozen outbox--1.0.sql and the update scripts outbox--A--B.sql.
 *
 * Rules for update scripts
 *
 * 1. outbox--A--B.sql is a delta from A to B, never a full copy.  Make the
 *    same change here, so that this file stays the current schema, and bump
 *    EXTVERSION (Makefile), default_version (outbox.control) and the versions
 *    in META.json.  test/integration/test_17_dump_upgrade.py compares a fresh
 *    install with every update path, catalog row by catalog row: add the new
 *    paths to its UPGRADE_PATHS.
 * 2. ALTER TABLE ... ADD COLUMN appends: put new columns at the end of the
 *    CREATE TABLE here, in the order the update script adds them.
 * 3. A script that touches both outbox.status and outbox.events locks the
 *    view first, in the order its readers take them (outbox--1.0--1.1.sql).
 * 4. Initial privileges.  While an extension script runs, every GRANT or
 *    REVOKE stores the object's whole ACL in pg_init_privs, users' grants
 *    included, and pg_dump dumps only what differs from pg_init_privs: those
 *    users' grants are then missing from a restored database, and a role
 *    dropped later stays there as an OID that breaks pg_restore.  So an
 *    update script that GRANTs or REVOKEs on objects that existed before it
 *    ran (schema outbox included: DROP EXTENSION leaves it behind, with its
 *    grants) must end by resetting pg_init_privs to what a fresh install
 *    records: copy the DO block at the end of this file, with its list of
 *    pg_monitor's and outbox_subscriber's grants brought up to date (outbox--1.2--1.3.sql does so).
 */

-- complain if script is sourced in psql, rather than via CREATE EXTENSION
\echo Use "CREATE EXTENSION outbox" to load this file. \quit

/*
 * Schema outbox may exist before CREATE EXTENSION (pg_restore makes it
 * first, DROP EXTENSION leaves it behind), and CREATE EXTENSION then puts
 * the objects in it as it is.  A schema owned by a role that is not a
 * superuser would let that role create objects beside the extension's (an
 * overload of outbox.emit() that superusers' and applications' calls
 * resolve to, run with their privileges), so install only into a schema a
 * superuser owns.
 */
DO $guard$
DECLARE
    owner_name name;
BEGIN
    SELECT r.rolname INTO owner_name
      FROM pg_catalog.pg_namespace AS n
      JOIN pg_catalog.pg_roles AS r ON r.oid = n.nspowner
     WHERE n.nspname = 'outbox' AND NOT r.rolsuper;
    IF FOUND THEN
        RAISE EXCEPTION 'schema outbox is owned by role "%", which is not a superuser', owner_name
            USING ERRCODE = 'insufficient_privilege',
                  DETAIL = 'The owner of the schema could create objects in it that run with the privileges of the extension''s callers.',
                  HINT = 'ALTER SCHEMA outbox OWNER TO a superuser (or DROP SCHEMA outbox when it holds nothing you need), then CREATE EXTENSION outbox again.';
    END IF;
END
$guard$;

/*
 * outbox_subscriber (1.9): the role that carries every grant a subscribing
 * role needs (granted at the end of this file), as pg_monitor does for
 * monitoring.  Roles belong to the cluster: made unless another database's
 * CREATE EXTENSION made it.
 */
DO $role$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'outbox_subscriber') THEN
        CREATE ROLE outbox_subscriber NOLOGIN;
    END IF;
END
$role$;
COMMENT ON ROLE outbox_subscriber IS
'Made by CREATE EXTENSION outbox (1.9): may use the inbox''s SQL API and read outbox.inbox_status, and the rows of outbox.subscriptions and outbox.inbox_dead of the subscriptions whose owner''s privileges the reader has. GRANT outbox_subscriber TO a role that subscribes.';

/*
 * outbox.uuidv7(): time-ordered event ids (UUID version 7, RFC 9562), the
 * default of outbox.events.event_id since 1.8.  Implemented in C
 * (src/write/event_id.c) so that 15 to 17, which have no uuidv7(), get the
 * same ids as 18: a random id (version 4) inserts into a random page of the
 * unique index, a time-ordered one into its rightmost page.  Unlike the
 * other functions it is neither SECURITY DEFINER nor pins search_path: it
 * runs no SQL and reads nothing, and as a column default it is called for
 * every row, where a pinned setting would cost each INSERT a GUC save and
 * restore.  Not granted to PUBLIC either (see below).
 */
CREATE FUNCTION outbox.uuidv7()
RETURNS uuid
AS 'MODULE_PATHNAME', 'outbox_uuidv7'
LANGUAGE C VOLATILE PARALLEL SAFE;

COMMENT ON FUNCTION outbox.uuidv7() IS
'Returns a new time-ordered UUID (version 7, RFC 9562): 48 bits of Unix time in milliseconds, 12 bits of the millisecond''s fraction, 62 random bits. The ids of one session increase strictly; across sessions they are ordered by time to within the clocks'' resolution. The default of outbox.events.event_id (since 1.8). Callers need EXECUTE (not granted to PUBLIC).';

/*
 * The outbox table.  Rows are written by outbox.emit() in the caller's
 * transaction and read, in id order, by the relay worker.  It is a normal,
 * WAL-logged table: an unlogged outbox would lose events on a crash.
 *
 * Storage parameters (WITH): every event is written twice (the INSERT of
 * emit() and the UPDATE that marks it published; that UPDATE cannot be HOT,
 * published_at being in the partial indexes' predicates) and deleted once by
 * the retention.  With the default thresholds (20% of the table) autovacuum
 * comes ever later as the table grows, and the space of deleted events is
 * reused late.  Vacuum this table whenever 10,000 rows are dead, without
 * cost-based throttling: its dead rows are the oldest, and the table is small
 * when vacuumed often.
 */
CREATE TABLE outbox.events (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id        uuid NOT NULL DEFAULT outbox.uuidv7() UNIQUE,
    aggregate_type  text NOT NULL,
    aggregate_id    text NOT NULL,
    event_type      text NOT NULL,
    topic           text,
    payload         jsonb,
    headers         jsonb,
    created_at      timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    published_at    timestamptz,
    attempts        integer NOT NULL DEFAULT 0,
    last_error      text,
    next_attempt_at timestamptz,
    permanent_failures integer NOT NULL DEFAULT 0,
    failed_at       timestamptz,
    xid             pg_catalog.xid8,
    payload_bytes   bytea
) WITH (
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_cost_delay = 0
);

/*
 * pg_dump keeps the events (pending ones must survive a dump and restore,
 * with their event ids) and the position of the id sequence.
 */
SELECT pg_catalog.pg_extension_config_dump('outbox.events', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.events_id_seq', '');

/* "oldest unpublished first": the relay's claim walks this index in id order */
CREATE INDEX events_pending_idx ON outbox.events (id)
    WHERE published_at IS NULL AND xid IS NULL;

/*
 * The relay's batches find the events of late committers by transaction,
 * each transaction's in id order.  Row-tracked events (xid NULL) are left
 * out: in row mode the index stays empty and costs emit() nothing.
 */
CREATE INDEX events_xid_idx ON outbox.events (xid, id) WHERE xid IS NOT NULL;

/*
 * Aggregates whose oldest pending event has failed at least once.  Later
 * events of such an aggregate wait behind it; the relay probes this (normally
 * empty) index for every candidate row, so it has to stay small and cheap.
 */
CREATE INDEX events_retry_idx ON outbox.events (aggregate_type, aggregate_id, id)
    WHERE published_at IS NULL AND attempts > 0;

COMMENT ON TABLE outbox.events IS
'Transactional outbox: one row per event, written in the producing transaction by outbox.emit() and relayed to Kafka in id order by the outbox relay worker. Rows are deleted outbox.retention after they were published (events tracked by snapshot: once published and created more than outbox.retention ago). Events Kafka refused outbox.max_attempts times are marked failed (failed_at) and wait for outbox.retry_failed(). outbox.published(e) tells whether an event is published.';
COMMENT ON COLUMN outbox.events.id IS
'Relay order: the worker claims unpublished rows in ascending id. Assigned from an identity sequence.';
COMMENT ON COLUMN outbox.events.event_id IS
'Globally unique event id, sent as the Kafka header "id"; consumers de-duplicate on it (delivery is at-least-once). Time-ordered (UUID version 7, outbox.uuidv7()) since 1.8; events written before are random (version 4).';
COMMENT ON COLUMN outbox.events.aggregate_type IS
'Kind of aggregate the event belongs to (e.g. order). Sent as header "aggregate_type"; when topic is NULL the topic is outbox.topic_prefix || aggregate_type.';
COMMENT ON COLUMN outbox.events.aggregate_id IS
'Id of the aggregate instance; the Kafka message key. Events of one aggregate keep their order.';
COMMENT ON COLUMN outbox.events.event_type IS
'Kind of event (e.g. order.created); sent as the Kafka header "event_type".';
COMMENT ON COLUMN outbox.events.topic IS
'Kafka topic for this event; NULL means routed: outbox.topic_prefix || aggregate_type, resolved when the event is published.';
COMMENT ON COLUMN outbox.events.payload IS
'Kafka message value, sent as JSON text. NULL (and payload_bytes NULL) sends a tombstone (a message with a NULL value) for compacted topics.';
COMMENT ON COLUMN outbox.events.headers IS
'Extra Kafka headers: a JSON object whose values are all strings, sent after id, event_type and aggregate_type. NULL for none.';
COMMENT ON COLUMN outbox.events.created_at IS
'When the event was emitted (clock time); sent as the Kafka message timestamp (CreateTime, ms).';
COMMENT ON COLUMN outbox.events.published_at IS
'When Kafka acknowledged the event (acks=all); NULL while it is not yet published, and always NULL for an event tracked by snapshot (xid set): outbox.published(e) tells.';
COMMENT ON COLUMN outbox.events.attempts IS
'Number of delivery attempts that failed so far, for any reason; 0 for an event never tried or delivered on the first try.';
COMMENT ON COLUMN outbox.events.last_error IS
'Error text of the most recent failed delivery attempt, NULL if none failed.';
COMMENT ON COLUMN outbox.events.next_attempt_at IS
'After a failed attempt: earliest time of the next one (capped exponential backoff). NULL means as soon as possible.';
COMMENT ON COLUMN outbox.events.permanent_failures IS
'Number of delivery attempts Kafka refused with a permanent error (message too large, topic refused, ...). Transient failures (broker unreachable, timeouts) do not count. At outbox.max_attempts the event is marked failed.';
COMMENT ON COLUMN outbox.events.failed_at IS
'When the event was marked failed (a dead letter): it is not retried until outbox.retry_failed(). With outbox.on_failed_event = hold, later events of its aggregate wait behind it. NULL = not failed.';
COMMENT ON COLUMN outbox.events.xid IS
'Writing (top-level) transaction of an event tracked by snapshot (outbox.relay_mode = snapshot): the relay publishes it in the batch whose commit snapshot first shows that transaction, and never writes the row; published_at stays NULL, outbox.published(e) tells. NULL for an event tracked row by row (published_at, attempts, failed_at), as every event was before 1.4; replayed, failed and restored events are tracked row by row.';
COMMENT ON COLUMN outbox.events.payload_bytes IS
'Kafka message value of an event written by outbox.emit_bytes(), sent byte for byte (payload is then NULL); NULL for the events of emit() and capture().';
COMMENT ON SEQUENCE outbox.events_id_seq IS
'Identity sequence of outbox.events.id; pg_dump keeps its position.';

/*
 * The relay's persistent switches.  One row; outbox.pause() and
 * outbox.resume() flip it, so a pause survives a server restart.
 */
CREATE TABLE outbox.relay (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    paused      boolean NOT NULL DEFAULT false,
    paused_at   timestamptz,
    paused_by   name
);
INSERT INTO outbox.relay DEFAULT VALUES;

COMMENT ON TABLE outbox.relay IS
'Relay switches that survive a restart (one row). Change them with outbox.pause() and outbox.resume(), not directly.';
COMMENT ON COLUMN outbox.relay.singleton IS
'Always true: keeps the table at one row.';
COMMENT ON COLUMN outbox.relay.paused IS
'True while the relay is paused by outbox.pause(): it claims and publishes nothing until outbox.resume().';
COMMENT ON COLUMN outbox.relay.paused_at IS
'When outbox.pause() was called; NULL when not paused.';
COMMENT ON COLUMN outbox.relay.paused_by IS
'Role (session user) that called outbox.pause(); NULL when not paused.';

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

/*
 * outbox.emit: the SQL API.  Implemented in C (src/write/emit.c) so that the
 * validation runs before anything is written and the committing transaction
 * can wake the relay worker.
 */
CREATE FUNCTION outbox.emit(aggregate_type text,
                            aggregate_id text,
                            event_type text,
                            payload jsonb,
                            headers jsonb DEFAULT NULL,
                            topic text DEFAULT NULL)
RETURNS uuid
AS 'MODULE_PATHNAME', 'outbox_emit'
LANGUAGE C VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.emit(text, text, text, jsonb, jsonb, text) IS
'Writes one event into outbox.events in the current transaction and returns its event_id (uuid). The relay publishes it to Kafka only if the transaction commits. aggregate_type, aggregate_id and event_type must be non-empty; headers must be a JSON object of string values (keys id, event_type, aggregate_type, ce_id, ce_specversion are reserved; other ce_* keys must be CloudEvents attributes a consumer can read; a traceparent or tracestate must be well-formed W3C trace context, a tracestate only with a traceparent; without a traceparent, the one of SET outbox.traceparent or of the statement''s sqlcommenter comment is added); topic, or outbox.topic_prefix || aggregate_type when topic is NULL, must be a legal Kafka topic name (1-249 of [a-zA-Z0-9._-], not "." or "..") and allowed by outbox.allowed_topics. Runs as the extension owner: callers need EXECUTE only (not granted to PUBLIC). Errors: 22004 for a NULL argument, 22023 for any other invalid argument, 42501 for a topic outbox.allowed_topics does not allow.';

/*
 * outbox.emit_bytes: emit() with a value sent byte for byte, for payloads
 * the application serialized itself (Avro, Protobuf, the Confluent wire
 * format).  A name of its own: a bytea overload of emit() would make
 * today's calls with untyped literals ambiguous.
 */
CREATE FUNCTION outbox.emit_bytes(aggregate_type text,
                                  aggregate_id text,
                                  event_type text,
                                  payload bytea,
                                  headers jsonb DEFAULT NULL,
                                  topic text DEFAULT NULL)
RETURNS uuid
AS 'MODULE_PATHNAME', 'outbox_emit_bytes'
LANGUAGE C VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.emit_bytes(text, text, text, bytea, jsonb, text) IS
'As outbox.emit(), with a payload of bytes the relay sends unchanged as the Kafka message value (e.g. Avro or Protobuf in the Confluent wire format: magic byte, schema id, data). NULL sends a tombstone. Same arguments, checks, errors (22004, 22023, 42501), ordering, dead letters, replay and status as emit(); in outbox.message_format = cloudevents the content-type header is application/octet-stream unless headers give one. Returns the event_id (uuid). Callers need EXECUTE (not granted to PUBLIC).';

/*
 * Requeue failed events (dead letters).  C, so that the requeue wakes the
 * relay at commit like emit() does.
 */
CREATE FUNCTION outbox.retry_failed()
RETURNS bigint
AS 'MODULE_PATHNAME', 'outbox_retry_failed_all'
LANGUAGE C VOLATILE STRICT PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.retry_failed() IS
'Requeues every event marked failed: clears failed_at, permanent_failures and the backoff, so the relay tries each again (in id order, before later events of its aggregate). Returns the number of events requeued. Takes effect when the calling transaction commits.';

CREATE FUNCTION outbox.retry_failed(event_id uuid)
RETURNS boolean
AS 'MODULE_PATHNAME', 'outbox_retry_failed_one'
LANGUAGE C VOLATILE STRICT PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.retry_failed(uuid) IS
'Requeues one failed event, given its event_id. Returns true if it was marked failed and is now requeued, false if no unpublished failed event has that id.';

/*
 * outbox.status: what the relay worker is doing, read from shared memory
 * (never blocks the worker) plus the backlog read from the table.
 */
CREATE FUNCTION outbox.worker_status(
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
AS 'MODULE_PATHNAME', 'outbox_worker_status'
LANGUAGE C VOLATILE
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.worker_status() IS
'One row per running relay worker of this database (of any database while outbox.databases is empty), read from shared memory: database, pid, state (starting, waiting_for_database, waiting_for_extension, not_configured, config_error, idle, publishing, broker_down, paused, error), events published, events marked failed and failed delivery attempts since the worker started, time of the last acknowledged event, last error text and time, and when the worker started. A database the launcher has no worker slot for has one row with state waiting_for_slot, no pid, and last_error saying which limit (outbox.max_workers or max_worker_processes) is used up since last_error_at. No rows when the library is not in shared_preload_libraries.';

/*
 * outbox.worker_buckets(): the key buckets each relay of the server serves
 * (outbox.workers_per_database); outbox.status and the postgres_exporter
 * queries join it by pid.
 */
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

CREATE VIEW outbox.status AS
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

COMMENT ON VIEW outbox.status IS
'Relay health: the worker''s state and counters since it started (from shared memory: published, failed = events marked failed, delivery_errors = failed attempts) with its table: pending events, the age of the oldest one, and failed_events (marked failed, waiting for outbox.retry_failed()); the table columns are NULL when queried from another database than the worker''s. State waiting_for_slot (no pid): this database has no relay because every worker slot is taken. With outbox.workers_per_database = k, one row per relay: worker (1 .. workers) and the key buckets it serves (see outbox.worker_buckets()); pending, failed_events and oldest_pending_age are the database''s, repeated on each row. Empty when no relay worker runs.';

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
'The whole server, read from shared memory, from any database. First row: kind launcher, state running (not_running, pid NULL, while the postmaster restarts it), started_at. Then kind relay, one row per relay worker of every database, with the columns of outbox.worker_status() (counters since that worker started). Then kind relay, state waiting_for_slot, pid NULL, for each database covered by outbox.databases that has no relay because outbox.max_workers or max_worker_processes is used up (last_error says which, last_error_at since when; the first 256 such databases). Then kind inbox_launcher, one row per database inbox launcher (schema 1.9: state running, or waiting_for_worker), and kind inbox, one row per inbox worker, one or more per subscription (schema 1.8): published = records it applied, failed = dead letters, delivery_errors = failed handler calls, last_publish_at = its last apply, since it started; state starting, running, paused, failing, not_configured, config_error, broker_down, error, or waiting_for_worker with pid NULL (per partition: outbox.inbox_status). No rows when the library is not in shared_preload_libraries. Executable by pg_monitor.';

/* trigger capture */
CREATE FUNCTION outbox.capture()
RETURNS trigger
AS 'MODULE_PATHNAME', 'outbox_capture'
LANGUAGE C VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.capture() IS
'Trigger function: CREATE TRIGGER ... AFTER INSERT OR UPDATE OR DELETE ON t FOR EACH ROW EXECUTE FUNCTION outbox.capture(aggregate_type, key_columns [, topic]). Writes one event per row in the same transaction: event_type <table>.created|updated|deleted (the root table for partitions), aggregate_id = the key column values (several columns: comma-separated in key_columns; values joined by '':'' with '':'' and ''\'' escaped by ''\''), payload {"op", "table", "before", "after"} with the rows as JSON (NULL for the missing side). Errors name the trigger and table: wrong arguments or timing (42P17), unknown key column (42703), NULL key value (22004).';

/* operations */
CREATE FUNCTION outbox.pause()
RETURNS void
AS 'MODULE_PATHNAME', 'outbox_pause'
LANGUAGE C VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.pause() IS
'Pauses the relay when the calling transaction commits: it finishes the batch in flight, then claims nothing (outbox.status state paused) until outbox.resume(). Survives restarts. emit() keeps working; events wait in the table.';

CREATE FUNCTION outbox.resume()
RETURNS void
AS 'MODULE_PATHNAME', 'outbox_resume'
LANGUAGE C VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.resume() IS
'Resumes a paused relay when the calling transaction commits, and wakes it.';

CREATE FUNCTION outbox.replay(since timestamptz)
RETURNS bigint
AS 'MODULE_PATHNAME', 'outbox_replay_since'
LANGUAGE C VOLATILE STRICT SECURITY DEFINER
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.replay(timestamptz) IS
'Publishes again every event created at or after since that is still kept (published, not yet deleted by outbox.retention): marks them unpublished (tracked row by row from then on), so the relay sends them again in id order with their original event ids. Returns the number of events requeued.';

CREATE FUNCTION outbox.replay(from_id bigint, to_id bigint)
RETURNS bigint
AS 'MODULE_PATHNAME', 'outbox_replay_range'
LANGUAGE C VOLATILE STRICT SECURITY DEFINER
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.replay(bigint, bigint) IS
'Publishes again the kept, published events whose id is between from_id and to_id (inclusive). Returns the number of events requeued. Error 22023 if from_id > to_id.';

CREATE FUNCTION outbox.purge(older_than interval)
RETURNS bigint
AS 'MODULE_PATHNAME', 'outbox_purge'
LANGUAGE C VOLATILE STRICT SECURITY DEFINER
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.purge(interval) IS
'Deletes now the published events published more than older_than ago (''0'' = all published events); for events tracked by snapshot, which have no published_at, created more than older_than ago. Pending and failed events are never deleted. Returns the number deleted. Error 22023 for a negative interval.';

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
'Inbox subscriptions of this database, one row each: written by outbox.subscribe(), outbox.unsubscribe(), outbox.pause_subscription() and outbox.resume_subscription(), never directly. A reader other than a superuser sees the rows whose owner''s privileges it has (row-level security). pg_dump keeps them.';
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
'Where partitions known at the first start begin: earliest, latest, an offset or a timestamp. Partitions and topics that appear later always begin at their first offset.';
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
    witness_offset  bigint,
    witness_hash    bigint,
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
COMMENT ON COLUMN outbox.inbox_offsets.witness_offset IS
'The offset of the last record applied from this partition (schema 1.9), or NULL (none yet, or a seek moved the offset): before a batch that goes on right after it commits, the inbox reads the record at this offset from Kafka again and stalls the partition if it is another one (the topic was deleted and created again).';
COMMENT ON COLUMN outbox.inbox_offsets.witness_hash IS
'A fingerprint (timestamp, key, value) of the record at witness_offset (schema 1.9).';

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
'Event ids the inbox applied, per subscription name, in two slots (partitions) that take turns: ids are kept at least outbox.inbox_dedupe_window and are dropped a slot at a time, never row by row, also after outbox.unsubscribe() (a subscription of the same name still skips them). Written by the inbox worker only.';
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
 * Queue mode's keys (schema 1.9): one row per topic and key with pending
 * events in outbox.inbox, with the lowest pending id.  inbox_take() locks
 * key rows (FOR UPDATE SKIP LOCKED, oldest first), so a taker works through
 * several events of a key while other takers skip that key, and each call
 * costs what it returns, not the backlog.  The worker upserts the rows in
 * the queue insert's statement; a take moves first_id on or deletes the
 * row of a key it drained.
 */
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
-- after inbox_dead's, where the 1.8--1.9 update adds it: the same list either way
SELECT pg_catalog.pg_extension_config_dump('outbox.inbox_keys', '');
COMMENT ON SEQUENCE outbox.inbox_dead_id_seq IS
'Identity sequence of outbox.inbox_dead.id; pg_dump keeps its position.';

COMMENT ON TABLE outbox.inbox_dead IS
'Inbox dead letters: events whose handler failed (held false: error, sqlstate, attempts) and, with on_failed_event = hold, later events of the same topic and key that wait behind them (held true). outbox.inbox_retry() applies them again in id order. A reader other than a superuser sees those of the subscriptions whose owner''s privileges it has (row-level security).';
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

/*
 * Row-level security (1.9): a subscriber reads its own subscriptions and
 * dead letters.  The extension's functions, its worker and
 * outbox.inbox_status read them as the tables' owner or a superuser, whom no
 * policy binds.
 */
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
'Subscribes this database to Kafka topics (exact names) when the calling transaction commits. handler(e outbox.inbox_event) is called once per event, or handler(events outbox.inbox_event[]) once per batch with the batch''s new events in arrival order (schema 1.9), as the calling role, in the transaction that records the events'' Kafka offsets; NULL queues the events in outbox.inbox for outbox.inbox_take(). on_failed_event: hold (later events of a failed event''s key wait) or skip; dedupe: drop events whose event_id was applied within outbox.inbox_dedupe_window, also by a former subscription of the same name (a NOTICE says when there is one); start_from: earliest (or ''-infinity''), latest (or ''infinity''), an offset or a timestamp. The caller needs EXECUTE on the handler; a superuser may subscribe only when outbox.inbox_superuser_subscriptions is on. Errors: 22023 bad name, topics, option or start_from (22007: a start_from that is no timestamp); 42710 a subscription of that name exists; 42P13 the handler is not a function of one outbox.inbox_event or outbox.inbox_event[] argument; 42501 no EXECUTE on the handler, or a superuser not allowed.';

CREATE FUNCTION outbox.unsubscribe(name text)
RETURNS void
AS 'MODULE_PATHNAME', 'outbox_unsubscribe'
LANGUAGE C VOLATILE STRICT PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.unsubscribe(text) IS
'Drops a subscription with its offsets, queued events and dead letters (a WARNING counts the events and dead letters dropped). Its seen event ids stay until outbox.inbox_dedupe_window has passed: subscribing again with the same name starts the offsets again from the start_from given, skips the events whose ids were applied within the window, and applies again the events without an id. The caller must be the owner or a member of it, or a superuser. Error 42704 if there is no such subscription.';

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
'Moves a partition''s next offset to kafka_offset (kafka_partition NULL: every known partition of the topic) when the calling transaction commits; a batch the worker is applying meanwhile rolls back (compare-and-set) and the worker goes on from the new offset. The way out of state stalled. Records skipped are not applied, records passed again are (dedupe still drops ids seen within the window); an offset past the end stalls the partition until it is sought again. Returns the partitions moved. Same rights as outbox.unsubscribe(); errors 42704 no such subscription, 22023 a negative offset, a topic the subscription does not consume, or a partition it does not know (the hint lists those it knows).';

CREATE FUNCTION outbox.inbox_seek(subscription text, topic text, kafka_partition integer,
                                  kafka_timestamp timestamptz)
RETURNS bigint
AS 'MODULE_PATHNAME', 'outbox_inbox_seek_time'
LANGUAGE C VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.inbox_seek(text, text, integer, timestamptz) IS
'As outbox.inbox_seek(text, text, integer, bigint), to the first record at or after kafka_timestamp (looked up by the worker in Kafka); ''-infinity'' is the partition''s first offset, ''infinity'' its end.';

CREATE FUNCTION outbox.inbox_seek(subscription text, topic text, kafka_partition integer,
                                  start_from text)
RETURNS bigint
AS 'MODULE_PATHNAME', 'outbox_inbox_seek_position'
LANGUAGE C VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.inbox_seek(text, text, integer, text) IS
'As outbox.inbox_seek(text, text, integer, bigint), to start_from, a position written as subscribe()''s start_from is: earliest (or ''-infinity''), latest (or ''infinity''), an offset, or a timestamp (the first record at or after it). Errors 22023 a negative offset, a topic the subscription does not consume or a partition it does not know; 22007 anything else that is no timestamp.';

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
'Queue mode: deletes and returns up to max events of the subscription from outbox.inbox, in id order, inside the calling transaction: several events of a key in key order, from the keys with the oldest pending events, skipping keys (and key-less events) other transactions took and have not committed, so that two takers never reorder a key (schema 1.9; each call costs what it returns). A rolled-back take gives them back; a committed one applied them exactly once. The caller must be the owner or a member of it, or a superuser. Errors: 42704 no such subscription, 22023 max below 1, or a subscription with a handler (its events are applied, not queued).';

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
'What the inbox of this database shows in shared memory (schema 1.9): one row for its inbox launcher (subscription and topic NULL: state running, or waiting_for_worker when a subscription has no worker), one per inbox worker (subscription set, topic NULL: state starting, running, paused, failing, not_configured, config_error, broker_down, error or waiting_for_worker with pid NULL) and one per partition a worker applies (high watermark, state running, paused, stalled or error, last error, last apply); kafka_partition -1 for a topic that does not exist yet (state waiting_for_topic). No rows when no inbox launcher runs. Executable by pg_monitor.';

CREATE VIEW outbox.inbox_status AS
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

/*
 * Least privilege.  emit() and the other functions run as the extension's
 * owner with a fixed search_path (see their definitions), so callers need
 * no right on the table and nothing a caller creates in public or pg_temp
 * is ever used.  PUBLIC gets nothing.
 */

REVOKE ALL ON FUNCTION outbox.emit(text, text, text, jsonb, jsonb, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.emit_bytes(text, text, text, bytea, jsonb, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.capture() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.pause() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.resume() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.replay(timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.replay(bigint, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.purge(interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.retry_failed() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.retry_failed(uuid) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.worker_status() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.cluster_status() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.worker_buckets() FROM PUBLIC;
REVOKE ALL ON TABLE outbox.events FROM PUBLIC;
REVOKE ALL ON TABLE outbox.relay FROM PUBLIC;
REVOKE ALL ON TABLE outbox.relay_progress FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.published(outbox.events) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.uuidv7() FROM PUBLIC;
REVOKE ALL ON TABLE outbox.status FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.subscribe(text, text[], regprocedure, text, boolean, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.unsubscribe(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.pause_subscription(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.resume_subscription(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.inbox_seek(text, text, integer, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.inbox_seek(text, text, integer, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.inbox_seek(text, text, integer, text) FROM PUBLIC;
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
REVOKE ALL ON TABLE outbox.inbox_keys FROM PUBLIC;
REVOKE ALL ON TABLE outbox.inbox_dead FROM PUBLIC;
REVOKE ALL ON TABLE outbox.inbox_status FROM PUBLIC;

/* monitoring: pg_monitor may read the status, nothing else */
GRANT USAGE ON SCHEMA outbox TO pg_monitor;
GRANT EXECUTE ON FUNCTION outbox.worker_status() TO pg_monitor;
GRANT EXECUTE ON FUNCTION outbox.cluster_status() TO pg_monitor;
GRANT EXECUTE ON FUNCTION outbox.worker_buckets() TO pg_monitor;
GRANT SELECT ON TABLE outbox.status TO pg_monitor;
GRANT EXECUTE ON FUNCTION outbox.inbox_worker_partitions() TO pg_monitor;
GRANT SELECT ON TABLE outbox.inbox_status TO pg_monitor;

/* outbox_subscriber: what a subscribing role needs, as pg_monitor has the status */
GRANT USAGE ON SCHEMA outbox TO outbox_subscriber;
GRANT EXECUTE ON FUNCTION outbox.subscribe(text, text[], regprocedure, text, boolean, text),
      outbox.unsubscribe(text), outbox.pause_subscription(text), outbox.resume_subscription(text),
      outbox.inbox_seek(text, text, integer, bigint), outbox.inbox_seek(text, text, integer, timestamptz),
      outbox.inbox_seek(text, text, integer, text), outbox.inbox_retry(text, text),
      outbox.inbox_take(text, integer), outbox.inbox_worker_partitions() TO outbox_subscriber;
GRANT SELECT ON TABLE outbox.inbox_status, outbox.subscriptions, outbox.inbox_dead TO outbox_subscriber;

/*
 * Initial privileges (rule 4 above).  The GRANTs and REVOKEs above stored
 * each object's ACL in pg_init_privs.  For objects this script created that is
 * the owner's items and pg_monitor's, unless the installing role has default
 * privileges (ALTER DEFAULT PRIVILEGES), which every new object gets.  And
 * schema outbox may exist before CREATE EXTENSION (DROP EXTENSION leaves it,
 * with the users' grants, and pg_restore creates it first).  So reset them,
 * as every update path to this version does: the owner's items, and
 * pg_monitor's USAGE on the schema, EXECUTE on worker_status(),
 * worker_buckets(), cluster_status() and inbox_worker_partitions() and
 * SELECT on status and inbox_status, then outbox_subscriber's (above); no
 * user's, no PUBLIC's.
 */
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
