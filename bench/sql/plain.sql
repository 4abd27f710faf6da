-- pgbench, section 1(b): the same transaction, the event row written into a plain table
-- (bench_plain, equivalent to outbox.events) instead of through outbox.emit().
\set aid random(1, :aggregates)
BEGIN;
INSERT INTO bench_orders (customer_id, total, status) VALUES (:aid, 123.45, 'created') RETURNING id AS oid \gset
INSERT INTO bench_plain (aggregate_type, aggregate_id, event_type, payload) VALUES ('bench_emit', :aid, 'order.created', jsonb_build_object('order_id', (:oid)::bigint, 'customer', 'customer-' || (:aid)::int, 'currency', 'EUR', 'total', 123.45, 'status', 'created', 'lines', jsonb_build_array(jsonb_build_object('sku', 'SKU-' || lpad(((:oid)::bigint % 1000000)::text, 6, '0'), 'qty', 2, 'price', 19.99), jsonb_build_object('sku', 'SKU-000042', 'qty', 1, 'price', 83.47)), 'note', 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'));
END;
