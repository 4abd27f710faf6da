-- pgTAP: least privilege, run as non-superuser roles.
-- PUBLIC may do nothing; a role granted EXECUTE on emit() can emit but not read or write the
-- table; nothing a caller creates in public or pg_temp is used by the extension's functions.
BEGIN;
CREATE EXTENSION IF NOT EXISTS pgtap;
CREATE EXTENSION outbox;

SELECT plan(55);

CREATE ROLE outbox_t_nobody;           -- only PUBLIC's rights
CREATE ROLE outbox_t_app;              -- may emit
CREATE ROLE outbox_t_monitor IN ROLE pg_monitor;
CREATE ROLE outbox_t_subscriber IN ROLE outbox_subscriber;   -- subscribes (1.9)
GRANT USAGE ON SCHEMA outbox TO outbox_t_nobody, outbox_t_app;   -- so table rights are what is tested
GRANT EXECUTE ON FUNCTION outbox.emit(text, text, text, jsonb, jsonb, text) TO outbox_t_app;
GRANT USAGE, CREATE ON SCHEMA public TO outbox_t_nobody, outbox_t_app;
GRANT SELECT ON pg_settings TO outbox_t_nobody;

-- nothing is granted to PUBLIC
SELECT is_empty($$
    SELECT p.oid::regprocedure::text FROM pg_proc p, aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
     WHERE p.pronamespace = 'outbox'::regnamespace AND a.grantee = 0
$$, 'PUBLIC may execute no function in schema outbox');
SELECT is_empty($$
    SELECT c.relname FROM pg_class c, aclexplode(coalesce(c.relacl, acldefault('r', c.relowner))) a
     WHERE c.relnamespace = 'outbox'::regnamespace AND a.grantee = 0
$$, 'PUBLIC has no right on any table or view in schema outbox');
SELECT ok(NOT has_schema_privilege('public', 'outbox', 'USAGE'), 'PUBLIC has no USAGE on schema outbox');

SET ROLE outbox_t_nobody;
SELECT throws_ok($$SELECT outbox.emit('o', '1', 'e', '{}')$$, '42501', NULL, 'PUBLIC cannot emit');
SELECT throws_ok($$SELECT outbox.emit_bytes('o', '1', 'e', '\x00')$$, '42501', NULL, 'PUBLIC cannot emit bytes');
SELECT throws_ok($$SELECT outbox.pause()$$, '42501', NULL, 'PUBLIC cannot pause');
SELECT throws_ok($$SELECT * FROM outbox.cluster_status()$$, '42501', NULL,
                 'PUBLIC cannot read outbox.cluster_status() (other databases'' relays)');
SELECT throws_ok($$SELECT outbox.resume()$$, '42501', NULL, 'PUBLIC cannot resume');
SELECT throws_ok($$SELECT outbox.replay(now())$$, '42501', NULL, 'PUBLIC cannot replay by time');
SELECT throws_ok($$SELECT outbox.replay(1, 2)$$, '42501', NULL, 'PUBLIC cannot replay by id');
SELECT throws_ok($$SELECT outbox.purge('1 day')$$, '42501', NULL, 'PUBLIC cannot purge');
SELECT throws_ok($$SELECT outbox.retry_failed()$$, '42501', NULL, 'PUBLIC cannot requeue failed events');
SELECT throws_ok($$SELECT outbox.retry_failed(gen_random_uuid())$$, '42501', NULL, 'PUBLIC cannot requeue one event');
SELECT throws_ok($$SELECT * FROM outbox.events$$, '42501', NULL, 'PUBLIC cannot read outbox.events');
SELECT throws_ok($$INSERT INTO outbox.events (aggregate_type, aggregate_id, event_type) VALUES ('o', '1', 'e')$$,
                 '42501', NULL, 'PUBLIC cannot insert into outbox.events');
SELECT throws_ok($$UPDATE outbox.events SET published_at = now()$$, '42501', NULL, 'PUBLIC cannot update outbox.events');
SELECT throws_ok($$DELETE FROM outbox.events$$, '42501', NULL, 'PUBLIC cannot delete from outbox.events');
SELECT throws_ok($$UPDATE outbox.relay SET paused = true$$, '42501', NULL, 'PUBLIC cannot flip the relay switch');
SELECT throws_ok($$SELECT * FROM outbox.status$$, '42501', NULL, 'PUBLIC cannot read outbox.status');
CREATE TABLE public.t_capture (id int);
SELECT throws_ok($$CREATE TRIGGER t AFTER INSERT ON public.t_capture FOR EACH ROW EXECUTE FUNCTION outbox.capture('t', 'id')$$,
                 '42501', NULL, 'PUBLIC cannot attach outbox.capture() to a table');
