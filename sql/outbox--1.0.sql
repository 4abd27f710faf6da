/*
 * outbox--1.0.sql: install script of outbox 1.0.  Frozen: its statements never change.
 *
 * Only for CREATE EXTENSION outbox VERSION '1.0' (and '1.1', '1.2', which
 * PostgreSQL installs as 1.0 plus the update scripts) and the upgrade tests
 * (test/integration/test_17_dump_upgrade.py).  The current schema is
 * sql/outbox.sql.
 */

-- complain if script is sourced in psql, rather than via CREATE EXTENSION
\echo Use "CREATE EXTENSION outbox" to load this file. \quit

/*
 * The outbox table.  Rows are written by outbox.emit() in the caller's
 * transaction and read, in id order, by the relay worker.  It is a normal,
 * WAL-logged table: an unlogged outbox would lose events on a crash.
 */
CREATE TABLE outbox.events (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id        uuid NOT NULL DEFAULT pg_catalog.gen_random_uuid() UNIQUE,
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
    next_attempt_at timestamptz
);

/* "oldest unpublished first": the relay's claim walks this index in id order */
CREATE INDEX events_pending_idx ON outbox.events (id)
    WHERE published_at IS NULL;

/*
 * Aggregates whose oldest pending event has failed at least once.  Later
 * events of such an aggregate wait behind it; the relay probes this (normally
 * empty) index for every candidate row, so it has to stay small and cheap.
 */
CREATE INDEX events_retry_idx ON outbox.events (aggregate_type, aggregate_id, id)
    WHERE published_at IS NULL AND attempts > 0;

COMMENT ON TABLE outbox.events IS
'Transactional outbox: one row per event, written in the producing transaction by outbox.emit() and relayed to Kafka in id order by the outbox relay worker. Rows are deleted outbox.retention after they were published.';
COMMENT ON COLUMN outbox.events.id IS
'Relay order: the worker claims unpublished rows in ascending id. Assigned from an identity sequence.';
COMMENT ON COLUMN outbox.events.event_id IS
'Globally unique event id, sent as the Kafka header "id"; consumers de-duplicate on it (delivery is at-least-once).';
COMMENT ON COLUMN outbox.events.aggregate_type IS
'Kind of aggregate the event belongs to (e.g. order). Sent as header "aggregate_type"; when topic is NULL the topic is outbox.topic_prefix || aggregate_type.';
COMMENT ON COLUMN outbox.events.aggregate_id IS
'Id of the aggregate instance; the Kafka message key. Events of one aggregate keep their order.';
COMMENT ON COLUMN outbox.events.event_type IS
'Kind of event (e.g. order.created); sent as the Kafka header "event_type".';
COMMENT ON COLUMN outbox.events.topic IS
'Kafka topic for this event; NULL means routed: outbox.topic_prefix || aggregate_type, resolved when the event is published.';
COMMENT ON COLUMN outbox.events.payload IS
'Kafka message value, sent as JSON text. NULL sends a tombstone (a message with a NULL value) for compacted topics.';
COMMENT ON COLUMN outbox.events.headers IS
'Extra Kafka headers: a JSON object whose values are all strings, sent after id, event_type and aggregate_type. NULL for none.';
COMMENT ON COLUMN outbox.events.created_at IS
'When the event was emitted (clock time); sent as the Kafka message timestamp (CreateTime, ms).';
COMMENT ON COLUMN outbox.events.published_at IS
'When Kafka acknowledged the event (acks=all); NULL while it is not yet published.';
COMMENT ON COLUMN outbox.events.attempts IS
'Number of delivery attempts that failed so far; 0 for an event never tried or delivered on the first try.';
COMMENT ON COLUMN outbox.events.last_error IS
'Error text of the most recent failed delivery attempt, NULL if none failed.';
COMMENT ON COLUMN outbox.events.next_attempt_at IS
'After a failed attempt: earliest time of the next one (capped exponential backoff). NULL means as soon as possible.';

/*
 * outbox.emit: the SQL API.  Implemented in C (src/emit.c) so that the
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
LANGUAGE C VOLATILE PARALLEL UNSAFE;

COMMENT ON FUNCTION outbox.emit(text, text, text, jsonb, jsonb, text) IS
'Writes one event into outbox.events in the current transaction and returns its event_id (uuid). The relay publishes it to Kafka only if the transaction commits. aggregate_type, aggregate_id and event_type must be non-empty; headers must be a JSON object of string values (keys id, event_type, aggregate_type are reserved); topic, or outbox.topic_prefix || aggregate_type when topic is NULL, must be a legal Kafka topic name (1-249 of [a-zA-Z0-9._-], not "." or ".."). Errors: 22004 for a NULL argument, 22023 for any other invalid argument.';

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
    OUT last_publish_at timestamptz,
    OUT last_error text,
    OUT last_error_at timestamptz,
    OUT started_at timestamptz)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'outbox_worker_status'
LANGUAGE C VOLATILE;

COMMENT ON FUNCTION outbox.worker_status() IS
'One row per running relay worker, read from shared memory: database, pid, state (starting, waiting_for_database, waiting_for_extension, not_configured, config_error, idle, publishing, broker_down), events published and delivery failures since the worker started, time of the last acknowledged event, last error text and time, and when the worker started. No rows when the library is not in shared_preload_libraries.';

CREATE VIEW outbox.status AS
SELECT w.database,
       w.pid,
       w.state,
       CASE WHEN w.database = pg_catalog.current_database() THEN p.pending END AS pending,
       CASE WHEN w.database = pg_catalog.current_database()
            THEN pg_catalog.clock_timestamp() - p.oldest_pending_at END AS oldest_pending_age,
       w.published,
       w.failed,
       w.last_publish_at,
       w.last_error,
       w.last_error_at,
       w.started_at
  FROM outbox.worker_status() AS w
 CROSS JOIN LATERAL (
       SELECT pg_catalog.count(*) AS pending,
              pg_catalog.min(e.created_at) AS oldest_pending_at
         FROM outbox.events AS e
        WHERE e.published_at IS NULL) AS p;

COMMENT ON VIEW outbox.status IS
'Relay health: the worker''s state and counters (from shared memory) with its backlog: pending events and the age of the oldest one (NULL when queried from another database than the worker''s). Empty when no relay worker runs.';
