#!/usr/bin/env bash
# The outbox benchmark: this extension side by side with Debezium (embedded engine) and a
# hand-written Python poller, in ONE run on this machine, against the same PostgreSQL 15
# cluster and the same Kafka broker, one system after the other.  See bench/README.md.
#
# Usage: bench/run.sh
#   Starts its own Kafka broker and PostgreSQL cluster (test/env/kafka.sh, test/env/pg.sh),
#   builds the Debezium peer once (Maven, cache in .cache/bench-m2), runs every section,
#   prints the tables, writes bench/results/latest.md and latest.json, and stops (and deletes)
#   both servers on exit.
#
# Environment (defaults):
#   BENCH_EVENTS            1000000   backlog size of the drain sections 2(a), 2(b) and of section 4
#   BENCH_POLLER_EVENTS     100000    backlog the Python poller drains in 2(c) (at most BENCH_EVENTS)
#   BENCH_AGGREGATES        10000     distinct aggregate ids (Kafka keys)
#   BENCH_PGBENCH_SECONDS   30        duration of each pgbench run (section 1)
#   BENCH_PGBENCH_ROUNDS    2         interleaved rounds of the three pgbench runs (best one reported)
#   BENCH_LATENCY_SECONDS   60        measured duration of each latency run (section 3)
#   BENCH_RATE              1000      events (= commits) per second in section 3
#   BENCH_WARMUP_SECONDS    5         unmeasured warm-up before each latency run
#   BENCH_DBZ_POLL_MS       10        Debezium poll.interval.ms in the latency run (its default 500 in the drain)
#   BENCH_LAT_BATCH_CONSUMER 0        1: section 3 also runs the Python consumer as it was before 2026-12
#                                     (consume(1000, 0.05)), to show what its batch window costs
#   BENCH_SECTIONS          1,2a,2b,2c,3,5,6,7 which sections to run (2a includes section 4; 6 is
#                                     bench/databases.sh: one backlog over 1, 2, 4 databases; 7 is
#                                     bench/load/delivery.py: exactly_once beside at_least_once,
#                                     drain and latency, BENCH_EOS_EVENTS 500000, BENCH_EOS_RATES 500,100;
#                                     8 is bench/inbox/run.sh: the inbox against a hand-written consumer
#                                     and Debezium's JDBC sink, BENCH_INBOX_EVENTS 1000000; not in the default)
#   BENCH_DB_EVENTS         1000000   section 6: backlog size; BENCH_DB_CASES "1,2,4" databases
#   BENCH_STEADY_EVENTS     5000000   section 5: events emitted at a steady rate, relay publishing
#   BENCH_STEADY_RATE       20000     section 5: events per second (BENCH_STEADY_BATCH per commit)
#   BENCH_STEADY_BATCH      1000      section 5: events per transaction (one emit() statement)
#   BENCH_STEADY_CONNECTIONS 2        section 5: loader connections sharing one schedule
#   BENCH_STEADY_SAMPLE_SECONDS 10    section 5: sampling interval of the table's size
#   BENCH_STEADY_CASES      snapshot,snapshot:outbox.vacuum_interval=0,row
#                                     section 5: comma-separated cases, each run on a fresh table:
#                                     row|snapshot[:key=value...], key = a storage parameter of
#                                     outbox.events (fillfactor, autovacuum_vacuum_threshold, ...),
#                                     autovacuum_naptime (server, reload), retention (s), or
#                                     vacuum_every (s: the bench runs VACUUM outbox.events itself)
#   BENCH_MAX_OTHER_CORES   0.5       before each section: wait while other processes use more
#   BENCH_QUIET_WAIT        60        ... but at most this many seconds (then run, and record it)
#   BENCH_KEEP              0         1: leave both servers running (and their data) at the end
#   BENCH_WORK_DIR          /tmp/outbox-bench-work   CSVs and logs of the run
#   OUTBOX_PG_PORT 54601, OUTBOX_PG_DIR /tmp/outbox-bench-pg,
#   OUTBOX_KAFKA_PORT 19601, OUTBOX_KAFKA_CONTROLLER_PORT 19602,
#   OUTBOX_KAFKA_DIR /tmp/outbox-bench-kafka, OUTBOX_KAFKA_HEAP 1g
#
# Quick smoke run (a few minutes):
#   BENCH_EVENTS=50000 BENCH_PGBENCH_SECONDS=5 BENCH_LATENCY_SECONDS=10 BENCH_STEADY_EVENTS=200000 bench/run.sh
# Section 5 alone (needs no Debezium build):
#   BENCH_SECTIONS=5 bench/run.sh
set -euo pipefail

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$BENCH_DIR/.." && pwd)
cd "$REPO_DIR"

