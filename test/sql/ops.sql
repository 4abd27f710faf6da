-- the operations API: pause/resume, replay, purge, retry_failed, as SQL
-- (no relay serves this database, so rows only change through these calls)
CREATE EXTENSION outbox;
\set SHOW_CONTEXT never

-- an operation in a database the relay does not serve warns on every call
SELECT outbox.resume();
SET client_min_messages = error;

-- pause and resume flip the persistent switch, and record who paused
SELECT paused, paused_at IS NULL AS no_time, paused_by IS NULL AS no_role FROM outbox.relay;
SELECT outbox.pause();
SELECT paused, paused_at IS NOT NULL AS has_time, paused_by = session_user AS by_me FROM outbox.relay;
SELECT paused_at AS first_paused_at FROM outbox.relay \gset
SELECT outbox.pause();            -- pausing twice is harmless, and keeps the first time
SELECT paused, paused_at = :'first_paused_at' AS same_time FROM outbox.relay;
SELECT outbox.resume();
SELECT paused, paused_at IS NULL AS no_time, paused_by IS NULL AS no_role FROM outbox.relay;
SELECT outbox.resume();
SELECT count(*) AS one_row FROM outbox.relay;

-- events to play with: three published long ago, one recently, one pending.  They are
-- tracked row by row (xid NULL, as with relay_mode = row or after the relay demoted them), so
-- that published_at alone says what is published; test_23 covers snapshot-tracked events.
SELECT outbox.emit('order', 'r' || i, 'e', jsonb_build_object('i', i)) IS NOT NULL AS emitted
  FROM generate_series(1, 5) AS i;
UPDATE outbox.events SET xid = NULL;
UPDATE outbox.events SET published_at = now() - interval '2 days', created_at = now() - interval '2 days'
 WHERE aggregate_id IN ('r1', 'r2', 'r3');
UPDATE outbox.events SET published_at = now() WHERE aggregate_id = 'r4';

-- replay by time: only kept, published events created since then
SELECT outbox.replay(now() - interval '1 day') AS requeued;
SELECT aggregate_id, published_at IS NULL AS pending FROM outbox.events ORDER BY id;
UPDATE outbox.events SET published_at = now() WHERE aggregate_id = 'r4';

-- replay by id range, inclusive
SELECT min(id) AS first_id FROM outbox.events \gset
SELECT outbox.replay(:first_id, :first_id + 1) AS requeued;
SELECT aggregate_id, published_at IS NULL AS pending FROM outbox.events ORDER BY id;
SELECT outbox.replay(:first_id + 1, :first_id);
SELECT :'LAST_ERROR_SQLSTATE' AS sqlstate;
SELECT outbox.replay(NULL::bigint, 1) IS NULL AS strict;

-- purge: published events older than the interval; never pending ones
UPDATE outbox.events SET published_at = now() - interval '2 days'
 WHERE aggregate_id IN ('r1', 'r2', 'r3');
SELECT outbox.purge(interval '1 day') AS deleted;
SELECT aggregate_id, published_at IS NULL AS pending FROM outbox.events ORDER BY id;
SELECT outbox.purge(interval '0') AS deleted;
SELECT aggregate_id, published_at IS NULL AS pending FROM outbox.events ORDER BY id;
SELECT outbox.purge(interval '-1 second');
SELECT :'LAST_ERROR_SQLSTATE' AS sqlstate;
-- reaching back before 4713 BC, where timestamptz begins: nothing is that old (not 22008)
UPDATE outbox.events SET published_at = now() - interval '2 days' WHERE aggregate_id = 'r5';
SELECT outbox.purge(interval '1000000 years') AS deleted, outbox.purge(interval '6800 years') AS near_the_limit,
       outbox.purge(interval '6000 years') AS below_it;
SELECT outbox.purge(interval '2147483647 days') AS deleted, outbox.purge(interval '178000000 years') AS deleted_too;
SELECT aggregate_id, published_at IS NULL AS pending FROM outbox.events ORDER BY id;
UPDATE outbox.events SET published_at = NULL WHERE aggregate_id = 'r5';

