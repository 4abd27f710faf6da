#!/usr/bin/python3
"""Paced steady loader for the table-bound section (bench/run.sh, section 5).

Commits --events events at --rate events/s through outbox.emit(), --batch events per
transaction (one statement: emit() over generate_series, with the ~300-byte payload of the
other sections built once per transaction, so this process does next to nothing per event).
--connections threads, one connection each, share one absolute schedule: batch k is due at
start + k * batch / rate and goes to thread k mod connections, so a slow commit is followed by
catch-up commits and the offered rate stays --rate on average.

Prints "READY" once connected, then every second "PROGRESS <seconds> <events committed>
<max schedule lag s in that second>", and at the end
"DONE <events> <seconds> <achieved events/s> <max schedule lag s> <p99 schedule lag s>".
"""

import argparse
import sys
import threading
import time

import psycopg

import common


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, required=True)
    ap.add_argument("--rate", type=float, required=True, help="events per second")
    ap.add_argument("--batch", type=int, default=1000, help="events per transaction")
    ap.add_argument("--connections", type=int, default=2)
    ap.add_argument("--aggregate-type", required=True)
    ap.add_argument("--aggregates", type=int, default=10000)
    args = ap.parse_args()

    # the ~300-byte payload of the other sections, built here once per transaction (order id =
    # the batch's first event) and shared by its events: built per row in SQL (jsonb_build_object)
    # it cost 16 us per event on the 2-core machine, CPU the loader would take from the relay,
    # Kafka and autovacuum; the rows keep the same size
    sql = ("SELECT count(outbox.emit(%%s, (g %%%% %d + 1)::text, 'order.created', %%s::jsonb))"
           " FROM generate_series(%%s::bigint, %%s::bigint) AS g" % args.aggregates)
    nbatches = (args.events + args.batch - 1) // args.batch
    period = args.batch / float(args.rate)
    committed = [0] * args.connections
    last_commit = [0.0] * args.connections
    window = []         # schedule lags since the last PROGRESS line
    all_lags = []
    lock = threading.Lock()
    errors = []
    conns = [psycopg.connect(common.pg_conninfo()) for _ in range(args.connections)]
    for c in conns:
        c.execute("SELECT 1")
        c.commit()
    print("READY", flush=True)
    t_start = time.time() + 0.2

    def worker(idx):
        conn = conns[idx]
        try:
            for k in range(idx, nbatches, args.connections):
                due = t_start + k * period
                delay = due - time.time()
                if delay > 0:
                    time.sleep(delay)
                lag = time.time() - due
                lo = k * args.batch + 1
                hi = min(lo + args.batch - 1, args.events)
                payload = common.payload_json(lo % args.aggregates + 1, lo)
                n = conn.execute(sql, (args.aggregate_type, payload, lo, hi)).fetchone()[0]
                conn.commit()
                with lock:
                    committed[idx] += n
                    last_commit[idx] = time.time()
                    window.append(lag)
        except Exception as e:  # reported by main
            errors.append("thread %d: %r" % (idx, e))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.connections)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads) and not errors:
        time.sleep(max(0.0, 1.0 - (time.time() - t_start) % 1.0))
        with lock:
            done = sum(committed)
            w = window[:]
            window.clear()
        all_lags.extend(w)
        print("PROGRESS %.1f %d %.3f" % (time.time() - t_start, done, max(w) if w else 0.0), flush=True)
    if errors:
        print("ERROR " + "; ".join(errors), flush=True)
        return 1
    for t in threads:
        t.join()
    all_lags.extend(window)
    secs = max(last_commit) - t_start
    al = sorted(all_lags)
    p99 = al[int(0.99 * (len(al) - 1))] if al else 0.0
    print("DONE %d %.2f %.1f %.3f %.3f" % (sum(committed), secs, sum(committed) / secs,
                                          al[-1] if al else 0.0, p99), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