-- the Kafka properties (they may hold passwords) are hidden
SELECT throws_ok($$SHOW outbox.kafka_properties$$, '42501', NULL, 'SHOW outbox.kafka_properties needs superuser');
SELECT throws_ok($$SELECT current_setting('outbox.kafka_properties')$$, '42501', NULL,
                 'current_setting(outbox.kafka_properties) needs superuser');
SELECT is_empty($$SELECT 1 FROM pg_settings WHERE name = 'outbox.kafka_properties'$$,
                'pg_settings hides outbox.kafka_properties');
SELECT throws_ok($$SET outbox.kafka_properties = 'linger.ms=1'$$, '55P02', NULL,
                 'outbox.kafka_properties cannot be SET in a session');
SELECT throws_ok($$SET outbox.allowed_topics = ''$$, '55P02', NULL,
                 'outbox.allowed_topics cannot be SET in a session');
RESET ROLE;

-- a role granted emit() can emit, and nothing else
SET ROLE outbox_t_app;
SELECT lives_ok($$SELECT outbox.emit('order', '1', 'order.created', '{"a": 1}')$$, 'the app role can emit');
SELECT throws_ok($$SELECT * FROM outbox.events$$, '42501', NULL, 'the app role cannot read other events');
SELECT throws_ok($$SELECT count(*) FROM outbox.events$$, '42501', NULL, 'the app role cannot even count events');
SELECT throws_ok($$INSERT INTO outbox.events (aggregate_type, aggregate_id, event_type, topic) VALUES ('o', '1', 'e', 'any')$$,
                 '42501', NULL, 'the app role cannot bypass emit() with an INSERT');
SELECT throws_ok($$UPDATE outbox.events SET topic = 'elsewhere'$$, '42501', NULL, 'the app role cannot redirect events');
SELECT throws_ok($$SELECT outbox.pause()$$, '42501', NULL, 'the app role cannot pause the relay');
SELECT throws_ok($$SELECT outbox.replay(now())$$, '42501', NULL, 'the app role cannot replay');
SELECT throws_ok($$SELECT outbox.purge('0')$$, '42501', NULL, 'the app role cannot purge');

-- the search_path attack: objects the caller puts first on its search_path are never used
CREATE TABLE public.attack_log (what text);
CREATE FUNCTION public.gen_random_uuid() RETURNS uuid LANGUAGE sql
    AS $$INSERT INTO public.attack_log VALUES ('gen_random_uuid') RETURNING '00000000-0000-0000-0000-000000000001'::uuid$$;
CREATE FUNCTION public.clock_timestamp() RETURNS timestamptz LANGUAGE sql
    AS $$INSERT INTO public.attack_log VALUES ('clock_timestamp') RETURNING '1999-01-01'::timestamptz$$;
CREATE FUNCTION public.now() RETURNS timestamptz LANGUAGE sql
    AS $$INSERT INTO public.attack_log VALUES ('now') RETURNING '1999-01-01'::timestamptz$$;
CREATE FUNCTION public.text_eq_evil(text, text) RETURNS boolean LANGUAGE sql
    AS $$INSERT INTO public.attack_log VALUES ('=') RETURNING true$$;
CREATE OPERATOR public.= (LEFTARG = text, RIGHTARG = text, FUNCTION = public.text_eq_evil);
CREATE TEMP TABLE events (id int);
-- (only our call runs under the hostile search_path: pgTAP's own functions would call the
-- planted operator themselves)
SET LOCAL search_path = public, pg_temp, pg_catalog;
SELECT outbox.emit('order', '2', 'order.created', '{"b": 2}') AS attacked_id \gset
RESET search_path;
SELECT isnt(:'attacked_id'::uuid, '00000000-0000-0000-0000-000000000001'::uuid,
            'emit() does not call a gen_random_uuid() planted in public');
SELECT is_empty($$SELECT what FROM public.attack_log$$,
                'no function or operator planted in public was called by emit()');
RESET ROLE;

-- the events the app emitted are there, with real ids and times
SELECT is((SELECT count(*)::int FROM outbox.events WHERE aggregate_id IN ('1', '2')), 2,
          'both events of the app role were written');
SELECT ok((SELECT bool_and(created_at > '2000-01-01' AND event_id <> '00000000-0000-0000-0000-000000000001')
             FROM outbox.events WHERE aggregate_id IN ('1', '2')),
          'their created_at and event_id come from pg_catalog, not from public');

-- capture() as a table owner who was granted it, with the same planted objects
GRANT EXECUTE ON FUNCTION outbox.capture() TO outbox_t_app;
SET ROLE outbox_t_app;
CREATE TABLE public.t_app_orders (id int PRIMARY KEY, note text);
SELECT lives_ok($$CREATE TRIGGER t AFTER INSERT OR UPDATE OR DELETE ON public.t_app_orders
                  FOR EACH ROW EXECUTE FUNCTION outbox.capture('order', 'id')$$,
                'a role granted capture() can attach it to its table');