export OUTBOX_PG_PORT="${OUTBOX_PG_PORT:-54601}"
export OUTBOX_PG_DIR="${OUTBOX_PG_DIR:-/tmp/outbox-bench-pg}"
export OUTBOX_PG_DATABASE="${OUTBOX_PG_DATABASE:-outbox}"
export OUTBOX_KAFKA_PORT="${OUTBOX_KAFKA_PORT:-19601}"
export OUTBOX_KAFKA_CONTROLLER_PORT="${OUTBOX_KAFKA_CONTROLLER_PORT:-19602}"
export OUTBOX_KAFKA_DIR="${OUTBOX_KAFKA_DIR:-/tmp/outbox-bench-kafka}"
export OUTBOX_KAFKA_HEAP="${OUTBOX_KAFKA_HEAP:-1g}"
export OUTBOX_KAFKA="127.0.0.1:$OUTBOX_KAFKA_PORT"
export PGHOST=127.0.0.1 PGPORT="$OUTBOX_PG_PORT" PGUSER=postgres PGDATABASE="$OUTBOX_PG_DATABASE"
export JAVA_HOME="${JAVA_HOME:-/usr/lib/jvm/java-17-openjdk-amd64}"
export BENCH_WORK_DIR="${BENCH_WORK_DIR:-/tmp/outbox-bench-work}"
M2_REPO="$REPO_DIR/.cache/bench-m2"
PY=/usr/bin/python3

log() { printf 'bench: %s\n' "$*" >&2; }
die() { printf 'bench: ERROR: %s\n' "$*" >&2; exit 1; }

