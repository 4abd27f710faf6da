-- outbox.capture(): row changes become events in the same transaction
CREATE EXTENSION outbox;
SET timezone = 'UTC';
SET extra_float_digits = 0;
\set SHOW_CONTEXT never

-- a table with the types whose JSON rendering matters
CREATE TABLE orders (
    id        int PRIMARY KEY,
    customer  text,
    total     numeric(30,10),
    placed_at timestamptz,
    blob      bytea,
    tags      text[],
    note      text,
    doubled   int GENERATED ALWAYS AS (id * 2) STORED
);
CREATE TRIGGER orders_outbox AFTER INSERT OR UPDATE OR DELETE ON orders
    FOR EACH ROW EXECUTE FUNCTION outbox.capture('order', 'id');

INSERT INTO orders (id, customer, total, placed_at, blob, tags, note)
VALUES (1, 'ada', 12345678901234567890.0123456789, '2026-01-02 03:04:05.678901+00',
        '\xdeadbeef', ARRAY['a', 'b"c', NULL], NULL);
UPDATE orders SET customer = 'grace', tags = '{}' WHERE id = 1;
DELETE FROM orders WHERE id = 1;

SELECT aggregate_type, aggregate_id, event_type, topic, payload
  FROM outbox.events ORDER BY id;

-- numbers keep every digit: compare the JSON number with the column's value
SELECT (payload -> 'after' ->> 'total')::numeric = 12345678901234567890.0123456789 AS total_exact
  FROM outbox.events WHERE event_type = 'orders.created';

-- a rolled-back change writes no event; a savepoint rolled back neither
BEGIN;
INSERT INTO orders (id, customer) VALUES (2, 'rolled back');
ROLLBACK;
BEGIN;
INSERT INTO orders (id, customer) VALUES (3, 'kept');
SAVEPOINT s;
INSERT INTO orders (id, customer) VALUES (4, 'rolled back to savepoint');
ROLLBACK TO SAVEPOINT s;
COMMIT;
SELECT aggregate_id, event_type FROM outbox.events WHERE aggregate_id IN ('2', '3', '4') ORDER BY id;

-- TOASTed values arrive whole, in the new and the old row
INSERT INTO orders (id, note) VALUES (5, repeat('toast-me ', 20000));
UPDATE orders SET customer = 'x' WHERE id = 5;
SELECT event_type, length(payload -> 'after' ->> 'note') AS after_len,
       length(payload -> 'before' ->> 'note') AS before_len
  FROM outbox.events WHERE aggregate_id = '5' ORDER BY id;

-- ALTER TABLE ADD / DROP COLUMN: the payload follows the table's current columns
ALTER TABLE orders ADD COLUMN status text DEFAULT 'new';
ALTER TABLE orders DROP COLUMN note;
UPDATE orders SET status = 'paid' WHERE id = 3;
SELECT payload FROM outbox.events WHERE aggregate_id = '3' ORDER BY id DESC LIMIT 1;

-- COPY fires the trigger for every row
COPY orders (id, customer) FROM stdin;
10	copy-a
11	copy-b
\.
SELECT aggregate_id, event_type, payload -> 'after' ->> 'customer' AS customer
  FROM outbox.events WHERE aggregate_id IN ('10', '11') ORDER BY id;

-- a composite key: values joined by ':', with ':' and '\' escaped by '\'
CREATE TABLE lines (order_id text, line int, sku text, PRIMARY KEY (order_id, line));
CREATE TRIGGER lines_outbox AFTER INSERT OR UPDATE OR DELETE ON lines
    FOR EACH ROW EXECUTE FUNCTION outbox.capture('order_line', 'order_id, line', 'order-lines');
INSERT INTO lines VALUES ('42', 1, 'x'), ('a:b', 2, 'y'), ('c\d', 3, 'z');
SELECT aggregate_id, event_type, topic FROM outbox.events
 WHERE aggregate_type = 'order_line' ORDER BY id;

-- a partitioned table: events carry the partitioned table's name, also for
-- rows written straight into a partition
CREATE TABLE readings (device text, at date, value float8) PARTITION BY RANGE (at);
CREATE TABLE readings_2026 PARTITION OF readings FOR VALUES FROM ('2026-01-01') TO ('2027-01-01');
CREATE TRIGGER readings_outbox AFTER INSERT OR UPDATE OR DELETE ON readings
    FOR EACH ROW EXECUTE FUNCTION outbox.capture('device', 'device');
