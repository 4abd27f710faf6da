#!/usr/bin/python3
"""Paced load generator for the latency section (bench/run.sh, section 3).

Each of --threads threads has its own connection and commits, on a fixed schedule, one
transaction per event: an order row plus the event, written the way the system under test
expects it:
  ext     INSERT bench_orders + SELECT outbox.emit(...)        (event id = emit()'s uuid)
  dbz     INSERT bench_orders + INSERT dbz_outbox(id, ...)     (event id generated here)
  poller  INSERT bench_orders + INSERT poller_outbox(event_id, ...)
Right after COMMIT returns it records (event id, commit time = time.time(), phase).  The
schedule is absolute (start + k / rate), so a slow commit is followed by catch-up commits and
the offered rate stays --rate; the lag behind the schedule is recorded too.

Writes a CSV: event_id,commit_time,phase,sched_lag  (phase: warmup or measure).
Prints "COMMITTED <n> <n_measure> <achieved rate of the measure phase>" at the end.
"""

import argparse
import csv
import random
import sys
import threading
import time
import uuid

import psycopg

import common

ORDER = "INSERT INTO bench_orders (customer_id, total, status) VALUES (%s, 123.45, 'created') RETURNING id"

SQL = {
    "ext": ("WITH o AS ({order}) SELECT outbox.emit(%s, %s, 'order.created', %s::jsonb) FROM o"),
    "dbz": ("WITH o AS ({order}) INSERT INTO dbz_outbox (id, aggregatetype, aggregateid, type, payload)"
            " SELECT %s, %s, %s, 'order.created', %s::jsonb FROM o"),
    "poller": ("WITH o AS ({order}) INSERT INTO poller_outbox (event_id, aggregate_type, aggregate_id,"
               " event_type, payload) SELECT %s, %s, %s, 'order.created', %s::jsonb FROM o"),
}


def worker(idx, args, t_start, results, errors):
    rnd = random.Random(idx)
    sql = SQL[args.system].format(order=ORDER)
    period = args.threads / float(args.rate)
    n_warm = int(args.warmup * args.rate / args.threads)
    n_total = n_warm + int(args.seconds * args.rate / args.threads)
    out = []
    try:
        with psycopg.connect(common.pg_conninfo()) as conn:
            conn.execute("SELECT 1")
            conn.commit()
            for k in range(n_total):
                due = t_start + (idx / float(args.rate)) + k * period
                delay = due - time.time()
                if delay > 0:
                    time.sleep(delay)
                lag = time.time() - due
                aid = rnd.randint(1, args.aggregates)
                payload = common.payload_json(aid, idx * 10_000_000 + k)
                if args.system == "ext":
                    cur = conn.execute(sql, (aid, args.aggregate_type, str(aid), payload))
                    event_id = str(cur.fetchone()[0])
                else:
                    event_id = str(uuid.uuid4())
                    conn.execute(sql, (aid, event_id, args.aggregate_type, str(aid), payload))
                conn.commit()
                t_commit = time.time()
                out.append((event_id, t_commit, "warmup" if k < n_warm else "measure", lag))
    except Exception as e:  # reported by main
        errors.append("thread %d: %r" % (idx, e))
    results[idx] = out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", choices=sorted(SQL), required=True)
    ap.add_argument("--aggregate-type", required=True)
    ap.add_argument("--rate", type=float, default=1000.0, help="events (= commits) per second")
    ap.add_argument("--seconds", type=float, default=60.0, help="measured phase")
    ap.add_argument("--warmup", type=float, default=5.0, help="warm-up phase, not measured")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--aggregates", type=int, default=10000)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    results = [None] * args.threads
    errors = []
    t_start = time.time() + 0.5
    threads = [threading.Thread(target=worker, args=(i, args, t_start, results, errors))
               for i in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        print("ERROR " + "; ".join(errors), flush=True)
        return 1
    rows = [r for part in results for r in part]
    rows.sort(key=lambda r: r[1])
    with open(args.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["event_id", "commit_time", "phase", "sched_lag"])
        for r in rows:
            w.writerow([r[0], "%.6f" % r[1], r[2], "%.6f" % r[3]])
    meas = [r for r in rows if r[2] == "measure"]
    rate = (len(meas) - 1) / (meas[-1][1] - meas[0][1]) if len(meas) > 1 else 0.0
    print("COMMITTED %d %d %.1f" % (len(rows), len(meas), rate), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
