#!/usr/bin/env bash
# Local single-node Apache Kafka 4.x (KRaft, combined broker+controller) for outbox tests.
# Jars come from Maven Central (test/env/kafka-pom.xml); no tarball, no Docker, no root needed.
#
# Usage: test/env/kafka.sh SUBCOMMAND [ARGS]
#   fetch                      download the jars into $OUTBOX_CACHE/kafka/libs (once)
#   start                      fetch if needed, format storage if new, start, wait until ready
#   stop                       controlled shutdown (SIGTERM, up to 30 s, then SIGKILL)
#   restart                    stop + start (data kept)
#   reset                      stop and delete the state dir
#   status                     exit 0 if running and answering
#   topic-create NAME [PARTS]  create a topic (replication 1), idempotent
#   bootstrap                  print 127.0.0.1:PORT
#   cli CLASS [ARGS...]        run a Kafka CLI class with the Kafka classpath
#   logs [N]                   print the last N (default 50) lines of the broker log
#
# Environment (defaults):
#   OUTBOX_CACHE                  <repo>/.cache      jar cache (git-ignored)
#   OUTBOX_KAFKA_DIR              /tmp/outbox-kafka  state: data/, logs/, broker.pid, configs
#   OUTBOX_KAFKA_PORT             19092              PLAINTEXT listener (127.0.0.1 only)
#   OUTBOX_KAFKA_CONTROLLER_PORT  19093              KRaft controller listener (127.0.0.1 only)
#   OUTBOX_KAFKA_SASL_PORT        (empty: off)       if set: an extra SASL_PLAINTEXT listener on 127.0.0.1
#                                                    there, mechanism PLAIN, users admin/admin-secret,
#                                                    outbox/outbox-secret and semi/Semi7;Colon7\Back7 (a ';'
#                                                    and a backslash in it; inter-broker and controller
#                                                    traffic stay PLAINTEXT); applies when the broker starts
#   OUTBOX_KAFKA_AUTOCREATE       true               auto.create.topics.enable
#   OUTBOX_KAFKA_PARTITIONS       4                  num.partitions, and topic-create's default
#   OUTBOX_KAFKA_HEAP             512m               -Xms/-Xmx of the broker
#   OUTBOX_KAFKA_FRESH            0                  1: wipe the state dir before `start`
#   OUTBOX_KAFKA_START_TIMEOUT    150                seconds to wait for the broker to answer (a JVM start
#                                                    on a loaded 2-core machine took over 60 s in CI runs
#                                                    of three stacks; tests allow 180 s for a restart)
#   OUTBOX_KAFKA_LOG_LEVEL        INFO               root log level of the broker
#   OUTBOX_KAFKA_NODE_ID          1                  node.id (a node of test/env/kafka-cluster.sh)
#   OUTBOX_KAFKA_VOTERS           ID@127.0.0.1:CPORT controller.quorum.voters
#   OUTBOX_KAFKA_REPLICATION      1                  default and internal topics' replication factor
#   OUTBOX_KAFKA_MIN_ISR          1                  min.insync.replicas (and the internal topics')
#   OUTBOX_KAFKA_EXTRA_PROPERTIES (empty)            more broker settings, key=value;key=value (experiments,
#                                                    e.g. transaction.partition.verification.enable=false)
#   JAVA_HOME / JAVA                                 java 17+ (default: /usr/lib/jvm/java-17-openjdk-amd64)
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$SCRIPT_DIR/../.." && pwd)
POM="$SCRIPT_DIR/kafka-pom.xml"

CACHE_DIR="${OUTBOX_CACHE:-$REPO_DIR/.cache}/kafka"
LIBS="$CACHE_DIR/libs"

STATE_DIR="${OUTBOX_KAFKA_DIR:-/tmp/outbox-kafka}"
DATA_DIR="$STATE_DIR/data"
LOG_DIR="$STATE_DIR/logs"
PID_FILE="$STATE_DIR/broker.pid"
BROKER_LOG="$LOG_DIR/broker.log"
SERVER_PROPS="$STATE_DIR/server.properties"
LOG4J_CONF="$STATE_DIR/log4j2.properties"

