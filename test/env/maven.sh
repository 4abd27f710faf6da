# test/env/maven.sh: sourced by test/env/kafka.sh and test/java/clients.sh, which take their
# jars from Maven Central.  The caller defines log() and die().
#
#   pick_java                      set JAVA: $JAVA, $JAVA_HOME/bin/java, Debian's Java 17, or java
#   maven_fetch POM DIR GLOB...    copy POM's runtime dependencies into DIR/libs, once: DIR/libs
#                                  is complete when its marker holds POM's sha256 (editing the POM
#                                  fetches again); one fetch at a time (flock on DIR/.fetch.lock);
#                                  each GLOB (relative to the download) must match, or die

pick_java() {
    [[ -n "${JAVA:-}" ]] && return 0
    if [[ -n "${JAVA_HOME:-}" && -x "$JAVA_HOME/bin/java" ]]; then
        JAVA="$JAVA_HOME/bin/java"
    elif [[ -x /usr/lib/jvm/java-17-openjdk-amd64/bin/java ]]; then
        JAVA=/usr/lib/jvm/java-17-openjdk-amd64/bin/java
    else
        JAVA=java
    fi
}

maven_libs_complete() {    # POM DIR
    [[ -f "$2/libs/.complete" ]] && [[ "$(cat "$2/libs/.complete")" == "$(sha256sum "$1" | cut -d' ' -f1)" ]]
}

maven_fetch() {
    local pom=$1 dir=$2 glob
    shift 2
    maven_libs_complete "$pom" "$dir" && return 0
    command -v mvn >/dev/null 2>&1 || die "'mvn' not found (apt-get install -y maven)"
    mkdir -p "$dir"
    exec 8>"$dir/.fetch.lock"
    flock 8
    if maven_libs_complete "$pom" "$dir"; then exec 8>&-; return 0; fi
    local tmp="$dir/libs.tmp.$$"
    rm -rf "$tmp"
    log "fetching jars from Maven Central into $dir/libs (one-time) ..."
    if ! mvn -B -q -Dstyle.color=never -f "$pom" -Dmaven.repo.local="$dir/m2" \
            dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$tmp" \
            >"$dir/fetch.log" 2>&1; then
        tail -n 40 "$dir/fetch.log" >&2 || true
        rm -rf "$tmp"
        exec 8>&-
        die "maven download failed (full log: $dir/fetch.log)"
    fi
    for glob in "$@"; do
        # shellcheck disable=SC2086  # the glob is meant to expand
        ls "$tmp"/$glob >/dev/null 2>&1 || { rm -rf "$tmp"; exec 8>&-; die "download incomplete: no $glob"; }
    done
    sha256sum "$pom" | cut -d' ' -f1 >"$tmp/.complete"
    rm -rf "$dir/libs"
    mv "$tmp" "$dir/libs"
    exec 8>&-
}
