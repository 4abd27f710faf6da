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

log() { printf 'clients.sh: %s\n' "$*" >&2; }
die() { printf 'clients.sh: ERROR: %s\n' "$*" >&2; exit 1; }

# shellcheck source=../env/maven.sh
source "$REPO_DIR/test/env/maven.sh"
pick_java

fetch() { maven_fetch "$POM" "$CACHE_DIR" 'kafka-clients-*.jar' 'cloudevents-kafka-*.jar'; }

case "${1:-}" in
    fetch) fetch ;;
    run)
        shift
        fetch
        exec "$JAVA" -cp "$CACHE_DIR/libs/*" "$DIR/ClientCheck.java" "$@"
        ;;
    *) die "usage: clients.sh fetch | run ARGS..." ;;
esac
