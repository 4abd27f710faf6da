"""
The hand-written consumer of the inbox benchmark (bench/inbox/inbox_bench.py): what users write
today to apply Kafka events to PostgreSQL once.  A consumer group, a table of processed event ids
checked before each event, the events of a poll applied in one database transaction, and Kafka
offsets committed after the database commit (so a crash in between re-delivers, and the ids table
drops the copies).

    /usr/bin/python3 python_consumer.py --bootstrap H:P --topic T --dsn DSN --events N

Prints one line "applied <n> cpu_seconds <s>" when n events were applied (its own CPU).
"""
import argparse
import json
import resource
import sys
import uuid

import psycopg2
from confluent_kafka import Consumer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--events", type=int, required=True)
    ap.add_argument("--batch", type=int, default=500)
    a = ap.parse_args()

    db = psycopg2.connect(a.dsn)
    c = Consumer({"bootstrap.servers": a.bootstrap, "group.id": f"bench-py-{uuid.uuid4()}",
                  "auto.offset.reset": "earliest", "enable.auto.commit": False,
                  "isolation.level": "read_committed"})
    c.subscribe([a.topic])
    applied = 0
    while applied < a.events:
        msgs = c.consume(num_messages=a.batch, timeout=1.0)
        if not msgs:
            continue
        with db.cursor() as cur:
            for m in msgs:
                if m.error():
                    print(f"error {m.error()}", file=sys.stderr)
                    continue
                eid = dict(m.headers() or []).get("id")
                cur.execute("INSERT INTO processed_ids (event_id) VALUES (%s) ON CONFLICT DO NOTHING",
                            (eid.decode() if eid else None,))
                if cur.rowcount == 0:
                    continue
                body = json.loads(m.value())["payload"]
                cur.execute("INSERT INTO bench_target (n, aggregate_id, body) VALUES (%s, %s, %s)"
                            " ON CONFLICT (n) DO UPDATE SET aggregate_id = excluded.aggregate_id,"
                            " body = excluded.body",
                            (body["n"], body["aggregate_id"], body["body"]))
                applied += 1
        db.commit()
        c.commit(asynchronous=False)
    c.close()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(f"applied {applied} cpu_seconds {ru.ru_utime + ru.ru_stime:.2f}", flush=True)


if __name__ == "__main__":
    main()
