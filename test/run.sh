#!/usr/bin/env bash
# Run every outbox test on every supported PostgreSQL major: install the packages, then per major
# build (no warnings allowed) and install the extension, start a local Kafka broker and a
# throw-away Postgres cluster, run pg_regress, pgTAP and the integration suite against them, and
# stop what it started.  Ends with a table: per major, warnings, pass counts and the time of each
# stage.
#
# Usage: test/run.sh [STAGE...]        stages: build regress pgtap integration package repro
#                                      (default: all)
#        test/run.sh --list            which integration tests run on which major, and why
#        OUTBOX_PG_MAJOR=17 test/run.sh        one major, with the whole integration suite
#        PYTEST_ARGS="-k config" test/run.sh integration     pass options to pytest
#
# Environment (defaults):
#   OUTBOX_PG_MAJORS       "15 16 17 18"  the majors to run
#   OUTBOX_PG_FULL_MAJORS  "15 18"        majors that run the whole integration suite; the others
#                                         run the core subset (CORE_TESTS below)
#   OUTBOX_PG_ROW_MAJORS   "16"           majors whose cluster runs outbox.relay_mode = row (the 1.3
#                                         relay) instead of the default snapshot, so both modes keep
#                                         running the same tests
#   OUTBOX_PG_MAJOR        (unset)        shorthand for OUTBOX_PG_MAJORS=N OUTBOX_PG_FULL_MAJORS=N
#                                         OUTBOX_PG_ROW_MAJORS= (unless set)
#   OUTBOX_KAFKA3_MAJORS   "17"           majors whose integration stage also runs test_27 against a
#                                         3-broker Kafka cluster (test/env/kafka-cluster.sh), and
#                                         not test_10 (test_27 kills Postgres 10 times itself)
#   OUTBOX_CLEANUP_EVENTS  150000         events per run of test_18's retention test (the README's
#                                         figures are from 1,000,000; 500,000 took 159 s per major)
#   OUTBOX_CI_STACKS       3              stacks run side by side: each major runs on one stack (its
#                                         own Kafka, Postgres cluster, ports and directories), the
#                                         longest majors first; 1 runs the majors one after another
#   OUTBOX_TEST_TIMEOUT    (pytest.ini)   seconds one integration test may take (pytest-timeout)
#   OUTBOX_REPRO_MAJORS    "15 18"        majors whose repro stage runs test/repro/fast-stop-hang.sh:
#                                         PostgreSQL's own fast-shutdown hang after a backend crash,
#                                         without the extension; reported, never a failure (only a
#                                         broken script fails the stage)
#   OUTBOX_INBOX_CHAOS_MAJORS "17"        majors whose integration stage runs test_37, the inbox's fault
#                                         schedule (three seeds, about 4 minutes): on a core major,
#                                         whose stack has the time to spare, not on the full ones
#                                         (with OUTBOX_PG_MAJOR=N, N runs it when listed here)
#   OUTBOX_REPRO_CYCLES    25             its cycles (about 3 s each, 15 s more per hang)
#
# Stack k (0, 1, ...) derives its ports and directories from the base ones below: Postgres port
# OUTBOX_PG_PORT + 50k (its throw-away clusters use up to +40), Kafka ports OUTBOX_KAFKA_PORT +
# 20k (SASL listener +5), OUTBOX_KAFKA_CONTROLLER_PORT + 20k and OUTBOX_KAFKA3_PORT + 20k (its
# three brokers use up to +12); directories get the suffix -s<k> (none for stack 0).  With the
# defaults, stack 0 is 25431 / 19192 / 19193 / 19292 with /tmp/outbox-test-{pg,kafka,kafka3}.
#
# Output: with more than one stack, each stage's output is printed whole when the stage ends
# (stages of different majors do not interleave); every stage's log is in test/out/pg<major>/.
# A failed integration test is reported with the server log's tail and outbox.status /
# outbox.cluster_status() (conftest.py), and a test that takes longer than its timeout fails
# alone, with its stack.
#
# 15 is Debian's; 16, 17 and 18 are fetched once by test/env/pgmajor.sh.  Each major builds and
# installs the extension into its own tree (one build at a time: they share the source tree) and
# gets a fresh Kafka and Postgres on its stack's ports, so the demo's servers (test/demo.sh) can
# keep running beside the tests.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"