INSERT INTO readings VALUES ('d1', '2026-03-01', 1.5);
INSERT INTO readings_2026 VALUES ('d2', '2026-04-01', 2.5);
UPDATE readings SET value = 3 WHERE device = 'd1';
SELECT aggregate_id, event_type, payload ->> 'table' AS source, payload -> 'after' AS after
  FROM outbox.events WHERE aggregate_type = 'device' ORDER BY id;

-- errors name the trigger and the table, and write nothing
SELECT count(*) AS n FROM outbox.events \gset
CREATE TABLE bad (id int, k text);
CREATE TRIGGER bad_key AFTER INSERT ON bad FOR EACH ROW EXECUTE FUNCTION outbox.capture('bad', 'nope');
INSERT INTO bad VALUES (1, 'x');
SELECT :'LAST_ERROR_SQLSTATE' AS sqlstate;
DROP TRIGGER bad_key ON bad;
CREATE TRIGGER bad_null AFTER INSERT ON bad FOR EACH ROW EXECUTE FUNCTION outbox.capture('bad', 'k');
INSERT INTO bad VALUES (1, NULL);
SELECT :'LAST_ERROR_SQLSTATE' AS sqlstate;
-- an empty key would be an empty Kafka key, which emit() refuses too; two columns never make one
INSERT INTO bad VALUES (1, '');
SELECT :'LAST_ERROR_SQLSTATE' AS sqlstate;
DROP TRIGGER bad_null ON bad;
CREATE TRIGGER bad_null AFTER INSERT ON bad FOR EACH ROW EXECUTE FUNCTION outbox.capture('bad', 'k,k2');
ALTER TABLE bad ADD COLUMN k2 text;
INSERT INTO bad VALUES (1, '', '') RETURNING id;
SELECT aggregate_id FROM outbox.events WHERE aggregate_type = 'bad';
ALTER TABLE bad DROP COLUMN k2;
DELETE FROM outbox.events WHERE aggregate_type = 'bad';
DROP TRIGGER bad_null ON bad;
CREATE TRIGGER bad_args AFTER INSERT ON bad FOR EACH ROW EXECUTE FUNCTION outbox.capture('bad');
INSERT INTO bad VALUES (1, 'x');
SELECT :'LAST_ERROR_SQLSTATE' AS sqlstate;
DROP TRIGGER bad_args ON bad;
CREATE TRIGGER bad_many AFTER INSERT ON bad FOR EACH ROW EXECUTE FUNCTION outbox.capture('bad', 'id', 't', 'x');
INSERT INTO bad VALUES (1, 'x');
DROP TRIGGER bad_many ON bad;
CREATE TRIGGER bad_empty AFTER INSERT ON bad FOR EACH ROW EXECUTE FUNCTION outbox.capture('', 'id');
INSERT INTO bad VALUES (1, 'x');
DROP TRIGGER bad_empty ON bad;
CREATE TRIGGER bad_nokeys AFTER INSERT ON bad FOR EACH ROW EXECUTE FUNCTION outbox.capture('bad', ' , ');
INSERT INTO bad VALUES (1, 'x');
DROP TRIGGER bad_nokeys ON bad;
CREATE TRIGGER bad_before BEFORE INSERT ON bad FOR EACH ROW EXECUTE FUNCTION outbox.capture('bad', 'id');
INSERT INTO bad VALUES (1, 'x');
SELECT :'LAST_ERROR_SQLSTATE' AS sqlstate;
DROP TRIGGER bad_before ON bad;
CREATE TRIGGER bad_statement AFTER INSERT ON bad FOR EACH STATEMENT EXECUTE FUNCTION outbox.capture('bad', 'id');
INSERT INTO bad VALUES (1, 'x');
DROP TRIGGER bad_statement ON bad;
CREATE TRIGGER bad_topic AFTER INSERT ON bad FOR EACH ROW EXECUTE FUNCTION outbox.capture('bad', 'id', 'no spaces allowed');
INSERT INTO bad VALUES (1, 'x');
SELECT :'LAST_ERROR_SQLSTATE' AS sqlstate;
DROP TRIGGER bad_topic ON bad;
CREATE TRIGGER bad_route AFTER INSERT ON bad FOR EACH ROW EXECUTE FUNCTION outbox.capture('not/routable', 'id');
INSERT INTO bad VALUES (1, 'x');
DROP TRIGGER bad_route ON bad;
-- an empty topic argument is a mistake, not "routed"
CREATE TRIGGER bad_empty_topic AFTER INSERT ON bad FOR EACH ROW EXECUTE FUNCTION outbox.capture('bad', 'id', '');
INSERT INTO bad VALUES (1, 'x');
SELECT :'LAST_ERROR_SQLSTATE' AS sqlstate;
DROP TRIGGER bad_empty_topic ON bad;
-- a key column listed twice
CREATE TRIGGER bad_twice AFTER INSERT ON bad FOR EACH ROW EXECUTE FUNCTION outbox.capture('bad', 'id, id');
INSERT INTO bad VALUES (1, 'x');
SELECT :'LAST_ERROR_SQLSTATE' AS sqlstate;
DROP TRIGGER bad_twice ON bad;
-- an aggregate id over 1024 bytes
CREATE TRIGGER bad_long AFTER INSERT ON bad FOR EACH ROW EXECUTE FUNCTION outbox.capture('bad', 'id, k');
INSERT INTO bad VALUES (1, repeat('x', 1100));
SELECT :'LAST_ERROR_SQLSTATE' AS sqlstate;
DROP TRIGGER bad_long ON bad;
SELECT outbox.capture();
SELECT count(*) = :n AS nothing_written FROM outbox.events;

