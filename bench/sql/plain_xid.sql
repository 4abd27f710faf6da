-- pgbench, section 1(b) for outbox.relay_mode = snapshot: the same transaction, the event row
-- written into the plain table (bench_plain) as emit() writes it in snapshot mode, i.e. with its
-- writing transaction in xid (so the row also enters the partial index on xid, as emit()'s does).
\set aid random(1, :aggregates)
BEGIN;
INSERT INTO bench_orders (customer_id, total, status) VALUES (:aid, 123.45, 'created') RETURNING id AS oid \gset
INSERT INTO bench_plain (aggregate_type, aggregate_id, event_type, payload, xid) VALUES ('bench_emit', :aid, 'order.created', jsonb_build_object('order_id', (:oid)::bigint, 'customer', 'customer-' || (:aid)::int, 'currency', 'EUR', 'total', 123.45, 'status', 'created', 'lines', jsonb_build_array(jsonb_build_object('sku', 'SKU-' || lpad(((:oid)::bigint % 1000000)::text, 6, '0'), 'qty', 2, 'price', 19.99), jsonb_build_object('sku', 'SKU-000042', 'qty', 1, 'price', 83.47)), 'note', 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'), pg_current_xact_id());
END;
