#!/usr/bin/env bash
# The quick-start demo: install what is needed, build and install the extension, start a local
# Kafka broker and a local Postgres cluster, run a sample order workload (orders + order lines +
# outbox.emit() in the same transactions, some rolled back), and show the events arriving in Kafka;
# then the inbox: user registrations emitted to Kafka and consumed back, one welcome mail each.
#
# Usage: test/demo.sh                      run the demo; the servers keep running afterwards
#        OUTBOX_PG_MAJOR=17 test/demo.sh   the same on PostgreSQL 17 (15, 16, 17 or 18; default 15);
#                                          a demo cluster of another major is deleted and made anew
#        test/demo.sh stop                 stop the demo's Postgres and Kafka
#
# Postgres: 127.0.0.1:54329 (/tmp/outbox-pg), Kafka: 127.0.0.1:19092 (/tmp/outbox-kafka); the
# variables of test/env/pg.sh and test/env/kafka.sh (OUTBOX_PG_PORT, OUTBOX_KAFKA_PORT, ...) move them.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"

case "${1:-}" in
    stop)
        test/env/pg.sh stop
        test/env/kafka.sh stop
        exit 0 ;;
    -h|--help|help)
        sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
        exit 0 ;;
    "") ;;
    *)
        echo "demo.sh: unknown argument '$1' (try: test/demo.sh --help)" >&2
        exit 2 ;;
esac

export OUTBOX_KAFKA="127.0.0.1:${OUTBOX_KAFKA_PORT:-19092}"
eval "$(test/env/pg.sh env)"
MAJOR="${OUTBOX_PG_MAJOR:-15}"
SUDO=()
[[ $(id -u) -eq 0 ]] || SUDO=(sudo)
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "1/7 packages"
test/env/deps.sh

step "2/7 build and install the extension into PostgreSQL $MAJOR"
# 15 is Debian's; 16 to 18 are fetched once from PyPI (test/env/pgmajor.sh)
BINDIR=$(test/env/pgmajor.sh "$MAJOR") || exit 1
PATH="$BINDIR:$PATH"
export PATH
make -s clean
make -s
"${SUDO[@]}" env PATH="$PATH" make -s install

step "3/7 start Kafka (KRaft, single node) and Postgres (shared_preload_libraries = 'outbox')"
test/env/kafka.sh start
test/env/kafka.sh topic-create outbox.event.order 4 >/dev/null
test/env/pg.sh start

