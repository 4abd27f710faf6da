#!/usr/bin/python3
"""
A complete consumer of outbox events: it applies each event to a PostgreSQL database exactly
once, across crashes and restarts of the consumer, of Postgres and of the relay.

The effect here counts orders per customer (`order.created` events with a JSON payload holding
"customer" and "total"); events of other types on the topic (`order.shipped`, say) are recorded as
processed and have no effect. It is not idempotent on its own: applied twice, an order counts twice.
Three rules make it exactly once:

1. De-duplicate on the `id` header (the event's uuid; `ce_id` in the CloudEvents format):
   `INSERT INTO processed_events ... ON CONFLICT DO NOTHING` in the SAME database transaction as
   the effect. A copy of an event inserts nothing, and its effect is skipped.
2. Commit the Kafka offsets only AFTER the database commit. A crash in between makes Kafka
   deliver the batch again; rule 1 skips it. Committing offsets first could lose events.
3. On a database error, roll back and seek back to the batch's first offsets before trying again:
   the consumer's position has moved past the batch, and the next commit of offsets would skip it.

How long to keep ids: as long as a copy of an event can still reach you.
  - The relay (at-least-once) sends a batch again only when it crashed after Kafka acknowledged
    the batch and before Postgres recorded it; the copy goes out when the relay runs again, so
    within Postgres' recovery, or after an outage, or when a backup is restored.
  - This consumer reads a batch again after it crashed before committing offsets, and everything
    still in the topic if its committed offsets expired (`offsets.retention.minutes`, 7 days by
    default) while `auto.offset.reset` is `earliest`.
  - `outbox.replay()` sends copies on purpose: delete their ids first if they should be applied.
  So keep ids at least as long as the topic keeps messages (`retention.ms`, 7 days by default)
  and longer than any outage or restore you would recover from. The default here: 7 days.

A topic that does not exist yet (the consumer started before the first event): librdkafka
reports "Subscribed topic not available: <topic>: Broker: Unknown topic or partition". That is
harmless: the subscription stays, and the consumer picks the topic up within about a second of
its creation. `auto.offset.reset = earliest` matters then: with librdkafka's default `latest` the
events written before the consumer got the new topic's partitions are skipped. (Or create topics
ahead, as production clusters usually require, or let the consumer create it with
`allow.auto.create.topics = true`, which gives it the broker's default partition count.)

Usage:
  doc/examples/consumer.py --bootstrap 127.0.0.1:19092 --topic outbox.event.order \\
      --group order-stats --dsn "host=127.0.0.1 port=54329 user=postgres dbname=shop"

Needs confluent-kafka and psycopg2 (Debian: python3-confluent-kafka python3-psycopg2).
It stops cleanly on SIGTERM or Ctrl-C. test/integration/test_40_docs.py runs it against a real
broker, kills it mid-way, and checks that every event was applied exactly once.
"""
import argparse
import decimal
import json
import logging
import os
import signal
import time

import psycopg2
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

log = logging.getLogger("consumer")

SCHEMA = """
CREATE TABLE IF NOT EXISTS processed_events (      -- rule 1: one row per event applied
    event_id    uuid PRIMARY KEY,
    received_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS customer_orders (       -- the effect
    customer    text PRIMARY KEY,
    orders      bigint NOT NULL,
    revenue     numeric NOT NULL
);
"""


def event_id(msg):
    """The event's uuid: header `id` (debezium format) or `ce_id` (cloudevents)."""
    headers = dict(msg.headers() or [])
    raw = headers.get("id") or headers.get("ce_id")
    return raw.decode() if raw is not None else None


# the event types this consumer has an effect for; any other (order.shipped, say) is only
# recorded as processed: a topic carries every event type of its aggregate type
HANDLED_TYPES = {"order.created"}


def event_type(msg):
    """The event's type: header `event_type` (debezium format) or `ce_type` (cloudevents)."""
    headers = dict(msg.headers() or [])
    raw = headers.get("event_type") or headers.get("ce_type")
    return raw.decode() if raw is not None else None


def apply(cur, msg):
    """The effect of one event, in the caller's transaction."""
    if msg.value() is None:             # a tombstone: nothing to count
        return
    if event_type(msg) not in HANDLED_TYPES:
        return
    order = json.loads(msg.value(), parse_float=decimal.Decimal)
    cur.execute("""INSERT INTO customer_orders AS c (customer, orders, revenue) VALUES (%s, 1, %s)
                   ON CONFLICT (customer) DO UPDATE
                   SET orders = c.orders + 1, revenue = c.revenue + excluded.revenue""",
                (order["customer"], order["total"]))


def store(db, msgs):
    """Rules 1 and 2: de-duplicate and apply the batch in one database transaction.
    Returns (applied, skipped)."""
    applied = skipped = 0
    with db, db.cursor() as cur:        # commits at the end of the block, rolls back on error
        for msg in msgs:
            eid = event_id(msg)
            if eid is None:
                log.warning("no id header at %s[%d]@%d: not an outbox event, skipped",
                            msg.topic(), msg.partition(), msg.offset())
                continue
            cur.execute("INSERT INTO processed_events (event_id) VALUES (%s) ON CONFLICT DO NOTHING",
                        (eid,))
            if cur.rowcount == 1:
                apply(cur, msg)
                applied += 1
            else:
                skipped += 1            # a copy: applied before
    return applied, skipped