# the base of stack 0; stack k adds its offsets (stack_env below)
# 25431 (and the throw-away clusters' 25438..25471) lies below Linux's ephemeral port range
# (32768-60999): a port inside it can be taken by any client connection's source port in the
# middle of a run, and a cluster started later then fails with "Address already in use" (CI saw
# it on 2026-12-02 with 54352).
BASE_PG_DIR="${OUTBOX_PG_DIR:-/tmp/outbox-test-pg}"
BASE_PG_PORT="${OUTBOX_PG_PORT:-25431}"
BASE_KAFKA_DIR="${OUTBOX_KAFKA_DIR:-/tmp/outbox-test-kafka}"
BASE_KAFKA_PORT="${OUTBOX_KAFKA_PORT:-19192}"
BASE_KAFKA_CONTROLLER_PORT="${OUTBOX_KAFKA_CONTROLLER_PORT:-19193}"
BASE_KAFKA3_DIR="${OUTBOX_KAFKA3_DIR:-/tmp/outbox-test-kafka3}"
BASE_KAFKA3_PORT="${OUTBOX_KAFKA3_PORT:-19292}"
PG_PORT_STRIDE=50
KAFKA_PORT_STRIDE=20
export OUTBOX_PG_DATABASE="${OUTBOX_PG_DATABASE:-outbox}"

# stack_env K: export the ports and directories of stack K (the scripts and conftest.py read them)
stack_env() {
    local k=$1 sfx=
    (( k == 0 )) || sfx="-s$k"
    export OUTBOX_STACK=$k
    export OUTBOX_PG_DIR="$BASE_PG_DIR$sfx"
    export OUTBOX_PG_PORT=$((BASE_PG_PORT + PG_PORT_STRIDE * k))
    export OUTBOX_KAFKA_DIR="$BASE_KAFKA_DIR$sfx"
    export OUTBOX_KAFKA_PORT=$((BASE_KAFKA_PORT + KAFKA_PORT_STRIDE * k))
    export OUTBOX_KAFKA_CONTROLLER_PORT=$((BASE_KAFKA_CONTROLLER_PORT + KAFKA_PORT_STRIDE * k))
    export OUTBOX_KAFKA3_DIR="$BASE_KAFKA3_DIR$sfx"
    export OUTBOX_KAFKA3_PORT=$((BASE_KAFKA3_PORT + KAFKA_PORT_STRIDE * k))
    export OUTBOX_KAFKA="127.0.0.1:$OUTBOX_KAFKA_PORT"
    export PGHOST=127.0.0.1 PGPORT="$OUTBOX_PG_PORT" PGUSER=postgres PGDATABASE="$OUTBOX_PG_DATABASE"
    unset OUTBOX_KAFKA_SASL_PORT
}

if [[ -n "${OUTBOX_PG_MAJOR:-}" ]]; then
    MAJORS=("$OUTBOX_PG_MAJOR")
    FULL_MAJORS=("$OUTBOX_PG_MAJOR")
    read -r -a ROW_MAJORS <<<"${OUTBOX_PG_ROW_MAJORS:-}"
else
    read -r -a MAJORS <<<"${OUTBOX_PG_MAJORS:-15 16 17 18}"
    read -r -a FULL_MAJORS <<<"${OUTBOX_PG_FULL_MAJORS:-15 18}"
    read -r -a ROW_MAJORS <<<"${OUTBOX_PG_ROW_MAJORS-16}"
fi
read -r -a KAFKA3_MAJORS <<<"${OUTBOX_KAFKA3_MAJORS-17}"
read -r -a REPRO_MAJORS <<<"${OUTBOX_REPRO_MAJORS-15 18}"
read -r -a INBOX_CHAOS_MAJORS <<<"${OUTBOX_INBOX_CHAOS_MAJORS-17}"
STACKS="${OUTBOX_CI_STACKS:-3}"
[[ "$STACKS" =~ ^[1-9]$ ]] || { echo "run.sh: OUTBOX_CI_STACKS must be 1..9" >&2; exit 2; }

