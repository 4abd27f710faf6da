#!/usr/bin/env bash
# Reproduce PostgreSQL's fast-shutdown hang after a backend crash, without any extension.
#
# Usage: test/repro/fast-stop-hang.sh [MAJOR [CYCLES [BOUND]]]      (defaults: 15 20 20)
#
# One cycle: start the cluster (shared_preload_libraries = ''), one session writes (a long INSERT:
# WAL for crash recovery to replay), another sits in pg_sleep(); the sleeping backend is killed
# with SIGKILL, so the postmaster kills every child and reinitializes (crash recovery); after a
# random 0.05-1.5 s, `pg_ctl stop -m fast`.  A stop not done after BOUND seconds is a hang: the
# script prints the postmaster's children and the log's last lines, then ends it with SIGQUIT
# (`pg_ctl stop -m immediate`).  The last line says how many cycles and hangs:
#   repro: major=18 version=18.6 cycles=20 hangs=1 stuck_children=checkpointer+3 io worker
#
# Exit status: 0 when every cycle ran (hang or not), 2 when the script itself failed.
#
# Environment:
#   REPRO_DIR    /tmp/stop-repro-<major>   cluster directory (deleted and re-created)
#   REPRO_PORT   27440 + major             TCP port on 127.0.0.1
#   REPRO_BINDIR bin directory of the major (15: /usr/lib/postgresql/15/bin, 16-18: pgmajor.sh)
#   REPRO_WAL_MB 16                        WAL the writer produces before the kill (MB)
# As root, the cluster runs as the user "postgres".
set -euo pipefail

MAJOR="${1:-15}"
CYCLES="${2:-20}"
BOUND="${3:-20}"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DIR="${REPRO_DIR:-/tmp/stop-repro-$MAJOR}"
PORT="${REPRO_PORT:-$((27440 + MAJOR))}"
WAL_MB="${REPRO_WAL_MB:-16}"
DATA="$DIR/data"
LOG="$DIR/server.log"

die() { printf 'repro: ERROR: %s\n' "$*" >&2; exit 2; }
trap 'die "line $LINENO: $BASH_COMMAND failed"' ERR

if [[ -n "${REPRO_BINDIR:-}" ]]; then
    BIN="$REPRO_BINDIR"
elif [[ "$MAJOR" = 15 ]]; then
    BIN=/usr/lib/postgresql/15/bin
else
    BIN=$("$HERE/../env/pgmajor.sh" "$MAJOR")
fi
[[ -x "$BIN/postgres" ]] || die "no postgres in $BIN"

if [[ $(id -u) -eq 0 ]]; then
    as_owner() { runuser -u postgres -- "$@"; }
else
    as_owner() { "$@"; }
fi
sql() { "$BIN/psql" -X -q -tA -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -c "$1"; }
pm_pid() { head -n 1 "$DATA/postmaster.pid" 2>/dev/null || true; }
children() { ps -o pid=,args= --ppid "$1" 2>/dev/null || true; }

# a fresh cluster
if [[ -f "$DATA/postmaster.pid" ]]; then
    as_owner "$BIN/pg_ctl" -D "$DATA" -m immediate -w -t 30 stop >/dev/null 2>&1 || true
fi
rm -rf "$DIR"
mkdir -p "$DIR"
[[ $(id -u) -eq 0 ]] && chown postgres "$DIR"
as_owner "$BIN/initdb" -D "$DATA" -U postgres -A trust >"$DIR/initdb.log" 2>&1 \
    || { cat "$DIR/initdb.log" >&2; die "initdb failed"; }
as_owner tee -a "$DATA/postgresql.conf" >/dev/null <<CONF
listen_addresses = '127.0.0.1'
port = $PORT
unix_socket_directories = '$DIR'
shared_preload_libraries = ''
restart_after_crash = on
max_wal_size = 4GB
checkpoint_timeout = 1h
log_line_prefix = '%m [%p] '
CONF
start() {
    as_owner "$BIN/pg_ctl" -D "$DATA" -l "$LOG" -w -t 120 start >/dev/null \
        || { tail -n 20 "$LOG" >&2; die "server did not start"; }
}
start
sql "CREATE UNLOGGED TABLE IF NOT EXISTS dummy (i int); CREATE TABLE w (i int, pad text)"
version=$(sql "SHOW server_version" | awk '{print $1}')
printf 'repro: PostgreSQL %s (%s), %d cycles, stop bound %d s, %s\n' "$version" "$BIN" "$CYCLES" "$BOUND" "$DIR"

