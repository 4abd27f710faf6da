#!/usr/bin/env bash
# emit() against the same INSERT, in CPU instructions: section 1's three pgbench scripts, each run
# by one pgbench client against a postmaster under valgrind's callgrind, which counts the
# instructions every process executes.  Unlike TPS, the count does not move with what else runs
# on the machine, so a change of a few percent shows on a shared 2-core machine (section 1's TPS
# varies more than that between rounds there).  See bench/README.md, section 1.
#
# Usage: bench/emit_instructions.sh
#   Starts its own PostgreSQL cluster (test/env/pg.sh, no Kafka: the relay is not configured),
#   creates the bench's tables (bench/sql/setup.sql), then for each script and relay mode runs
#   pgbench -M prepared -c 1 -t N twice (N = BENCH_IR_TXNS_LOW, BENCH_IR_TXNS_HIGH) with the
#   postmaster under callgrind, and takes the instructions of the pgbench client's backend:
#   (Ir(high) - Ir(low)) / (high - low) is the cost of one transaction, without the backend's
#   start and the first executions (plans, caches).  Prints one table; deletes the cluster.
#
# Environment (defaults):
#   BENCH_IR_TXNS_LOW    200     transactions of the shorter run
#   BENCH_IR_TXNS_HIGH   600     transactions of the longer run
#   OUTBOX_PG_PORT, OUTBOX_PG_DIR   54612, /tmp/outbox-bench-ir-pg
# The PostgreSQL is the one whose pg_config comes first on PATH (test/env/pgmajor.sh 18 prints
# the bin directory of 18); the extension must be installed there.  Needs valgrind.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
LOW="${BENCH_IR_TXNS_LOW:-200}"
HIGH="${BENCH_IR_TXNS_HIGH:-600}"
export OUTBOX_PG_DIR="${OUTBOX_PG_DIR:-/tmp/outbox-bench-ir-pg}" OUTBOX_PG_PORT="${OUTBOX_PG_PORT:-54612}"
export OUTBOX_PG_DATABASE=outbox OUTBOX_KAFKA=''
export PGHOST=127.0.0.1 PGPORT="$OUTBOX_PG_PORT" PGUSER=postgres PGDATABASE=outbox
BIN=$(pg_config --bindir)
command -v valgrind >/dev/null || { echo "emit_instructions.sh: valgrind not found" >&2; exit 1; }
WORK=$(mktemp -d /tmp/outbox-bench-ir.XXXXXX)
chmod 777 "$WORK"
trap 'test/env/pg.sh reset >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
psql() { command psql -X -q -v ON_ERROR_STOP=1 "$@"; }

OUTBOX_PG_FRESH=1 test/env/pg.sh start
psql -f bench/sql/setup.sql
test/env/pg.sh stop

# ir SCRIPT N MODE: instructions of the backend that ran N transactions of SCRIPT
ir() {
    local script=$1 n=$2 mode=$3 f best=0 t
    rm -f "$WORK"/cg.*
    test/env/pg.sh run valgrind --tool=callgrind --callgrind-out-file="$WORK/cg.%p" \
        "$BIN/postgres" -D "$OUTBOX_PG_DIR/data" -c outbox.relay_mode="$mode" >"$WORK/server.log" 2>&1 &
    local vg=$!
    for _ in $(seq 1 300); do "$BIN/pg_isready" -q && break; sleep 1; done
    psql -c "TRUNCATE bench_orders, bench_plain, outbox.events" -c CHECKPOINT
    pgbench -n -M prepared -c 1 -t "$n" -D aggregates=10000 -f "bench/sql/$script" >"$WORK/pgbench.log" 2>&1 \
        || { cat "$WORK/pgbench.log" >&2; exit 1; }
    # the mode took effect: snapshot events carry their xid, row events none
    local want=0; [[ $mode == snapshot || $script == plain_xid.sql ]] && want=$n
    local table=outbox.events; [[ $script == plain* ]] && table=bench_plain
    if [[ $script != order.sql ]]; then
        local got; got=$(psql -tAc "SELECT count(xid) FROM $table")
        [[ $got == "$want" ]] || { echo "emit_instructions.sh: $script ($mode): $got of $n events with an xid, expected $want" >&2; exit 1; }
    fi
    test/env/pg.sh stop >/dev/null
    wait "$vg" || true
    # the pgbench backend ran the most instructions (then the startup process, checkpointer, psql's)
    for f in "$WORK"/cg.*; do
        t=$(awk '/^totals:/ {print $2}' "$f")
        [[ -n "$t" && $t -gt $best ]] && best=$t
    done
    echo "$best"
}

declare -A per_txn
for run in "emit.sql snapshot" "plain_xid.sql snapshot" "emit.sql row" "plain.sql row" "order.sql row"; do
    read -r script mode <<<"$run"
    lo=$(ir "$script" "$LOW" "$mode")
    hi=$(ir "$script" "$HIGH" "$mode")
    per_txn["$script $mode"]=$(( (hi - lo) / (HIGH - LOW) ))
    echo "$script ($mode): $lo / $hi instructions for $LOW / $HIGH transactions" >&2
done

ratio() { awk "BEGIN { printf \"%.3f\", $1 / $2 }"; }
printf '\n| transaction | relay_mode | instructions per transaction |\n|---|---|---:|\n'
for run in "emit.sql snapshot" "plain_xid.sql snapshot" "emit.sql row" "plain.sql row" "order.sql row"; do
    read -r script mode <<<"$run"
    printf '| %s | %s | %s |\n' "$script" "$mode" "${per_txn[$run]}"
done
printf '\nemit() over the same INSERT: snapshot mode %s (emit.sql / plain_xid.sql), row mode %s (emit.sql / plain.sql)\n' \
    "$(ratio "${per_txn[emit.sql snapshot]}" "${per_txn[plain_xid.sql snapshot]}")" \
    "$(ratio "${per_txn[emit.sql row]}" "${per_txn[plain.sql row]}")"
echo "(PostgreSQL $(pg_config --version | cut -d' ' -f2), pgbench -M prepared -c 1, (Ir($HIGH) - Ir($LOW)) / $((HIGH - LOW)) of the client's backend, callgrind)"
