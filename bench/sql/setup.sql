-- Schema of the outbox benchmark (bench/run.sh runs it once on its own fresh cluster).
CREATE EXTENSION IF NOT EXISTS outbox;

-- the business row every transaction writes
CREATE TABLE bench_orders (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer_id integer NOT NULL,
    total       numeric(12,2) NOT NULL,
    status      text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- section 1(b): a plain table equivalent to outbox.events (identity ALWAYS, uuid default and
-- unique, the same partial indexes); LIKE ... INCLUDING ALL copies all of it on PG 15, and
-- the driver checks that the columns, defaults and index definitions match.
CREATE TABLE bench_plain (LIKE outbox.events INCLUDING ALL);

-- section 2(b)/3: Debezium's outbox table, in the EventRouter's default shape
CREATE TABLE dbz_outbox (
    id            uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    aggregatetype text NOT NULL,
    aggregateid   text NOT NULL,
    type          text NOT NULL,
    payload       jsonb
);

-- section 2(c)/3: the hand-written poller's table, as outbox tutorials define it
CREATE TABLE poller_outbox (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id       uuid NOT NULL DEFAULT gen_random_uuid() UNIQUE,
    aggregate_type text NOT NULL,
    aggregate_id   text NOT NULL,
    event_type     text NOT NULL,
    payload        jsonb,
    created_at     timestamptz NOT NULL DEFAULT now(),
    published_at   timestamptz
);
CREATE INDEX poller_outbox_pending_idx ON poller_outbox (id) WHERE published_at IS NULL;
