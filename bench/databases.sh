#!/usr/bin/env bash
# Section 6 of bench/run.sh (issue 11): one backlog drained by one relay in one database, and
# the same backlog spread over several databases, each with its own relay (the launcher, with
# outbox.databases = '*'), side by side in one run.
#
# Runs on the cluster bench/run.sh started (PG* and OUTBOX_* variables set by it); call it as
#   BENCH_SECTIONS=6 bench/run.sh
# For each case (BENCH_DB_CASES, default "1,2,4" databases) it creates that many fresh databases
# with the extension, pauses their relays, commits BENCH_DB_EVENTS (1,000,000) events split
# evenly over them (10,000 aggregates, the payload of section 2(a), written in chunks of 100,000
# with the transaction's xid as emit() writes them in relay_mode = snapshot), then resumes every
# relay and waits until outbox.cluster_status()'s published counters of these relays advanced by
# the backlog.  It prints one row per case: wall time, events/s, the CPU seconds of the relays
# (utime + stime of all their threads, librdkafka's included, from /proc), of Kafka's broker and
# of the whole machine (/proc/stat), and relay CPU per event.  The databases are dropped after
# their case.  The relays keep outbox.retention = -1 (never delete) during the drain, so the
# retention's cleanup cannot fall into the measured window.
#
# Then (BENCH_DB_K_CASES, default "1,2,4,1") the same backlog in ONE database drained by k relays
# (outbox.workers_per_database = k), written row-tracked (xid NULL, as emit() writes them while
# k > 1; the k = 1 rows drain the same row-tracked backlog, for a fair side by side).
#
# What the rows are for: one relay publishes on one core at most; more databases, or more relays
# per database, get more.  On a machine with few cores the relays, Kafka and the rest share
# them: the table says how far that goes.
set -euo pipefail

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$BENCH_DIR/.." && pwd)
cd "$REPO_DIR"

EVENTS=${BENCH_DB_EVENTS:-1000000}
CASES=${BENCH_DB_CASES:-1,2,4,1}   # 1 again last: how much the order moves the figures
K_CASES=${BENCH_DB_K_CASES:-1,2,4,1}
AGGS=10000
CHUNK=100000
CLK=$(getconf CLK_TCK)
NOTE=$(printf 'x%.0s' $(seq 72))
OUT=${BENCH_RESULTS_DIR:-bench/results}/databases.md

log() { printf 'bench: %s\n' "$*" >&2; }
q() { psql -X -q -At -v ON_ERROR_STOP=1 "$@"; }

