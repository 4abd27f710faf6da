#!/usr/bin/python3
"""Render the benchmark's raw numbers (bench/results/latest.json) as Markdown tables.

  report.py [results.json]     print the Markdown (driver.py also writes it to latest.md)
"""

import json
import sys


def mb(b):
    return "%.1f" % (b / 1048576.0) if b is not None else "-"


def f(v, fmt="%.1f"):
    return fmt % v if v is not None else "-"


def ratio(a, b):
    return "%.2f" % (a / b) if a and b else "-"


def pct_of(a, b):
    return "%.0f%%" % (100.0 * a / b) if a and b else "-"


def headline(s):
    """The drain rates the headline compares (events/s): the default relay (relay_mode = snapshot,
    retention 60 s, every default), the row relay beside it, librdkafka alone, Debezium, the poller.
    Results of before relay_mode (no snapshot_60) have only the row relay: default_relay is then
    the row relay, which was the default of those versions."""
    x = s.get("2a_4_extension_drain", {})
    row = x.get("retention_60", {}).get("events_per_s")
    snap = x.get("snapshot_60", {}).get("events_per_s")
    return {"default_relay": snap or row, "row_relay": row if snap else None,
            "librdkafka_alone": s.get("2d_librdkafka_alone", {}).get("stream", {}).get("events_per_s"),
            "debezium": s.get("2b_debezium_drain", {}).get("events_per_s"),
            "poller": s.get("2c_poller_drain", {}).get("events_per_s")}


def quiet_cell(d):
    """Load average (1 min) and cores used by other processes, measured just before the run."""
    q = d.get("quiet") or {}
    if not q:
        return "-"
    w = ", waited %.0f s" % q["waited_s"] if q.get("waited_s", 0) > 1 else ""
    return "%.2f / %.2f%s" % (q["load1"], q["other_cores"], w)


def cpu_cells(c):
    return "%s | %s | %s | %s | %s | %s" % (f(c.get("wall")), f(c.get("postgres")), f(c.get("relay")),
                                           f(c.get("kafka")), f(c.get("bench")), f(c.get("other_cores"), "%.2f"))