-- retry_failed: only events marked failed, all or one by event_id
SELECT outbox.emit('order', 'r' || i, 'e', '{}') IS NOT NULL AS emitted FROM generate_series(6, 7) AS i;
UPDATE outbox.events SET xid = NULL, failed_at = now(), permanent_failures = 3, attempts = 3,
       next_attempt_at = now() + interval '1 hour';
SELECT event_id AS one_id FROM outbox.events ORDER BY id LIMIT 1 \gset
SELECT outbox.retry_failed(:'one_id') AS requeued_one;
SELECT outbox.retry_failed(:'one_id') AS again;
SELECT outbox.retry_failed('00000000-0000-0000-0000-000000000000') AS unknown_id;
SELECT outbox.retry_failed() AS requeued_rest;
SELECT aggregate_id, failed_at IS NULL AS not_failed, permanent_failures, attempts,
       next_attempt_at IS NULL AS due_now
  FROM outbox.events ORDER BY id;

-- outbox.database must name a database: ALTER SYSTEM checks it as the server's start does
ALTER SYSTEM SET outbox.database = '';
SELECT :'LAST_ERROR_SQLSTATE' AS sqlstate;

-- outbox.kafka_properties: a ';' inside a value is written \;, a backslash \\; an empty item
-- (';;') is refused, one ';' at the end is not; messages never quote a value
-- (RESET leaves postgresql.auto.conf as it was)
ALTER SYSTEM SET outbox.kafka_properties = 'sasl.password=ab;cd';
SELECT :'LAST_ERROR_SQLSTATE' AS sqlstate;
ALTER SYSTEM SET outbox.kafka_properties = 'sasl.password="ab;cd"';
ALTER SYSTEM SET outbox.kafka_properties = 'sasl.password=ab;;cd=1';
ALTER SYSTEM SET outbox.kafka_properties = ';linger.ms=5';
ALTER SYSTEM SET outbox.kafka_properties = 'linger.ms=5;;';
ALTER SYSTEM SET outbox.kafka_properties = 'sasl.password=ab\;cd\\;client.id=x\;y;linger.ms=5;';
ALTER SYSTEM SET outbox.kafka_properties = 'ssl.ca.location=C:\certs\ca.pem;sasl.password=ab\';
ALTER SYSTEM RESET outbox.kafka_properties;

-- DROP EXTENSION says what it discards (pending and failed); ROLLBACK keeps it all
RESET client_min_messages;
SELECT outbox.emit('order', 'r8', 'e', '{}') IS NOT NULL AS emitted;
UPDATE outbox.events SET failed_at = now() WHERE aggregate_id = 'r6';
BEGIN;
DROP EXTENSION outbox;
ROLLBACK;
SELECT count(*) AS kept FROM outbox.events;
DROP EXTENSION outbox;

-- a schema before 1.4 (no outbox.published, no relay_progress): DROP EXTENSION counts nothing and works
-- (in a new session: a session remembers which columns the schema it first used has)
\c -
CREATE EXTENSION outbox VERSION '1.3';
SELECT outbox.emit('order', 'old', 'e', '{}') IS NOT NULL AS emitted;
DROP EXTENSION outbox;

-- schema outbox left behind, now owned by a role that is not a superuser: CREATE EXTENSION
-- refuses it (that owner could plant an overload of outbox.emit()); owned by a superuser again, it works
CREATE ROLE regress_outbox_schema_owner NOLOGIN;
ALTER SCHEMA outbox OWNER TO regress_outbox_schema_owner;
CREATE EXTENSION outbox;
SELECT :'LAST_ERROR_SQLSTATE' AS sqlstate;
SELECT count(*) AS extensions FROM pg_extension WHERE extname = 'outbox';
ALTER SCHEMA outbox OWNER TO CURRENT_USER;
DROP ROLE regress_outbox_schema_owner;
CREATE EXTENSION outbox;
SELECT extversion FROM pg_extension WHERE extname = 'outbox';
DROP EXTENSION outbox;