ticks_of() { # utime + stime of a /proc/.../stat file
    local s
    s=$(cat "$1" 2>/dev/null) || { echo 0; return; }
    s=${s##*) }
    read -r -a f <<<"$s"
    echo $((f[11] + f[12]))
}
machine_busy() { # busy ticks of all cores: user nice system irq softirq steal
    read -r _ u n s _ _ i si st _ </proc/stat
    echo $((u + n + s + i + si + st))
}
sum_ticks() { local t=0 p; for p in "$@"; do t=$((t + $(ticks_of "/proc/$p/stat"))); done; echo $t; }

payload="jsonb_build_object('order_id', (g)::bigint, 'customer', 'customer-' || (g % $AGGS + 1)::int, \
'currency', 'EUR', 'total', 123.45, 'status', 'created', 'lines', jsonb_build_array(\
jsonb_build_object('sku', 'SKU-' || lpad(((g)::bigint % 1000000)::text, 6, '0'), 'qty', 2, 'price', 19.99), \
jsonb_build_object('sku', 'SKU-000042', 'qty', 1, 'price', 83.47)), 'note', '$NOTE')"

# outbox.cluster_status() is read in the bench's own database
q -c "CREATE EXTENSION IF NOT EXISTS outbox" >/dev/null
# the launcher needs a worker slot per relay, and the relays' VACUUM workers need theirs
q -c "ALTER SYSTEM SET max_worker_processes = 24" -c "ALTER SYSTEM SET outbox.max_workers = 16" \
  -c "ALTER SYSTEM SET outbox.databases = '*'" -c "ALTER SYSTEM SET outbox.retention = -1" >/dev/null
test/env/pg.sh restart
for _ in $(seq 100); do q -c "SELECT 1" >/dev/null 2>&1 && break; sleep 0.1; done
kafka_pid=$(cat "$OUTBOX_KAFKA_DIR/broker.pid")

# relays of the given databases in cluster_status(): "pid published" per line
relays() {
    local list
    list=$(printf "'%s'," "$@")
    q -c "SELECT pid, published FROM outbox.cluster_status()
           WHERE kind = 'relay' AND database IN (${list%,}) AND pid IS NOT NULL" -F ' '
}
wait_state() { # $1 state, $2 relays per database, databases...
    local want=$1 k=$2 n
    shift 2
    for _ in $(seq 600); do
        n=$(q -c "SELECT count(*) FROM outbox.cluster_status() WHERE kind = 'relay' AND state = '$want'
                   AND database IN ($(printf "'%s'," "$@" | sed 's/,$//'))")
        ((n == $# * k)) && return 0
        sleep 0.1
    done
    log "the relays of $* did not reach state $want"; exit 1
}

rows=()
# run_case N EVENTS [K]: drain EVENTS over N databases, tracked by snapshot; with K, over one
# database with K relays, tracked row by row.  Its table row goes to rows[]
run_case() {
    local n=$1 events=$2 k=${3:-} dbs=() d i lo hi per agg before after pids pub0 pub r load r0 r1 k0 k1 m0 m1 t0 t1 same
    local xid="pg_current_xact_id()" tracking=snapshot relays_per_db=1
    if [[ -n "$k" ]]; then
        xid=NULL tracking=row relays_per_db=$k
        q -c "ALTER SYSTEM SET outbox.workers_per_database = $k" -c "SELECT pg_reload_conf()" >/dev/null
    fi
    dbs=()
    for i in $(seq "$n"); do dbs+=("bench_db${n}_$i"); done
    per=$((events / n))
    agg="bench_dbs_${n}_$(date +%s)"
    log "section 6: $n database(s) with $relays_per_db relay(s) each, $per events each ($tracking)"
    for d in "${dbs[@]}"; do
        q -c "DROP DATABASE IF EXISTS $d WITH (FORCE)" -c "CREATE DATABASE $d" >/dev/null
        q -d "$d" -c "CREATE EXTENSION outbox" >/dev/null
    done
    wait_state idle "$relays_per_db" "${dbs[@]}"
    for d in "${dbs[@]}"; do q -d "$d" -c "SELECT outbox.pause()" >/dev/null; done
    wait_state paused "$relays_per_db" "${dbs[@]}"
    for d in "${dbs[@]}"; do
        for ((lo = 1; lo <= per; lo += CHUNK)); do
            hi=$((lo + CHUNK - 1 < per ? lo + CHUNK - 1 : per))
            q -d "$d" >/dev/null <<SQL
BEGIN;
INSERT INTO outbox.events (aggregate_type, aggregate_id, event_type, payload, xid)
SELECT '$agg', (g % $AGGS + 1)::text, 'order.created', $payload, $xid
  FROM generate_series($lo, $hi) AS g;
COMMIT;
SQL
        done
        q -d "$d" -c "VACUUM (ANALYZE) outbox.events" >/dev/null   # no autovacuum during the drain
    done
    q -c "CHECKPOINT" >/dev/null
    mapfile -t before < <(relays "${dbs[@]}")
    pids=() pub0=0
    for r in "${before[@]}"; do pids+=("${r%% *}"); pub0=$((pub0 + ${r##* })); done
    ((${#pids[@]} == n * relays_per_db)) || { log "expected $((n * relays_per_db)) relays, found ${#pids[@]}"; exit 1; }
    load=$(cut -d' ' -f1-3 /proc/loadavg)
    r0=$(sum_ticks "${pids[@]}") k0=$(ticks_of "/proc/$kafka_pid/stat") m0=$(machine_busy)
    t0=$(date +%s.%N)
    for d in "${dbs[@]}"; do q -d "$d" -c "SELECT outbox.resume()" >/dev/null; done
    while :; do
        pub=0
        while read -r _ p; do pub=$((pub + p)); done < <(relays "${dbs[@]}")
        ((pub - pub0 >= per * n)) && break
        sleep 0.05
    done
    t1=$(date +%s.%N)
    r1=$(sum_ticks "${pids[@]}") k1=$(ticks_of "/proc/$kafka_pid/stat") m1=$(machine_busy)
    mapfile -t after < <(relays "${dbs[@]}")
    same=$( [[ "$(printf '%s\n' "${after[@]%% *}" | sort)" == "$(printf '%s\n' "${pids[@]}" | sort)" ]] && echo yes || echo no)
    rows+=("$(awk -v n="$n" -v kk="$relays_per_db" -v tr="$tracking" -v e="$((per * n))" -v t0="$t0" -v t1="$t1" \
        -v r="$((r1 - r0))" -v k="$((k1 - k0))" -v m="$((m1 - m0))" -v clk="$CLK" -v l="$load" -v same="$same" 'BEGIN {
        s = t1 - t0;
        printf "| %d | %d | %s | %d | %d | %.2f | %.0f | %.2f | %.2f | %.2f | %.2f | %s | %s |", n, kk, tr, n * kk, e, s, e / s,
               r / clk, r * 1e6 / clk / e, k / clk, m / clk, same, l }')")
    log "  ${rows[-1]}"
    for d in "${dbs[@]}"; do q -c "DROP DATABASE $d WITH (FORCE)" >/dev/null; done
    if [[ -n "$k" ]]; then
        q -c "ALTER SYSTEM RESET outbox.workers_per_database" -c "SELECT pg_reload_conf()" >/dev/null
    fi
}

# a warm-up (Kafka's JIT, the first topic), not reported
run_case 1 $((EVENTS / 10))
rows=()
IFS=',' read -r -a ncases <<<"$CASES"
for n in "${ncases[@]}"; do
    run_case "$n" "$EVENTS"
done
IFS=',' read -r -a kcases <<<"$K_CASES"
for k in "${kcases[@]}"; do
    [[ -n "$k" ]] && run_case 1 "$EVENTS" "$k"
done

q -c "ALTER SYSTEM RESET max_worker_processes" -c "ALTER SYSTEM RESET outbox.max_workers" \
  -c "ALTER SYSTEM RESET outbox.databases" -c "ALTER SYSTEM RESET outbox.retention" >/dev/null
test/env/pg.sh restart

mkdir -p "$(dirname "$OUT")"
{
    echo "## Section 6: one backlog over 1, 2 and 4 databases, and over k relays of one database (issue 11)"
    echo
    echo "$(date -u +%Y-%m-%d), PostgreSQL $(q -c 'SHOW server_version'), $(nproc) cores; $EVENTS events"
    echo "(10,000 aggregates, ~300-byte payloads; tracked by snapshot over several databases, row by row"
    echo "over k relays of one database, as emit() writes them there) committed while the relays were"
    echo "paused, then drained, after an unreported warm-up drain; CPU seconds over the drain (1 CPU s ="
    echo "one core busy for 1 s)."
    echo
    echo "| databases | relays per database | tracking | relays | events | wall s | events/s | relays CPU s | relay CPU µs/event | Kafka CPU s | machine CPU s | same relay pids | load before |"
    echo "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"
    printf '%s\n' "${rows[@]}"
} | tee "$OUT"
