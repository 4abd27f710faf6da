#!/usr/bin/env bash
# Relay CPU per event, the way bench/run.sh section 2a measures it, on an already running cluster
# (test/env/pg.sh + test/env/kafka.sh, PG* variables pointing at it, extension installed).
#
# Usage: bench/relay_cpu.sh [RUNS]      (default 1)
#   pauses the relay, commits a backlog of RELAY_CPU_EVENTS (1,000,000) events over
#   RELAY_CPU_AGGREGATES (10,000) aggregates in chunks of 100,000 with the transaction's xid (as
#   emit() writes them in relay_mode = snapshot, the bench's payload), resumes, waits until the
#   relay's `published` counter advanced by that many, and prints events/s and the relay process's
#   CPU (utime+stime of all its threads from /proc/<pid>/stat, librdkafka's included) per event.
#   Each run uses a fresh topic (4 partitions, auto-created) and starts from an empty table.
#   The drain runs with outbox.retention = RELAY_CPU_RETENTION (-1: never delete, so that the
#   retention's cleanup, which starts 60 s after the events were created by default, cannot fall
#   into the measured window of a slow drain); the setting is reset at the end.
#   The relay's CPU is also split into its main thread (SPI, message building, delivery reports)
#   and librdkafka's threads (rdk:*), from /proc/<pid>/task/*/stat.
#   RELAY_CPU_PERF=1: also `perf record -g` the relay during the drain (perf.data in $RELAY_CPU_OUT).
set -euo pipefail

RUNS=${1:-1}
EVENTS=${RELAY_CPU_EVENTS:-1000000}
AGGS=${RELAY_CPU_AGGREGATES:-10000}
OUT=${RELAY_CPU_OUT:-/tmp/relay-cpu}
mkdir -p "$OUT"
CLK=$(getconf CLK_TCK)
NOTE=$(printf 'x%.0s' $(seq 72))

q() { psql -X -q -At -v ON_ERROR_STOP=1 -c "$1"; }

q "CREATE EXTENSION IF NOT EXISTS outbox" >/dev/null 2>&1 || true
q "ALTER SYSTEM SET outbox.retention = ${RELAY_CPU_RETENTION:--1}" >/dev/null
q "SELECT pg_reload_conf()" >/dev/null
trap 'q "ALTER SYSTEM RESET outbox.retention" >/dev/null; q "SELECT pg_reload_conf()" >/dev/null' EXIT

ticks_of() { # utime+stime of /proc/.../stat $1
    local s; s=$(cat "$1"); s=${s##*) }
    read -r -a f <<<"$s"
    echo $((f[11] + f[12]))
}
cpu_ticks() { # whole process (all threads), then its main thread
    echo "$(ticks_of "/proc/$1/stat") $(ticks_of "/proc/$1/task/$1/stat")"
}

payload="jsonb_build_object('order_id', (g)::bigint, 'customer', 'customer-' || (g % $AGGS + 1)::int, \
'currency', 'EUR', 'total', 123.45, 'status', 'created', 'lines', jsonb_build_array(\
jsonb_build_object('sku', 'SKU-' || lpad(((g)::bigint % 1000000)::text, 6, '0'), 'qty', 2, 'price', 19.99), \
jsonb_build_object('sku', 'SKU-000042', 'qty', 1, 'price', 83.47)), 'note', '$NOTE')"

for run in $(seq "$RUNS"); do
    agg="relaycpu_$(date +%s%N)"
    q "SELECT outbox.pause()" >/dev/null
    for _ in $(seq 300); do [[ $(q "SELECT state FROM outbox.worker_status()") == paused ]] && break; sleep 0.1; done
    q "TRUNCATE outbox.events" >/dev/null
    for ((lo = 1; lo <= EVENTS; lo += 100000)); do
        hi=$((lo + 99999 < EVENTS ? lo + 99999 : EVENTS))
        psql -X -q -v ON_ERROR_STOP=1 >/dev/null <<SQL
BEGIN;
SELECT pg_current_xact_id();
INSERT INTO outbox.events (aggregate_type, aggregate_id, event_type, payload, xid)
SELECT '$agg', (g % $AGGS + 1)::text, 'order.created', $payload, pg_current_xact_id()
  FROM generate_series($lo, $hi) AS g;
COMMIT;
SQL
    done
    q "ANALYZE outbox.events; CHECKPOINT" >/dev/null
    pid=$(q "SELECT pid FROM outbox.worker_status()")
    pub0=$(q "SELECT published FROM outbox.worker_status()")
    load=$(cut -d' ' -f1-3 /proc/loadavg)
    read -r c0 m0 <<<"$(cpu_ticks "$pid")"
    t0=$(date +%s.%N)
    q "SELECT outbox.resume()" >/dev/null
    perfpid=
    if [[ ${RELAY_CPU_PERF:-0} == 1 ]]; then
        /usr/bin/perf record ${RELAY_CPU_PERF_ARGS:--g} -o "$OUT/perf.data" -p "$pid" >"$OUT/perf.log" 2>&1 &
        perfpid=$!
    fi
    while :; do
        pub=$(q "SELECT published FROM outbox.worker_status()")
        ((pub - pub0 >= EVENTS)) && break
        sleep 0.1
    done
    t1=$(date +%s.%N)
    read -r c1 m1 <<<"$(cpu_ticks "$pid")"
    if [[ -n $perfpid ]]; then kill -INT "$perfpid"; wait "$perfpid" || true; fi
    pending=$(q "SELECT pending FROM outbox.status")
    awk -v e="$EVENTS" -v t0="$t0" -v t1="$t1" -v c="$((c1 - c0))" -v m="$((m1 - m0))" -v clk="$CLK" -v p="$pending" -v l="$load" -v r="$run" 'BEGIN {
        s = t1 - t0; cpu = c / clk; main = m / clk;
        printf "run %d: %d events in %.2f s = %.0f events/s; relay cpu %.2f s = %.2f us/event (main thread %.2f, librdkafka threads %.2f); pending after %s; load before %s\n",
               r, e, s, e / s, cpu, cpu * 1e6 / e, main * 1e6 / e, (cpu - main) * 1e6 / e, p, l }'
done
