/*
 * outbox--1.2--1.3.sql: autovacuum settings that keep outbox.events small.
 * There is no outbox--1.3.sql: CREATE EXTENSION installs 1.2 and applies
 * this script, so the two never drift apart.
 */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION outbox UPDATE TO '1.3'" to load this file. \quit

/*
 * Every event is written twice (the INSERT of emit() and the UPDATE that
 * marks it published; that UPDATE cannot be HOT, published_at being in the
 * partial indexes' predicates) and deleted once by the retention.  With the
 * default thresholds (20% of the table) autovacuum comes ever later as the
 * table grows, and the space of deleted events is reused late.  Vacuum this
 * table whenever 10,000 rows are dead, without cost-based throttling: its
 * dead rows are the oldest, and the table is small when vacuumed often.
 */
ALTER TABLE outbox.events SET (
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_cost_delay = 0
);

/*
 * The states outbox.worker_status() shows, with those added since 1.0.
 */
COMMENT ON FUNCTION outbox.worker_status() IS
'One row per running relay worker, read from shared memory: database, pid, state (starting, waiting_for_database, waiting_for_extension, not_configured, config_error, idle, publishing, broker_down, paused, error), events published, events marked failed and failed delivery attempts since the worker started, time of the last acknowledged event, last error text and time, and when the worker started. No rows when the library is not in shared_preload_libraries.';
