--
-- outbox.emit_bytes(): a payload of bytes, stored as is in payload_bytes
-- (payload stays NULL), with the checks and errors of emit().
--
\set SHOW_CONTEXT never
CREATE EXTENSION outbox;
SET client_min_messages = error;

-- the Confluent wire format: magic byte 0, a 4-byte schema id, then the data (0x00 bytes included)
SELECT outbox.emit_bytes('order', 'b1', 'order.created', '\x0000000007020a00ff00'::bytea) IS NOT NULL AS ok;
SELECT payload_bytes, payload IS NULL AS no_json, headers, topic FROM outbox.events WHERE aggregate_id = 'b1';
-- headers and topic as in emit()
SELECT outbox.emit_bytes('order', 'b2', 'order.created', '\x01', '{"content-type": "application/avro"}',
                         'orders.avro') IS NOT NULL AS ok;
SELECT payload_bytes, headers, topic FROM outbox.events WHERE aggregate_id = 'b2';
-- NULL is a tombstone: no value at all; an empty bytea is an empty value
SELECT outbox.emit_bytes('order', 'b3', 'order.deleted', NULL) IS NOT NULL AS ok;
SELECT outbox.emit_bytes('order', 'b4', 'order.empty', '') IS NOT NULL AS ok;
SELECT aggregate_id, payload IS NULL AS no_json, payload_bytes IS NULL AS no_bytes,
       length(payload_bytes) AS bytes
  FROM outbox.events WHERE aggregate_id IN ('b3', 'b4') ORDER BY id;
-- 1 MB of every byte value arrives unchanged in the row
SELECT outbox.emit_bytes('order', 'b5', 'order.big',
                         (SELECT string_agg(set_byte('\x00'::bytea, 0, g % 256), ''::bytea)
                            FROM generate_series(0, 1048575) g)) IS NOT NULL AS ok;
SELECT length(payload_bytes) AS bytes, md5(payload_bytes) = md5((SELECT string_agg(set_byte('\x00'::bytea, 0, g % 256), ''::bytea)
                                                            FROM generate_series(0, 1048575) g)) AS same
  FROM outbox.events WHERE aggregate_id = 'b5';
-- it rolls back with its transaction
BEGIN;
SELECT outbox.emit_bytes('order', 'b6', 'order.gone', '\x06') IS NOT NULL AS ok;
ROLLBACK;
SELECT count(*) AS rolled_back FROM outbox.events WHERE aggregate_id = 'b6';

-- the errors of emit()
SELECT outbox.emit_bytes(NULL, '1', 'e', '\x00');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT outbox.emit_bytes('order', '', 'e', '\x00');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT outbox.emit_bytes('order', '1', 'e', '\x00', '[1]');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT outbox.emit_bytes('order', '1', 'e', '\x00', '{"id": "x"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT outbox.emit_bytes('order', '1', 'e', '\x00', NULL, 'bad topic');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT outbox.emit_bytes('order', repeat('x', 1025), 'e', '\x00');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT count(*) AS events FROM outbox.events;

-- emit() with an untyped literal still resolves to the jsonb one (no overload of emit)
SELECT outbox.emit('order', 'j1', 'e', '{"a": 1}') IS NOT NULL AS ok;
SELECT payload, payload_bytes FROM outbox.events WHERE aggregate_id = 'j1';

DROP EXTENSION outbox;