def next_offsets(msgs):
    """The offsets to commit after msgs: one past the last message of each partition."""
    last = {}
    for m in msgs:
        last[(m.topic(), m.partition())] = max(m.offset(), last.get((m.topic(), m.partition()), -1))
    return [TopicPartition(t, p, o + 1) for (t, p), o in last.items()]


def rewind(consumer, msgs):
    """Rule 3: move the consumer back to the first message of each partition of msgs."""
    first = {}
    for m in msgs:
        first[(m.topic(), m.partition())] = min(m.offset(), first.get((m.topic(), m.partition()), m.offset()))
    for (t, p), o in first.items():
        try:
            consumer.seek(TopicPartition(t, p, o))
        except KafkaException as e:     # the partition was revoked meanwhile: its new owner reads it
            log.info("could not rewind %s[%d]: %s", t, p, e)


def forget_old_ids(db, keep_days):
    with db, db.cursor() as cur:
        cur.execute("DELETE FROM processed_events WHERE received_at < now() - make_interval(days => %s)",
                    (keep_days,))
        if cur.rowcount:
            log.info("forgot %d id(s) older than %d days", cur.rowcount, keep_days)


def connect(dsn):
    while True:
        try:
            db = psycopg2.connect(dsn)
            with db, db.cursor() as cur:
                cur.execute(SCHEMA)
            return db
        except psycopg2.OperationalError as e:
            log.warning("database not reachable (%s); retrying in 2 s", str(e).strip())
            time.sleep(2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bootstrap", required=True, help="Kafka bootstrap servers")
    ap.add_argument("--topic", required=True, help="topic to read (e.g. outbox.event.order)")
    ap.add_argument("--group", required=True, help="consumer group id")
    ap.add_argument("--dsn", required=True, help="libpq connection string of the target database")
    ap.add_argument("--batch-size", type=int, default=500, help="most events per database transaction")
    ap.add_argument("--keep-ids-days", type=int, default=7, help="how long to keep processed ids")
    ap.add_argument("--instance-id", help="a stable id of this consumer process (group.instance.id):"
                    " restarted, it gets its partitions back at once instead of after"
                    " session.timeout.ms; never run two processes with one id")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s consumer %(levelname)s %(message)s")

    # a test hook (test_40_docs.py): exit hard after the n-th database commit, before the offsets
    # are committed: the very window that rule 1 covers
    crash_after = int(os.environ.get("CONSUMER_CRASH_AFTER_BATCH", "0"))

    consumer = Consumer({
        "bootstrap.servers": args.bootstrap,
        "group.id": args.group,
        "enable.auto.commit": False,            # rule 2: offsets are committed by hand
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",        # a new group or a new topic: read from the start
        "isolation.level": "read_committed",    # librdkafka's default; needed for exactly_once
        **({"group.instance.id": args.instance_id} if args.instance_id else {}),
    })
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    db = connect(args.dsn)
    consumer.subscribe([args.topic])
    log.info("subscribed to %s as group %s", args.topic, args.group)
    waiting_logged = False
    batches = 0
    forgot_at = 0.0
    try:
        while not stop:
            if time.monotonic() - forgot_at > 3600:
                forget_old_ids(db, args.keep_ids_days)
                forgot_at = time.monotonic()
            msgs = []
            for m in consumer.consume(args.batch_size, timeout=1.0):
                err = m.error()
                if err is None:
                    msgs.append(m)
                elif err.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC):
                    if not waiting_logged:      # harmless: see the head comment
                        log.info("topic %s does not exist yet; waiting for its first event (%s)",
                                 args.topic, err.str())
                        waiting_logged = True
                elif err.fatal():
                    raise KafkaException(err)
                else:
                    log.warning("Kafka: %s", err.str())
            if not msgs:
                continue
            try:
                applied, skipped = store(db, msgs)
            except psycopg2.Error as e:
                log.warning("database error, batch rolled back and read again: %s", str(e).strip())
                rewind(consumer, msgs)
                db.close()
                time.sleep(1)
                db = connect(args.dsn)
                continue
            batches += 1
            if crash_after and batches == crash_after:
                log.info("CONSUMER_CRASH_AFTER_BATCH: exiting after the database commit of batch %d,"
                         " before its offsets", batches)
                os._exit(70)
            try:
                consumer.commit(offsets=next_offsets(msgs), asynchronous=False)
            except KafkaException as e:         # e.g. a rebalance: the batch is read again, rule 1
                log.warning("batch %d: applied %d, skipped %d duplicate(s); offsets not committed (%s):"
                            " the batch will be read again and skipped", batches, applied, skipped, e)
            else:
                log.info("batch %d: applied %d, skipped %d duplicate(s); offsets committed",
                         batches, applied, skipped)
    finally:
        consumer.close()
        db.close()
        log.info("stopped")


if __name__ == "__main__":
    main()
