#!/usr/bin/env bash
# The layering of src/: every #include of a project header names its folder, and goes to the
# file's own folder or to a folder on a lower floor of the table in src/README.md, never up or
# sideways.  Prints the folder graph (which folder includes which) and fails on any other include.
#
# Usage: test/layering.sh
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 - <<'PY'
import os, re, sys, collections

# floors from the table in src/README.md: "| 4 | `relay/` | ..." or "| 0 | `outbox.h` `compat.h` |"
floor, row = {}, {}                   # row: a top-level file -> the first name of its row
for line in open("src/README.md"):
    m = re.match(r"\|\s*(\d+)\s*\|\s*((?:`[^`]+`\s*)+)\|", line)
    if m:
        names = re.findall(r"`([^`]+)`", m.group(2))
        floor[names[0]] = int(m.group(1))
        for name in names:
            row[name] = names[0]
if not floor:
    sys.exit("layering: no floor table in src/README.md")

def unit(path):                      # path relative to src/
    return row.get(path, path) if "/" not in path else path.split("/")[0] + "/"

files = sorted(os.path.relpath(os.path.join(d, f), "src")
               for d, _, fs in os.walk("src") for f in fs if f.endswith((".c", ".h")))
ours = set(files)
graph = collections.defaultdict(set)
errors = []
for f in files:
    u = unit(f)
    if u not in floor:
        errors.append(f"src/{f}: {u} has no floor in src/README.md")
        continue
    for n, line in enumerate(open(os.path.join("src", f)), 1):
        m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
        if not m:
            continue
        h = m.group(1)
        if h not in ours:
            if os.path.exists(os.path.join("src", os.path.dirname(f), h)):
                errors.append(f"src/{f}:{n}: #include \"{h}\" does not name its folder")
            continue                 # a PostgreSQL or system header
        t = unit(h)
        if t == u:
            continue
        graph[u].add(t)
        if floor.get(t, 99) >= floor[u]:
            errors.append(f"src/{f}:{n}: #include \"{h}\": {u} (floor {floor[u]}) may not include "
                          f"{t} (floor {floor.get(t)})")
for u in sorted(graph, key=lambda u: -floor[u]):
    print(f"{u:14} -> " + " ".join(sorted(graph[u], key=lambda t: -floor[t])))
if errors:
    print("\n".join(errors), file=sys.stderr)
    sys.exit(f"layering: {len(errors)} include(s) against the floors of src/README.md")
print(f"layering: {len(files)} files, every include goes down the floors of src/README.md")
PY