-- an empty item in the key column list
CREATE TRIGGER bad_empty_key AFTER INSERT ON bad FOR EACH ROW EXECUTE FUNCTION outbox.capture('bad', 'id,,k');
INSERT INTO bad VALUES (1, 'x');
SELECT :'LAST_ERROR_SQLSTATE' AS sqlstate;
DROP TRIGGER bad_empty_key ON bad;

-- capture() runs as the extension's owner, but the row is rendered as the
-- table's owner in a security-restricted operation: a cast to json that the
-- table's owner wrote never runs with more rights than its own
CREATE ROLE capture_owner;
GRANT USAGE ON SCHEMA outbox TO capture_owner;
GRANT EXECUTE ON FUNCTION outbox.capture() TO capture_owner;
CREATE SCHEMA cap_evil AUTHORIZATION capture_owner;
SET ROLE capture_owner;
CREATE TYPE cap_evil.e AS ENUM ('a');
CREATE FUNCTION cap_evil.evil(cap_evil.e) RETURNS json LANGUAGE plpgsql AS $$
BEGIN
    RAISE NOTICE 'the cast runs as %', current_user;
    EXECUTE 'ALTER ROLE capture_owner SUPERUSER';
    RETURN to_json($1::text);
EXCEPTION WHEN insufficient_privilege THEN
    -- PostgreSQL 16 reworded this error: re-raise it with a text of our own
    RAISE EXCEPTION 'ALTER ROLE refused (SQLSTATE %)', SQLSTATE USING ERRCODE = SQLSTATE;
END $$;
CREATE CAST (cap_evil.e AS json) WITH FUNCTION cap_evil.evil(cap_evil.e);
CREATE TABLE cap_evil.t (id int PRIMARY KEY, v cap_evil.e);
CREATE TRIGGER t_out AFTER INSERT ON cap_evil.t FOR EACH ROW EXECUTE FUNCTION outbox.capture('capevil', 'id');
INSERT INTO cap_evil.t VALUES (1, 'a');
RESET ROLE;
SELECT rolsuper AS became_superuser FROM pg_roles WHERE rolname = 'capture_owner';
SELECT count(*) AS captured FROM outbox.events WHERE aggregate_type = 'capevil';
DROP SCHEMA cap_evil CASCADE;
REVOKE ALL ON FUNCTION outbox.capture() FROM capture_owner;
REVOKE ALL ON SCHEMA outbox FROM capture_owner;
DROP ROLE capture_owner;

-- "table" is quoted where SQL needs quotes: no ambiguity with dots in names
CREATE SCHEMA "We.ird";
CREATE TABLE "We.ird"."My Table" (id int PRIMARY KEY);
CREATE TRIGGER weird_outbox AFTER INSERT ON "We.ird"."My Table" FOR EACH ROW EXECUTE FUNCTION outbox.capture('weird', 'id');
INSERT INTO "We.ird"."My Table" VALUES (1);
SELECT event_type, payload->>'table' AS "table" FROM outbox.events WHERE aggregate_type = 'weird';
DROP SCHEMA "We.ird" CASCADE;

-- keys and rows are rendered with fixed output settings, not the session's:
-- one row keeps one key (hence one partition) whatever DateStyle, TimeZone,
-- IntervalStyle, bytea_output or extra_float_digits the writer uses
CREATE TABLE stamps (day date, at timestamptz, b bytea, f float8, iv interval, v text,
                     PRIMARY KEY (day, at, b, f, iv));
