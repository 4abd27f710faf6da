-- pgTAP: the SQL objects created by CREATE EXTENSION outbox (the current version, sql/outbox.sql).
-- Run with: pg_prove -h 127.0.0.1 -p PORT -U postgres -d outbox test/pgtap/*.sql
-- Everything happens in one transaction that is rolled back.
BEGIN;
CREATE EXTENSION IF NOT EXISTS pgtap;
CREATE EXTENSION outbox;

SELECT plan(182);

-- the extension and its schema
SELECT has_extension('outbox', 'extension outbox is installed');
SELECT has_schema('outbox', 'schema outbox exists');
SELECT is_empty($$
    SELECT c.relname FROM pg_class c
     WHERE c.relnamespace = 'outbox'::regnamespace
       AND c.relkind IN ('r', 'v', 'S')
       AND NOT EXISTS (SELECT 1 FROM pg_depend d
                        WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid
                          AND d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e')
       AND NOT EXISTS (SELECT 1 FROM pg_depend d           -- identity sequence: owned by the table
                        WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid
                          AND d.deptype = 'i')
$$, 'every table and view in schema outbox belongs to the extension');

-- table outbox.events
SELECT has_table('outbox', 'events', 'table outbox.events exists');
SELECT is((SELECT relpersistence FROM pg_class WHERE oid = 'outbox.events'::regclass), 'p'::"char",
          'outbox.events is a permanent (WAL-logged) table');
SELECT is((SELECT reloptions FROM pg_class WHERE oid = 'outbox.events'::regclass),
          ARRAY['autovacuum_vacuum_scale_factor=0.0', 'autovacuum_vacuum_threshold=10000',
                'autovacuum_vacuum_cost_delay=0'],
          'outbox.events is vacuumed at 10,000 dead rows, unthrottled (storage parameters)');
SELECT columns_are('outbox', 'events', ARRAY[
    'id', 'event_id', 'aggregate_type', 'aggregate_id', 'event_type', 'topic', 'payload',
    'headers', 'created_at', 'published_at', 'attempts', 'last_error', 'next_attempt_at',
    'permanent_failures', 'failed_at', 'xid', 'payload_bytes'],
    'outbox.events has exactly the expected columns');

-- column types
SELECT col_type_is('outbox', 'events', 'id',              'bigint',                   'events.id is bigint');
SELECT col_type_is('outbox', 'events', 'event_id',        'uuid',                     'events.event_id is uuid');
SELECT col_type_is('outbox', 'events', 'aggregate_type',  'text',                     'events.aggregate_type is text');
SELECT col_type_is('outbox', 'events', 'aggregate_id',    'text',                     'events.aggregate_id is text');
SELECT col_type_is('outbox', 'events', 'event_type',      'text',                     'events.event_type is text');
SELECT col_type_is('outbox', 'events', 'topic',           'text',                     'events.topic is text');
SELECT col_type_is('outbox', 'events', 'payload',         'jsonb',                    'events.payload is jsonb');
SELECT col_type_is('outbox', 'events', 'headers',         'jsonb',                    'events.headers is jsonb');
SELECT col_type_is('outbox', 'events', 'created_at',      'timestamp with time zone', 'events.created_at is timestamptz');
SELECT col_type_is('outbox', 'events', 'published_at',    'timestamp with time zone', 'events.published_at is timestamptz');
SELECT col_type_is('outbox', 'events', 'attempts',        'integer',                  'events.attempts is integer');
SELECT col_type_is('outbox', 'events', 'last_error',      'text',                     'events.last_error is text');
SELECT col_type_is('outbox', 'events', 'next_attempt_at', 'timestamp with time zone', 'events.next_attempt_at is timestamptz');
SELECT col_type_is('outbox', 'events', 'permanent_failures', 'integer',               'events.permanent_failures is integer');
SELECT col_type_is('outbox', 'events', 'failed_at',       'timestamp with time zone', 'events.failed_at is timestamptz');
SELECT col_type_is('outbox', 'events', 'xid',             'xid8',                     'events.xid is xid8');
SELECT col_type_is('outbox', 'events', 'payload_bytes',   'bytea',                    'events.payload_bytes is bytea');
SELECT col_hasnt_default('outbox', 'events', 'xid',
                         'events.xid has no default: a plain INSERT writes a row-tracked event');

-- NOT NULL-ness
SELECT col_not_null('outbox', 'events', 'id',              'events.id is NOT NULL');
SELECT col_not_null('outbox', 'events', 'event_id',        'events.event_id is NOT NULL');
SELECT col_not_null('outbox', 'events', 'aggregate_type',  'events.aggregate_type is NOT NULL');
SELECT col_not_null('outbox', 'events', 'aggregate_id',    'events.aggregate_id is NOT NULL');
SELECT col_not_null('outbox', 'events', 'event_type',      'events.event_type is NOT NULL');
SELECT col_is_null ('outbox', 'events', 'topic',           'events.topic is nullable (NULL = routed)');
SELECT col_is_null ('outbox', 'events', 'payload',         'events.payload is nullable (NULL = tombstone)');
SELECT col_is_null ('outbox', 'events', 'headers',         'events.headers is nullable');
SELECT col_not_null('outbox', 'events', 'created_at',      'events.created_at is NOT NULL');
SELECT col_is_null ('outbox', 'events', 'published_at',    'events.published_at is nullable (NULL = pending)');
SELECT col_not_null('outbox', 'events', 'attempts',        'events.attempts is NOT NULL');
SELECT col_is_null ('outbox', 'events', 'last_error',      'events.last_error is nullable');
SELECT col_is_null ('outbox', 'events', 'next_attempt_at', 'events.next_attempt_at is nullable');
SELECT col_not_null('outbox', 'events', 'permanent_failures', 'events.permanent_failures is NOT NULL');
SELECT col_is_null ('outbox', 'events', 'failed_at',       'events.failed_at is nullable');

-- defaults and identity
SELECT is((SELECT attidentity FROM pg_attribute
            WHERE attrelid = 'outbox.events'::regclass AND attname = 'id'), 'a'::"char",
          'events.id is GENERATED ALWAYS AS IDENTITY');
SELECT isnt(pg_get_serial_sequence('outbox.events', 'id'), NULL, 'events.id has an identity sequence');
SELECT col_has_default('outbox', 'events', 'event_id', 'events.event_id has a default');
SELECT col_default_is ('outbox', 'events', 'event_id', 'outbox.uuidv7()', 'events.event_id defaults to outbox.uuidv7() (time-ordered, 1.8)');
SELECT col_has_default('outbox', 'events', 'created_at', 'events.created_at has a default');
SELECT col_default_is ('outbox', 'events', 'created_at', 'clock_timestamp()', 'events.created_at defaults to clock_timestamp()');
SELECT col_has_default('outbox', 'events', 'attempts', 'events.attempts has a default');
SELECT col_default_is ('outbox', 'events', 'attempts', 0, 'events.attempts defaults to 0');
SELECT col_hasnt_default('outbox', 'events', 'aggregate_type', 'events.aggregate_type has no default');
SELECT col_hasnt_default('outbox', 'events', 'aggregate_id',   'events.aggregate_id has no default');
SELECT col_hasnt_default('outbox', 'events', 'event_type',     'events.event_type has no default');
SELECT col_hasnt_default('outbox', 'events', 'published_at',   'events.published_at has no default (new events are pending)');
SELECT col_hasnt_default('outbox', 'events', 'next_attempt_at', 'events.next_attempt_at has no default');
SELECT col_default_is ('outbox', 'events', 'permanent_failures', 0, 'events.permanent_failures defaults to 0');
SELECT col_hasnt_default('outbox', 'events', 'failed_at', 'events.failed_at has no default');

-- keys
SELECT has_pk('outbox', 'events', 'outbox.events has a primary key');
SELECT col_is_pk('outbox', 'events', 'id', 'the primary key of outbox.events is id');
SELECT col_is_unique('outbox', 'events', 'event_id', 'events.event_id is unique');

-- indexes
SELECT indexes_are('outbox', 'events',
    ARRAY['events_pkey', 'events_event_id_key', 'events_pending_idx', 'events_retry_idx',
          'events_xid_idx'],
    'outbox.events has exactly the expected indexes');
SELECT has_index('outbox', 'events', 'events_pending_idx', ARRAY['id'],
                 'index events_pending_idx is on (id)');
SELECT isnt((SELECT indpred FROM pg_index WHERE indexrelid = 'outbox.events_pending_idx'::regclass)::text, NULL,
            'events_pending_idx is a partial index');
SELECT is((SELECT pg_get_expr(indpred, indrelid) FROM pg_index
            WHERE indexrelid = 'outbox.events_pending_idx'::regclass),
          '((published_at IS NULL) AND (xid IS NULL))',
          'events_pending_idx covers only pending row-tracked events');
SELECT matches((SELECT indexdef FROM pg_indexes
                 WHERE schemaname = 'outbox' AND indexname = 'events_pending_idx'),
               'USING btree \(id\) WHERE \(\(published_at IS NULL\) AND \(xid IS NULL\)\)$',
               'pg_indexes shows events_pending_idx as btree (id) WHERE published_at IS NULL AND xid IS NULL');
SELECT has_index('outbox', 'events', 'events_xid_idx', ARRAY['xid', 'id'],
                 'index events_xid_idx is on (xid, id): the relay finds late committers by transaction');
SELECT has_index('outbox', 'events', 'events_retry_idx', ARRAY['aggregate_type', 'aggregate_id', 'id'],
                 'index events_retry_idx is on (aggregate_type, aggregate_id, id)');
SELECT is((SELECT pg_get_expr(indpred, indrelid) FROM pg_index
            WHERE indexrelid = 'outbox.events_retry_idx'::regclass),
          '((published_at IS NULL) AND (attempts > 0))',
          'events_retry_idx covers only pending events that failed at least once');

-- function outbox.emit
SELECT has_function('outbox', 'emit', ARRAY['text', 'text', 'text', 'jsonb', 'jsonb', 'text'],
                    'function outbox.emit(text, text, text, jsonb, jsonb, text) exists');
SELECT is((SELECT count(*)::int FROM pg_proc WHERE pronamespace = 'outbox'::regnamespace AND proname = 'emit'),
          1, 'outbox.emit is not overloaded');
SELECT function_returns('outbox', 'emit', ARRAY['text', 'text', 'text', 'jsonb', 'jsonb', 'text'], 'uuid',
                        'outbox.emit returns uuid');
SELECT is(pg_get_function_arguments('outbox.emit(text, text, text, jsonb, jsonb, text)'::regprocedure),
          'aggregate_type text, aggregate_id text, event_type text, payload jsonb, headers jsonb DEFAULT NULL::jsonb, topic text DEFAULT NULL::text',
          'outbox.emit argument names, and headers and topic default to NULL');
SELECT is((SELECT pronargdefaults::int FROM pg_proc WHERE oid = 'outbox.emit(text, text, text, jsonb, jsonb, text)'::regprocedure),
          2, 'outbox.emit has exactly two defaulted arguments');
SELECT function_lang_is('outbox', 'emit', ARRAY['text', 'text', 'text', 'jsonb', 'jsonb', 'text'], 'c',
                        'outbox.emit is written in C');
SELECT volatility_is('outbox', 'emit', ARRAY['text', 'text', 'text', 'jsonb', 'jsonb', 'text'], 'volatile',
                     'outbox.emit is VOLATILE');
SELECT isnt_strict('outbox', 'emit', ARRAY['text', 'text', 'text', 'jsonb', 'jsonb', 'text'],
                   'outbox.emit is not STRICT (a NULL payload makes a tombstone)');
SELECT is_definer('outbox', 'emit', ARRAY['text', 'text', 'text', 'jsonb', 'jsonb', 'text'],
                  'outbox.emit is SECURITY DEFINER (callers need no right on the table)');
SELECT is((SELECT proparallel FROM pg_proc WHERE oid = 'outbox.emit(text, text, text, jsonb, jsonb, text)'::regprocedure),
          'u'::"char", 'outbox.emit is PARALLEL UNSAFE');

-- function outbox.worker_status
SELECT has_function('outbox', 'worker_status', ARRAY[]::text[], 'function outbox.worker_status() exists');
SELECT function_returns('outbox', 'worker_status', ARRAY[]::text[], 'setof record',
                        'outbox.worker_status returns setof record');
SELECT is(pg_get_function_arguments('outbox.worker_status()'::regprocedure),
          'OUT database name, OUT pid integer, OUT state text, OUT published bigint, OUT failed bigint, OUT delivery_errors bigint, OUT last_publish_at timestamp with time zone, OUT last_error text, OUT last_error_at timestamp with time zone, OUT started_at timestamp with time zone',
          'outbox.worker_status OUT columns');
SELECT function_lang_is('outbox', 'worker_status', ARRAY[]::text[], 'c', 'outbox.worker_status is written in C');
SELECT volatility_is('outbox', 'worker_status', ARRAY[]::text[], 'volatile', 'outbox.worker_status is VOLATILE');
-- function outbox.cluster_status (1.5): worker_status' columns after kind
SELECT has_function('outbox', 'cluster_status', ARRAY[]::text[], 'function outbox.cluster_status() exists');
SELECT is(pg_get_function_arguments('outbox.cluster_status()'::regprocedure),
          'OUT kind text, ' || pg_get_function_arguments('outbox.worker_status()'::regprocedure),
          'outbox.cluster_status OUT columns: kind, then those of worker_status');
SELECT function_lang_is('outbox', 'cluster_status', ARRAY[]::text[], 'c', 'outbox.cluster_status is written in C');
SELECT volatility_is('outbox', 'cluster_status', ARRAY[]::text[], 'volatile', 'outbox.cluster_status is VOLATILE');
-- function outbox.worker_buckets (1.7): each relay's key buckets, joined into outbox.status
SELECT has_function('outbox', 'worker_buckets', ARRAY[]::text[], 'function outbox.worker_buckets() exists');
SELECT is(pg_get_function_arguments('outbox.worker_buckets()'::regprocedure),
          'OUT pid integer, OUT worker integer, OUT workers integer, OUT buckets int4range',
          'outbox.worker_buckets OUT columns');
SELECT function_lang_is('outbox', 'worker_buckets', ARRAY[]::text[], 'c', 'outbox.worker_buckets is written in C');
SELECT ok(NOT has_function_privilege('public', 'outbox.worker_buckets()', 'EXECUTE'),
          'PUBLIC may not execute outbox.worker_buckets()');
SELECT ok(has_function_privilege('pg_monitor', 'outbox.worker_buckets()', 'EXECUTE'),
          'pg_monitor may execute outbox.worker_buckets()');
-- function outbox.emit_bytes (1.6): emit() with a bytea payload, under its own name
SELECT has_function('outbox', 'emit_bytes', ARRAY['text', 'text', 'text', 'bytea', 'jsonb', 'text'],
                    'function outbox.emit_bytes(text, text, text, bytea, jsonb, text) exists');
SELECT is(pg_get_function_arguments('outbox.emit_bytes(text, text, text, bytea, jsonb, text)'::regprocedure),
          'aggregate_type text, aggregate_id text, event_type text, payload bytea, headers jsonb DEFAULT NULL::jsonb, topic text DEFAULT NULL::text',
          'outbox.emit_bytes argument names, and headers and topic default to NULL');
SELECT function_returns('outbox', 'emit_bytes', ARRAY['text', 'text', 'text', 'bytea', 'jsonb', 'text'], 'uuid',
                        'outbox.emit_bytes returns uuid');
SELECT is_definer('outbox', 'emit_bytes', ARRAY['text', 'text', 'text', 'bytea', 'jsonb', 'text'],
                  'outbox.emit_bytes is SECURITY DEFINER');
SELECT isnt_strict('outbox', 'emit_bytes', ARRAY['text', 'text', 'text', 'bytea', 'jsonb', 'text'],
                   'outbox.emit_bytes is not STRICT (a NULL payload makes a tombstone)');
-- function outbox.uuidv7 (1.8): the time-ordered event id, event_id's default
SELECT has_function('outbox', 'uuidv7', ARRAY[]::text[], 'function outbox.uuidv7() exists');
SELECT function_returns('outbox', 'uuidv7', ARRAY[]::text[], 'uuid', 'outbox.uuidv7 returns uuid');
SELECT function_lang_is('outbox', 'uuidv7', ARRAY[]::text[], 'c', 'outbox.uuidv7 is written in C');
SELECT volatility_is('outbox', 'uuidv7', ARRAY[]::text[], 'volatile', 'outbox.uuidv7 is VOLATILE');
SELECT isnt_definer('outbox', 'uuidv7', ARRAY[]::text[], 'outbox.uuidv7 is not SECURITY DEFINER');
SELECT ok(NOT has_function_privilege('public', 'outbox.uuidv7()', 'EXECUTE'),
          'PUBLIC may not execute outbox.uuidv7()');
SELECT isnt(obj_description('outbox.uuidv7()'::regprocedure, 'pg_proc'), NULL, 'outbox.uuidv7 has a comment');
SELECT functions_are('outbox', ARRAY['emit', 'emit_bytes', 'worker_status', 'worker_buckets', 'cluster_status', 'retry_failed', 'capture', 'pause',
                                     'resume', 'replay', 'purge', 'published',
                                     'subscribe', 'unsubscribe', 'pause_subscription', 'resume_subscription',
                                     'inbox_seek', 'inbox_retry', 'inbox_take', 'inbox_worker_partitions',
                                     'uuidv7'],
                     'schema outbox has exactly the documented functions');
SELECT function_returns('outbox', 'capture', ARRAY[]::text[], 'trigger', 'outbox.capture() is a trigger function');
SELECT function_returns('outbox', 'pause', ARRAY[]::text[], 'void', 'outbox.pause() returns void');
SELECT function_returns('outbox', 'resume', ARRAY[]::text[], 'void', 'outbox.resume() returns void');
SELECT function_returns('outbox', 'replay', ARRAY['timestamp with time zone'], 'bigint',
                        'outbox.replay(timestamptz) returns bigint');
SELECT function_returns('outbox', 'replay', ARRAY['bigint', 'bigint'], 'bigint',
                        'outbox.replay(bigint, bigint) returns bigint');
SELECT function_returns('outbox', 'purge', ARRAY['interval'], 'bigint', 'outbox.purge(interval) returns bigint');
SELECT function_returns('outbox', 'published', ARRAY['outbox.events'], 'boolean',
                        'outbox.published(outbox.events) returns boolean');
SELECT volatility_is('outbox', 'published', ARRAY['outbox.events'], 'stable',
                     'outbox.published is STABLE (it reads the relay''s progress)');
SELECT is(pg_get_function_arguments('outbox.replay(bigint, bigint)'::regprocedure), 'from_id bigint, to_id bigint',
          'outbox.replay takes from_id, to_id');
SELECT is(pg_get_function_arguments('outbox.purge(interval)'::regprocedure), 'older_than interval',
          'outbox.purge takes older_than');

-- functions outbox.retry_failed() and outbox.retry_failed(uuid)
SELECT function_returns('outbox', 'retry_failed', ARRAY[]::text[], 'bigint',
                        'outbox.retry_failed() returns bigint (events requeued)');
SELECT function_returns('outbox', 'retry_failed', ARRAY['uuid'], 'boolean',
                        'outbox.retry_failed(uuid) returns boolean');
SELECT is(pg_get_function_arguments('outbox.retry_failed(uuid)'::regprocedure), 'event_id uuid',
          'outbox.retry_failed takes event_id uuid');
SELECT is_strict('outbox', 'retry_failed', ARRAY['uuid'], 'outbox.retry_failed(uuid) is STRICT');
SELECT ok(coalesce(btrim(obj_description('outbox.retry_failed()'::regprocedure, 'pg_proc')), '') <> ''
          AND coalesce(btrim(obj_description('outbox.retry_failed(uuid)'::regprocedure, 'pg_proc')), '') <> '',
          'both outbox.retry_failed functions have a comment');

-- pg_dump keeps the events and the id sequence (pg_extension_config_dump)
SELECT is((SELECT array_agg(c::regclass::text ORDER BY c::regclass::text)
             FROM pg_extension e, unnest(e.extconfig) AS c WHERE e.extname = 'outbox'),
          ARRAY['outbox.events', 'outbox.events_id_seq', 'outbox.inbox', 'outbox.inbox_dead',
                'outbox.inbox_dead_id_seq', 'outbox.inbox_id_seq', 'outbox.inbox_keys', 'outbox.inbox_offsets',
                'outbox.inbox_seen_0', 'outbox.inbox_seen_1',
                'outbox.relay_progress', 'outbox.subscriptions'],
          'outbox.events, its id sequence, the relay progress and the inbox''s tables are configuration tables (dumped by pg_dump)');

-- view outbox.status
SELECT has_view('outbox', 'status', 'view outbox.status exists');
SELECT views_are('outbox', ARRAY['status', 'inbox_status'], 'schema outbox has exactly the views status and inbox_status');
SELECT tables_are('outbox', ARRAY['events', 'relay', 'relay_progress', 'subscriptions', 'inbox_offsets',
                                  'inbox_seen', 'inbox_seen_0', 'inbox_seen_1', 'inbox_seen_window',
                                  'inbox', 'inbox_dead', 'inbox_keys'],
                  'schema outbox has exactly the tables events, relay, relay_progress and the inbox''s');
SELECT columns_are('outbox', 'relay_progress', ARRAY['system_identifier', 'snapshot', 'id_floor',
                   'batch_snapshot', 'batch_id_floor', 'batch_last_id'],
                   'outbox.relay_progress has exactly the expected columns');
SELECT results_eq($$SELECT count(*)::int, bool_and(system_identifier =
                         (SELECT system_identifier FROM pg_control_system())),
                         bool_and(snapshot IS NULL AND id_floor = 0 AND batch_snapshot IS NULL)
                    FROM outbox.relay_progress$$,
                  $$VALUES (1, true, true)$$,
                  'outbox.relay_progress holds one row of this cluster, before any batch');
SELECT is_empty($$
    SELECT attname FROM pg_attribute
     WHERE attrelid = 'outbox.relay_progress'::regclass AND attnum > 0 AND NOT attisdropped
       AND coalesce(btrim(col_description(attrelid, attnum)), '') = ''
$$, 'every column of outbox.relay_progress has a non-empty comment');
SELECT columns_are('outbox', 'relay', ARRAY['singleton', 'paused', 'paused_at', 'paused_by'],
                   'outbox.relay has exactly the expected columns');
SELECT results_eq('SELECT singleton, paused, paused_at IS NULL, paused_by IS NULL FROM outbox.relay',
                  $$VALUES (true, false, true, true)$$, 'outbox.relay holds one row, not paused');
SELECT throws_ok('INSERT INTO outbox.relay (singleton) VALUES (false)', '23514', NULL,
                 'outbox.relay cannot get a second row');
SELECT ok(coalesce(btrim(obj_description('outbox.relay'::regclass, 'pg_class')), '') <> '',
          'table outbox.relay has a comment');
SELECT is_empty($$
    SELECT attname FROM pg_attribute
     WHERE attrelid = 'outbox.relay'::regclass AND attnum > 0 AND NOT attisdropped
       AND coalesce(btrim(col_description(attrelid, attnum)), '') = ''
$$, 'every column of outbox.relay has a non-empty comment');
SELECT ok(coalesce(btrim(obj_description('outbox.events_id_seq'::regclass, 'pg_class')), '') <> '',
          'sequence outbox.events_id_seq has a comment');
SELECT columns_are('outbox', 'status', ARRAY[
    'database', 'pid', 'state', 'pending', 'failed_events', 'oldest_pending_age', 'published',
    'failed', 'delivery_errors', 'last_publish_at', 'last_error', 'last_error_at', 'started_at',
    'worker', 'workers', 'buckets'],
    'outbox.status has exactly the expected columns');
SELECT is(ARRAY(SELECT attname::text FROM pg_attribute
                 WHERE attrelid = 'outbox.status'::regclass AND attnum > 0 AND NOT attisdropped
                 ORDER BY attnum),
          ARRAY['database', 'pid', 'state', 'pending', 'failed_events', 'oldest_pending_age', 'published',
                'failed', 'delivery_errors', 'last_publish_at', 'last_error', 'last_error_at', 'started_at',
                'worker', 'workers', 'buckets'],
          'outbox.status columns are in the documented order');
SELECT col_type_is('outbox', 'status', 'database',           'name',                     'status.database is name');
SELECT col_type_is('outbox', 'status', 'pid',                'integer',                  'status.pid is integer');
SELECT col_type_is('outbox', 'status', 'state',              'text',                     'status.state is text');
SELECT col_type_is('outbox', 'status', 'pending',            'bigint',                   'status.pending is bigint');
SELECT col_type_is('outbox', 'status', 'oldest_pending_age', 'interval',                 'status.oldest_pending_age is interval');
SELECT col_type_is('outbox', 'status', 'published',          'bigint',                   'status.published is bigint');
SELECT col_type_is('outbox', 'status', 'failed',             'bigint',                   'status.failed is bigint');
SELECT col_type_is('outbox', 'status', 'failed_events',      'bigint',                   'status.failed_events is bigint');
SELECT col_type_is('outbox', 'status', 'delivery_errors',    'bigint',                   'status.delivery_errors is bigint');
SELECT col_type_is('outbox', 'status', 'last_publish_at',    'timestamp with time zone', 'status.last_publish_at is timestamptz');
SELECT col_type_is('outbox', 'status', 'last_error',         'text',                     'status.last_error is text');
SELECT col_type_is('outbox', 'status', 'last_error_at',      'timestamp with time zone', 'status.last_error_at is timestamptz');
SELECT col_type_is('outbox', 'status', 'started_at',         'timestamp with time zone', 'status.started_at is timestamptz');
SELECT col_type_is('outbox', 'status', 'buckets',            'int4range',                'status.buckets is int4range');
SELECT lives_ok('SELECT * FROM outbox.status', 'outbox.status can be queried');

-- comments: present and non-empty on the table, every column, both functions and the view
SELECT ok(coalesce(btrim(obj_description('outbox.events'::regclass, 'pg_class')), '') <> '',
          'table outbox.events has a comment');
SELECT is((SELECT count(*)::int FROM pg_attribute
            WHERE attrelid = 'outbox.events'::regclass AND attnum > 0 AND NOT attisdropped),
          17, 'outbox.events has 17 columns to check for comments');
SELECT is_empty($$
    SELECT attname FROM pg_attribute
     WHERE attrelid = 'outbox.events'::regclass AND attnum > 0 AND NOT attisdropped
       AND coalesce(btrim(col_description(attrelid, attnum)), '') = ''
     ORDER BY attnum
$$, 'every column of outbox.events has a non-empty comment');
SELECT ok(coalesce(btrim(obj_description('outbox.emit(text, text, text, jsonb, jsonb, text)'::regprocedure, 'pg_proc')), '') <> '',
          'function outbox.emit has a comment');
SELECT ok(coalesce(btrim(obj_description('outbox.worker_status()'::regprocedure, 'pg_proc')), '') <> '',
          'function outbox.worker_status has a comment');
SELECT ok(coalesce(btrim(obj_description('outbox.cluster_status()'::regprocedure, 'pg_proc')), '') <> '',
          'function outbox.cluster_status has a comment');
SELECT ok(coalesce(btrim(obj_description('outbox.status'::regclass, 'pg_class')), '') <> '',
          'view outbox.status has a comment');
SELECT is_empty($$
    SELECT p.oid::regprocedure FROM pg_proc p
     WHERE p.pronamespace = 'outbox'::regnamespace
       AND coalesce(btrim(obj_description(p.oid, 'pg_proc')), '') = ''
$$, 'every function in schema outbox has a comment');

-- comments say what the SQLSTATEs and the reserved headers are (the documented contract)
SELECT matches(obj_description('outbox.emit(text, text, text, jsonb, jsonb, text)'::regprocedure, 'pg_proc'),
               '22004.*22023', 'outbox.emit comment documents SQLSTATEs 22004 and 22023');
SELECT matches(obj_description('outbox.worker_status()'::regprocedure, 'pg_proc'),
               'broker_down, paused, error\)', 'outbox.worker_status comment lists the states paused and error');

-- a plain INSERT gets the documented defaults (inside this rolled-back transaction)
INSERT INTO outbox.events (aggregate_type, aggregate_id, event_type) VALUES ('t', '1', 'e');
SELECT results_eq($$
    SELECT id IS NOT NULL, event_id IS NOT NULL, created_at IS NOT NULL, published_at IS NULL,
           attempts, topic IS NULL, payload IS NULL, headers IS NULL
      FROM outbox.events
$$, $$ VALUES (true, true, true, true, 0, true, true, true) $$,
   'an inserted row gets id, event_id, created_at, attempts 0 and NULL elsewhere');
SELECT throws_ok($$ INSERT INTO outbox.events (id, aggregate_type, aggregate_id, event_type) VALUES (1, 't', '1', 'e') $$,
                 '428C9', NULL, 'events.id cannot be set explicitly (GENERATED ALWAYS)');
SELECT throws_ok($$ INSERT INTO outbox.events (event_id, aggregate_type, aggregate_id, event_type)
                    SELECT event_id, 't', '2', 'e' FROM outbox.events $$,
                 '23505', NULL, 'a duplicate event_id is rejected');
SELECT throws_ok($$ INSERT INTO outbox.events (aggregate_type, aggregate_id) VALUES ('t', '3') $$,
                 '23502', NULL, 'event_type is required');

-- the inbox (1.8): the handler's type, every table, column, type attribute and view commented
SELECT has_type('outbox', 'inbox_event', 'type outbox.inbox_event exists');
SELECT is(ARRAY(SELECT a.attname::text || ' ' || format_type(a.atttypid, a.atttypmod)
                  FROM pg_attribute a WHERE a.attrelid = 'outbox.inbox_event'::regclass AND a.attnum > 0
                 ORDER BY a.attnum),
          ARRAY['subscription text', 'topic text', 'kafka_partition integer', 'kafka_offset bigint',
                'key text', 'event_id uuid', 'event_type text', 'aggregate_type text', 'headers jsonb',
                'payload jsonb', 'payload_bytes bytea', 'kafka_timestamp timestamp with time zone'],
          'outbox.inbox_event has the fields of the contract, in order');
SELECT ok(coalesce(btrim(obj_description('outbox.inbox_event'::regtype, 'pg_type')), '') <> '',
          'type outbox.inbox_event has a comment');
SELECT is_empty($$
    SELECT c.relname FROM pg_class c
     WHERE c.relnamespace = 'outbox'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'S')
       AND c.relname ~ '^(inbox|subscriptions)'
       AND coalesce(btrim(obj_description(c.oid, 'pg_class')), '') = ''
$$, 'every table, sequence and view of the inbox has a comment');
SELECT is_empty($$
    SELECT c.relname || '.' || a.attname FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid
     WHERE c.relnamespace = 'outbox'::regnamespace AND c.relkind IN ('r', 'p')
       AND c.relname IN ('subscriptions', 'inbox_offsets', 'inbox_seen', 'inbox_seen_window', 'inbox', 'inbox_dead', 'inbox_keys')
       AND a.attnum > 0 AND NOT a.attisdropped
       AND coalesce(btrim(col_description(c.oid, a.attnum)), '') = ''
$$, 'every column of the inbox''s tables has a comment');
SELECT is((SELECT reloptions FROM pg_class WHERE oid = 'outbox.inbox_offsets'::regclass),
          ARRAY['fillfactor=50'], 'outbox.inbox_offsets leaves room for HOT updates of its offsets');
SELECT is((SELECT relkind FROM pg_class WHERE oid = 'outbox.inbox_seen'::regclass), 'p'::"char",
          'outbox.inbox_seen is partitioned (two slots dropped whole, never row by row)');
SELECT is((SELECT count(*)::int FROM outbox.inbox_seen_window), 1, 'outbox.inbox_seen_window has one row');
SELECT matches(obj_description('outbox.subscribe(text, text[], regprocedure, text, boolean, text)'::regprocedure, 'pg_proc'),
               '22023.*42710.*42P13.*42501', 'outbox.subscribe comment documents its SQLSTATEs');
SELECT is(pg_get_function_arguments('outbox.subscribe(text, text[], regprocedure, text, boolean, text)'::regprocedure),
          'name text, topics text[], handler regprocedure DEFAULT NULL::regprocedure, on_failed_event text DEFAULT ''hold''::text, dedupe boolean DEFAULT true, start_from text DEFAULT ''earliest''::text',
          'outbox.subscribe arguments and defaults');
SELECT is(pg_get_function_arguments('outbox.inbox_take(text, integer)'::regprocedure),
          'subscription text, max integer DEFAULT 100', 'outbox.inbox_take arguments, max defaults to 100');
SELECT function_returns('outbox', 'inbox_take', ARRAY['text', 'integer'], 'setof outbox.inbox',
                        'outbox.inbox_take returns SETOF outbox.inbox');

-- 1.9: the seek to a position as text, the subscribing role, row-level security
SELECT function_returns('outbox', 'inbox_seek', ARRAY['text', 'text', 'integer', 'text'], 'bigint',
                        'outbox.inbox_seek(text, text, integer, text) returns bigint');
SELECT is(pg_get_function_arguments('outbox.inbox_seek(text, text, integer, text)'::regprocedure),
          'subscription text, topic text, kafka_partition integer, start_from text',
          'outbox.inbox_seek takes a position as start_from text');
SELECT ok(coalesce(btrim(obj_description('outbox.inbox_seek(text, text, integer, text)'::regprocedure, 'pg_proc')), '') <> '',
          'outbox.inbox_seek(text, text, integer, text) has a comment');
SELECT has_role('outbox_subscriber', 'role outbox_subscriber exists');
SELECT ok(NOT (SELECT rolcanlogin OR rolsuper FROM pg_roles WHERE rolname = 'outbox_subscriber'),
          'outbox_subscriber cannot log in and is no superuser');
SELECT ok(coalesce(btrim(shobj_description('outbox_subscriber'::regrole, 'pg_authid')), '') <> '',
          'role outbox_subscriber has a comment');
SELECT is(ARRAY(SELECT relname::text FROM pg_class WHERE relnamespace = 'outbox'::regnamespace
                   AND relrowsecurity ORDER BY 1),
          ARRAY['inbox_dead', 'subscriptions'], 'row-level security is on for outbox.inbox_dead and outbox.subscriptions');
SELECT is(ARRAY(SELECT c.relname || '.' || p.polname FROM pg_policy p JOIN pg_class c ON c.oid = p.polrelid
                 WHERE c.relnamespace = 'outbox'::regnamespace
                   AND coalesce(btrim(obj_description(p.oid, 'pg_policy')), '') <> '' ORDER BY 1),
          ARRAY['inbox_dead.dead_letters_of_the_owner', 'subscriptions.subscriptions_of_the_owner'],
          'each policy exists and has a comment');

SELECT * FROM finish();
ROLLBACK;
