#!/usr/bin/env bash
# Section 8 of bench/run.sh: the inbox against a hand-written Python consumer and Debezium's JDBC
# sink in Kafka Connect standalone (bench/inbox/inbox_bench.py says what it measures).  Expects the
# bench's servers (bench/run.sh starts them and sets PGHOST, PGPORT, OUTBOX_KAFKA, JAVA_HOME).
# Fetches the Kafka Connect and JDBC sink jars once (Maven, cache in .cache/bench-m2).
set -euo pipefail

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REPO_DIR=$(cd "$BENCH_DIR/.." && pwd)
WORK="${BENCH_WORK_DIR:-/tmp/outbox-bench-work}"
M2_REPO="$REPO_DIR/.cache/bench-m2"
LIBS="$WORK/connect-libs"
mkdir -p "$WORK"

if [[ ",${BENCH_INBOX_ARMS:-inbox,batch,python,jdbc}," == *",jdbc,"* ]]; then
    sum=$(sha256sum "$BENCH_DIR/inbox/connect/pom.xml" | cut -d' ' -f1)
    if [[ ! -f "$LIBS/.fetched" || "$(cat "$LIBS/.fetched")" != "$sum" ]]; then
        echo "bench inbox: fetching Kafka Connect and Debezium's JDBC sink (Maven, one-time) ..." >&2
        rm -rf "$LIBS"
        (cd "$BENCH_DIR/inbox/connect" && mvn -B -q -Dstyle.color=never -Dmaven.repo.local="$M2_REPO" \
            dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$LIBS") \
            >"$WORK/maven-connect.log" 2>&1 \
            || { tail -n 40 "$WORK/maven-connect.log" >&2; exit 1; }
        echo "$sum" >"$LIBS/.fetched"
    fi
fi
BENCH_INBOX_CONNECT_LIBS="$LIBS" /usr/bin/python3 "$BENCH_DIR/inbox/inbox_bench.py"
