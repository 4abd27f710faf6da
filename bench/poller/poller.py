#!/usr/bin/python3
"""The classic hand-written outbox relay, as outbox tutorials teach it (bench/run.sh's peer 2(c)).

A separate process polls its own outbox table:

    loop {
        BEGIN;
        SELECT ... FROM poller_outbox WHERE published_at IS NULL
         ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED;
        for each row: produce it, flush (wait for Kafka's acknowledgement of that message);
                      UPDATE poller_outbox SET published_at = now() WHERE id = <row>;
        COMMIT;
        nothing claimed: sleep --idle-sleep-ms (10 ms), then poll again (poll interval 0)
    }

Kafka settings as the extension's relay: acks=all, enable.idempotence=true, murmur2_random
partitioner, linger.ms=1; key = aggregate_id; headers id (event uuid), event_type,
aggregate_type; topic = outbox.event.<aggregate_type>.

  poller.py --drain     exit when a poll finds nothing; print "DONE <n> <seconds>" (seconds
                        from the first poll to the last commit)
  poller.py             run until SIGTERM/SIGINT (latency runs)
Prints "PROGRESS <seconds> <published>" every second on stdout.  Connection from PG* env vars,
Kafka from OUTBOX_KAFKA.  Run with Debian's /usr/bin/python3 (psycopg 3, confluent_kafka).
"""

import argparse
import os
import signal
import sys
import time

import psycopg
from confluent_kafka import KafkaException, Producer

CLAIM = """SELECT id, event_id::text, aggregate_type, aggregate_id, event_type, payload::text
             FROM poller_outbox
            WHERE published_at IS NULL
            ORDER BY id
            LIMIT %s
              FOR UPDATE SKIP LOCKED"""
MARK = "UPDATE poller_outbox SET published_at = now() WHERE id = %s"

stop = False


def on_signal(signum, frame):
    global stop
    stop = True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--drain", action="store_true", help="exit when the table has nothing pending")
    ap.add_argument("--batch", type=int, default=100, help="rows claimed per transaction")
    ap.add_argument("--idle-sleep-ms", type=float, default=10.0,
                    help="sleep when a poll found nothing (the poll interval is 0)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    conn = psycopg.connect("host=%s port=%s user=%s dbname=%s" % (
        os.environ.get("PGHOST", "127.0.0.1"), os.environ.get("PGPORT", "5432"),
        os.environ.get("PGUSER", "postgres"), os.environ.get("PGDATABASE", "outbox")))
    producer = Producer({
        "bootstrap.servers": os.environ.get("OUTBOX_KAFKA", "127.0.0.1:9092"),
        "acks": "all",
        "enable.idempotence": True,
        "partitioner": "murmur2_random",
        "linger.ms": 1,
    })
    errors = []

    def on_delivery(err, msg):
        if err is not None:
            errors.append(err)

    published = 0
    t_first = None
    t_last_commit = None
    last_print = time.time()
    while not stop:
        t_poll = time.time()
        with conn.transaction():
            rows = conn.execute(CLAIM, (args.batch,)).fetchall()
            for (rid, event_id, agg_type, agg_id, ev_type, payload) in rows:
                producer.produce("outbox.event." + agg_type, value=payload, key=agg_id,
                                 headers=[("id", event_id), ("event_type", ev_type),
                                          ("aggregate_type", agg_type)],
                                 on_delivery=on_delivery)
                producer.flush()
                if errors:
                    raise KafkaException(errors[0])
                conn.execute(MARK, (rid,))
        if rows:
            if t_first is None:
                t_first = t_poll
            published += len(rows)
            t_last_commit = time.time()
        now = time.time()
        if now - last_print >= 1.0:
            last_print = now
            print("PROGRESS %.1f %d" % (now - (t_first or now), published), flush=True)
        if not rows:
            if args.drain:
                break
            time.sleep(args.idle_sleep_ms / 1000.0)
    if args.drain:
        secs = (t_last_commit - t_first) if t_first is not None else 0.0
        print("DONE %d %.3f" % (published, secs), flush=True)
    producer.flush(10)
    conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
