#!/usr/bin/env bash
# Run every outbox test: build (no warnings allowed) and install the extension, start a local
# Kafka broker and a throw-away Postgres cluster, run pg_regress, pgTAP and the integration
# suites against them, and stop what it started.
#
# Usage: test/run.sh [STAGE...]      stages: build regress pgtap integration (default: all)
#        PYTEST_ARGS="-k config" test/run.sh integration     pass options to pytest
#
# Needs the packages test/env/deps.sh installs. Servers get their own ports and directories
# (below), so the demo's servers (test/demo.sh) can keep running beside the tests.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"

export OUTBOX_PG_DIR="${OUTBOX_PG_DIR:-/tmp/outbox-test-pg}"
export OUTBOX_PG_PORT="${OUTBOX_PG_PORT:-54331}"
export OUTBOX_PG_DATABASE="${OUTBOX_PG_DATABASE:-outbox}"
export OUTBOX_KAFKA_DIR="${OUTBOX_KAFKA_DIR:-/tmp/outbox-test-kafka}"
export OUTBOX_KAFKA_PORT="${OUTBOX_KAFKA_PORT:-19192}"
export OUTBOX_KAFKA_CONTROLLER_PORT="${OUTBOX_KAFKA_CONTROLLER_PORT:-19193}"
export OUTBOX_KAFKA="127.0.0.1:$OUTBOX_KAFKA_PORT"
export PGHOST=127.0.0.1 PGPORT="$OUTBOX_PG_PORT" PGUSER=postgres PGDATABASE="$OUTBOX_PG_DATABASE"

PY=/usr/bin/python3     # Debian's interpreter: it has psycopg2 and confluent_kafka
STAGES=("$@")
[[ ${#STAGES[@]} -gt 0 ]] || STAGES=(build regress pgtap integration)
want() { local s; for s in "${STAGES[@]}"; do [[ "$s" == "$1" ]] && return 0; done; return 1; }

SUDO=()
[[ $(id -u) -eq 0 ]] || SUDO=(sudo)
mkdir -p test/out
START=$(date +%s)
FAILED=()

say() { printf '\n=== %s\n' "$*"; }

cleanup() {
    test/env/pg.sh reset >/dev/null 2>&1 || true
    test/env/kafka.sh reset >/dev/null 2>&1 || true
}
trap cleanup EXIT

if want build; then
    say "build (warnings are errors)"
    make clean >/dev/null
    make -C test/mock clean >/dev/null
    { make; make -C test/mock; } 2>&1 | tee test/out/build.log >/dev/null
    if grep -E 'warning:|error:' test/out/build.log; then
        echo "build printed warnings or errors" >&2
        exit 1
    fi
    "${SUDO[@]}" make install >/dev/null
fi

say "servers: Kafka on $OUTBOX_KAFKA, Postgres on 127.0.0.1:$OUTBOX_PG_PORT"
OUTBOX_KAFKA_FRESH=1 test/env/kafka.sh start
OUTBOX_PG_FRESH=1 test/env/pg.sh start

run_stage() {
    local name=$1; shift
    say "$name"
    if "$@"; then echo "--- $name: ok"; else echo "--- $name: FAILED"; FAILED+=("$name"); fi
}

if want regress; then
    run_stage "pg_regress" make installcheck
    [[ -f test/out/regression.diffs ]] && cat test/out/regression.diffs
fi

if want pgtap; then
    run_stage "pgTAP" pg_prove -h "$PGHOST" -p "$PGPORT" -U postgres -d "$PGDATABASE" test/pgtap/*.sql
fi

if want integration; then
    eval "PYARGS=(${PYTEST_ARGS:-})"     # keeps quoting, e.g. PYTEST_ARGS="-k 'a or b'"
    run_stage "integration (real Kafka)" "$PY" -m pytest -v -p no:cacheprovider test/integration "${PYARGS[@]}"
fi

say "done in $(( $(date +%s) - START )) s"
if [[ ${#FAILED[@]} -gt 0 ]]; then
    echo "FAILED: ${FAILED[*]}"
    exit 1
fi
echo "all stages passed"
