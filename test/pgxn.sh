#!/usr/bin/env bash
# PGXN packaging checks: META.json against the PGXN meta spec, and against the tree.
#
# Usage: test/pgxn.sh check
#        test/pgxn.sh validator     build the validator only (if missing)
#
# The validator is pgxn_meta, the PGXN project's own (crates.io, built once with cargo into
# ${CARGO_HOME:-~/.cargo}/bin; a second run finds it there).  Then: META.json's version is the
# extension's default_version (1.3 -> 1.3.x), its provides entry has that version and names files
# that exist, and `make dist` gives a zip holding META.json, the control file, every source and
# every SQL script, which builds alone with no warning against the pg_config first on PATH.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
VALIDATOR_VERSION=0.7.0

die() { printf 'pgxn.sh: FAILED: %s\n' "$*" >&2; exit 1; }

validator() {
    local bin="${CARGO_HOME:-$HOME/.cargo}/bin/pgxn_meta" cargo
    if [[ ! -x "$bin" || "$("$bin" --version 2>/dev/null)" != *"$VALIDATOR_VERSION"* ]]; then
        cargo=$(command -v cargo || echo "${CARGO_HOME:-$HOME/.cargo}/bin/cargo")
        [[ -x "$cargo" ]] || die "cargo is needed to build the PGXN validator pgxn_meta"
        echo "pgxn.sh: building pgxn_meta $VALIDATOR_VERSION (one-time, a few minutes)" >&2
        "$cargo" install -q --locked pgxn_meta --version "$VALIDATOR_VERSION" >&2
    fi
    echo "$bin"
}

check() {
    local bin control_version meta_version dir listing f
    bin=$(validator)
    "$bin" META.json || die "META.json is not valid under the PGXN meta spec"

    control_version=$(sed -n "s/^default_version = '\(.*\)'/\1/p" outbox.control)
    meta_version=$(python3 -c 'import json; print(json.load(open("META.json"))["version"])')
    [[ "$meta_version" == "$control_version".* ]] \
        || die "META.json version $meta_version is not the extension's $control_version"
    python3 - "$meta_version" <<'PY' || die "META.json's provides entry does not match the tree"
import json, os, sys
meta = json.load(open("META.json"))
for name, ext in meta["provides"].items():
    assert ext["version"] == sys.argv[1], f"{name}: version {ext['version']}"
    for key in ("file", "docfile"):
        assert os.path.isfile(ext[key]), f"{name}: {key} {ext[key]} is missing"
PY

    dir=$(mktemp -d /tmp/outbox-pgxn.XXXXXX)
    trap 'rm -rf "$dir"' RETURN
    make -s dist DISTDIR="$dir" >/dev/null
    listing=$(python3 -m zipfile -l "$dir"/outbox-"$meta_version".zip)
    for f in META.json Makefile outbox.control README.md $(git ls-files src sql doc); do
        grep -q " *outbox-$meta_version/$f " <<<"$listing" || die "make dist left out $f"
    done
    python3 -m zipfile -e "$dir"/outbox-"$meta_version".zip "$dir"
    (cd "$dir/outbox-$meta_version" && make >"$dir/build.log" 2>&1) \
        || { cat "$dir/build.log"; die "the make dist zip does not build"; }
    ! grep -E 'warning:|error:' "$dir/build.log" || die "the make dist zip builds with warnings"
    echo "pgxn.sh: META.json valid (pgxn_meta $VALIDATOR_VERSION), version $meta_version, make dist complete"
    echo "summary: PGXN zip builds with 0 warnings"
}

case "${1:-}" in
    check) check ;;
    validator) validator >/dev/null ;;     # only build the validator (test/run.sh, in the background)
    *) sed -n '2,10p' "$0"; exit 2 ;;
esac
