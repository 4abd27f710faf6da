#!/usr/bin/env bash
# test/java/clients.sh: the Java Kafka clients the integration tests check messages with.
#
#   clients.sh fetch                     download the jars into $OUTBOX_CACHE/java-clients/libs (once)
#   clients.sh run ARGS...               run ClientCheck.java (see its header) with those jars
#
# Environment: OUTBOX_CACHE (default <repo>/.cache), JAVA_HOME / JAVA (java 17+).
set -euo pipefail

DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$DIR/../.." && pwd)
POM="$DIR/pom.xml"
CACHE_DIR="${OUTBOX_CACHE:-$REPO_DIR/.cache}/java-clients"
LIBS="$CACHE_DIR/libs"
MARKER="$LIBS/.complete"

if [[ -z "${JAVA:-}" ]]; then
    if [[ -n "${JAVA_HOME:-}" && -x "$JAVA_HOME/bin/java" ]]; then
        JAVA="$JAVA_HOME/bin/java"
    elif [[ -x /usr/lib/jvm/java-17-openjdk-amd64/bin/java ]]; then
        JAVA=/usr/lib/jvm/java-17-openjdk-amd64/bin/java
    else
        JAVA=java
    fi
fi

die() { printf 'clients.sh: ERROR: %s\n' "$*" >&2; exit 1; }
pom_sum() { sha256sum "$POM" | cut -d' ' -f1; }

fetch() {
    [[ -f "$MARKER" && "$(cat "$MARKER")" == "$(pom_sum)" ]] && return 0
    command -v mvn >/dev/null || die "mvn not found (apt-get install -y maven)"
    mkdir -p "$CACHE_DIR"
    exec 8>"$CACHE_DIR/.fetch.lock"
    flock 8
    [[ -f "$MARKER" && "$(cat "$MARKER")" == "$(pom_sum)" ]] && return 0
    local tmp="$CACHE_DIR/libs.tmp.$$"
    rm -rf "$tmp"
    if ! mvn -B -q -Dstyle.color=never -f "$POM" -Dmaven.repo.local="$CACHE_DIR/m2" \
            dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$tmp" \
            >"$CACHE_DIR/fetch.log" 2>&1; then
        tail -n 40 "$CACHE_DIR/fetch.log" >&2 || true
        rm -rf "$tmp"
        die "maven download failed (full log: $CACHE_DIR/fetch.log)"
    fi
    ls "$tmp"/kafka-clients-*.jar "$tmp"/cloudevents-kafka-*.jar >/dev/null 2>&1 \
        || { rm -rf "$tmp"; die "download incomplete: kafka-clients / cloudevents-kafka jar missing"; }
    pom_sum >"$tmp/.complete"
    rm -rf "$LIBS"
    mv "$tmp" "$LIBS"
}

case "${1:-}" in
    fetch) fetch ;;
    run)
        shift
        fetch
        exec "$JAVA" -cp "$LIBS/*" "$DIR/ClientCheck.java" "$@"
        ;;
    *) die "usage: clients.sh fetch | run ARGS..." ;;
esac
