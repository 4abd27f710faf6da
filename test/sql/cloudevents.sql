--
-- CloudEvents: emit() refuses ce_* headers a CloudEvents consumer could not
-- read (22023); outbox.message_format and outbox.ce_source refuse values the
-- relay could not use.  Found by a fresh user's try-out: such values were
-- accepted and made every consumer fail on the event.
--
\set SHOW_CONTEXT never
CREATE EXTENSION outbox;
SET client_min_messages = error;

-- overrides a consumer can read are accepted
SELECT outbox.emit('ce', 'ok', 'e', '{}', '{"ce_source": "urn:shop:orders", "ce_type": "com.example.v2",
                   "ce_subject": "order/1", "ce_time": "2026-12-03T04:05:06.123456789+01:00",
                   "ce_dataschema": "https://example.com/schemas/order.json", "ce_tenant": "acme",
                   "ce_x1": "", "content-type": "application/avro"}') IS NOT NULL AS ok;
SELECT outbox.emit('ce', 'ok2', 'e', '{}', '{"ce_source": "/relative/path?q=1#frag", "ce_time": "2024-02-29t00:00:00Z"}') IS NOT NULL AS ok;

-- and these are refused
SELECT outbox.emit('ce', 'bad', 'e', '{}', '{"ce_source": "\"quoted\""}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT outbox.emit('ce', 'bad', 'e', '{}', '{"ce_source": "has space"}');
SELECT outbox.emit('ce', 'bad', 'e', '{}', '{"ce_source": ""}');
SELECT outbox.emit('ce', 'bad', 'e', '{}', '{"ce_source": "%%%"}');
SELECT outbox.emit('ce', 'bad', 'e', '{}', '{"ce_source": "a|b"}');
SELECT outbox.emit('ce', 'bad', 'e', '{}', '{"ce_source": "1abc:x"}');
SELECT outbox.emit('ce', 'bad', 'e', '{}', '{"ce_source": "urn:"}');
SELECT outbox.emit('ce', 'bad', 'e', '{}', '{"ce_source": "ünï"}');
SELECT outbox.emit('ce', 'bad', 'e', '{}', '{"ce_type": ""}');
SELECT outbox.emit('ce', 'bad', 'e', '{}', '{"ce_subject": ""}');
SELECT outbox.emit('ce', 'bad', 'e', '{}', '{"ce_time": "yesterday"}');
SELECT outbox.emit('ce', 'bad', 'e', '{}', '{"ce_time": "2026-02-29T00:00:00Z"}');
SELECT outbox.emit('ce', 'bad', 'e', '{}', '{"ce_time": "2026-12-03 04:05:06Z"}');
SELECT outbox.emit('ce', 'bad', 'e', '{}', '{"ce_time": "2026-12-03T04:05:06"}');
SELECT outbox.emit('ce', 'bad', 'e', '{}', '{"ce_time": "2026-12-03T04:05:60Z"}');
SELECT outbox.emit('ce', 'bad', 'e', '{}', '{"ce_datacontenttype": "text/plain"}');
SELECT outbox.emit('ce', 'bad', 'e', '{}', '{"ce_my_ext": "x"}');
SELECT outbox.emit('ce', 'bad', 'e', '{}', '{"ce_my-ext": "x"}');
SELECT outbox.emit('ce', 'bad', 'e', '{}', '{"ce_Tenant": "x"}');
SELECT outbox.emit('ce', 'bad', 'e', '{}', '{"ce_": "x"}');
SELECT outbox.emit_bytes('ce', 'bad', 'e', '\x00', '{"ce_source": "has space"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT count(*) AS written FROM outbox.events WHERE aggregate_id = 'bad';

-- the settings
-- (reload settings: ALTER SYSTEM checks the value; RESET leaves postgresql.auto.conf as it was)
ALTER SYSTEM SET outbox.message_format = 'avro';
\echo SQLSTATE :LAST_ERROR_SQLSTATE
ALTER SYSTEM SET outbox.message_format = 'CloudEvents';
ALTER SYSTEM RESET outbox.message_format;
SET outbox.ce_source = '"quoted"';
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SET outbox.ce_source = 'has space';
SET outbox.ce_source = 'https://shop.example/orders%20eu';
SHOW outbox.ce_source;
RESET outbox.ce_source;

DROP EXTENSION outbox;
