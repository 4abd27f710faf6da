-- pgbench, section 1(a): an order row and outbox.emit() in one transaction.
-- pgbench -M prepared -D aggregates=N
\set aid random(1, :aggregates)
BEGIN;
INSERT INTO bench_orders (customer_id, total, status) VALUES (:aid, 123.45, 'created') RETURNING id AS oid \gset
SELECT outbox.emit('bench_emit', :aid, 'order.created', jsonb_build_object('order_id', (:oid)::bigint, 'customer', 'customer-' || (:aid)::int, 'currency', 'EUR', 'total', 123.45, 'status', 'created', 'lines', jsonb_build_array(jsonb_build_object('sku', 'SKU-' || lpad(((:oid)::bigint % 1000000)::text, 6, '0'), 'qty', 2, 'price', 19.99), jsonb_build_object('sku', 'SKU-000042', 'qty', 1, 'price', 83.47)), 'note', 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'));
END;