CREATE TRIGGER stamps_outbox AFTER INSERT OR UPDATE ON stamps
    FOR EACH ROW EXECUTE FUNCTION outbox.capture('stamp', 'day,at,b,f,iv');
SET TimeZone = 'UTC'; SET DateStyle = 'ISO'; SET bytea_output = 'hex';
SET IntervalStyle = 'postgres'; SET extra_float_digits = 1;
INSERT INTO stamps VALUES ('2026-03-04', '2026-03-04 10:00+00', '\x01', 0.1, '1 day 2 hours', 'v1');
SET TimeZone = 'America/New_York'; SET DateStyle = 'German'; SET bytea_output = 'escape';
SET IntervalStyle = 'sql_standard'; SET extra_float_digits = -3;
UPDATE stamps SET v = 'v2';
SET DateStyle = 'SQL'; SET IntervalStyle = 'iso_8601';
UPDATE stamps SET v = 'v3';
-- the session's settings are its own again after the trigger
SHOW DateStyle;
SHOW TimeZone;
SHOW bytea_output;
SELECT event_type, aggregate_id, payload->'after'->>'at' AS at, payload->'after'->>'b' AS b,
       payload->'after'->>'iv' AS iv
  FROM outbox.events WHERE aggregate_type = 'stamp' ORDER BY id;
SELECT count(DISTINCT aggregate_id) AS distinct_keys FROM outbox.events WHERE aggregate_type = 'stamp';
RESET TimeZone; RESET DateStyle; RESET bytea_output; RESET IntervalStyle;
SET timezone = 'UTC';
SET extra_float_digits = 0;
DROP TABLE stamps;

-- an UPDATE that changes the key ends the old key's history with a deleted
-- event and starts the new key's with a created one
CREATE TABLE rekey (id int PRIMARY KEY, v text);
CREATE TRIGGER rekey_outbox AFTER INSERT OR UPDATE OR DELETE ON rekey
    FOR EACH ROW EXECUTE FUNCTION outbox.capture('rekey', 'id');
INSERT INTO rekey VALUES (1, 'a');
UPDATE rekey SET id = 2;
UPDATE rekey SET v = 'b';
SELECT aggregate_id, event_type, payload->'before' AS before, payload->'after' AS after
  FROM outbox.events WHERE aggregate_type = 'rekey' ORDER BY id;
DROP TABLE rekey;

-- a json value jsonb refuses (\u0000) cannot be captured: the
-- error names the trigger and the table, and nothing is written
CREATE TABLE docs (id int PRIMARY KEY, body json);
CREATE TRIGGER docs_outbox AFTER INSERT OR UPDATE OR DELETE ON docs
    FOR EACH ROW EXECUTE FUNCTION outbox.capture('docs', 'id');
\set SHOW_CONTEXT errors
INSERT INTO docs VALUES (1, '{"a": "\u0000"}');
\set SHOW_CONTEXT never
INSERT INTO docs VALUES (3, '{"a": "\u00e9"}');
SELECT id FROM docs;
SELECT aggregate_id, payload->'after'->'body' AS body FROM outbox.events WHERE aggregate_type = 'docs';
DROP TABLE docs;

-- the tombstone recipe of doc/sql-api.md: a trigger that sorts after the capture trigger
-- emits a NULL payload under the same aggregate type and key
CREATE TABLE kv (id int PRIMARY KEY, v text);
CREATE TRIGGER a_outbox AFTER INSERT OR UPDATE OR DELETE ON kv
    FOR EACH ROW EXECUTE FUNCTION outbox.capture('kv', 'id');
CREATE FUNCTION kv_tombstone() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM outbox.emit('kv', OLD.id::text, 'kv.tombstone', NULL);
    RETURN NULL;
END $$;
CREATE TRIGGER z_tombstone AFTER DELETE ON kv FOR EACH ROW EXECUTE FUNCTION kv_tombstone();
INSERT INTO kv VALUES (7, 'x');
DELETE FROM kv;
SELECT aggregate_id, event_type, payload IS NULL AS tombstone
  FROM outbox.events WHERE aggregate_type = 'kv' ORDER BY id;
DROP TABLE kv;
DROP FUNCTION kv_tombstone();

DROP TABLE orders, lines, readings, bad;
DROP EXTENSION outbox;