# ------------------------------------------------------------------ prerequisites
command -v pgbench >/dev/null || die "pgbench not found (postgresql-contrib / postgresql-client-15)"
# Debezium (Java, Maven) only for the sections that run it: 2b, and 3 unless BENCH_LAT_SYSTEMS leaves it out
SECTIONS=",${BENCH_SECTIONS:-1,2a,2b,2c,3,5,6,7},"
SECTIONS=${SECTIONS// /}
NEED_DBZ=0
if [[ "$SECTIONS" == *",2b,"* ]] || { [[ "$SECTIONS" == *",3,"* ]] && [[ ",${BENCH_LAT_SYSTEMS:-ext,dbz,poller}," == *",dbz,"* ]]; }; then
    NEED_DBZ=1
fi
if [[ $NEED_DBZ == 1 ]]; then
    command -v mvn >/dev/null || die "mvn not found (apt-get install -y maven)"
    [[ -x "$JAVA_HOME/bin/java" ]] || die "no Java 17 at $JAVA_HOME"
fi
"$PY" -c 'import psycopg, confluent_kafka' 2>/dev/null \
    || die "$PY needs psycopg 3 and confluent_kafka (apt-get install -y python3-psycopg python3-confluent-kafka)"
[[ -f "$(pg_config --pkglibdir)/outbox.so" ]] || die "the outbox extension is not installed (make install)"
# measure this tree, not an older build: a library older than a source file is refused
newer=$(find "$REPO_DIR/src" "$REPO_DIR/sql" -newer "$(pg_config --pkglibdir)/outbox.so" -type f | head -1)
[[ -z "$newer" ]] || die "the installed outbox.so ($(pg_config --pkglibdir)) is older than $newer: make install first"

# ------------------------------------------------------------------ Debezium peer, built once
build_debezium() {
    local dir="$BENCH_DIR/debezium" sum marker
    sum=$(cat "$dir/pom.xml" "$dir/src/main/java/DbzBench.java" | sha256sum | cut -d' ' -f1)
    marker="$dir/target/.built"
    if [[ -f "$marker" && "$(cat "$marker")" == "$sum" ]]; then
        return 0
    fi
    log "building the Debezium peer (Maven cache $M2_REPO; one-time) ..."
    mkdir -p "$M2_REPO"
    rm -rf "$dir/target"
    (cd "$dir" && mvn -B -q -Dstyle.color=never -Dmaven.repo.local="$M2_REPO" \
        package dependency:copy-dependencies -DincludeScope=runtime) >"$BENCH_WORK_DIR/maven.log" 2>&1 \
        || { tail -n 40 "$BENCH_WORK_DIR/maven.log" >&2; die "Debezium build failed (log $BENCH_WORK_DIR/maven.log)"; }
    echo "$sum" >"$marker"
}

# ------------------------------------------------------------------ servers
stop_servers() {
    local rc=$?
    set +e
    if [[ "${BENCH_KEEP:-0}" == 1 ]]; then
        log "leaving the servers running (BENCH_KEEP=1): PG $PGPORT ($OUTBOX_PG_DIR), Kafka $OUTBOX_KAFKA ($OUTBOX_KAFKA_DIR)"
    else
        log "stopping and deleting the bench servers"
        test/env/pg.sh reset
        test/env/kafka.sh reset
    fi
    exit $rc
}

mkdir -p "$BENCH_WORK_DIR"
if [[ $NEED_DBZ == 1 ]]; then build_debezium; fi
# section 3's low-overhead consumer (librdkafka, like the relay)
cc -O2 -Wall -o "$BENCH_WORK_DIR/lat_consumer" "$BENCH_DIR/load/lat_consumer.c" -lrdkafka \
    || die "cannot build bench/load/lat_consumer.c (librdkafka-dev)"
export BENCH_LAT_C_CONSUMER="$BENCH_WORK_DIR/lat_consumer"
# section 2's limit: librdkafka alone, producing the drain's messages with the relay's settings
cc -O2 -Wall -o "$BENCH_WORK_DIR/produce_alone" "$BENCH_DIR/load/produce_alone.c" -lrdkafka \
    || die "cannot build bench/load/produce_alone.c (librdkafka-dev)"
export BENCH_PRODUCE_ALONE="$BENCH_WORK_DIR/produce_alone"

trap stop_servers EXIT
trap 'exit 130' INT TERM
log "load average before start: $(cut -d' ' -f1-3 /proc/loadavg)"
OUTBOX_KAFKA_FRESH=1 test/env/kafka.sh start
OUTBOX_PG_FRESH=1 test/env/pg.sh start

t0=$SECONDS
# driver.py runs sections 1-5 and writes latest.md; sections 6 and 7 are scripts of their own
DRIVER_SECTIONS=${SECTIONS//,6,/,}
DRIVER_SECTIONS=${DRIVER_SECTIONS//,7,/,}
DRIVER_SECTIONS=${DRIVER_SECTIONS//,8,/,}
if [[ "$DRIVER_SECTIONS" != "," ]]; then
    BENCH_SECTIONS="${DRIVER_SECTIONS:1:-1}" "$PY" "$BENCH_DIR/load/driver.py"
fi
if [[ "$SECTIONS" == *",6,"* ]]; then
    "$BENCH_DIR/databases.sh"
fi
if [[ "$SECTIONS" == *",7,"* ]]; then
    "$PY" "$BENCH_DIR/load/delivery.py"
fi
if [[ "$SECTIONS" == *",8,"* ]]; then
    "$BENCH_DIR/inbox/run.sh"
fi
log "finished in $((SECONDS - t0)) s; results in ${BENCH_RESULTS_DIR:-bench/results}/latest.md, latest.json, databases.md and delivery.md"