step "4/7 schema: the extension and a small order model"
psql -X -q -v ON_ERROR_STOP=1 <<'SQL'
CREATE EXTENSION IF NOT EXISTS outbox;
-- a cluster left by an earlier demo may hold an older version (quietly: a fresh one is current)
SET client_min_messages = warning;
ALTER EXTENSION outbox UPDATE;
RESET client_min_messages;
CREATE TABLE IF NOT EXISTS orders (
    id          bigint PRIMARY KEY,
    customer    text NOT NULL,
    total       numeric(12,2) NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS order_lines (
    order_id    bigint REFERENCES orders,
    line        int,
    sku         text NOT NULL,
    qty         int NOT NULL,
    price       numeric(12,2) NOT NULL,
    PRIMARY KEY (order_id, line)
);
CREATE SEQUENCE IF NOT EXISTS order_ids;
SQL

# One order per transaction: the order, three lines, and its event. One transaction in ten
# rolls back at the end, and its event must never reach Kafka.
cat > /tmp/outbox-demo-order.sql <<'SQL'
\set customer random(1, 50)
\set rollback random(1, 10)
BEGIN;
SELECT nextval('order_ids') AS order_id \gset
INSERT INTO orders (id, customer, total) VALUES (:order_id, 'customer-' || :customer, 0);
INSERT INTO order_lines SELECT :order_id, l, 'sku-' || (l * 7 + :customer) % 40, l, 9.90 * l FROM generate_series(1, 3) AS l;
UPDATE orders SET total = (SELECT sum(qty * price) FROM order_lines WHERE order_id = :order_id) WHERE id = :order_id;
SELECT outbox.emit('order', :order_id::text, 'order.created',
                   jsonb_build_object('order_id', :order_id, 'customer', 'customer-' || :customer,
                                      'total', (SELECT total FROM orders WHERE id = :order_id),
                                      'lines', (SELECT jsonb_agg(jsonb_build_object('sku', sku, 'qty', qty, 'price', price))
                                                  FROM order_lines WHERE order_id = :order_id)),
                   jsonb_build_object('source', 'demo'));
\if :rollback = 1
ROLLBACK;
\else
COMMIT;
\endif
SQL

step "5/7 workload: 4 sessions, 10 s of orders (10% rolled back)"
# count by id, not by rows: the retention deletes rows published by an earlier run meanwhile
before=$(psql -X -tAc "SELECT coalesce(max(id), 0) FROM outbox.events")
pgbench -n -c 4 -j 2 -T 10 -f /tmp/outbox-demo-order.sql -P 2 2>&1 | grep -E 'progress|tps|transactions actually' || true
sleep 1
committed=$(psql -X -tAc "SELECT count(*) FROM outbox.events WHERE id > $before")
echo "committed orders with an event in this run: $committed"

step "6/7 what arrived in Kafka (topic outbox.event.order)"
psql -X -c "SELECT state, pending, published, last_error FROM outbox.status"
in_kafka=$(kcat -C -b "$OUTBOX_KAFKA" -t outbox.event.order -o beginning -e -q -f 'x\n' 2>/dev/null | wc -l)
echo "messages in the topic (all runs): $in_kafka; published events still kept in outbox.events (for outbox.retention): $(psql -X -tAc 'SELECT count(*) FROM outbox.events e WHERE outbox.published(e)')"
echo
echo "the last 3 messages (partition, offset, key, headers, payload):"
# -o -4, not -1: after outbox.delivery = exactly_once a partition's last offsets may be
# transaction markers, which kcat does not print
kcat -C -b "$OUTBOX_KAFKA" -t outbox.event.order -o -4 -e -q \
    -f 'partition=%p offset=%o key=%k\n  headers: %h\n  payload: %s\n' 2>/dev/null | tail -n 9

step "7/7 the inbox: each committed registration becomes one welcome mail (Kafka -> Postgres)"
# The other half (doc/inbox.md): a subscription consumes outbox.event.user into this database
# and calls send_welcome_mail() once per event, as role demo_mailer, in the transaction that
# records the Kafka offset.  A real setup consumes in another database or cluster.
test/env/kafka.sh topic-create outbox.event.user 2 >/dev/null
psql -X -q -v ON_ERROR_STOP=1 <<'SQL'
SET client_min_messages = warning;
CREATE TABLE IF NOT EXISTS users (id bigint PRIMARY KEY, email text NOT NULL);
CREATE SEQUENCE IF NOT EXISTS user_ids;
CREATE TABLE IF NOT EXISTS mail_queue (event_id uuid PRIMARY KEY, user_id bigint NOT NULL,
                                       queued_at timestamptz NOT NULL DEFAULT now());
DO $$ BEGIN CREATE ROLE demo_mailer; EXCEPTION WHEN duplicate_object THEN NULL; END $$;
GRANT USAGE ON SCHEMA outbox TO demo_mailer;
GRANT EXECUTE ON FUNCTION outbox.subscribe(text, text[], regprocedure, text, boolean, text) TO demo_mailer;
GRANT INSERT ON mail_queue TO demo_mailer;
CREATE OR REPLACE FUNCTION send_welcome_mail(e outbox.inbox_event) RETURNS void
LANGUAGE sql SET search_path = public AS $$
    INSERT INTO mail_queue (event_id, user_id)
    SELECT e.event_id, e.key::bigint WHERE e.event_type = 'user.registered'
$$;
SELECT NOT EXISTS (SELECT FROM outbox.subscriptions WHERE name = 'welcome_mail') AS new_subscription \gset
\if :new_subscription
SET ROLE demo_mailer;       -- the handler runs as the role that subscribes, never as a superuser
SELECT outbox.subscribe('welcome_mail', ARRAY['outbox.event.user'],
                        'send_welcome_mail(outbox.inbox_event)') \g /dev/null
RESET ROLE;
\endif
SQL
cat > /tmp/outbox-demo-register.sql <<'SQL'
\set rollback random(1, 10)
BEGIN;
SELECT nextval('user_ids') AS user_id \gset
INSERT INTO users VALUES (:user_id, 'user' || :user_id || '@example.com');
SELECT outbox.emit('user', :user_id::text, 'user.registered',
                   jsonb_build_object('user_id', :user_id, 'email', 'user' || :user_id || '@example.com'));
\if :rollback = 1
ROLLBACK;
\else
COMMIT;
\endif
SQL
before_user=$(psql -X -tAc "SELECT coalesce(max(id), 0) FROM users")
pgbench -n -c 2 -j 2 -T 5 -f /tmp/outbox-demo-register.sql 2>&1 | grep -E 'transactions actually' || true
registered=$(psql -X -tAc "SELECT count(*) FROM users WHERE id > $before_user")
mails() { psql -X -tAc "SELECT count(*) FROM mail_queue WHERE user_id > $before_user"; }
for _ in $(seq 1 120); do
    [[ "$(mails)" -ge "$registered" ]] && break
    sleep 0.5
done
echo "registrations committed in this run: $registered; welcome mails queued for them: $(mails);" \
     "mails for rolled-back registrations: $(psql -X -tAc "SELECT count(*) FROM mail_queue m WHERE user_id > $before_user AND NOT EXISTS (SELECT FROM users u WHERE u.id = m.user_id)")"
psql -X -c "SELECT subscription, topic, kafka_partition AS partition, next_offset, lag, applied, duplicates, state FROM outbox.inbox_status"

echo
echo "Servers keep running: psql -h 127.0.0.1 -p $PGPORT -U postgres $PGDATABASE"
echo "Watch events live:    kcat -C -b $OUTBOX_KAFKA -t outbox.event.order -f '%k %h %s\n'"
echo "Stop them:            test/demo.sh stop"
