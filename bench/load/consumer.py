#!/usr/bin/python3
"""Latency consumer (bench/run.sh, section 3): reads one fresh topic from the beginning of its
partitions and records, per message, the receive time (time.time(), the same clock as the load
generator's commit times) and the event id from the "id" header.

Stops when --stop-file exists (it holds the number of events the load generator committed) and
that many distinct ids arrived, or --grace seconds after the stop file appeared.
Writes a CSV: event_id,recv_time,partition,kafka_ts_ms,kafka_ts_type (the message timestamp: the
broker's LogAppendTime on the bench topics).  Prints READY once its fetchers are running, and
"RECEIVED <messages> <distinct ids>" at the end.
"""

import argparse
import csv
import os
import sys
import time

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

import common


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--topic", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stop-file", required=True)
    ap.add_argument("--grace", type=float, default=120.0)
    ap.add_argument("--batch", action="store_true",
                    help="the consumer of runs before 2026-12: consume(1000, 0.05), stamped after the call")
    args = ap.parse_args()

    c = Consumer({
        "bootstrap.servers": common.kafka_bootstrap(),
        "group.id": "bench-latency",
        "enable.auto.commit": False,
        "fetch.wait.max.ms": 5,
        "fetch.min.bytes": 1,
        "fetch.error.backoff.ms": 10,
    })
    c.assign([TopicPartition(args.topic, p, OFFSET_BEGINNING) for p in range(common.PARTITIONS)])
    for _ in range(5):          # connect and start the partition fetchers before the load starts
        c.poll(0.2)
    print("READY", flush=True)

    rows = []
    ids = set()
    expected = None
    stop_seen = None
    while True:
        # One message per call.  consume(1000, 0.05) returned only when 1,000 messages or 50 ms
        # had passed, so at 1,000 events/s every message waited for the end of a ~50 ms window
        # before it was stamped: that was most of the 30 ms p50 of the earlier runs.
        msgs = c.consume(1000, 0.05) if args.batch else [c.poll(0.05)]
        now = time.time()
        for m in msgs:
            if m is None or m.error():
                continue
            eid = None
            for k, v in (m.headers() or []):
                if k == "id":
                    eid = v.decode() if isinstance(v, bytes) else str(v)
                    break
            ts_type, ts = m.timestamp()
            rows.append((eid, now, m.partition(), ts, ts_type))
            ids.add(eid)
        if expected is None and os.path.exists(args.stop_file):
            with open(args.stop_file) as f:
                expected = int(f.read().strip() or 0)
            stop_seen = time.time()
        if expected is not None and (len(ids) >= expected or time.time() - stop_seen > args.grace):
            break
    c.close()
    with open(args.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["event_id", "recv_time", "partition", "kafka_ts_ms", "kafka_ts_type"])
        for r in rows:
            w.writerow([r[0], "%.6f" % r[1], r[2], r[3], r[4]])
    print("RECEIVED %d %d" % (len(rows), len(ids)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
