#!/usr/bin/env bash
# A throw-away PostgreSQL cluster for outbox's demo and tests, in its own directory, on 127.0.0.1.
#
# Usage: test/env/pg.sh SUBCOMMAND
#   start      initdb if needed, then start (shared_preload_libraries = 'outbox'); waits until ready
#   stop       pg_ctl stop -m fast, then -m immediate if not done in OUTBOX_PG_STOP_TIMEOUT s
#              (idempotent; never waits forever: see doc/operations.md#a-stop-that-never-ends)
#   restart    stop, then start
#   reset      stop and delete the cluster directory
#   status     exit 0 if running
#   env        print PGHOST/PGPORT/PGUSER/PGDATABASE lines to eval
#   log [N]    last N lines (default 50) of the server log
#   ctl ARGS   run pg_ctl ARGS on the cluster (as the cluster's owner)
#   run CMD    run a command as the cluster's owner (e.g. pg_ctl, pg_basebackup)
#
# Environment (defaults):
#   OUTBOX_PG_DIR        /tmp/outbox-pg     cluster directory (data/, log, sockets)
#   OUTBOX_PG_PORT       54329              TCP port on 127.0.0.1
#   OUTBOX_PG_DATABASE   outbox             database the relay serves (outbox.database); created
#   OUTBOX_KAFKA         127.0.0.1:19092    outbox.bootstrap_servers ('' leaves the relay unconfigured)
#   OUTBOX_PG_FRESH      0                  1: wipe the cluster before start
#   OUTBOX_PG_CONF       (none)             lines appended to postgresql.conf of a new cluster
#   OUTBOX_PG_STOP_TIMEOUT 60               seconds a fast shutdown may take before stop ends the
#                                           server with an immediate shutdown
#
# The PostgreSQL is the one whose pg_config comes first on PATH (test/env/pgmajor.sh prints the
# bin directory of each major).  A cluster of another major in the directory is re-created.
#
# initdb and postgres refuse to run as root; as root the cluster runs as the user "postgres"
# (created by Debian's postgresql package), otherwise as whoever runs this script.
set -euo pipefail

DIR="${OUTBOX_PG_DIR:-/tmp/outbox-pg}"
DATA="$DIR/data"
LOG="$DIR/server.log"
PORT="${OUTBOX_PG_PORT:-54329}"
DB="${OUTBOX_PG_DATABASE:-outbox}"
KAFKA="${OUTBOX_KAFKA-127.0.0.1:19092}"
STOP_TIMEOUT="${OUTBOX_PG_STOP_TIMEOUT:-60}"
BINDIR=$(pg_config --bindir)

die() { printf 'pg.sh: ERROR: %s\n' "$*" >&2; exit 1; }
log() { printf 'pg.sh: %s\n' "$*" >&2; }

if [[ $(id -u) -eq 0 ]]; then
    OWNER=postgres
    id -u "$OWNER" >/dev/null 2>&1 || die "user 'postgres' does not exist (install postgresql-15)"
    as_owner() { runuser -u "$OWNER" -- "$@"; }
else
    OWNER=$(id -un)
    as_owner() { "$@"; }
fi

psql_admin() { "$BINDIR/psql" -X -q -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -v ON_ERROR_STOP=1 "$@"; }

# running: the postmaster of the lock file lives and answers (accepting connections, or starting up
# or recovering: pg_isready exit 0 or 1).  A postmaster killed a moment ago (kill -9) can still
# look alive to pg_ctl status while nothing answers: that is not running.
running() {
    [[ -f "$DATA/postmaster.pid" ]] && as_owner "$BINDIR/pg_ctl" -D "$DATA" status >/dev/null 2>&1 || return 1
    local rc=0
    "$BINDIR/pg_isready" -h 127.0.0.1 -p "$PORT" -t 10 >/dev/null 2>&1 || rc=$?
    [[ $rc -le 1 ]]
}

# start_server: pg_ctl start, again for up to 60 s while it fails: after a kill -9 of the postmaster
# its backends exit within seconds, and until they have, the old shared memory is in use and a new
# postmaster refuses to start ("pre-existing shared memory block is still in use")
start_server() {
    local tries=0
    until as_owner "$BINDIR/pg_ctl" -D "$DATA" -l "$LOG" -w -t 60 start >/dev/null 2>&1; do
        tries=$((tries + 1))
        if [[ $tries -ge 60 ]]; then
            tail -n 30 "$LOG" >&2
            die "server did not start"
        fi
        sleep 1
    done
}

create_database() {
    if ! psql_admin -tAc "SELECT 1 FROM pg_database WHERE datname = '$DB'" | grep -q 1; then
        psql_admin -c "CREATE DATABASE \"$DB\"" >/dev/null
    fi
}