hangs=0
stuck=""
for ((c = 1; c <= CYCLES; c++)); do
    [[ -f "$DATA/postmaster.pid" ]] || start
    pm=$(pm_pid)
    sql "TRUNCATE w"
    # the writer: one INSERT that writes WAL until it is killed with the others
    "$BIN/psql" -X -q -h 127.0.0.1 -p "$PORT" -U postgres -d postgres \
        -c "INSERT INTO w SELECT generate_series(1, 100000000), repeat('x', 200)" \
        >/dev/null 2>&1 &
    writer=$!
    "$BIN/psql" -X -q -h 127.0.0.1 -p "$PORT" -U postgres -d postgres \
        -c "SELECT pg_sleep(3600)" >/dev/null 2>&1 &
    sleeper=$!
    lsn0=$(sql "SELECT pg_current_wal_lsn()")
    victim=""
    for ((i = 0; i < 300; i++)); do      # up to 60 s: the sleeper shows, the writer wrote WAL_MB
        victim=$(sql "SELECT pid FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(3600)'
                      AND pg_wal_lsn_diff(pg_current_wal_lsn(), '$lsn0') >= $WAL_MB * 1048576.0
                      LIMIT 1" || true)
        [[ -n "$victim" ]] && break
        sleep 0.2
    done
    [[ -n "$victim" ]] || die "cycle $c: no pg_sleep backend, or not $WAL_MB MB of WAL written, in 60 s"
    delay=$(awk -v r="$RANDOM" 'BEGIN { printf "%.2f", 0.05 + (r % 146) / 100 }')
    kill -9 "$victim"
    sleep "$delay"
    t0=$(date +%s.%N)
    rc=0
    as_owner "$BIN/pg_ctl" -D "$DATA" -m fast -w -t "$BOUND" stop >/dev/null 2>&1 || rc=$?
    t1=$(date +%s.%N)
    if [[ $rc -eq 0 ]]; then
        printf 'cycle %d: kill -9, fast stop after %s s: stopped in %.1f s\n' "$c" "$delay" \
            "$(echo "$t1 - $t0" | bc)"
    else
        hangs=$((hangs + 1))
        kids=$(children "$pm")
        # "checkpointer", or "checkpointer+3 io worker" (18): what the postmaster waits for
        names=$(printf '%s\n' "$kids" | sed -E 's/^ *[0-9]+ postgres: ([a-z ]+).*/\1/; s/ *$//' \
            | sort | uniq -c | awk '{ n = $1; $1 = ""; sub(/^ /, ""); printf "%s%s%s", sep, (n > 1 ? n " " : ""), $0; sep = "+" }')
        stuck="$stuck${stuck:+,}${names:-none}"
        printf 'cycle %d: kill -9, fast stop after %s s: HANG, not stopped after %d s; postmaster %s has:\n%s\n' \
            "$c" "$delay" "$BOUND" "$pm" "$kids"
        printf '  log:\n'
        grep -E 'terminated by signal|reinitializing|shutdown request|shutting down|database system|redo' "$LOG" \
            | tail -n 8 | sed 's/^/    /'
        as_owner "$BIN/pg_ctl" -D "$DATA" -m immediate -w -t 30 stop >/dev/null 2>&1 \
            || kill -9 "$pm" 2>/dev/null || true
    fi
    wait "$writer" "$sleeper" 2>/dev/null || true
    # the stop must have ended the postmaster: a lingering one would fail the next start
    for ((i = 0; i < 300; i++)); do kill -0 "$pm" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pm" 2>/dev/null && die "cycle $c: postmaster $pm still alive after the stop"
done
as_owner "$BIN/pg_ctl" -D "$DATA" -m immediate -w -t 30 stop >/dev/null 2>&1 || true
printf 'repro: major=%s version=%s cycles=%d hangs=%d stuck_children=%s\n' \
    "$MAJOR" "$version" "$CYCLES" "$hangs" "${stuck:-none}"
