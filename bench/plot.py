#!/usr/bin/python3
"""
Plots of the benchmark results: PNGs next to the tables in bench/results/, drawn from those
Markdown files only (the numbers bench/run.sh and bench/databases.sh wrote), so a plot never
shows a figure that is not in a results table.

Usage: bench/plot.py [RESULTS_DIR]        (default: bench/results next to this script)

Needs matplotlib (Debian: apt-get install python3-matplotlib).  Writes:

  steady-table-size.png   section 5: table size and table / retained ratio over 5,000,000 events
                          at 12,000 events/s, one line per case (2026-12-02-relay-v2.md,
                          2026-12-02-steady-vacuum.md, 2026-12-02-steady-default.md)
  latency.png             section 3: commit -> consumer percentiles per system, and where the
                          extension's time goes (2026-12-02-relay-v2.md)
  drain.png               section 2: events/s and relay CPU per event of each drain
                          (2026-12-02-relay-v2.md, 2026-12-02-relay-cpu.md)
  databases.png           section 6: one backlog over 1, 2, 4 databases and k relays (databases.md)
  delivery.png            section 7: exactly_once beside at_least_once, drain and latency per
                          round (delivery.md)
  inbox.png               section 8: events/s and CPU per event of each inbox arm beside
                          Debezium's JDBC sink (inbox.md)

Every file a plot reads must hold the table it expects; a missing table is an error, not an
empty plot.
"""
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

RESULTS = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "results"
DPI = 110


# --------------------------------------------------------------------------- Markdown tables