init_cluster() {
    mkdir -p "$DIR"
    chmod 755 "$DIR"
    [[ $(id -u) -eq 0 ]] && chown "$OWNER" "$DIR"
    [[ -O "$DIR" || $(id -u) -eq 0 ]] || die "$DIR belongs to another user; set OUTBOX_PG_DIR"
    as_owner "$BINDIR/initdb" -D "$DATA" -U postgres -A trust -E UTF8 --locale=C.UTF-8 >"$DIR/initdb.log" 2>&1 \
        || { cat "$DIR/initdb.log" >&2; die "initdb failed"; }
    as_owner tee -a "$DATA/postgresql.conf" >/dev/null <<EOF

# --- test cluster (test/env/pg.sh) ---
listen_addresses = '127.0.0.1'
port = $PORT
unix_socket_directories = '$DIR'
max_connections = 100
# the launcher, relays, their VACUUM worker, an inbox launcher and an inbox worker per subscription
max_worker_processes = 24
max_wal_senders = 10
max_prepared_transactions = 10
wal_level = replica
fsync = on
log_line_prefix = '%m [%p] %b '
log_min_messages = info
EOF
    # create the relay's database before the relay exists, so that it connects at its first start
    touch "$LOG"
    [[ $(id -u) -eq 0 ]] && chown "$OWNER" "$LOG"
    as_owner "$BINDIR/pg_ctl" -D "$DATA" -l "$LOG" -w -t 60 start >/dev/null \
        || { tail -n 30 "$LOG" >&2; die "server did not start"; }
    create_database
    as_owner "$BINDIR/pg_ctl" -D "$DATA" -m fast -w -t 60 stop >/dev/null
    as_owner tee -a "$DATA/postgresql.conf" >/dev/null <<EOF
shared_preload_libraries = 'outbox'
outbox.database = '$DB'
outbox.bootstrap_servers = '$KAFKA'
outbox.poll_interval = 1000
EOF
    # extra settings for every test cluster, e.g. OUTBOX_PG_CONF="outbox.relay_mode = snapshot"
    if [[ -n "${OUTBOX_PG_CONF:-}" ]]; then
        printf '%s\n' "$OUTBOX_PG_CONF" | as_owner tee -a "$DATA/postgresql.conf" >/dev/null
    fi
}

start() {
    [[ "${OUTBOX_PG_FRESH:-0}" = 1 ]] && reset
    local major
    major=$("$BINDIR/pg_config" --version | sed -E 's/[^0-9]*([0-9]+).*/\1/')
    if [[ -f "$DATA/PG_VERSION" && "$(cat "$DATA/PG_VERSION")" != "$major" ]]; then
        # a throw-away cluster of another major (OUTBOX_PG_MAJOR changed): start anew
        log "the cluster in $DIR is PostgreSQL $(cat "$DATA/PG_VERSION"), this is $major: re-creating it"
        reset
    fi
    if running; then log "already running on port $PORT"; return 0; fi
    [[ -f "$DATA/PG_VERSION" ]] || init_cluster
    touch "$LOG" 2>/dev/null || true
    [[ $(id -u) -eq 0 ]] && chown "$OWNER" "$LOG"
    start_server
    create_database
    log "running on 127.0.0.1:$PORT (data $DATA, log $LOG)"
}

# stop: a fast shutdown, bounded.  PostgreSQL 15-18 never ends a fast shutdown asked for right
# after a backend crash, before the restart's redo began (test/repro/): past STOP_TIMEOUT the
# postmaster's children are printed and an immediate shutdown (SIGQUIT) ends it, SIGKILL if even
# that is not done in 30 s.  The next start then runs crash recovery.
stop() {
    [[ -f "$DATA/postmaster.pid" ]] || return 0
    as_owner "$BINDIR/pg_ctl" -D "$DATA" -m fast -w -t "$STOP_TIMEOUT" stop >/dev/null 2>&1 && return 0
    local pid
    pid=$(head -n 1 "$DATA/postmaster.pid" 2>/dev/null) || return 0
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 0
    log "fast shutdown not done after ${STOP_TIMEOUT}s; postmaster $pid still has:"
    ps -o pid=,args= --ppid "$pid" >&2 || true
    log "immediate shutdown (only a checkpointer left after a backend crash: PostgreSQL's own hang, doc/operations.md)"
    as_owner "$BINDIR/pg_ctl" -D "$DATA" -m immediate -w -t 30 stop >/dev/null 2>&1 && return 0
    kill -0 "$pid" 2>/dev/null || return 0
    log "immediate shutdown not done after 30s: SIGKILL to postmaster $pid and its children"
    # the children too: one left attached to the shared memory would keep the next start out
    local kids
    kids=$(ps -o pid= --ppid "$pid" 2>/dev/null || true)
    kill -KILL "$pid" $kids 2>/dev/null || true
}

reset() {
    stop
    rm -rf "$DIR"
}

cmd="${1:-}"; shift || true
case "$cmd" in
    start) start ;;
    stop) stop ;;
    restart) stop; start ;;
    reset) reset ;;
    status) running ;;
    env) printf 'export PGHOST=127.0.0.1 PGPORT=%s PGUSER=postgres PGDATABASE=%s\n' "$PORT" "$DB" ;;
    log) tail -n "${1:-50}" "$LOG" ;;
    ctl) as_owner "$BINDIR/pg_ctl" -D "$DATA" "$@" ;;
    run) as_owner "$@" ;;
    *) sed -n '2,30p' "$0"; exit 2 ;;
esac
