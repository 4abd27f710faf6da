#!/usr/bin/env bash
# Event ids: random UUIDs (version 4, gen_random_uuid(), what outbox.events uses today) against
# time-ordered ones (version 7, PostgreSQL 18's uuidv7()), measured side by side in one run on
# PostgreSQL 18, to decide whether a time-ordered id is worth a schema change.
#
# Usage: bench/event_id.sh
#   Starts its own PostgreSQL 18 cluster (test/env/pg.sh, no Kafka, no extension), fills two tables
#   shaped like outbox.events' unique event_id index with BENCH_ID_ROWS rows each (so that the
#   index outgrows shared_buffers), then runs pgbench on both in interleaved rounds: one
#   single-row INSERT per transaction, like emit(). Prints one table; deletes the cluster.
#
# Environment (defaults):
#   BENCH_ID_ROWS       3000000   rows in each table before the measured runs
#   BENCH_ID_SECONDS    20        seconds of each pgbench run
#   BENCH_ID_ROUNDS     2         interleaved rounds (v4, v7, v4, v7, ...); the best run is reported
#   BENCH_ID_CLIENTS    4         pgbench sessions
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
ROWS="${BENCH_ID_ROWS:-3000000}"
SECONDS_PER_RUN="${BENCH_ID_SECONDS:-20}"
ROUNDS="${BENCH_ID_ROUNDS:-2}"
CLIENTS="${BENCH_ID_CLIENTS:-4}"

export PATH="$(test/env/pgmajor.sh 18):$PATH"
export OUTBOX_PG_DIR=/tmp/outbox-bench-id-pg OUTBOX_PG_PORT=54611 OUTBOX_PG_DATABASE=bench OUTBOX_KAFKA=''
export PGHOST=127.0.0.1 PGPORT=54611 PGUSER=postgres PGDATABASE=bench
WORK=$(mktemp -d /tmp/outbox-bench-id.XXXXXX)
chmod 755 "$WORK"
trap 'test/env/pg.sh reset >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT

OUTBOX_PG_FRESH=1 test/env/pg.sh start
# a plain cluster: the comparison needs no relay
test/env/pg.sh run sed -i "s/^shared_preload_libraries = 'outbox'/#&/" "$OUTBOX_PG_DIR/data/postgresql.conf"
test/env/pg.sh restart
psql() { command psql -X -q -v ON_ERROR_STOP=1 "$@"; }

for v in v4 v7; do
    fn=$([[ $v == v4 ]] && echo gen_random_uuid || echo uuidv7)
    psql -c "CREATE TABLE events_$v (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                 event_id uuid NOT NULL DEFAULT $fn() UNIQUE, payload text)" \
         -c "INSERT INTO events_$v (payload) SELECT 'x' FROM generate_series(1, $ROWS)" \
         -c "VACUUM ANALYZE events_$v" -c "CHECKPOINT"
    echo "INSERT INTO events_$v (payload) VALUES ('{\"n\": 1}');" >"$WORK/insert_$v.sql"
done

declare -A best_tps best_wal
for ((r = 1; r <= ROUNDS; r++)); do
    for v in v4 v7; do
        psql -c CHECKPOINT
        lsn0=$(psql -tAc "SELECT pg_current_wal_lsn()")
        out=$(pgbench -n -c "$CLIENTS" -j 2 -T "$SECONDS_PER_RUN" -f "$WORK/insert_$v.sql" 2>&1)
        n=$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' <<<"$out")
        tps=$(sed -n 's/^tps = \([0-9.]*\) .*/\1/p' <<<"$out")
        wal=$(psql -tAc "SELECT round(pg_wal_lsn_diff(pg_current_wal_lsn(), '$lsn0') / $n)")
        echo "round $r $v: $tps tps, $wal WAL bytes per insert" >&2
        if [[ -z "${best_tps[$v]:-}" ]] || awk "BEGIN {exit !($tps > ${best_tps[$v]})}"; then
            best_tps[$v]=$tps
            best_wal[$v]=$wal
        fi
    done
done

printf '\n%-20s %12s %18s %16s %14s\n' "event id" "inserts/s" "WAL bytes/insert" "index MB" "rows"
for v in v4 v7; do
    size=$(psql -tAc "SELECT round(pg_relation_size('events_${v}_event_id_key') / 1048576.0)")
    rows=$(psql -tAc "SELECT count(*) FROM events_$v")
    printf '%-20s %12s %18s %16s %14s\n' "$([[ $v == v4 ]] && echo 'v4 gen_random_uuid' || echo 'v7 uuidv7')" \
        "${best_tps[$v]}" "${best_wal[$v]}" "$size" "$rows"
done
echo "(PostgreSQL 18, $CLIENTS sessions, best of $ROUNDS interleaved ${SECONDS_PER_RUN} s runs after $ROWS rows per table)"
