#!/usr/bin/env bash
# Install what building, demoing and testing outbox needs, from Debian's packages.
# Idempotent: packages already installed are skipped, so a second run takes a second.
# Runs apt-get as root, or through sudo for a normal user.
set -euo pipefail

PACKAGES=(
    build-essential
    postgresql-15 postgresql-server-dev-15 postgresql-contrib
    librdkafka-dev
    postgresql-15-pgtap libtap-parser-sourcehandler-pgtap-perl
    kcat patchelf
    gdb bc            # stacks of a stuck stop's processes (conftest.stop_server); test/repro
    python3 python3-psycopg2 python3-psycopg python3-confluent-kafka python3-pytest python3-pytest-timeout
    python3-yaml
    openjdk-17-jre-headless maven
)

missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [[ ${#missing[@]} -eq 0 ]]; then
    echo "deps.sh: all packages present" >&2
    exit 0
fi

SUDO=()
[[ $(id -u) -eq 0 ]] || SUDO=(sudo)
echo "deps.sh: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "deps.sh: done" >&2
