-- pgbench, section 1(c): the order row alone.
\set aid random(1, :aggregates)
BEGIN;
INSERT INTO bench_orders (customer_id, total, status) VALUES (:aid, 123.45, 'created') RETURNING id AS oid \gset
END;
