/* outbox--1.0--1.1.sql: dead letters, pg_dump support, richer status */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION outbox UPDATE TO '1.1'" to load this file. \quit

/*
 * Lock the view before the table it reads, in the order readers of
 * outbox.status take them, so that a concurrent reader cannot deadlock
 * with this update.
 */
LOCK TABLE outbox.status, outbox.events IN ACCESS EXCLUSIVE MODE;

/* new columns go last, as in a fresh 1.1 install; no table rewrite */
ALTER TABLE outbox.events
    ADD COLUMN permanent_failures integer NOT NULL DEFAULT 0,
    ADD COLUMN failed_at timestamptz;

SELECT pg_catalog.pg_extension_config_dump('outbox.events', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.events_id_seq', '');

COMMENT ON TABLE outbox.events IS
'Transactional outbox: one row per event, written in the producing transaction by outbox.emit() and relayed to Kafka in id order by the outbox relay worker. Rows are deleted outbox.retention after they were published. Events Kafka refused outbox.max_attempts times are marked failed (failed_at) and wait for outbox.retry_failed().';
COMMENT ON COLUMN outbox.events.attempts IS
'Number of delivery attempts that failed so far, for any reason; 0 for an event never tried or delivered on the first try.';
COMMENT ON COLUMN outbox.events.permanent_failures IS
'Number of delivery attempts Kafka refused with a permanent error (message too large, topic refused, ...). Transient failures (broker unreachable, timeouts) do not count. At outbox.max_attempts the event is marked failed.';
COMMENT ON COLUMN outbox.events.failed_at IS
'When the event was marked failed (a dead letter): it is not retried until outbox.retry_failed(). With outbox.on_failed_event = hold, later events of its aggregate wait behind it. NULL = not failed.';

CREATE FUNCTION outbox.retry_failed()
RETURNS bigint
AS 'MODULE_PATHNAME', 'outbox_retry_failed_all'
LANGUAGE C VOLATILE STRICT PARALLEL UNSAFE;

COMMENT ON FUNCTION outbox.retry_failed() IS
'Requeues every event marked failed: clears failed_at, permanent_failures and the backoff, so the relay tries each again (in id order, before later events of its aggregate). Returns the number of events requeued. Takes effect when the calling transaction commits.';

CREATE FUNCTION outbox.retry_failed(event_id uuid)
RETURNS boolean
AS 'MODULE_PATHNAME', 'outbox_retry_failed_one'
LANGUAGE C VOLATILE STRICT PARALLEL UNSAFE;

COMMENT ON FUNCTION outbox.retry_failed(uuid) IS
'Requeues one failed event, given its event_id. Returns true if it was marked failed and is now requeued, false if no unpublished failed event has that id.';

/* the status function gains a column; the view depends on it */
DROP VIEW outbox.status;
DROP FUNCTION outbox.worker_status();

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
LANGUAGE C VOLATILE;

COMMENT ON FUNCTION outbox.worker_status() IS
'One row per running relay worker, read from shared memory: database, pid, state (starting, waiting_for_database, waiting_for_extension, not_configured, config_error, idle, publishing, broker_down), events published, events marked failed and failed delivery attempts since the worker started, time of the last acknowledged event, last error text and time, and when the worker started. No rows when the library is not in shared_preload_libraries.';

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
       w.started_at
  FROM outbox.worker_status() AS w
 CROSS JOIN LATERAL (
       SELECT pg_catalog.count(*) FILTER (WHERE e.failed_at IS NULL) AS pending,
              pg_catalog.count(*) FILTER (WHERE e.failed_at IS NOT NULL) AS failed_events,
              pg_catalog.min(e.created_at) FILTER (WHERE e.failed_at IS NULL) AS oldest_pending_at
         FROM outbox.events AS e
        WHERE e.published_at IS NULL) AS p;

COMMENT ON VIEW outbox.status IS
'Relay health: the worker''s state and counters since it started (from shared memory: published, failed = events marked failed, delivery_errors = failed attempts) with its table: pending events, the age of the oldest one, and failed_events (marked failed, waiting for outbox.retry_failed()); the table columns are NULL when queried from another database than the worker''s. Empty when no relay worker runs.';
