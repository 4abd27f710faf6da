--
-- outbox.emit(): happy path, transactionality, and every rejected argument.
--
-- Deterministic output: uuids and timestamps are never printed, only
-- comparisons (IS NOT NULL, =) and counts.  Errors are shown with their
-- message, DETAIL and HINT (default verbosity: no source-line LOCATION), and
-- the SQLSTATE is printed right after each one from psql's
-- LAST_ERROR_SQLSTATE, together with a check that no row was written.
--
\set SHOW_CONTEXT never
CREATE EXTENSION outbox;

-- the default routing prefix the messages below depend on
SHOW outbox.topic_prefix;

--
-- Happy path
--

-- emit returns the event_id of the row it wrote
SELECT outbox.emit('order', '42', 'order.created', '{"total": 10, "currency": "EUR"}') AS eid \gset
SELECT :'eid'::uuid IS NOT NULL AS returned_uuid;
SELECT count(*) AS events FROM outbox.events;
SELECT event_id = :'eid' AS same_uuid,
       id IS NOT NULL AS has_id,
       aggregate_type, aggregate_id, event_type,
       payload, headers, topic,
       created_at IS NOT NULL AS has_created_at,
       created_at <= clock_timestamp() AS created_in_past,
       published_at IS NULL AS unpublished,
       attempts, last_error, next_attempt_at
  FROM outbox.events;

-- the result type of the function itself is uuid
SELECT pg_typeof(outbox.emit('order', '43', 'order.created', '{}')) AS type;

-- explicit topic (named notation, headers left at its default)
SELECT outbox.emit('order', '44', 'order.shipped', '{"carrier": "ups"}',
                   topic => 'shipping.events') IS NOT NULL AS ok;
-- headers: a JSON object of string values (an empty string value is a string)
SELECT outbox.emit('order', '45', 'order.paid', '{"amount": 5}',
                   '{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tenant": "acme", "ID": "upper case is not reserved", "empty": ""}') IS NOT NULL AS ok;
-- empty headers object
SELECT outbox.emit('order', '46', 'order.noted', '[1, 2]', '{}') IS NOT NULL AS ok;
-- NULL payload: a tombstone
SELECT outbox.emit('order', '47', 'order.deleted', NULL) IS NOT NULL AS ok;
-- JSON null payload: a real value, distinct from the tombstone
SELECT outbox.emit('order', '48', 'order.nulled', 'null'::jsonb) IS NOT NULL AS ok;
-- all arguments given positionally
SELECT outbox.emit('customer', 'c-1', 'customer.created', '"a string payload"',
                   '{"source": "crm"}', 'crm.customers') IS NOT NULL AS ok;
-- an aggregate_type that cannot be routed is fine with an explicit topic
SELECT outbox.emit('line item', 'li-1', 'line_item.added', '{}', NULL, 'line-items') IS NOT NULL AS ok;
-- a legal topic of the maximum length, 249 characters
SELECT outbox.emit('order', '49', 'order.long', '{}', NULL, repeat('t', 249)) IS NOT NULL AS ok;
-- a routed topic of exactly 249 characters: 13 (prefix) + 236
SELECT outbox.emit(repeat('a', 236), '50', 'x.routed_max', '{}') IS NOT NULL AS ok;
-- topics made only of '.', '_', '-' and digits, and "..." are legal
SELECT outbox.emit('order', '51', 'order.t1', '{}', NULL, '...') IS NOT NULL AS ok;
SELECT outbox.emit('order', '52', 'order.t2', '{}', NULL, '_-.09AZaz') IS NOT NULL AS ok;

SELECT aggregate_type = repeat('a', 236) AS long_type,
       CASE WHEN length(aggregate_type) > 20 THEN '(long)' ELSE aggregate_type END AS aggregate_type,
       aggregate_id, event_type,
       CASE WHEN length(topic) > 20 THEN 'length ' || length(topic) ELSE topic END AS topic,
       payload, payload IS NULL AS sql_null_payload, headers,
       published_at IS NULL AS unpublished, attempts
  FROM outbox.events ORDER BY id;
-- every row got its own event_id and a distinct id
SELECT count(*) AS events, count(DISTINCT event_id) AS event_ids, count(DISTINCT id) AS ids
  FROM outbox.events;

--
-- Transactionality
--
SELECT count(*) AS n FROM outbox.events \gset
SELECT :n AS events_before;

-- a rolled-back transaction leaves no row
BEGIN;
SELECT outbox.emit('order', 'rb-1', 'order.created', '{}') IS NOT NULL AS ok;
SELECT outbox.emit('order', 'rb-2', 'order.created', '{}') IS NOT NULL AS ok;
SELECT count(*) - :n AS visible_inside FROM outbox.events;
ROLLBACK;
SELECT count(*) - :n AS added, count(*) FILTER (WHERE aggregate_id LIKE 'rb-%') AS rb_rows
  FROM outbox.events;

-- a rolled-back savepoint drops its events; the outer commit keeps the others
BEGIN;
SELECT outbox.emit('order', 'sp-keep-1', 'order.created', '{}') IS NOT NULL AS ok;
SAVEPOINT s1;
SELECT outbox.emit('order', 'sp-drop-1', 'order.created', '{}') IS NOT NULL AS ok;
SELECT outbox.emit('order', 'sp-drop-2', 'order.created', '{}') IS NOT NULL AS ok;
ROLLBACK TO SAVEPOINT s1;
SELECT outbox.emit('order', 'sp-keep-2', 'order.created', '{}') IS NOT NULL AS ok;
-- a failing emit inside the transaction, recovered by a savepoint
SAVEPOINT s2;
SELECT outbox.emit('order', 'sp-bad', 'order.created', '{}', '[]');
ROLLBACK TO SAVEPOINT s2;
COMMIT;
SELECT aggregate_id FROM outbox.events WHERE aggregate_id LIKE 'sp-%' ORDER BY id;
SELECT count(*) - :n AS added FROM outbox.events;