def tables(path):
    """Every Markdown table of path: (lines before it, header cells, rows of cells)."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-:| ]+\|$", lines[i + 1]):
            header = cells(lines[i])
            rows, j = [], i + 2
            while j < len(lines) and lines[j].startswith("|"):
                rows.append(cells(lines[j]))
                j += 1
            out.append((lines[:i], header, rows))
            i = j
        else:
            i += 1
    return out


def cells(line):
    return [c.strip().replace("**", "") for c in line.strip().strip("|").split("|")]


def num(text):
    """A table cell as a float: '**1.37** (270)' -> 1.37, '-' or '' -> None."""
    m = re.match(r"^-?[\d,]*\.?\d+", text.replace("**", "").strip())
    return float(m.group(0).replace(",", "")) if m else None


def find(path, test, what):
    """The tables of path whose header passes test; at least one, or an error naming what."""
    found = [t for t in tables(path) if test(t[1])]
    if not found:
        raise SystemExit(f"plot.py: {path.name} has no {what} table")
    return found


def column(header, rows, name):
    k = header.index(name)
    return [num(r[k]) for r in rows]


def save(fig, name, source):
    fig.text(0.995, 0.005, f"from bench/results/{source}", ha="right", va="bottom", fontsize=7,
             color="0.4")
    fig.savefig(RESULTS / name, dpi=DPI)
    plt.close(fig)
    print(f"plot.py: wrote {RESULTS / name}")


# --------------------------------------------------------------------------- section 5

def steady_cases():
    """(label, t, table MB, retained MB, ratio) of every section-5 case, in a fixed order."""
    labels = {
        ("2026-12-02-relay-v2.md", "snapshot"): "autovacuum alone (no relay VACUUM)",
        ("2026-12-02-relay-v2.md", "row"): "relay_mode = row, autovacuum alone",
        ("2026-12-02-steady-vacuum.md", "snapshot"): "relay VACUUM every 10 s",
        ("2026-12-02-steady-vacuum.md", "snapshot:outbox.vacuum_interval=5"): "relay VACUUM every 5 s",
        ("2026-12-02-steady-default.md", "snapshot"): "every default (relay VACUUM every 5 s)",
    }
    out = []
    for fname in ("2026-12-02-relay-v2.md", "2026-12-02-steady-vacuum.md", "2026-12-02-steady-default.md"):
        path = RESULTS / fname
        for before, header, rows in find(path, lambda h: h[:2] == ["t s", "phase"], "section 5 sample"):
            case = next((re.match(r"^Case `([^`]+)`", l).group(1) for l in reversed(before)
                         if re.match(r"^Case `([^`]+)`", l)), None)
            if (fname, case) not in labels:
                raise SystemExit(f"plot.py: {fname}: unexpected section 5 case {case!r}")
            out.append((labels[(fname, case)], column(header, rows, "t s"),
                        column(header, rows, "table MB"), column(header, rows, "retained MB"),
                        column(header, rows, "ratio")))
    return out


def plot_steady():
    cases = steady_cases()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7.5), sharex=True)
    for label, t, table, retained, ratio in cases:
        line, = top.plot(t, table, label=label)
        bottom.plot(t, ratio, color=line.get_color(), label=label)
    label, t, _, retained, _ = cases[-1]
    top.plot(t, retained, color="black", linestyle=":", label="size of the rows retained (every-default run)")
    top.set_ylabel("outbox.events, heap + indexes (MB)")
    top.set_title("5,000,000 events at 12,000 events/s, retention 60 s (bench section 5, PostgreSQL 15, 2 cores)")
    top.legend(fontsize=8, loc="upper left")
    top.grid(alpha=0.3)
    bottom.axhline(1.5, color="red", linewidth=0.8, linestyle="--", label="target 1.5×")
    bottom.set_ylabel("table / retained rows")
    bottom.set_xlabel("seconds since the load started")
    bottom.set_ylim(1.0, None)
    bottom.legend(fontsize=8, loc="upper left")
    bottom.grid(alpha=0.3)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save(fig, "steady-table-size.png",
         "2026-12-02-relay-v2.md, 2026-12-02-steady-vacuum.md, 2026-12-02-steady-default.md")


# --------------------------------------------------------------------------- section 3

def plot_latency():
    path = RESULTS / "2026-12-02-relay-v2.md"
    _, header, rows = find(path, lambda h: h[0] == "system" and "p50 ms" in h, "section 3 latency")[0]
    _, bh, brows = find(path, lambda h: h[0] == "span", "section 3 breakdown")[0]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    pcts = ["p50 ms", "p95 ms", "p99 ms", "max ms"]
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        vals = [num(r[header.index(p)]) for p in pcts]
        xs = [k + (i - (len(rows) - 1) / 2) * width for k in range(len(pcts))]
        behind = vals[0] > 1000     # a median over a second: it could not keep up, a backlog grew
        left.bar(xs, vals, width, label=r[0] + (": fell behind, a backlog" if behind else ""))
        for x, v in zip(xs, vals):
            left.text(x, v * 1.08, f"{v:g}", ha="center", fontsize=7)
    left.set_yscale("log")
    left.set_ylim(5, 2e7)          # room for the legend above the poller's bars
    left.set_xticks(range(len(pcts)), [p.replace(" ms", "") for p in pcts])
    left.set_ylabel("commit → consumer (ms, log scale)")
    left.set_title("1,000 commits/s for 60 s, one event each")
    left.legend(fontsize=7, loc="upper left")
    left.grid(axis="y", alpha=0.3)

    ext = bh.index(next(h for h in bh if h.startswith("extension relay")))
    spans = [r for r in brows if r[0].startswith("commit → Kafka appended") or r[0].startswith("Kafka append → Python")
             or r[0].startswith("commit → Python consumer (poll")]
    names = ["commit → Kafka append", "append → consumer", "commit → consumer"]
    p50 = [num(r[ext].split("/")[0]) for r in spans]
    p99 = [num(r[ext].split("/")[1]) for r in spans]
    ys = range(len(spans))
    right.barh([y + 0.2 for y in ys], p50, 0.4, label="p50")
    right.barh([y - 0.2 for y in ys], p99, 0.4, label="p99")
    right.set_yticks(list(ys), names)
    right.invert_yaxis()
    right.set_xlabel("ms")
    right.set_title("the extension's time, by span")
    right.legend(fontsize=8)
    right.grid(axis="x", alpha=0.3)
    fig.suptitle("Bench section 3, 2026-12-02, PostgreSQL 15, 2 cores (the machine's CPU is the bound)", fontsize=10)
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    save(fig, "latency.png", "2026-12-02-relay-v2.md (section 3)")


# --------------------------------------------------------------------------- section 2

def drain_rows(fname):
    path = RESULTS / fname
    _, header, rows = find(path, lambda h: h[0] == "system" and "backlog events" in h, "section 2 drain")[0]
    _, ch, crows = find(path, lambda h: h[0] == "system" and "relay µs/event" in h, "section 2 CPU")[0]
    cpu = {r[0]: num(r[ch.index("relay µs/event")]) for r in crows}
    return [(r[0], num(r[header.index("events/s")]), cpu.get(r[0])) for r in rows]


def short(system):
    s = system.replace("extension relay, relay_mode = snapshot", "snapshot relay")
    s = s.replace("extension relay", "row relay").replace("Debezium embedded, pgoutput + EventRouter", "Debezium")
    return s.replace("retention 60 s, default", "retention 60 s").replace(", no VACUUM", "")


def plot_drain():
    runs = [("2026-12-02-relay-v2.md", "2026-12-02 (library 9c01d11)"),
            ("2026-12-02-relay-cpu.md", "2026-12-02, after the relay CPU work (a218ad3)")]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    systems = [short(s) for s, _, _ in drain_rows(runs[0][0])]
    width = 0.4
    for i, (fname, label) in enumerate(runs):
        rows = {short(s): (r, c) for s, r, c in drain_rows(fname)}
        ys = [k + (i - 0.5) * width for k in range(len(systems))]
        left.barh(ys, [rows[s][0] for s in systems], width, label=label)
        right.barh(ys, [rows[s][1] or 0 for s in systems], width, label=label)
        for y, s in zip(ys, systems):
            left.text(rows[s][0], y, f" {rows[s][0]:,.0f}", va="center", fontsize=7)
            if rows[s][1]:
                right.text(rows[s][1], y, f" {rows[s][1]:g}", va="center", fontsize=7)
    for ax in (left, right):
        ax.set_yticks(range(len(systems)), systems, fontsize=8)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    left.set_xlabel("events/s (1,000,000 committed events)")
    left.set_title("drain rate")
    handles, names = left.get_legend_handles_labels()
    fig.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, 0.94), ncol=2, fontsize=8)
    left.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v / 1000:.0f}k"))
    left.set_xlim(0, left.get_xlim()[1] * 1.12)
    right.set_xlim(0, right.get_xlim()[1] * 1.1)
    right.set_xlabel("relay CPU per event (µs; Debezium: not measured)")
    right.set_title("relay CPU per event")
    fig.suptitle("Bench section 2: draining a committed backlog (PostgreSQL 15, 2 cores)", fontsize=10)
    fig.tight_layout(rect=(0, 0.03, 1, 0.89))
    save(fig, "drain.png", "2026-12-02-relay-v2.md, 2026-12-02-relay-cpu.md (section 2)")


# --------------------------------------------------------------------------- section 6

def plot_databases():
    path = RESULTS / "databases.md"
    _, header, rows = find(path, lambda h: h[0] == "databases", "section 6")[0]
    labels, rate, cpu = [], [], []
    seen = set()
    for r in rows:
        key = (r[0], r[1], r[2])
        label = f"{r[0]} db × {r[1]} relay{'s' if r[1] != '1' else ''}, {r[2]}" + (" (again)" if key in seen else "")
        seen.add(key)
        labels.append(label)
        rate.append(num(r[header.index("events/s")]))
        cpu.append(num(r[header.index("relay CPU µs/event")]))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
    colors = ["tab:blue" if "snapshot" in l else "tab:orange" for l in labels]
    left.barh(range(len(labels)), rate, color=colors)
    right.barh(range(len(labels)), cpu, color=colors)
    for ax, vals, fmt in ((left, rate, "{:,.0f}"), (right, cpu, "{:g}")):
        for y, v in enumerate(vals):
            ax.text(v, y, " " + fmt.format(v), va="center", fontsize=7)
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    left.set_xlabel("events/s (1,000,000 events)")
    right.set_xlabel("relays' CPU per event (µs)")
    fig.suptitle("Bench section 6, 2026-12-04: several databases (snapshot) and k relays per database (row)", fontsize=10)
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    save(fig, "databases.png", "databases.md (first table)")


# --------------------------------------------------------------------------- section 7

def plot_delivery():
    path = RESULTS / "delivery.md"
    _, dh, drows = find(path, lambda h: h[0] == "round" and "events/s" in h, "section 7 drain")[0]
    _, lh, lrows = find(path, lambda h: h[0] == "commits/s", "section 7 latency")[0]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.4))
    modes = ["at_least_once", "exactly_once"]
    ax = axes[0]
    for i, mode in enumerate(modes):
        rs = [r for r in drows if r[1] == mode]
        xs = [int(r[0]) + (i - 0.5) * 0.38 for r in rs]
        vals = [num(r[dh.index("events/s")]) for r in rs]
        ax.bar(xs, vals, 0.38, label=mode)
        for x, v in zip(xs, vals):
            ax.text(x, v, f"{v / 1000:.0f}k", ha="center", va="bottom", fontsize=7)
    ax.set_xticks([1, 2, 3], ["round 1", "round 2", "round 3"])
    ax.set_ylabel("events/s (drain of 500,000)")
    ax.set_title("drain")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    pcts = ["p50 ms", "p90 ms", "p99 ms"]
    for ax, rate in zip(axes[1:], ("500", "100")):
        for i, mode in enumerate(modes):
            rs = [r for r in lrows if r[0] == rate and r[2] == mode]
            for k, p in enumerate(pcts):
                vals = [num(r[lh.index(p)]) for r in rs]
                ax.scatter([k + (i - 0.5) * 0.3] * len(vals), vals, s=18,
                           color="tab:blue" if i == 0 else "tab:orange",
                           label=f"{mode} (3 rounds)" if k == 0 else None)
        ax.set_xticks(range(len(pcts)), [p.replace(" ms", "") for p in pcts])
        ax.set_ylabel("COMMIT → read_committed consumer (ms)")
        ax.set_title(f"latency at {rate} commits/s")
        ax.set_ylim(0, None)
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Bench section 7, 2026-12-04: exactly_once beside at_least_once (PostgreSQL 15, 2 cores, one broker)", fontsize=10)
    fig.tight_layout(rect=(0, 0.03, 1, 0.94))
    save(fig, "delivery.png", "delivery.md")


# --------------------------------------------------------------------------- section 8

def plot_inbox():
    _, header, rows = find(RESULTS / "inbox.md", lambda h: h[0] == "arm" and "events/s" in h, "section 8 arms")[0]
    arms = [r[0].replace(" (Kafka Connect standalone, 1 task)", ", 1 task") for r in rows]
    rate = column(header, rows, "events/s")
    cpu = column(header, rows, "CPU ms per 1,000 events")   # ms per 1,000 events = µs per event
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.6))
    for ax, values, fmt in ((left, rate, "{:,.0f}"), (right, cpu, "{:g}")):
        ax.barh(range(len(arms)), values, 0.6, color=["C0" if "inbox" in a else "C1" for a in arms])
        for y, v in enumerate(values):
            ax.text(v, y, " " + fmt.format(v), va="center", fontsize=8)
        ax.set_yticks(range(len(arms)), arms, fontsize=8)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
        ax.set_xlim(0, max(values) * 1.18)
    left.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v / 1000:.0f}k"))
    left.set_xlabel("events/s (1,000,000 events, 12 partitions)")
    left.set_title("apply rate")
    right.set_xlabel("CPU µs per event (the applying process and its threads)")
    right.set_title("CPU per event")
    fig.suptitle("Bench section 8: the inbox beside Debezium's JDBC sink (PostgreSQL 15, 2 cores)", fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 0.93))
    save(fig, "inbox.png", "inbox.md (section 8)")


def main():
    plot_steady()
    plot_latency()
    plot_drain()
    plot_databases()
    plot_delivery()
    plot_inbox()


if __name__ == "__main__":
    main()
