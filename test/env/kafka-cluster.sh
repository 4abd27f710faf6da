#!/usr/bin/env bash
# A local 3-broker Apache Kafka cluster (KRaft, each node broker and controller) on loopback,
# replicated as users run it: replication factor 3, min.insync.replicas 2.  Each node is one
# test/env/kafka.sh broker with its own state directory and ports.
#
# Usage: test/env/kafka-cluster.sh SUBCOMMAND [N]
#   start          format (once) and start the three nodes together, wait until each answers
#   stop           stop every node (controlled shutdown)
#   reset          kill every node and delete the state (nothing of it is kept, so no
#                  controlled shutdown: that took 30 s of CI time)
#   status         exit 0 if all three answer
#   bootstrap      print the three client addresses, comma-separated
#   pid N          pid of node N (1-3)
#   kill N         kill -9 node N
#   pause N        SIGSTOP node N (it keeps its connections but answers nothing)
#   resume N       SIGCONT node N
#   start-node N   start node N again (after kill), wait until it answers
#
# Environment (defaults):
#   OUTBOX_KAFKA3_DIR    /tmp/outbox-kafka3   state: node1/ node2/ node3/ (each a kafka.sh state dir)
#   OUTBOX_KAFKA3_PORT   19292                client ports PORT, PORT+1, PORT+2;
#                                             controller ports PORT+10, PORT+11, PORT+12
#   OUTBOX_KAFKA3_HEAP   256m                 -Xms/-Xmx of each node (three JVMs on a small machine)
#   OUTBOX_CACHE                              as for kafka.sh (jar cache)
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
KAFKA_SH="$SCRIPT_DIR/kafka.sh"
DIR="${OUTBOX_KAFKA3_DIR:-/tmp/outbox-kafka3}"
BASE="${OUTBOX_KAFKA3_PORT:-19292}"
HEAP="${OUTBOX_KAFKA3_HEAP:-256m}"
HOST=127.0.0.1
NODES=(1 2 3)

log() { printf 'kafka-cluster.sh: %s\n' "$*" >&2; }
die() { printf 'kafka-cluster.sh: ERROR: %s\n' "$*" >&2; exit 1; }

[[ "$BASE" =~ ^[0-9]+$ ]] && (( BASE > 0 && BASE + 12 <= 65535 )) || die "invalid OUTBOX_KAFKA3_PORT '$BASE'"

voters() {
    local n out=""
    for n in "${NODES[@]}"; do out+="${out:+,}$n@$HOST:$((BASE + 9 + n))"; done
    echo "$out"
}

bootstrap() {
    local n out=""
    for n in "${NODES[@]}"; do out+="${out:+,}$HOST:$((BASE + n - 1))"; done
    echo "$out"
}

# node N SUBCOMMAND: kafka.sh for node N
node() {
    local n=$1
    shift
    OUTBOX_KAFKA_DIR="$DIR/node$n" OUTBOX_KAFKA_PORT=$((BASE + n - 1)) \
        OUTBOX_KAFKA_CONTROLLER_PORT=$((BASE + 9 + n)) OUTBOX_KAFKA_NODE_ID=$n \
        OUTBOX_KAFKA_VOTERS="$(voters)" OUTBOX_KAFKA_REPLICATION=3 OUTBOX_KAFKA_MIN_ISR=2 \
        OUTBOX_KAFKA_PARTITIONS=6 OUTBOX_KAFKA_HEAP="$HEAP" OUTBOX_KAFKA_SASL_PORT= \
        OUTBOX_KAFKA_START_TIMEOUT="${OUTBOX_KAFKA_START_TIMEOUT:-120}" \
        bash "$KAFKA_SH" "$@"
}

check_node() {
    [[ "${1:-}" =~ ^[123]$ ]] || die "node must be 1, 2 or 3"
}

node_pid() {
    local f="$DIR/node$1/broker.pid" pid
    [[ -f "$f" ]] || return 1
    pid=$(cat "$f")
    kill -0 "$pid" 2>/dev/null || return 1
    echo "$pid"
}

cmd_start() {
    local n cid pids=() failed=0
    bash "$KAFKA_SH" fetch
    mkdir -p "$DIR"
    # one cluster id for the three nodes' storage (kafka.sh formats with the id in cluster.id)
    cid=$(cat "$DIR/cluster.id" 2>/dev/null || true)
    if [[ -z "$cid" ]]; then
        cid=$(bash "$KAFKA_SH" cli kafka.tools.StorageTool random-uuid) || die "StorageTool random-uuid failed"
        echo "$cid" >"$DIR/cluster.id"
    fi
    for n in "${NODES[@]}"; do
        mkdir -p "$DIR/node$n"
        echo "$cid" >"$DIR/node$n/cluster.id"
    done
    # together: a node answers only once a quorum of controllers (2 of 3) is up
    for n in "${NODES[@]}"; do
        node "$n" start &
        pids+=($!)
    done
    for n in "${!pids[@]}"; do
        wait "${pids[$n]}" || failed=1
    done
    (( failed == 0 )) || { cmd_stop; die "a node did not start (logs: $DIR/node*/logs/broker.log)"; }
    log "3 brokers ready: $(bootstrap)"
}

cmd_stop() {
    local n pids=()
    for n in "${NODES[@]}"; do
        [[ -d "$DIR/node$n" ]] || continue
        # a paused node would never finish its controlled shutdown
        if pid=$(node_pid "$n"); then kill -CONT "$pid" 2>/dev/null || true; fi
        node "$n" stop &
        pids+=($!)
    done
    for n in "${pids[@]}"; do wait "$n" || true; done
}

cmd_kill_all() {
    local n pid
    for n in "${NODES[@]}"; do
        if pid=$(node_pid "$n"); then
            kill -KILL "$pid" 2>/dev/null || true
            # bounded: a killed process nobody reaps stays a zombie that kill -0 still finds
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        fi
    done
}

cmd_status() {
    local n ok=0
    for n in "${NODES[@]}"; do
        node "$n" status >/dev/null 2>&1 && ok=$((ok + 1))
    done
    echo "$ok of 3 brokers answer ($(bootstrap))"
    (( ok == 3 ))
}

main() {
    local cmd="${1:-}"
    [[ $# -gt 0 ]] && shift
    case "$cmd" in
        start)      cmd_start ;;
        stop)       cmd_stop ;;
        reset)      cmd_kill_all; rm -rf "$DIR"; log "deleted $DIR" ;;
        status)     cmd_status ;;
        bootstrap)  bootstrap ;;
        pid)        check_node "${1:-}"; node_pid "$1" || die "node $1 is not running" ;;
        kill)       check_node "${1:-}"; pid=$(node_pid "$1") || die "node $1 is not running"
                    kill -KILL "$pid"; log "node $1 (pid $pid) killed" ;;
        pause)      check_node "${1:-}"; pid=$(node_pid "$1") || die "node $1 is not running"
                    kill -STOP "$pid"; log "node $1 (pid $pid) paused" ;;
        resume)     check_node "${1:-}"; pid=$(node_pid "$1") || die "node $1 is not running"
                    kill -CONT "$pid"; log "node $1 (pid $pid) resumed" ;;
        start-node) check_node "${1:-}"; node "$1" start ;;
        *)          sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' >&2; exit 2 ;;
    esac
}

main "$@"