-- a failing emit aborts the whole transaction: the good event before it is lost too
BEGIN;
SELECT outbox.emit('order', 'tx-lost', 'order.created', '{}') IS NOT NULL AS ok;
SELECT outbox.emit('order', 'tx-bad', '', '{}');
COMMIT;
SELECT count(*) AS tx_rows FROM outbox.events WHERE aggregate_id LIKE 'tx-%';

--
-- Rejected arguments.  After each error: did it fail, its SQLSTATE, and
-- whether the number of rows is unchanged.
--
SELECT count(*) AS n FROM outbox.events \gset

-- required text arguments: NULL is 22004, empty is 22023
SELECT outbox.emit(NULL, '1', 'e', '{}');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
SELECT outbox.emit('', '1', 'e', '{}');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
SELECT outbox.emit('order', NULL, 'e', '{}');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
SELECT outbox.emit('order', '', 'e', '{}');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
SELECT outbox.emit('order', '1', NULL, '{}');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
SELECT outbox.emit('order', '1', '', '{}');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
-- the first offending argument is reported
SELECT outbox.emit(NULL, NULL, NULL, NULL);
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;

-- headers that are not an object
SELECT outbox.emit('order', '1', 'e', '{}', '["a", "b"]');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
SELECT outbox.emit('order', '1', 'e', '{}', '"just a string"');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
SELECT outbox.emit('order', '1', 'e', '{}', '42');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
-- JSON null (not SQL NULL) is a scalar too
SELECT outbox.emit('order', '1', 'e', '{}', 'null'::jsonb);
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;

-- header values that are not strings
SELECT outbox.emit('order', '1', 'e', '{}', '{"ok": "yes", "retries": 3}');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
SELECT outbox.emit('order', '1', 'e', '{}', '{"replay": true}');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
SELECT outbox.emit('order', '1', 'e', '{}', '{"trace": null}');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
SELECT outbox.emit('order', '1', 'e', '{}', '{"nested": {"a": "b"}}');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
SELECT outbox.emit('order', '1', 'e', '{}', '{"list": ["a"]}');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;

-- empty and reserved header keys
SELECT outbox.emit('order', '1', 'e', '{}', '{"": "v"}');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
SELECT outbox.emit('order', '1', 'e', '{}', '{"id": "mine"}');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
SELECT outbox.emit('order', '1', 'e', '{}', '{"event_type": "mine"}');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
SELECT outbox.emit('order', '1', 'e', '{}', '{"aggregate_type": "mine"}');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;

-- explicit topics that Kafka would reject
SELECT outbox.emit('order', '1', 'e', '{}', NULL, '');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
SELECT outbox.emit('order', '1', 'e', '{}', NULL, repeat('t', 250));
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
SELECT outbox.emit('order', '1', 'e', '{}', NULL, 'my topic');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
SELECT outbox.emit('order', '1', 'e', '{}', NULL, 'orders/eu');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
SELECT outbox.emit('order', '1', 'e', '{}', NULL, U&'caf\00E9');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
SELECT outbox.emit('order', '1', 'e', '{}', NULL, '.');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
SELECT outbox.emit('order', '1', 'e', '{}', NULL, '..');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;

-- routed topics (topic NULL: outbox.topic_prefix || aggregate_type) that Kafka would reject
SELECT outbox.emit('line item', '1', 'e', '{}');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
-- 13 + 237 = 250 characters
SELECT outbox.emit(repeat('a', 237), '1', 'e', '{}');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;

--
-- aggregate_type and aggregate_id are indexed by the relay: at most 255 and
-- 1024 bytes (22001), checked in bytes, not characters
--
SELECT count(*) AS n FROM outbox.events \gset
SELECT outbox.emit('order', repeat('k', 1025), 'e', '{}');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
SELECT outbox.emit('order', repeat('k', 1023) || 'é', 'e', '{}');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
SELECT outbox.emit(repeat('t', 256), '1', 'e', '{}', NULL, 'explicit');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
BEGIN;
SELECT outbox.emit(repeat('t', 255), repeat('k', 1024), 'e', '{}', NULL, 'explicit') IS NOT NULL AS longest_accepted;
ROLLBACK;

-- Kafka's internal topics take no events
SELECT outbox.emit('order', '1', 'e', '{}', NULL, '__consumer_offsets');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;
-- nor does the exactly_once relay's progress topic (a forged record could make a relay skip events)
SELECT outbox.emit('order', '1', 'e', '{}', NULL, '_outbox_progress');
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate, count(*) = :n AS nothing_written FROM outbox.events;

--
-- outbox.topic_prefix is PGC_SIGHUP: a session cannot change it
--
SET outbox.topic_prefix = 'other.';
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate;
BEGIN;
SET LOCAL outbox.topic_prefix = 'other.';
ROLLBACK;
SELECT :'LAST_ERROR_SQLSTATE' AS sqlstate;
SELECT set_config('outbox.topic_prefix', 'other.', false);
SELECT :'ERROR' AS failed, :'LAST_ERROR_SQLSTATE' AS sqlstate;
SHOW outbox.topic_prefix;

DROP EXTENSION outbox;