# The core subset for the majors that do not run everything: delivery and rollbacks, settings at
# start and on reload, restart, kill -9 under load, standby promotion, dump/restore and every
# upgrade path, secrets, the snapshot relay (relay_mode = snapshot), the relay's VACUUM, the
# launcher (relays for several databases), the consumers' formats read by Java clients,
# exactly-once delivery (test_28; on 16 through the row relay), key-partitioned relays (test_29),
# a 3-broker Kafka cluster (test_27, on the majors in OUTBOX_KAFKA3_MAJORS only: its three JVMs
# cost about a minute and a half), commits that land in a batch's windows between its snapshot and
# its reads (test_35: per-aggregate order across the two kinds of tracking), the inbox
# (test_31_inbox: subscribe, apply, offsets; its registration->mail run under kill -9; its
# standby, promotion and dump/restore).
# The relay's fault schedule (test_32) runs on the full majors only, the inbox's (test_37) on the
# majors of OUTBOX_INBOX_CHAOS_MAJORS (17: a full major's stack is the long pole, and three seeds
# cost about 4 minutes); 3 minutes of faults each by default (OUTBOX_CHAOS_MINUTES).
# SASL (test_22) is librdkafka's, not the server's: it runs on the full majors only, as do the
# tests marked full_only (slow checks of nothing that differs between majors; pytest.ini).
CORE_TESTS=(
    test_01_basic.py test_03_restart.py test_06_config.py test_10_crash.py
    test_16_standby.py test_17_dump_upgrade.py test_21_security.py
    test_23_snapshot.py test_24_vacuum.py test_25_launcher.py test_26_formats.py
    test_27_replicated.py test_28_exactly_once.py test_29_partitioned.py
    test_35_batch_windows.py
    test_31_inbox.py test_31_inbox_crash.py test_31_inbox_lifecycle.py
    test_31_inbox_operators.py test_36_inbox_isolation.py test_38_inbox_batch.py
)

PY=/usr/bin/python3     # Debian's interpreter: it has psycopg2 and confluent_kafka
LIST=
STAGES=()
for a in "$@"; do
    case "$a" in
        --list) LIST=1 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
        *) STAGES+=("$a") ;;
    esac