SET LOCAL search_path = public, pg_temp, pg_catalog;
INSERT INTO public.t_app_orders VALUES (7, 'seven');
UPDATE public.t_app_orders SET note = 'seven!' WHERE id = 7;
RESET search_path;
SELECT is_empty($$SELECT what FROM public.attack_log$$,
                'no function or operator planted in public was called by capture()');
RESET ROLE;
SELECT is(ARRAY(SELECT payload -> 'after' ->> 'note' FROM outbox.events
                 WHERE event_type LIKE 't_app_orders.%' ORDER BY id),
          ARRAY['seven', 'seven!'], 'the captured events are in outbox.events');

-- pg_monitor may read the status, nothing else
SET ROLE outbox_t_monitor;
SELECT lives_ok($$SELECT * FROM outbox.status$$, 'pg_monitor can read outbox.status');
SELECT throws_ok($$SELECT * FROM outbox.events$$, '42501', NULL, 'pg_monitor cannot read outbox.events');
SELECT throws_ok($$SELECT outbox.pause()$$, '42501', NULL, 'pg_monitor cannot pause');
SELECT lives_ok($$SELECT * FROM outbox.cluster_status()$$, 'pg_monitor can read outbox.cluster_status()');
-- (pg_monitor includes pg_read_all_settings: that it sees no secret values in
-- outbox.kafka_properties is tested with real secrets in test/integration/test_21_security.py)
RESET ROLE;

-- outbox_subscriber (1.9) may use the inbox's SQL API and read its status, nothing else
SET ROLE outbox_t_subscriber;
SELECT ok(has_schema_privilege('outbox', 'USAGE'), 'outbox_subscriber has USAGE on schema outbox');
SELECT is_empty($$
    SELECT f FROM unnest(ARRAY['outbox.subscribe(text, text[], regprocedure, text, boolean, text)',
                               'outbox.unsubscribe(text)', 'outbox.pause_subscription(text)',
                               'outbox.resume_subscription(text)', 'outbox.inbox_seek(text, text, integer, bigint)',
                               'outbox.inbox_seek(text, text, integer, timestamptz)',
                               'outbox.inbox_seek(text, text, integer, text)', 'outbox.inbox_retry(text, text)',
                               'outbox.inbox_take(text, integer)', 'outbox.inbox_worker_partitions()']) AS f
     WHERE NOT has_function_privilege(f, 'EXECUTE')
$$, 'outbox_subscriber may execute every function of the inbox''s SQL API');
SELECT lives_ok($$SELECT * FROM outbox.inbox_status$$, 'outbox_subscriber can read outbox.inbox_status');
SELECT lives_ok($$SELECT * FROM outbox.inbox_dead$$, 'outbox_subscriber can read outbox.inbox_dead (its own rows)');
SELECT lives_ok($$SELECT * FROM outbox.subscriptions$$, 'outbox_subscriber can read outbox.subscriptions (its own rows)');
SELECT throws_ok($$SELECT * FROM outbox.inbox_offsets$$, '42501', NULL, 'outbox_subscriber cannot read outbox.inbox_offsets');
SELECT throws_ok($$SELECT * FROM outbox.inbox$$, '42501', NULL, 'outbox_subscriber cannot read the queued events');
SELECT throws_ok($$DELETE FROM outbox.inbox_dead$$, '42501', NULL, 'outbox_subscriber cannot delete dead letters');
SELECT throws_ok($$SELECT outbox.emit('o', '1', 'e', '{}')$$, '42501', NULL, 'outbox_subscriber cannot emit');
RESET ROLE;

-- the functions run with a fixed search_path, as the extension's owner
SELECT is_empty($$
    SELECT p.oid::regprocedure::text FROM pg_proc p
     WHERE p.pronamespace = 'outbox'::regnamespace
       AND NOT (coalesce(p.proconfig, '{}') @> ARRAY['search_path=pg_catalog, pg_temp'])
       AND p.oid <> 'outbox.uuidv7()'::regprocedure
$$, 'every function in schema outbox but uuidv7() (no SQL, called per row) pins search_path = pg_catalog, pg_temp');
SELECT is(ARRAY(SELECT p.proname::text FROM pg_proc p
                 WHERE p.pronamespace = 'outbox'::regnamespace AND NOT p.prosecdef
                 ORDER BY 1),
          ARRAY['cluster_status', 'inbox_retry', 'inbox_seek', 'inbox_seek', 'inbox_seek', 'inbox_take',
                'inbox_worker_partitions', 'pause_subscription', 'resume_subscription', 'subscribe',
                'unsubscribe', 'uuidv7', 'worker_buckets', 'worker_status'],
          'every function but the status functions, uuidv7() and the inbox''s SQL API (which checks the caller''s rights itself and writes as the extension''s owner) is SECURITY DEFINER');

SELECT * FROM finish();
ROLLBACK;
