--
-- outbox.uuidv7(): time-ordered event ids (UUID version 7, RFC 9562), the
-- default of outbox.events.event_id since 1.8: their layout, their order
-- within a session, their uniqueness, and that emit() writes them.
--
\set SHOW_CONTEXT never
CREATE EXTENSION outbox;
SET client_min_messages = error;

-- layout: version 7 in the high nibble of byte 6, variant 10 in the top bits of byte 8
SELECT get_byte(uuid_send(u), 6) >> 4 AS version, get_byte(uuid_send(u), 8) >> 6 AS variant
  FROM (SELECT outbox.uuidv7() AS u) AS s;
-- bytes 0-5: Unix time in ms, between the clock read before and after
SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint AS t0 \gset
SELECT outbox.uuidv7() AS u \gset
SELECT ceil(extract(epoch FROM clock_timestamp()) * 1000)::bigint AS t1 \gset
SELECT ('x' || substr(replace(:'u', '-', ''), 1, 12))::bit(48)::bigint BETWEEN :t0 AND :t1 AS ms_in_range;
-- the id's time is PostgreSQL's clock: 48-bit ms within a minute of now()
SELECT abs(('x' || substr(replace(u::text, '-', ''), 1, 12))::bit(48)::bigint
           - floor(extract(epoch FROM now()) * 1000)::bigint) < 60000 AS near_now
  FROM (SELECT outbox.uuidv7() AS u) AS s;

-- 100,000 ids of one session (most of them within the same millisecond): every
-- one greater than the one made before it, all distinct, version 7 and variant
-- 10 throughout, and 62 random bits that differ
CREATE TEMP TABLE ids AS
SELECT g, outbox.uuidv7() AS u FROM generate_series(1, 100000) AS g;
SELECT count(*) AS not_increasing
  FROM (SELECT u, lag(u) OVER (ORDER BY g) AS prev FROM ids) AS x
 WHERE u <= prev;
SELECT count(DISTINCT u) AS distinct_ids FROM ids;
SELECT count(*) FILTER (WHERE get_byte(uuid_send(u), 6) >> 4 <> 7
                           OR get_byte(uuid_send(u), 8) >> 6 <> 2) AS bad_layout
  FROM ids;
SELECT count(DISTINCT substr(u::text, 20)) AS distinct_random_parts FROM ids;
-- the 12 bits after the ms (bytes 6-7, less the version) carry the fraction
-- of the millisecond: ids of the same millisecond differ there
SELECT count(*) > 1 AS fractions_used
  FROM (SELECT DISTINCT substr(u::text, 16, 3) FROM ids) AS x;

-- emit() writes them: the event's id is version 7 and sorts after an id made
-- before it in this session, and the column's default is outbox.uuidv7()
SELECT outbox.uuidv7() AS before_emit \gset
SELECT outbox.emit('order', 'v7', 'order.created', '{}') AS emitted \gset
SELECT get_byte(uuid_send(event_id), 6) >> 4 AS version, event_id > :'before_emit' AS after_before,
       event_id = :'emitted' AS returned
  FROM outbox.events WHERE aggregate_id = 'v7';
SELECT pg_get_expr(d.adbin, d.adrelid) AS event_id_default
  FROM pg_attrdef AS d
  JOIN pg_attribute AS a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
 WHERE d.adrelid = 'outbox.events'::regclass AND a.attname = 'event_id';
-- a table of one's own may use it too
CREATE TEMP TABLE mine (id uuid DEFAULT outbox.uuidv7(), n int);
INSERT INTO mine (n) SELECT generate_series(1, 3);
SELECT count(*) AS ordered FROM (SELECT id, lag(id) OVER (ORDER BY n) AS prev FROM mine) AS x
 WHERE prev IS NULL OR id > prev;

DROP TABLE mine;
DROP EXTENSION outbox;