done
[[ ${#STAGES[@]} -gt 0 ]] || STAGES=(build regress pgtap integration package repro)
want() { local s; for s in "${STAGES[@]}"; do [[ "$s" == "$1" ]] && return 0; done; return 1; }
in_list() { local x=$1 s; shift; for s in "$@"; do [[ "$s" == "$x" ]] && return 0; done; return 1; }
is_full() { in_list "$1" "${FULL_MAJORS[@]}"; }
is_kafka3() { in_list "$1" "${KAFKA3_MAJORS[@]}"; }

SUDO=()
[[ $(id -u) -eq 0 ]] || SUDO=(sudo)
START=$(date +%s)
OUT="$REPO/test/out"

say() { printf '\n=== %s\n' "$*"; }

# integration_args MAJOR: pytest's arguments for MAJOR's integration stage (without PYTEST_ARGS)
# -- what runs where, and why, is what `--list` prints
integration_args() {
    local major=$1 t files=()
    if is_full "$major"; then
        for t in test/integration/test_*.py; do files+=("${t##*/}"); done
    else
        files=("${CORE_TESTS[@]}")
    fi
    ARGS=()
    for t in "${files[@]}"; do
        # test_27 needs the 3-broker cluster (its three JVMs cost about a minute and a half);
        # where it runs, it kills Postgres 10 times under load (exactly_once): on a core major
        # test_10's at-least-once crash run is left to the other majors
        if [[ $t == test_27_replicated.py ]] && ! is_kafka3 "$major"; then continue; fi
        if [[ $t == test_10_crash.py ]] && is_kafka3 "$major" && ! is_full "$major"; then continue; fi
        # the inbox's fault schedule: below, where OUTBOX_INBOX_CHAOS_MAJORS says, full or core
        if [[ $t == test_37_inbox_fault_schedule.py ]]; then continue; fi
        ARGS+=("test/integration/$t")
    done
    if in_list "$major" "${INBOX_CHAOS_MAJORS[@]}"; then
        ARGS+=(test/integration/test_37_inbox_fault_schedule.py)
    fi
    is_full "$major" || ARGS+=(-m "not full_only")
}

# --list: collect (not run) each major's integration tests and print which run where, and why
list_tests() {
    local major col ids
    declare -A RUNS=()          # node id -> " 15 16 ..."
    local -a ALL=()
    for major in "${MAJORS[@]}"; do
        integration_args "$major"
        ids=$(OUTBOX_KAFKA3=$(is_kafka3 "$major" && echo 1 || echo 0) \
              "$PY" -m pytest --collect-only -q -p no:cacheprovider "${ARGS[@]}" 2>/dev/null \
              | grep '::' || true)
        while read -r id; do
            [[ -n "$id" ]] || continue
            [[ -n "${RUNS[$id]+x}" ]] || ALL+=("$id")
            RUNS[$id]+=" $major"
        done <<<"$ids"
    done
    mapfile -t ALL < <(printf '%s\n' "${ALL[@]}" | sort -t: -k1,1 -s)
    local full_only
    full_only=$("$PY" -m pytest --collect-only -q -p no:cacheprovider -m full_only test/integration \
                2>/dev/null | grep '::' || true)
    printf 'Integration tests per PostgreSQL major (%s; full: %s; core subset: the others)\n\n' \
        "${MAJORS[*]}" "${FULL_MAJORS[*]}"
    printf '%-78s %-12s %s\n' "test (module, or a test that runs on fewer majors than its module)" majors why
    local mod prev= id rest why m
    declare -A MODMAJ=()
    for id in "${ALL[@]}"; do
        mod=${id%%::*}
        MODMAJ[$mod]="${MODMAJ[$mod]:-${RUNS[$id]}}"
        # a module's majors: those its tests run on at most
        [[ ${#RUNS[$id]} -gt ${#MODMAJ[$mod]} ]] && MODMAJ[$mod]=${RUNS[$id]}
    done
    for id in "${ALL[@]}"; do
        mod=${id%%::*}
        if [[ "$mod" != "$prev" ]]; then
            why=$(why_module "${mod##*/}" "${MODMAJ[$mod]}")
            printf '%-78s %-12s %s\n' "${mod#test/integration/} ($(grep -c "^$mod::" <<<"$(printf '%s\n' "${ALL[@]}")") test(s))" \
                "${MODMAJ[$mod]# }" "$why"
            prev=$mod
        fi
        if [[ "${RUNS[$id]}" != "${MODMAJ[$mod]}" ]]; then
            if grep -qxF "$id" <<<"$full_only"; then why="marked full_only (pytest.ini): a slow check of nothing that differs between majors"
            elif [[ $id == *test_fault_schedule\[seed* ]]; then why="the random seed: each run draws its own"
            else why="?"; fi
            rest=${id#*::}
            printf '  %-76s %-12s %s\n' "$rest" "${RUNS[$id]# }" "$why"
        fi
    done
    echo
    echo "Skips a test decides at run time (the server's major lacks the feature):"
    grep -n 'pytest.skip(' test/integration/*.py | sed 's/^/  /'
}

why_module() {
    local mod=$1 majors=$2 m missing=()
    for m in "${MAJORS[@]}"; do [[ " $majors " == *" $m "* ]] || missing+=("$m"); done
    if [[ ${#missing[@]} -eq 0 ]]; then
        echo "every major (core subset, CORE_TESTS)"
    elif [[ $mod == test_27_replicated.py ]]; then
        echo "needs the 3-broker Kafka cluster: OUTBOX_KAFKA3_MAJORS only"
    elif [[ $mod == test_37_inbox_fault_schedule.py ]]; then
        echo "the inbox's fault schedule (about 4 minutes): OUTBOX_INBOX_CHAOS_MAJORS only"
    elif [[ $mod == test_10_crash.py ]]; then
        echo "not where test_27 runs (it kills Postgres 10 times itself: OUTBOX_KAFKA3_MAJORS)"
    elif ! in_list "$mod" "${CORE_TESTS[@]}"; then
        echo "not in the core subset: full majors only (OUTBOX_PG_FULL_MAJORS)"
    else
        echo "?"
    fi
}

if [[ -n $LIST ]]; then
    list_tests
    exit 0
fi

# --------------------------------------------------------------------------- stages

# counts_of LOG: set COUNTS, PASSED and FAILED_N from the runner's closing line in LOG (pytest,
# prove, pg_regress); else COUNTS is the log's last "summary: " line
counts_of() {
    local log=$1 line
    PASSED=0 FAILED_N=0 COUNTS=
    if line=$(grep -E '^=+ .*(passed|failed|error).* in [0-9.]+s' "$log" | tail -n 1) && [[ -n "$line" ]]; then
        PASSED=$(grep -oE '[0-9]+ passed' <<<"$line" | grep -oE '[0-9]+' || echo 0)
        FAILED_N=$(( $(grep -oE '[0-9]+ failed' <<<"$line" | grep -oE '[0-9]+' || echo 0) \
                 + $(grep -oE '[0-9]+ errors?' <<<"$line" | grep -oE '[0-9]+' || echo 0) ))
    elif line=$(grep -E '^Files=[0-9]+, Tests=[0-9]+' "$log" | tail -n 1) && [[ -n "$line" ]]; then
        PASSED=$(grep -oE 'Tests=[0-9]+' <<<"$line" | grep -oE '[0-9]+')
        grep -q '^Result: PASS' "$log" || { FAILED_N=$PASSED; PASSED=0; }
    elif line=$(grep -E '^#? *(All [0-9]+ tests passed|[0-9]+ of [0-9]+ tests failed)' "$log" | tail -n 1) \
            && [[ -n "$line" ]]; then
        if [[ "$line" == *"passed"* ]]; then
            PASSED=$(grep -oE '[0-9]+' <<<"$line" | head -n 1)
        else
            FAILED_N=$(grep -oE '[0-9]+' <<<"$line" | head -n 1)
            PASSED=$(( $(grep -oE '[0-9]+' <<<"$line" | sed -n 2p) - FAILED_N ))
        fi
    else
        COUNTS=$(grep -E '^summary: ' "$log" | tail -n 1 | sed 's/^summary: //' || true)
        return 0
    fi
    COUNTS="$PASSED passed, $FAILED_N failed"
}

# run_stage MAJOR NAME CMD...: run one stage, its output in test/out/pgMAJOR/NAME.log and on the
# terminal (live with one stack; else whole when the stage ends); one line per stage in
# test/out/pgMAJOR/stages.txt for the closing table
run_stage() {
    local major=$1 name=$2 t0 t1 rc log
    shift 2
    log="$OUT/pg$major/$name.log"
    t0=$(date +%s)
    set +e
    if (( STACKS == 1 )); then
        say "PostgreSQL $major: $name"
        "$@" 2>&1 | tee "$log"
        rc=${PIPESTATUS[0]}
    else
        printf '=== PostgreSQL %s: %s started on stack %s (+%d s)\n' "$major" "$name" "$OUTBOX_STACK" $((t0 - START))
        "$@" >"$log" 2>&1
        rc=$?
    fi
    set -e
    t1=$(date +%s)
    counts_of "$log"
    if (( STACKS > 1 )); then
        (   flock 7
            say "PostgreSQL $major: $name (stack $OUTBOX_STACK, +$((t0 - START)) s .. +$((t1 - START)) s)"
            cat "$log"
            printf -- '--- PostgreSQL %s %s: %s in %d s\n' "$major" "$name" \
                "$([[ $rc -eq 0 ]] && echo ok || echo FAILED)" $((t1 - t0))
        ) 7>"$OUT/.terminal.lock"
    else
        printf -- '--- PostgreSQL %s %s: %s\n' "$major" "$name" "$([[ $rc -eq 0 ]] && echo ok || echo FAILED)"
    fi
    printf '%s|%s|%s|%s|%s|%s|%s|%s|%s\n' "$major" "$OUTBOX_STACK" "$name" \
        "$([[ $rc -eq 0 ]] && echo ok || echo FAILED)" "$COUNTS" "$PASSED" "$FAILED_N" \
        $((t0 - START)) $((t1 - t0)) >>"$OUT/pg$major/stages.txt"
    return $rc
}

# build: make (no warning), then make install into this major's tree.  One build at a time: the
# majors share the source tree.  `make clean` keeps test/out (the other majors' logs).
build() {
    local t0=$SECONDS
    (
        flock 8
        waited=$((SECONDS - t0))
        # src/'s folders include only downwards (src/README.md)
        test/layering.sh || { echo "summary: an #include against the floors of src/README.md"; exit 1; }
        make clean EXTRA_CLEAN= >/dev/null
        out=$(make -j"$(nproc)" 2>&1) || { echo "$out"; echo "summary: make failed"; exit 1; }
        echo "$out"
        warnings=$(grep -cE 'warning:|error:' <<<"$out" || true)
        echo "summary: $warnings warnings$( ((waited < 2)) || echo ", $waited s waiting for another build")"
        [[ $warnings -eq 0 ]] || exit 1
        "${SUDO[@]}" env PATH="$PATH" make install >/dev/null
    ) 8>"$OUT/.build.lock"
}

servers() {
    OUTBOX_KAFKA_FRESH=1 test/env/kafka.sh start
    OUTBOX_PG_FRESH=1 test/env/pg.sh start
}

regress() {
    local major=$1 rc=0 dir="test/out/pg$1/regress"
    mkdir -p "$dir"
    # the Makefile's options, with an output directory per major (PGXS adds --dbname only to its own)
    make installcheck REGRESS_OPTS="--inputdir=test --outputdir=$dir --dbname=contrib_regression" || rc=$?
    [[ -f "$dir/regression.diffs" ]] && cat "$dir/regression.diffs"
    return $rc
}

integration() {
    local major=$1 cleanup=${OUTBOX_CLEANUP_EVENTS:-150000} timeout=()
    eval "PYARGS=(${PYTEST_ARGS:-})"     # keeps quoting, e.g. PYTEST_ARGS="-k 'a or b'"
    integration_args "$major"
    [[ -z "${OUTBOX_TEST_TIMEOUT:-}" ]] || timeout=(--timeout="$OUTBOX_TEST_TIMEOUT")
    OUTBOX_KAFKA3=$(is_kafka3 "$major" && echo 1 || echo 0) OUTBOX_CLEANUP_EVENTS=$cleanup \
        OUTBOX_TEST_OUT="$OUT/pg$major" \
        "$PY" -m pytest -v -p no:cacheprovider --durations=15 "${timeout[@]}" "${ARGS[@]}" "${PYARGS[@]}"
}

# package: META.json valid under the PGXN meta spec, `make dist` complete, and its zip builds
# alone with no warning on this major (test/pgxn.sh; one at a time: it may build its validator)
package() {
    ( flock 8; test/pgxn.sh check ) 8>"$OUT/.package.lock"
}

# repro: PostgreSQL's fast-shutdown hang after a backend crash, reproduced without the extension
# (test/repro/), on its own cluster (port OUTBOX_PG_PORT + 45: the stack's throw-away clusters
# use up to +40).  What it saw is the stage's summary; a hang is PostgreSQL's and passes, only a
# script that breaks (exit 2) fails the stage.
repro() {
    local major=$1 rc out="$OUT/pg$1/repro-lines.txt"
    REPRO_PORT=$((OUTBOX_PG_PORT + 45)) REPRO_DIR="$OUTBOX_PG_DIR-repro" \
        test/repro/fast-stop-hang.sh "$major" "${OUTBOX_REPRO_CYCLES:-25}" 15 | tee "$out"
    rc=${PIPESTATUS[0]}
    rm -rf "$OUTBOX_PG_DIR-repro"
    [[ $rc -eq 0 ]] || return "$rc"
    echo "summary: $(grep -E '^repro: major=' "$out" | tail -n 1 \
        | sed -E 's/.*cycles=([0-9]+) hangs=([0-9]+).*/\2 hangs in \1 cycles (PostgreSQL'"'"'s)/')"
}

cleanup_stack() {
    test/env/pg.sh reset >/dev/null 2>&1 || true
    test/env/kafka.sh reset >/dev/null 2>&1 || true
    test/env/kafka-cluster.sh reset >/dev/null 2>&1 || true
}

run_major() {
    local major=$1 bindir
    mkdir -p "$OUT/pg$major"
    rm -f "$OUT/pg$major/stages.txt"
    bindir=$(test/env/pgmajor.sh "$major")
    export PATH="$bindir:$PATH"
    echo "=== PostgreSQL $major: $(pg_config --version) from $bindir, stack $OUTBOX_STACK" \
         "(Postgres $OUTBOX_PG_PORT, Kafka $OUTBOX_KAFKA_PORT)"
    if in_list "$major" "${ROW_MAJORS[@]}"; then
        # pg.sh appends these lines to the new cluster's postgresql.conf
        export OUTBOX_PG_CONF="${OUTBOX_PG_CONF:+$OUTBOX_PG_CONF$'\n'}outbox.relay_mode = row"
        echo "=== PostgreSQL $major runs outbox.relay_mode = row"
    fi
    if want build; then
        run_stage "$major" build build || return 0
    fi
    if want regress || want pgtap || want integration; then
        run_stage "$major" servers servers || { cleanup_stack; return 0; }
    fi
    want regress && { run_stage "$major" pg_regress regress "$major" || true; }
    want pgtap && { run_stage "$major" pgTAP \
        pg_prove -h "$PGHOST" -p "$PGPORT" -U postgres -d "$PGDATABASE" test/pgtap/*.sql || true; }
    want integration && { run_stage "$major" integration integration "$major" || true; }
    cleanup_stack
    if want package && is_full "$major"; then
        run_stage "$major" package package || true
    fi
    if want repro && in_list "$major" "${REPRO_MAJORS[@]}"; then
        run_stage "$major" repro repro "$major" || true
    fi
    return 0
}

# stack_worker K: run majors from the queue on stack K until it is empty
stack_worker() {
    local k=$1 major
    stack_env "$k"
    trap cleanup_stack EXIT
    while major=$(next_major); do
        (run_major "$major")
    done
}

# next_major: take the next major from the queue (the longest first), one taker at a time
next_major() {
    local first
    exec 9>>"$OUT/.queue.lock"
    flock 9
    first=$(head -n 1 "$OUT/.queue")
    [[ -n "$first" ]] || { exec 9>&-; return 1; }
    sed -i 1d "$OUT/.queue"
    exec 9>&-
    echo "$first"
}

say "packages"
test/env/deps.sh
mkdir -p "$OUT"
rm -f "$OUT"/pg*/stages.txt
if want build; then
    make -C test/mock clean >/dev/null
    make -C test/mock 2>&1 | tee "$OUT/mock-build.log"
fi
if want regress || want pgtap || want integration; then
    test/env/kafka.sh fetch     # once, before several stacks start a broker
fi
if want package; then
    # the PGXN validator (built once with cargo, minutes on a fresh machine) meanwhile; the
    # package stages wait for it
    ( flock 8; test/pgxn.sh validator ) 8>"$OUT/.package.lock" >"$OUT/pgxn-validator.log" 2>&1 &
fi

# the queue: full majors first (the longest stages), then the 3-broker ones, then the rest
: >"$OUT/.queue"
for major in "${MAJORS[@]}"; do is_full "$major" && echo "$major" >>"$OUT/.queue"; done
for major in "${MAJORS[@]}"; do ! is_full "$major" && is_kafka3 "$major" && echo "$major" >>"$OUT/.queue"; done
for major in "${MAJORS[@]}"; do ! is_full "$major" && ! is_kafka3 "$major" && echo "$major" >>"$OUT/.queue"; done
n=$STACKS
(( n <= ${#MAJORS[@]} )) || n=${#MAJORS[@]}
pids=()
for ((k = 0; k < n; k++)); do
    stack_worker "$k" &
    pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null; wait; exit 130' INT TERM
for p in "${pids[@]}"; do wait "$p" || true; done
wait || true                    # the validator build, if still running
trap - INT TERM

# ------------------------------------------------------------------------- summary
FAILED=()
PASSED_TOTAL=0
FAILED_TOTAL=0
say "summary (done in $(( $(date +%s) - START )) s on $n stack(s))"
printf '%-5s %-5s %-12s %-6s %-28s %7s %7s\n' major stack stage result counts start time
for major in "${MAJORS[@]}"; do
    if [[ ! -s "$OUT/pg$major/stages.txt" ]]; then
        printf '%-5s %-5s %-12s %-6s\n' "$major" - - "NOT RUN"
        FAILED+=("pg$major")
        continue
    fi
    while IFS='|' read -r m k name result counts passed failed t0 secs; do
        printf '%-5s %-5s %-12s %-6s %-28s %6ss %6ss\n' "$m" "$k" "$name" "$result" "$counts" "+$t0" "$secs"
        [[ "$result" == ok ]] || FAILED+=("pg$m:$name")
        PASSED_TOTAL=$((PASSED_TOTAL + passed))
        FAILED_TOTAL=$((FAILED_TOTAL + failed))
    done <"$OUT/pg$major/stages.txt"
done
if want build && grep -E 'warning:|error:' "$OUT/mock-build.log"; then FAILED+=("mock build"); fi
echo
if [[ ${#FAILED[@]} -gt 0 ]]; then
    echo "FAILED: ${FAILED[*]}"
    echo "total: $PASSED_TOTAL passed, $FAILED_TOTAL failed"
    exit 1
fi
echo "all stages passed on PostgreSQL ${MAJORS[*]}"
echo "total: $PASSED_TOTAL passed, $FAILED_TOTAL failed"