HOST=127.0.0.1
PORT="${OUTBOX_KAFKA_PORT:-19092}"
CPORT="${OUTBOX_KAFKA_CONTROLLER_PORT:-19093}"
SPORT="${OUTBOX_KAFKA_SASL_PORT:-}"
AUTOCREATE="${OUTBOX_KAFKA_AUTOCREATE:-true}"
PARTITIONS="${OUTBOX_KAFKA_PARTITIONS:-4}"
HEAP="${OUTBOX_KAFKA_HEAP:-512m}"
# one node of a cluster (test/env/kafka-cluster.sh sets these; alone, the broker is node 1)
NODE_ID="${OUTBOX_KAFKA_NODE_ID:-1}"
VOTERS="${OUTBOX_KAFKA_VOTERS:-}"
REPLICATION="${OUTBOX_KAFKA_REPLICATION:-1}"
MIN_ISR="${OUTBOX_KAFKA_MIN_ISR:-1}"
START_TIMEOUT="${OUTBOX_KAFKA_START_TIMEOUT:-150}"
LOG_LEVEL="${OUTBOX_KAFKA_LOG_LEVEL:-INFO}"
STOP_TIMEOUT=30

# shellcheck source=maven.sh
source "$SCRIPT_DIR/maven.sh"
pick_java

log() { printf 'kafka.sh: %s\n' "$*" >&2; }
die() { printf 'kafka.sh: ERROR: %s\n' "$*" >&2; exit 1; }

need() { command -v "$1" >/dev/null 2>&1 || die "'$1' not found${2:+ ($2)}"; }

check_port() {
    if ! [[ "$1" =~ ^[0-9]+$ ]] || (( $1 < 1 || $1 > 65535 )); then die "invalid port '$1'"; fi
}

# --------------------------------------------------------------------------- fetch

cmd_fetch() {
    maven_libs_complete "$POM" "$CACHE_DIR" && return 0
    local t0=$SECONDS
    maven_fetch "$POM" "$CACHE_DIR" 'kafka_2.13-*.jar' 'kafka-tools-[0-9]*.jar' 'log4j-slf4j-impl-*.jar'
    log "fetched $(ls "$LIBS"/*.jar | wc -l) jars ($(du -sh "$LIBS" | cut -f1)) in $((SECONDS - t0)) s: $(kafka_version)"
}