def render(r):
    env = r.get("environment", {})
    p = r["params"]
    s = r["sections"]
    L = []
    L.append("# outbox benchmark: run %s" % r["run_id"])
    L.append("")
    L.append("All numbers below are from this one run (`bench/run.sh`), started %s, finished %s, runtime %s s. "
             "The three systems ran one after another on the same machine, the same PostgreSQL cluster and "
             "the same Kafka broker." % (r.get("started_at"), r.get("finished_at"), r.get("runtime_s")))
    L.append("")
    L.append("| machine | |")
    L.append("|---|---|")
    L.append("| CPU | %s, %s cores, %s GiB RAM |" % (env.get("cpu_model"), env.get("cores"), env.get("memory_gib")))
    L.append("| kernel | %s |" % env.get("kernel"))
    L.append("| PostgreSQL | %s (outbox extension %s) |" % (env.get("postgres"), env.get("outbox_extension")))
    L.append("| librdkafka | %s (Debian %s): the relay and the poller |" % (env.get("librdkafka"), env.get("librdkafka_deb")))
    L.append("| Kafka broker | %s (KRaft, 1 node, heap 1g) |" % env.get("kafka"))
    L.append("| Debezium | %s embedded, Kafka clients %s |" % (env.get("debezium"), env.get("debezium_kafka_clients")))
    L.append("| Java | %s |" % env.get("java"))
    L.append("| Python | %s, psycopg %s, confluent_kafka %s |" % (env.get("python"), env.get("psycopg"),
                                                                   env.get("confluent_kafka")))
    L.append("| load average | at start %s, at end %s |" % (env.get("load_at_start"), env.get("load_at_end")))
    L.append("| parameters | events %(events)d, aggregates %(aggregates)d, pgbench %(pgbench_seconds)d s, "
             "poller backlog %(poller_events)s, latency %(latency_seconds)d s at %(rate)d events/s (+%(warmup_seconds)d s warm-up)%(steady)s |"
             % dict(p, steady=(", steady load %(steady_events)d events at %(steady_rate)d/s, %(steady_batch)d per commit "
                               "(cases %(steady_cases)s)" % p) if "steady_events" in p and "5_steady_table" in s else ""))
    ps = r.get("pg_settings", {})
    L.append("| PostgreSQL settings | %s |" % ", ".join("%s=%s" % kv for kv in ps.items()))
    L.append("")

    if "1_emit_cost" in s:
        e = s["1_emit_cost"]
        L.append("## 1. Emit cost (pgbench, 8 clients, %d s per run, relay paused)" % p["pgbench_seconds"])
        L.append("")
        rounds = e.get("rounds", 1)
        L.append("Runs interleaved (a, b, c, a, b, c, ...), %d rounds; the best round of each is used "
                 "(other users' load only ever slows a run down). All rounds, with the cores other processes "
                 "used during each, are listed." % rounds)
        L.append("")
        L.append("| transaction | TPS (best) | avg latency ms | cost of (a) | all rounds: TPS (other cores during) "
                 "| Postgres CPU µs per transaction, each round | load avg / other cores before best |")
        L.append("|---|---:|---:|---:|---|---|---|")

        def cpu_cell(d):
            us = d.get("all_cpu_us_per_txn")
            return ", ".join("%.0f" % u for u in us) if us else "-"

        def rounds_cell(d):
            tps = d.get("all_tps", [d["tps"]])
            oc = d.get("all_other_cores", [d["cpu"]["other_cores"]])
            return ", ".join("%.0f (%.2f)" % (t, o) for t, o in zip(tps, oc))
        rows = [("(a) order row + `outbox.emit()` (`relay_mode = row`)", "emit", "1.00"),
                ("(b) order row + INSERT into a plain table like outbox.events", "plain",
                 "TPS(b)/TPS(a) = **%.2f**" % e["cost_emit_vs_plain"]),
                ("(c) order row alone", "order", "TPS(c)/TPS(a) = **%.2f**" % e["cost_emit_vs_order"])]
        if "emit_snapshot" in e:
            rows += [("(a') order row + `outbox.emit()` (`relay_mode = snapshot`: the row carries its xid)",
                      "emit_snapshot", "1.00"),
                     ("(b') order row + INSERT into the plain table, with `xid = pg_current_xact_id()`", "plain_xid",
                      "TPS(b')/TPS(a') = **%.2f**" % e["cost_emit_snapshot_vs_plain_xid"]),
                     ("(b)/(a'), (c)/(a'): against the plain INSERT without xid and the order alone", None,
                      "%.2f, %.2f" % (e["cost_emit_snapshot_vs_plain"], e["cost_emit_snapshot_vs_order"]))]
        for label, k, cost in rows:
            if k is None:
                L.append("| %s | | | %s | | | |" % (label, cost))
                continue
            L.append("| %s | %s | %s | %s | %s | %s | %s |" % (label, f(e[k]["tps"]), f(e[k]["latency_ms"], "%.2f"),
                                                            cost, rounds_cell(e[k]), cpu_cell(e[k]),
                                                            quiet_cell(e[k])))
        L.append("")
        if "emit_snapshot" in e:
            L.append("`emit()` over the same INSERT into a plain table: **%.2f×** with `relay_mode = row`, **%.2f×** "
                     "with `relay_mode = snapshot` (target ≤ 1.10×)."
                     % (e["cost_emit_vs_plain"], e["cost_emit_snapshot_vs_plain_xid"]))
            L.append("")

    drains = []
    x = s.get("2a_4_extension_drain", {})
    # the default relay (relay_mode = snapshot, retention 60 s, every default) comes first and is
    # what the headline ratios compare; the row relay (the 1.3 relay) is listed beside it, labelled
    if "snapshot_60" in x:
        drains.append(("**extension relay, defaults** (`relay_mode = snapshot`, retention 60 s)", x["snapshot_60"]))
        drains.append(("extension relay, defaults, 2nd drain into the space the 1st left", x["snapshot_60_second"]))
    if "retention_60" in x:
        row = "`relay_mode = row`, " if "snapshot_60" in x else ""
        drains.append(("extension relay, %sretention 60 s" % row, x["retention_60"]))
        drains.append(("extension relay, %sretention 0" % row, x["retention_0"]))
        drains.append(("extension relay, %sretention 60 s, 2nd drain, no VACUUM" % row, x["retention_60_second"]))
    alone = s.get("2d_librdkafka_alone")
    if alone:
        drains.append(("librdkafka alone (`bench/load/produce_alone.c`: the same messages, the relay's producer "
                       "settings, no database)", alone["stream"]))
        if alone.get("batched"):
            drains.append(("librdkafka alone, in batches of %d, each waiting for its delivery reports (the relay's "
                           "cycle without the database)" % alone["batched"]["batch"], alone["batched"]))
    if "2b_debezium_drain" in s:
        drains.append(("Debezium embedded, pgoutput + EventRouter", s["2b_debezium_drain"]))
    if "2c_poller_drain" in s:
        drains.append(("Python poller (100 rows/txn, flush per message; smaller backlog)", s["2c_poller_drain"]))
    if drains:
        L.append("## 2. Drain of a committed backlog (%d aggregates, ~300-byte payloads)" % p["aggregates"])
        L.append("")
        L.append("The rate (events/s) is what is compared; the poller drains a smaller backlog "
                 "(BENCH_POLLER_EVENTS) because it is far slower.")
        L.append("")
        L.append("| system | backlog events | seconds | events/s | messages in topic | load avg / other cores before |")
        L.append("|---|---:|---:|---:|---:|---|")
        for name, d in drains:
            L.append("| %s | %d | %s | **%s** | %s | %s |" % (name, d["events"], f(d["seconds"], "%.2f"),
                                                           f(d["events_per_s"], "%.0f"), d.get("messages_in_topic"),
                                                           quiet_cell(d)))
        L.append("")
        h = headline(s)
        if h.get("default_relay"):
            L.append("Headline, the default relay (`relay_mode = snapshot`, every default): extension/Debezium = "
                     "**%s**, extension/poller = **%s**."
                     % (ratio(h["default_relay"], h.get("debezium")), ratio(h["default_relay"], h.get("poller"))))
        if h.get("row_relay"):
            L.append("Beside it, `relay_mode = row` (the 1.3 relay, retention 60 s): row/Debezium = %s, row/poller = "
                     "%s%s." % (ratio(h["row_relay"], h.get("debezium")), ratio(h["row_relay"], h.get("poller")),
                                ", default/row = %s" % ratio(h["default_relay"], h["row_relay"])
                                if h.get("default_relay") else ""))
        if alone:
            L.append("librdkafka alone: %s; the default relay's drain is **%s** of it (%s for its 2nd drain)."
                     % (alone.get("what", "the same messages from a C program"),
                        pct_of(h.get("default_relay"), h.get("librdkafka_alone")),
                        pct_of(x.get("snapshot_60_second", {}).get("events_per_s"), h.get("librdkafka_alone"))))
        dbz = h.get("debezium")
        pol = h.get("poller")
        if dbz:
            d = s["2b_debezium_drain"]
            L.append("Debezium's time runs from the engine's start (after JVM start) to the last acknowledgement; "
                     "from its first record: %s s; with JVM start: %s s. WAL to decode: %s MB."
                     % (f(d["seconds_from_first_record"], "%.2f"), f(d["seconds_with_jvm_start"], "%.2f"),
                        mb(d.get("wal_backlog_bytes"))))
        if pol:
            d = s["2c_poller_drain"]
            L.append("The poller's time runs from its first poll to its last commit (%s s with process start)."
                     % f(d["seconds_with_process_start"], "%.2f"))
        L.append("")
        L.append("CPU seconds used during each drain (`other` = average cores used by processes outside this "
                 "benchmark, i.e. other users of the machine):")
        L.append("")
        L.append("| system | wall s | postgres | of which relay | kafka | bench procs (Java/Python) | other (cores) "
                 "| relay µs/event |")
        L.append("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name, d in drains:
            relay_us = d["cpu"].get("relay") if "mode" in d or name.startswith("extension") else None
            L.append("| %s | %s | %s |" % (name, cpu_cells(d["cpu"]),
                                          f(relay_us * 1e6 / d["events"], "%.1f") if relay_us else "-"))
        L.append("")
        if "2a_4_extension_drain" in s:
            xd = s["2a_4_extension_drain"]
            prof = (xd.get("snapshot_60") or xd["retention_60"]).get("relay_activity_pct", {})
            if prof:
                L.append("Relay worker during the default relay's drain (pg_stat_activity every 100 ms; "
                         "activity | wait event, `CPU` = no wait event):")
                L.append("")
                L.append("| relay activity | wait | % of samples |")
                L.append("|---|---|---:|")
                for k, v in list(prof.items())[:8]:
                    act, wait = k.split(" | ", 1)
                    L.append("| %s | %s | %s |" % (act, wait, v))
                L.append("")

    if "3_latency" in s:
        lt = s["3_latency"]
        L.append("## 3. Commit-to-consumer latency, %d events/s for %d s" % (p["rate"], p["latency_seconds"]))
        L.append("")
        L.append("| system | p50 ms | p95 ms | p99 ms | max ms | received / missing / duplicates | commits/s achieved "
                 "| load avg / other cores before |")
        L.append("|---|---:|---:|---:|---:|---|---:|---|")
        names = {"ext": "extension relay (defaults, woken by the commit)",
                 "dbz": "Debezium embedded (poll.interval.ms %s)" % lt.get("dbz_poll_interval_ms", 500),
                 "poller": "Python poller (idle sleep %d ms)" % lt.get("poller_idle_sleep_ms", 10)}
        ext = lt.get("ext", {})
        if ext.get("relay_kafka_properties") or ext.get("relay_synchronous_commit_off"):
            changed = ([ext["relay_kafka_properties"]] if ext.get("relay_kafka_properties") else []) + \
                      (["relay's synchronous_commit off"] if ext.get("relay_synchronous_commit_off") else [])
            names["ext"] = "extension relay (woken by the commit; %s)" % ", ".join(changed)
        for k in ("ext", "dbz", "poller"):
            if k in lt:
                d = lt[k]
                L.append("| %s | %s | %s | %s | %s | %d / %d / %d | %s | %s |"
                         % (names[k], f(d["p50_ms"]), f(d["p95_ms"]), f(d["p99_ms"]), f(d["max_ms"]),
                            d["received"], d["missing"], d["duplicates"], f(d["achieved_commit_rate"]),
                            quiet_cell(d)))
        L.append("")
        L.append("| system | wall s | postgres | of which relay | kafka | bench procs | other (cores) |")
        L.append("|---|---:|---:|---:|---:|---:|---:|")
        for k in ("ext", "dbz", "poller"):
            if k in lt:
                L.append("| %s | %s |" % (names[k], cpu_cells(lt[k]["cpu"])))
        L.append("")

        if any("breakdown" in lt.get(k, {}) for k in ("ext", "dbz", "poller")):
            L.append("Where the time goes (same runs, per event, ms, p50 / p99; the bench topics use the broker's "
                     "`LogAppendTime`, which has ms resolution and is truncated, so spans that start or end there "
                     "are up to 1 ms off):")
            L.append("")
            present = [k for k in ("ext", "dbz", "poller") if k in lt]
            L.append("| span | " + " | ".join(names[k] for k in present) + " |")
            L.append("|---|" + "---:|" * len(present))
            rows = [("commit → relay sees Kafka's ack (`published_at`, the relay's commit follows)", "commit_to_relay_ack"),
                    ("commit → Kafka appended it (`LogAppendTime`)", "commit_to_kafka_append"),
                    ("Kafka append → C consumer (`lat_consumer.c`, librdkafka)", "kafka_append_to_c_consumer"),
                    ("Kafka append → Python consumer", "kafka_append_to_py_consumer"),
                    ("**commit → C consumer**", "commit_to_c_consumer"),
                    ("**commit → Python consumer** (poll per message; the table above)", "commit_to_py_consumer"),
                    ("commit → Python consumer as before 2026-12 (`consume(1000, 0.05)`)", "commit_to_py_batch_consumer")]
            for label, key in rows:
                cells = []
                for k in present:
                    d = lt[k].get("breakdown", {}).get(key)
                    cells.append("%s / %s" % (f(d["p50"]), f(d["p99"])) if d else "—")
                if any(c != "—" for c in cells):
                    L.append("| %s | %s |" % (label, " | ".join(cells)))
            L.append("")
            rb = lt.get("ext", {}).get("breakdown", {}).get("relay_batches")
            if rb:
                L.append("Relay cycles during its run: %d batches, %.2f events each; time between batches p50 %s / "
                         "p99 %s ms (each cycle: claim, produce, wait for every delivery report, mark, commit)."
                         % (rb["batches"], rb["events_per_batch"], f(rb["batch_interval_ms"]["p50"]),
                            f(rb["batch_interval_ms"]["p99"])))
                L.append("")
            kp = lt.get("kafka_probe") or {}
            if "rtt_us" in kp:              # results of before the linger.ms=0 probe
                kp = {"linger_1": kp}
            for name in ("linger_1", "linger_0"):
                k = kp.get(name)
                if not k or "rtt_us" not in k:
                    continue
                ms = lambda d, q: f(d[q] / 1000.0, "%.2f") if d.get(q) is not None else "-"
                L.append("Kafka alone, `linger.ms=%d` (`probe_producer.py`: %d small messages at %d/s with the relay's other "
                         "producer settings, before the runs; librdkafka statistics, median of the 1-s windows' p50 / largest "
                         "p99): queue incl. linger (`int_latency`) %s / %s ms, output buffer (`outbuf_latency`) %s / %s ms, "
                         "request → acks=all response (`rtt`) %s / %s ms; produce() → delivery report in Python %s / %s ms."
                         % (k.get("linger_ms", 1), k["messages"], p["rate"],
                            ms(k["int_latency_us"], "p50"), ms(k["int_latency_us"], "p99"),
                            ms(k["outbuf_latency_us"], "p50"), ms(k["outbuf_latency_us"], "p99"),
                            ms(k["rtt_us"], "p50"), ms(k["rtt_us"], "p99"),
                            f(k["dr_ms"]["p50"], "%.2f"), f(k["dr_ms"]["p99"], "%.2f")))
                L.append("")
            sched = [(k, sorted((w, d) for w, d in lt[k].get("breakdown", {}).get("sched", {}).items() if d))
                     for k in present]
            if any(x for _, x in sched):
                L.append("Waiting for a CPU (kernel `schedstat` of the process, summed over its threads, per second of "
                         "the run: runnable but not running / on a CPU, ms; mean wait per time slice):")
                L.append("")
                for k, x in sched:
                    if x:
                        L.append("- %s run: %s" % (names[k].split(" (")[0], "; ".join(
                            "%s %s / %s (%s per slice)" % ("the relay" if w == "relay" else "Kafka",
                                                         f(d["runqueue_ms_per_s"]), f(d["cpu_ms_per_s"]),
                                                         f(d["wait_per_slice_ms"], "%.2f")) for w, d in x)))
                L.append("")
            fs = lt.get("fsync")
            if fs and "fdatasync_ms" in fs:
                L.append("Commit floor (`pg_test_fsync`, one 8kB write + fdatasync on the cluster's file system): "
                         "%.3f ms (%.0f/s)." % (fs["fdatasync_ms"], fs["fdatasync_ops_per_s"]))
                L.append("")

        prof = lt.get("ext", {}).get("relay_activity_pct", {})
        if prof:
            L.append("Relay worker during its latency run (pg_stat_activity every 100 ms):")
            L.append("")
            L.append("| relay activity | wait | % of samples |")
            L.append("|---|---|---:|")
            for k, v in list(prof.items())[:8]:
                act, wait = k.split(" | ", 1)
                L.append("| %s | %s | %s |" % (act, wait, v))
            L.append("")

    if "2a_4_extension_drain" in s:
        x = s["2a_4_extension_drain"]
        L.append("## 4. outbox.events size around the drains of section 2(a)")
        L.append("")
        L.append("| case | moment | table MB | indexes MB | rows | dead tuples | autovacuums so far |")
        L.append("|---|---|---:|---:|---:|---:|---:|")

        def row(case, moment, z):
            L.append("| %s | %s | %s | %s | %s | %s | %s |" % (case, moment, mb(z["table_bytes"]), mb(z["index_bytes"]),
                                                           z["rows"], z["n_dead_tup"], z["autovacuum_count"]))
        rm = "row, " if "snapshot_60" in x else ""
        for case, key in (("defaults (snapshot), retention 60 s", "snapshot_60"),
                          ("defaults (snapshot), retention 60 s, 2nd drain", "snapshot_60_second"),
                          (rm + "retention 0", "retention_0"), (rm + "retention 60 s", "retention_60"),
                          (rm + "retention 60 s, 2nd drain", "retention_60_second")):
            if key not in x:
                continue
            d = x[key]
            row(case, "backlog committed, before the drain", d["size_before"])
            row(case, "drain finished", d["size_after"])
            if key != "retention_0":
                row(case, "retention cleanup done (%s s after the drain)" % d.get("cleanup_wait_s"),
                    d["size_after_retention"])
        L.append("")

    if "5_steady_table" in s:
        L.extend(render_steady(s["5_steady_table"]))

    if r.get("quiet_checks"):
        L.append("Machine quietness before each measured section (CPU of processes outside the benchmark over 3 s):")
        L.append("")
        L.append(", ".join("%s: %.2f cores (load %.2f%s)" % (q["section"], q["other_cores"], q["load1"],
                                                            ", waited %s s" % q["waited_s"] if q["waited_s"] > 1 else "")
                           for q in r["quiet_checks"]))
        L.append("")
    for n in r.get("notes", []):
        L.append("- " + n)
    L.append("")
    return "\n".join(L)


def render_steady(x):
    """Section 5: outbox.events under a steady load, one table per case and a summary."""
    L = []
    tgt = x["target_ratio"]
    L.append("## 5. outbox.events under a steady load: %d events at %d events/s, relay publishing, retention deleting"
             % (x["events"], x["rate"]))
    L.append("")
    L.append("Paced loader (`bench/load/steady.py`): %d events per transaction (one `SELECT count(outbox.emit(...)) FROM "
             "generate_series(...)`, the ~300-byte payload built once per transaction), %d connections on one absolute "
             "schedule; the relay publishes to the bench's Kafka broker while the load runs. Every %d s: **retained** "
             "= `max(id) - min(id) + 1` of the rows a fresh snapshot of `outbox.events` sees (the loader's ids have no "
             "gaps; the retention deletes the oldest first), its size = that × the average `pg_column_size(e.*)` of the "
             "newest 10,000 rows (each row's tuple: header + data, without line pointer or page overhead; checked "
             "against a full `count(*)`/`sum(pg_column_size(e.*))` scan at the end); **table** = "
             "`pg_total_relation_size` = heap (all forks) + TOAST + every index; **ratio** = table / retained size. "
             "The sizes are read after the row figures, so the ratio errs high. Max ratio: over the samples while the "
             "load ran (with at least 10,000 rows retained); end: once the relay had caught up after the load (the "
             "retention has not yet deleted the last minute). "
             "Target: ≤ %.1f×. *Table / peak retained* divides by the largest retained size seen so far instead: "
             "when the loader falls behind its schedule (a busy machine) fewer rows are retained, but the table "
             "keeps the size the peak needed; that column separates the two." % (x["batch"], x["connections"],
                                                                                 x["sample_seconds"], tgt))
    L.append("")
    L.append("| case | settings | achieved events/s (1-s min–max) | ratio max (at s) | ratio end | ≤ %.1f× | "
             "table / peak retained: max, end | max table MB | autovacuums / relay VACUUMs (bench's) | relay lag max: pending / oldest s "
             "| caught up s after load | runtime s | load avg / other cores before | other cores during |" % tgt)
    L.append("|---|---|---:|---:|---:|---|---:|---:|---:|---|---:|---:|---|---:|")

    def settings(c):
        st = c["settings"]
        parts = ["relay_mode=%s" % st.get("outbox.relay_mode"), "retention=%s" % st.get("outbox.retention"),
                 "autovacuum=%s" % st.get("autovacuum"), "naptime=%s" % st.get("autovacuum_naptime")]
        parts += ["%s=%s" % kv for kv in c["table_options"].items()]
        if c.get("vacuum_every"):
            parts.append("bench VACUUM every %g s" % c["vacuum_every"])
        return ", ".join(parts)
    for c in x["cases"]:
        L.append("| `%s` | %s | %s (%s–%s) | **%s** (%s) | **%s** | %s | %s, %s | %s | %d / %s (%d) | %s / %s | %s | %s | %s | %s |"
                 % (c["spec"], settings(c), f(c["achieved_rate"], "%.0f"), f(c["rate_per_second_min"], "%.0f"),
                    f(c["rate_per_second_max"], "%.0f"), f(c["max_ratio"], "%.2f"), f(c["max_ratio_t"], "%.0f"),
                    f(c["end_ratio"], "%.2f"), ("yes" if c["within_target"] else "**no**") +
                    ("" if c.get("steady_state", True) else " (load too short for a steady state)"),
                    f(c.get("max_peak_ratio"), "%.2f"), f(c.get("end_peak_ratio"), "%.2f"), mb(c["max_total_bytes"]),
                    c["autovacuums"], ("%d" % (c["vacuums"] - c["manual_vacuums"])) if "vacuums" in c else "-",
                    c["manual_vacuums"], c["max_pending"], f(c["max_oldest_pending_s"], "%.2f"),
                    f(c["relay_caught_up_s"]) if c["relay_caught_up_s"] is not None else "not within the timeout",
                    f(c["runtime_s"], "%.0f"), quiet_cell(c), f(c["cpu"].get("other_cores"), "%.2f")))
    L.append("")
    for c in x["cases"]:
        L.append("Case `%s` (%s); the storage parameters of outbox.events during the run: `%s`. "
                 "Loader: %d events in %.1f s = %.0f events/s, schedule lag max %.2f s (p99 %.2f s); "
                 "relay published %d, topic holds %d. CPU during the run (s): postgres %s (relay %s), Kafka %s, "
                 "bench %s, other %s cores."
                 % (c["spec"], settings(c), c["settings"].get("table reloptions"), c["events"], c["load_seconds"],
                    c["achieved_rate"], c["schedule_lag_max_s"], c["schedule_lag_p99_s"], c["published"],
                    c["messages_in_topic"], f(c["cpu"].get("postgres")), f(c["cpu"].get("relay")),
                    f(c["cpu"].get("kafka")), f(c["cpu"].get("bench")), f(c["cpu"].get("other_cores"), "%.2f")))
        L.append("")
        if c.get("autovacuum_log"):
            L.append("Autovacuums of outbox.events (server log, `log_autovacuum_min_duration = 0`): " + "; ".join(
                "ended at %.0f s, took %.1f s, removed %s, dead but not yet removable %s, index scans %s"
                % (v["ended_at"], v["elapsed_s"], v["removed"], v["not_yet_removable"], v["index_scans"])
                for v in c["autovacuum_log"]) + ".")
            L.append("")
        vs = c.get("vacuums_seen") or []
        if vs:
            def med(xs):
                xs = sorted(xs)
                return xs[len(xs) // 2] if xs else None
            by = {}
            for v in vs:
                by.setdefault(v["by"] or "?", []).append(v)
            parts = []
            for who, lst in sorted(by.items()):
                dur = [v["end"] - v["start"] for v in lst]
                starts = sorted(v["start"] for v in lst)
                gaps = [b - a for a, b in zip(starts, starts[1:])]
                parts.append("%d by %s, running %s s at the median (max %s), one starting every %s s at the median, "
                             "heap blocks to scan median %s, index passes %s"
                             % (len(lst), who, f(med(dur), "%.2f"), f(max(dur), "%.2f"), f(med(gaps), "%.1f"),
                                med([v["heap_blks_total"] for v in lst]),
                                "/".join(str(n) for n in sorted(set(v["index_passes"] for v in lst)))))
            L.append("VACUUMs of outbox.events seen in `pg_stat_progress_vacuum` (sampled every 0.25 s; duration "
                     "to within a sample): " + "; ".join(parts) + ".")
            L.append("")
        an = c.get("anatomy_end")
        if an:
            h = an["heap"]
            L.append("What the table holds at the end (`pgstattuple`, after the relay caught up): heap %s MB = live "
                     "tuples %s MB (%d) + dead tuples %s MB (%d) + free space %s MB + page overhead %s MB."
                     % (mb(h["bytes"]), mb(h["live_bytes"]), h["live_tuples"], mb(h["dead_bytes"]), h["dead_tuples"],
                        mb(h["free_bytes"]), mb(h["bytes"] - h["live_bytes"] - h["dead_bytes"] - h["free_bytes"])))
            L.append("")
            L.append("| index | MB | leaf pages | avg leaf density % | empty pages | deleted pages | leaf fragmentation % |")
            L.append("|---|---:|---:|---:|---:|---:|---:|")
            for name, x in sorted(an["indexes"].items()):
                L.append("| %s | %s | %d | %s | %d | %d | %s |" % (name, mb(x["bytes"]), x["leaf_pages"],
                                                                   f(x["avg_leaf_density"]), x["empty_pages"],
                                                                   x["deleted_pages"], f(x["leaf_fragmentation"])))
            L.append("")
        if c.get("manual_vacuums"):
            L.append("The bench's own VACUUMs: %d, taking %s s." % (c["manual_vacuums"], ", ".join(
                "%.1f" % v for v in c["manual_vacuum_seconds"])))
            L.append("")
        if c.get("end_exact"):
            ex = c["end_exact"]
            L.append("Check at the end (full scan, %.0f ms): %d rows, %s MB by `sum(pg_column_size(e.*))`, ratio %s "
                     "(the estimate: %d rows, %s MB, ratio %s)."
                     % (ex["scan_ms"], ex["rows"], mb(ex["row_bytes"]), f(c.get("end_exact_ratio"), "%.3f"),
                        c["samples"][-1]["rows"], mb(c["samples"][-1]["row_bytes"]), f(c["end_ratio"], "%.3f")))
            L.append("")
        idx = sorted(c["samples"][-1]["indexes"]) if c["samples"] else []
        L.append("| t s | phase | committed | events/s since last | retained rows | retained MB | heap MB | " +
                 " | ".join("%s MB" % i for i in idx) +
                 " | table MB | **ratio** | / peak retained | n_live_tup | n_dead_tup | autovacuums | vacuum now | pending | oldest pending s "
                 "| probe ms |")
        L.append("|---:|---|---:|---:|---:|---:|---:|" + "---:|" * len(idx) + "---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
        av0 = c.get("autovacuum_base", 0)
        prev = (0.0, 0)
        for z in c["samples"]:
            dt = z["t"] - prev[0]
            rate = (z.get("committed", 0) - prev[1]) / dt if dt > 0.5 else None
            prev = (z["t"], z.get("committed", 0))
            L.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s | **%s** | %s | %s | %s | %s | %s | %s | %s | %s |"
                     % (f(z["t"], "%.0f"), z["phase"], z.get("committed", "-"), f(rate, "%.0f"), z["rows"], mb(z["row_bytes"]),
                        mb(z["heap_bytes"]), " | ".join(mb(z["indexes"].get(i)) for i in idx), mb(z["total_bytes"]),
                        f(z["ratio"], "%.2f"), f(z.get("peak_ratio"), "%.2f"), z["n_live_tup"], z["n_dead_tup"], z["autovacuum_count"] - av0,
                        z["vacuum_phase"] or "", z["pending"], f(z["oldest_pending_s"], "%.2f"), f(z["probe_ms"], "%.0f")))
        L.append("")
    return L


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else "bench/results/latest.json"
    with open(path) as fh:
        print(render(json.load(fh)))
