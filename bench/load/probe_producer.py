#!/usr/bin/python3
"""Kafka's own part of the latency (bench/run.sh, section 3): a producer with the relay's settings
(acks=all, idempotence, linger.ms=1 unless --linger-ms, Nagle off) sends --rate small messages per second for
--seconds to a fresh topic, with librdkafka statistics every second.  Measured outside the relay,
so the relay's hot path does no extra work for it.

Prints one JSON object: from librdkafka's per-broker statistics windows (microseconds inside
librdkafka, averaged over the windows: the median of the windows' p50 and the largest p99)
  int_latency     produce() -> the message enters a request (queueing, linger.ms)
  outbuf_latency  request built -> written to the socket
  rtt             request written -> response (the broker's acks=all append, round trip)
and "dr_ms": produce() -> delivery report as seen by this Python process (poll loop), p50/p99.
"""

import argparse
import json
import statistics
import sys
import time

from confluent_kafka import Producer

import common


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--topic", required=True)
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--linger-ms", type=int, default=1)
    ap.add_argument("--warmup", type=float, default=5.0,
                    help="sent first and not counted: a freshly started broker is slow until its JIT warms up")
    args = ap.parse_args()

    windows = {"int_latency": [], "outbuf_latency": [], "rtt": []}
    measuring = [False]

    def on_stats(js):
        if not measuring[0]:
            return
        st = json.loads(js)
        for b in st.get("brokers", {}).values():
            if b.get("nodeid", -1) < 0:
                continue        # the bootstrap entry
            for k in windows:
                w = b.get(k) or {}
                if w.get("cnt", 0) > 0:
                    windows[k].append((w["p50"], w["p99"]))

    p = Producer({"bootstrap.servers": common.kafka_bootstrap(), "acks": "all",
                  "enable.idempotence": True, "linger.ms": args.linger_ms, "socket.nagle.disable": True,
                  "statistics.interval.ms": 1000, "stats_cb": on_stats})
    dr = []

    def on_dr(err, msg, t0):
        if err is None and measuring[0]:
            dr.append((time.time() - t0) * 1000.0)

    payload = b"x" * 300
    t_start = time.time() + 0.2
    n_warm = int(args.rate * args.warmup)
    n = int(args.rate * args.seconds)
    for k in range(n_warm + n):
        if k == n_warm:
            p.flush(10)
            measuring[0] = True
            t_start = time.time() - k / args.rate
        due = t_start + k / args.rate
        while True:
            d = due - time.time()
            if d <= 0:
                break
            p.poll(min(d, 0.001))
        t0 = time.time()
        p.produce(args.topic, payload, key=str(k % 10000), on_delivery=lambda e, m, t0=t0: on_dr(e, m, t0))
        p.poll(0)
    p.flush(10)
    time.sleep(1.1)
    p.poll(0)

    def pct(v, q):
        v = sorted(v)
        return v[min(len(v) - 1, int(round(q / 100.0 * (len(v) - 1))))] if v else None

    out = {"linger_ms": args.linger_ms, "messages": n, "delivered": len(dr),
           "dr_ms": {"p50": pct(dr, 50), "p99": pct(dr, 99)}}
    for k, w in windows.items():
        # skip the first window (connection set-up)
        w = w[1:] or w
        out[k + "_us"] = {"p50": statistics.median([a for a, _ in w]) if w else None,
                          "p99": max(b for _, b in w) if w else None}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