kafka_version() {
    local j
    j=$(ls "$LIBS"/kafka_2.13-*.jar 2>/dev/null | head -n1) || true
    [[ -n "$j" ]] || { echo unknown; return; }
    j=${j##*/kafka_2.13-}
    echo "kafka ${j%.jar}"
}

# ------------------------------------------------------------------ state / process

# PID of our broker if the pid file names a live kafka.Kafka process of this state dir.
broker_pid() {
    [[ -f "$PID_FILE" ]] || return 1
    local pid
    pid=$(cat "$PID_FILE" 2>/dev/null) || return 1
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    kill -0 "$pid" 2>/dev/null || return 1
    local cmdline
    cmdline=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
    [[ "$cmdline" == *kafka.Kafka*"$SERVER_PROPS"* ]] || return 1
    echo "$pid"
}

# Broker answers a metadata request and lists itself.
broker_answers() {
    local md
    md=$(kcat -b "$HOST:$PORT" -L -m 2 2>/dev/null) || return 1
    [[ "$md" == *"broker $NODE_ID at $HOST:$PORT"* ]]
}

port_open() { (exec 3<>"/dev/tcp/$HOST/$1") 2>/dev/null; }

ensure_state_dir() {
    mkdir -p "$STATE_DIR" 2>/dev/null || die "cannot create $STATE_DIR (set OUTBOX_KAFKA_DIR)"
    [[ -w "$STATE_DIR" && -O "$STATE_DIR" ]] \
        || die "$STATE_DIR belongs to $(stat -c %U "$STATE_DIR"), not $(id -un): run as that user, or set OUTBOX_KAFKA_DIR"
    chmod 700 "$STATE_DIR"
    mkdir -p "$DATA_DIR" "$LOG_DIR"
}

# another kafka.sh (a start, a stop) holds the state for seconds at most: never wait forever
state_lock() {
    exec 9>"$STATE_DIR/.lock"
    flock -w "${OUTBOX_KAFKA_LOCK_TIMEOUT:-300}" 9 \
        || die "another kafka.sh has held $STATE_DIR/.lock for ${OUTBOX_KAFKA_LOCK_TIMEOUT:-300} s"
}

write_configs() {
    local listeners="PLAINTEXT://$HOST:$PORT,CONTROLLER://$HOST:$CPORT"
    local advertised="PLAINTEXT://$HOST:$PORT"
    local protocols="CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT"
    if [[ -n "$SPORT" ]]; then
        listeners+=",SASL_PLAINTEXT://$HOST:$SPORT"
        advertised+=",SASL_PLAINTEXT://$HOST:$SPORT"
        protocols+=",SASL_PLAINTEXT:SASL_PLAINTEXT"
    fi
    cat >"$SERVER_PROPS" <<EOF
# generated by test/env/kafka.sh; rewritten on every start
process.roles=broker,controller
node.id=$NODE_ID
controller.quorum.voters=${VOTERS:-$NODE_ID@$HOST:$CPORT}
listeners=$listeners
advertised.listeners=$advertised
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=$protocols
log.dirs=$DATA_DIR
num.partitions=$PARTITIONS
default.replication.factor=$REPLICATION
auto.create.topics.enable=$AUTOCREATE
delete.topic.enable=true
offsets.topic.replication.factor=$REPLICATION
offsets.topic.num.partitions=1
transaction.state.log.replication.factor=$REPLICATION
transaction.state.log.min.isr=$MIN_ISR
transaction.state.log.num.partitions=1
share.coordinator.state.topic.replication.factor=$REPLICATION
share.coordinator.state.topic.min.isr=$MIN_ISR
min.insync.replicas=$MIN_ISR
group.initial.rebalance.delay.ms=0
# after a kill -9 the restarted broker cannot register until the old session expires
# (default 9 s + heartbeat 2 s): shorter, so crash/restart tests come back in ~5 s
broker.heartbeat.interval.ms=1000
broker.session.timeout.ms=4000
EOF
    if [[ -n "${OUTBOX_KAFKA_EXTRA_PROPERTIES:-}" ]]; then
        printf '# OUTBOX_KAFKA_EXTRA_PROPERTIES\n%s\n' "${OUTBOX_KAFKA_EXTRA_PROPERTIES//;/$'\n'}" >>"$SERVER_PROPS"
    fi
    if [[ -n "$SPORT" ]]; then
        cat >>"$SERVER_PROPS" <<'EOF'
# OUTBOX_KAFKA_SASL_PORT: SASL_PLAINTEXT listener with mechanism PLAIN (test credentials)
listener.name.sasl_plaintext.sasl.enabled.mechanisms=PLAIN
# user semi's password is Semi7;Colon7\Back7 (a ';' and a backslash: properties and JAAS each halve the backslashes)
listener.name.sasl_plaintext.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required username="admin" password="admin-secret" user_admin="admin-secret" user_outbox="outbox-secret" user_semi="Semi7;Colon7\\\\Back7";
EOF
    fi
    cat >"$LOG4J_CONF" <<EOF
status = warn
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = $LOG_LEVEL
rootLogger.appenderRef.out.ref = OUT
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.cleaner.name = kafka.log.LogCleaner
logger.cleaner.level = WARN
EOF
}

# JVM options for short-lived CLI tools: quiet log4j config on stderr, small heap, fast start.
tools_log4j() {
    local f="$CACHE_DIR/tools-log4j2.properties"
    if [[ ! -f "$f" ]]; then
        cat >"$f.$$" <<'EOF'
status = warn
appender.err.type = Console
appender.err.name = ERR
appender.err.target = SYSTEM_ERR
appender.err.layout.type = PatternLayout
appender.err.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.err.ref = ERR
EOF
        mv "$f.$$" "$f"
    fi
    echo "$f"
}

run_tool() {
    cmd_fetch
    local cls="$1"; shift
    "$JAVA" -Xmx256m -XX:+UseSerialGC -XX:TieredStopAtLevel=1 -Djava.awt.headless=true \
        -Dlog4j2.configurationFile="$(tools_log4j)" -cp "$LIBS/*" "$cls" "$@"
}

# ------------------------------------------------------------------ subcommands

cmd_status() {
    local pid
    if pid=$(broker_pid) && broker_answers; then
        echo "running: pid $pid, bootstrap $HOST:$PORT, state $STATE_DIR"
        if grep -q '^listeners=.*SASL_PLAINTEXT://' "$SERVER_PROPS" 2>/dev/null; then
            echo "SASL_PLAINTEXT listener: $(sed -n 's|^listeners=.*SASL_PLAINTEXT://\([^,]*\).*|\1|p' "$SERVER_PROPS")"
        fi
        return 0
    fi
    if pid=$(broker_pid); then
        echo "starting or unhealthy: pid $pid does not answer on $HOST:$PORT"
    elif [[ -e "$STATE_DIR" && ! -O "$STATE_DIR" ]]; then
        echo "not ours: $STATE_DIR belongs to $(stat -c %U "$STATE_DIR"), not $(id -un) (set OUTBOX_KAFKA_DIR)"
    elif port_open "$PORT"; then
        echo "not running from $STATE_DIR, but something else listens on $HOST:$PORT"
    else
        echo "not running"
    fi
    return 1
}

cmd_start() {
    check_port "$PORT"; check_port "$CPORT"
    [[ "$PORT" != "$CPORT" ]] || die "OUTBOX_KAFKA_PORT and OUTBOX_KAFKA_CONTROLLER_PORT must differ"
    if [[ -n "$SPORT" ]]; then
        check_port "$SPORT"
        [[ "$SPORT" != "$PORT" && "$SPORT" != "$CPORT" ]] \
            || die "OUTBOX_KAFKA_SASL_PORT must differ from OUTBOX_KAFKA_PORT and OUTBOX_KAFKA_CONTROLLER_PORT"
    fi
    [[ "$AUTOCREATE" == true || "$AUTOCREATE" == false ]] || die "OUTBOX_KAFKA_AUTOCREATE must be true or false"
    [[ "$PARTITIONS" =~ ^[1-9][0-9]*$ ]] || die "OUTBOX_KAFKA_PARTITIONS must be a positive integer"
    need kcat "apt-get install -y kcat"
    need flock
    "$JAVA" -version >/dev/null 2>&1 || die "java not runnable: $JAVA (need 17+)"

    if [[ "${OUTBOX_KAFKA_FRESH:-0}" == 1 ]]; then
        cmd_reset
    fi
    ensure_state_dir
    state_lock

    local pid
    if pid=$(broker_pid); then
        if wait_ready "$pid" "$START_TIMEOUT"; then
            log "already running (pid $pid, $HOST:$PORT)"
            if [[ -n "$SPORT" ]] && ! port_open "$SPORT"; then
                log "note: no SASL listener on $HOST:$SPORT; OUTBOX_KAFKA_SASL_PORT applies at the next start (use restart)"
            fi
            return 0
        fi
        fail_start "pid $pid is alive but does not answer on $HOST:$PORT"
    fi
    rm -f "$PID_FILE"
    local p
    for p in "$PORT" "$CPORT" ${SPORT:+"$SPORT"}; do
        ! port_open "$p" || die "port $HOST:$p is already in use by another process (set OUTBOX_KAFKA_PORT / OUTBOX_KAFKA_CONTROLLER_PORT / OUTBOX_KAFKA_SASL_PORT)"
    done

    cmd_fetch
    write_configs
    local jlog=(-Dlog4j2.configurationFile="$LOG4J_CONF" -Dkafka.logs.dir="$LOG_DIR")

    if [[ ! -f "$DATA_DIR/meta.properties" ]]; then
        local cid
        cid=$(cat "$STATE_DIR/cluster.id" 2>/dev/null || true)
        if [[ -z "$cid" ]]; then
            cid=$(run_tool kafka.tools.StorageTool random-uuid) || die "StorageTool random-uuid failed"
            echo "$cid" >"$STATE_DIR/cluster.id"
        fi
        log "formatting KRaft storage in $DATA_DIR (cluster id $cid)"
        run_tool kafka.tools.StorageTool format -t "$cid" -c "$SERVER_PROPS" --ignore-formatted \
            >>"$LOG_DIR/format.log" 2>&1 \
            || { tail -n 30 "$LOG_DIR/format.log" >&2; die "StorageTool format failed"; }
    fi

    log "starting $(kafka_version) on $HOST:$PORT (controller $CPORT${SPORT:+, SASL_PLAINTEXT $SPORT}), state $STATE_DIR"
    printf '\n===== start %s =====\n' "$(date -Is)" >>"$BROKER_LOG"
    # setsid: own session, so the broker survives the calling shell and its job-control signals.
    # The pid is written by the shell that then execs java, so it is java's pid.
    # 9>&- : do not leak the state lock into the broker.
    setsid bash -c 'echo $$ >"$0"; exec "$@"' "$PID_FILE" \
        "$JAVA" -Xms"$HEAP" -Xmx"$HEAP" -server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
        -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent -XX:MaxInlineLevel=15 \
        -Djava.awt.headless=true "${jlog[@]}" -cp "$LIBS/*" kafka.Kafka "$SERVER_PROPS" \
        </dev/null >>"$BROKER_LOG" 2>&1 9>&- &
    local t0=$SECONDS
    local i
    for i in $(seq 1 50); do [[ -s "$PID_FILE" ]] && break; sleep 0.1; done
    pid=$(cat "$PID_FILE" 2>/dev/null || true)
    [[ -n "$pid" ]] || fail_start "broker process did not start"
    if ! wait_ready "$pid" "$START_TIMEOUT"; then
        if kill -0 "$pid" 2>/dev/null; then
            fail_start "broker (pid $pid) did not answer on $HOST:$PORT within ${START_TIMEOUT}s"
        fi
        fail_start "broker (pid $pid) exited during startup"
    fi
    if [[ -n "$SPORT" ]]; then
        local deadline=$((SECONDS + 30))
        until port_open "$SPORT"; do
            (( SECONDS < deadline )) || fail_start "broker (pid $pid) does not listen on the SASL port $HOST:$SPORT"
            sleep 0.2
        done
    fi
    log "ready in $((SECONDS - t0)) s (pid $pid, bootstrap $HOST:$PORT${SPORT:+, SASL_PLAINTEXT $HOST:$SPORT})"
}

# wait_ready PID TIMEOUT: poll metadata until it answers; fail early if the process dies.
wait_ready() {
    local pid="$1" deadline=$((SECONDS + $2))
    while (( SECONDS < deadline )); do
        kill -0 "$pid" 2>/dev/null || return 1
        broker_answers && return 0
        sleep 0.5
    done
    return 1
}

fail_start() {
    log "last 40 lines of $BROKER_LOG:"
    tail -n 40 "$BROKER_LOG" >&2 || true
    local pid
    if pid=$(broker_pid); then
        log "stopping the half-started broker (pid $pid)"
        stop_pid "$pid"
    fi
    die "$1"
}

stop_pid() {
    local pid="$1" i
    kill -TERM "$pid" 2>/dev/null || return 0
    for ((i = 0; i < STOP_TIMEOUT * 5; i++)); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.2
    done
    log "broker (pid $pid) still alive after ${STOP_TIMEOUT}s: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
}

cmd_stop() {
    [[ -d "$STATE_DIR" ]] || { log "not running"; return 0; }
    [[ -O "$STATE_DIR" ]] || die "$STATE_DIR belongs to $(stat -c %U "$STATE_DIR"), not $(id -un)"
    state_lock
    local pid
    if pid=$(broker_pid); then
        local t0=$SECONDS
        stop_pid "$pid"
        log "stopped (pid $pid) in $((SECONDS - t0)) s"
    else
        log "not running"
    fi
    rm -f "$PID_FILE"
}

cmd_reset() {
    cmd_stop
    if [[ -d "$STATE_DIR" ]]; then
        rm -rf "$STATE_DIR"
        log "deleted $STATE_DIR"
    fi
}

cmd_topic_create() {
    [[ $# -ge 1 ]] || die "usage: topic-create NAME [PARTITIONS]"
    local name="$1" parts="${2:-$PARTITIONS}"
    run_tool org.apache.kafka.tools.TopicCommand --bootstrap-server "$HOST:$PORT" \
        --create --if-not-exists --topic "$name" --partitions "$parts" --replication-factor 1
}

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }

main() {
    local cmd="${1:-}"
    [[ $# -gt 0 ]] && shift
    case "$cmd" in
        fetch)        cmd_fetch; log "jars ready in $LIBS ($(kafka_version))" ;;
        start)        cmd_start ;;
        stop)         cmd_stop ;;
        restart)      cmd_stop; cmd_start ;;
        reset)        cmd_reset ;;
        status)       cmd_status ;;
        topic-create) cmd_topic_create "$@" ;;
        bootstrap)    echo "$HOST:$PORT" ;;
        cli)          [[ $# -ge 1 ]] || die "usage: cli CLASS [ARGS...]"; run_tool "$@" ;;
        logs)         tail -n "${1:-50}" "$BROKER_LOG" ;;
        -h|--help|help) usage ;;
        *)            usage >&2; exit 2 ;;
    esac
}

main "$@"
