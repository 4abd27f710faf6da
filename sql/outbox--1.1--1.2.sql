/* outbox--1.1--1.2.sql: trigger capture, operations API, least privilege */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION outbox UPDATE TO '1.2'" to load this file. \quit

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

COMMENT ON SEQUENCE outbox.events_id_seq IS
'Identity sequence of outbox.events.id; pg_dump keeps its position.';

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
'Publishes again every event created at or after since that is still kept (published, not yet deleted by outbox.retention): marks them unpublished, so the relay sends them again in id order with their original event ids. Returns the number of events requeued.';

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
'Deletes now the published events published more than older_than ago (''0'' = all published events). Pending and failed events are never deleted. Returns the number deleted. Error 22023 for a negative interval.';

/*
 * Least privilege.  emit() and the other functions run as the extension's
 * owner with a fixed search_path, so callers need no right on the table
 * and nothing a caller creates in public or pg_temp is ever used.
 */
ALTER FUNCTION outbox.emit(text, text, text, jsonb, jsonb, text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox.retry_failed()
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox.retry_failed(uuid)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox.worker_status()
    SET search_path = pg_catalog, pg_temp;

REVOKE ALL ON FUNCTION outbox.emit(text, text, text, jsonb, jsonb, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.capture() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.pause() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.resume() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.replay(timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.replay(bigint, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.purge(interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.retry_failed() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.retry_failed(uuid) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.worker_status() FROM PUBLIC;
REVOKE ALL ON TABLE outbox.events FROM PUBLIC;
REVOKE ALL ON TABLE outbox.relay FROM PUBLIC;
REVOKE ALL ON TABLE outbox.status FROM PUBLIC;

/* monitoring: pg_monitor may read the status, nothing else */
GRANT USAGE ON SCHEMA outbox TO pg_monitor;
GRANT EXECUTE ON FUNCTION outbox.worker_status() TO pg_monitor;
GRANT SELECT ON TABLE outbox.status TO pg_monitor;

COMMENT ON FUNCTION outbox.emit(text, text, text, jsonb, jsonb, text) IS
'Writes one event into outbox.events in the current transaction and returns its event_id (uuid). The relay publishes it to Kafka only if the transaction commits. aggregate_type, aggregate_id and event_type must be non-empty; headers must be a JSON object of string values (keys id, event_type, aggregate_type are reserved); topic, or outbox.topic_prefix || aggregate_type when topic is NULL, must be a legal Kafka topic name (1-249 of [a-zA-Z0-9._-], not "." or "..") and allowed by outbox.allowed_topics. Runs as the extension owner: callers need EXECUTE only (not granted to PUBLIC). Errors: 22004 for a NULL argument, 22023 for any other invalid argument, 42501 for a topic outbox.allowed_topics does not allow.';
