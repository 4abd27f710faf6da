"""
Hot standby: the relay never runs on a standby, and starts by itself when it is promoted.

A throw-away primary (env.pg_dir-primary, port env.pg_port+24) and a standby made from it with
pg_basebackup -R (env.pg_dir-standby, port +25), both preloading the library and pointed at
the test Kafka.  Events published on the primary are replicated as published; events emitted
while the primary's relay is idle (outbox.bootstrap_servers = '') stay pending and replicate.
On the standby: no relay process, outbox.status empty, nothing published.  After the primary
stops and the standby is promoted (pg_promote()), its relay publishes exactly the pending
events, in per-aggregate order, and not the already published ones.
"""
import time
from pathlib import Path

import psycopg2
import pytest

from conftest import (LogWatcher, create_topics, emit_round_robin, new_aggregate_type,
                      order_problems, pg_connect, pg_sh, query, query_one, relay_status, report,
                      topic_prefix, unique_messages, wait_relay_ready, wait_until)
from helpers_lifecycle import (PG_BINDIR, count_check, error_lines_of, id_counts, other_cluster,
                               relay_exit_lines, relay_pids, set_system)

N_AGGREGATES = 6
PUBLISHED_PER_AGG = 4           # published on the primary before the pause
PENDING_PER_AGG = 10            # pending when the primary goes away
STANDBY_POLL_MS = 100          # outbox.poll_interval of the standby


def test_standby_does_not_relay_and_promotion_publishes_pending(env, reader_factory):
    # the relay serves "postgres" (it exists from initdb on: the worker starts at once)
    primary = other_cluster(env, "primary", 24, database="postgres")
    standby = other_cluster(env, "standby", 25, database="postgres")
    agg_type = new_aggregate_type("standby")
    for c in (standby, primary):
        pg_sh(c, "reset", check=False)
    try:
        pg_sh(primary, "start")
        pc = pg_connect(primary)
        query(pc, "CREATE EXTENSION outbox")
        wait_relay_ready(primary)
        topic = topic_prefix(pc) + agg_type
        create_topics(env, [topic])
        reader = reader_factory([topic])
        reader.settle_env = primary     # its events come from that cluster's relay

        pc.autocommit = False
        published = emit_round_robin(pc, agg_type, N_AGGREGATES, PUBLISHED_PER_AGG, "sb")
        pc.autocommit = True
        msgs = unique_messages(reader.read_until(len(published), timeout=30, extra=0))
        count_check(id_counts(msgs), [e for e, _, _ in published], "events published on the primary")
        wait_until(lambda: query_one(pc, "SELECT count(*) FROM outbox.events WHERE aggregate_type = %s"
                                         " AND outbox.published(events)", (agg_type,))[0] == len(published),
                   20, "published_at on the primary")

        # the standby: a base backup with streaming replication settings (-R)
        data = Path(standby.pg_dir) / "data"
        pg_sh(standby, "run", "mkdir", "-p", standby.pg_dir)
        pg_sh(primary, "run", f"{PG_BINDIR}/pg_basebackup", "-h", "127.0.0.1", "-p", str(primary.pg_port),
              "-U", "postgres", "-D", str(data), "-R", "-X", "stream", "-c", "fast")
        conf = data / "postgresql.conf"
        conf.write_text(conf.read_text() + "\n# --- standby (test_16) ---\n"
                        f"port = {standby.pg_port}\nunix_socket_directories = '{standby.pg_dir}'\n"
                        "hot_standby = on\n"
                        # a relay, if one ran on the standby, would poll this often: the
                        # observation below spans 10 of its polls in 1 s (3 s at the default)
                        f"outbox.poll_interval = {STANDBY_POLL_MS}\n")
        assert (data / "standby.signal").exists()
        sb_watcher = LogWatcher(standby)
        pg_sh(standby, "start")
        sc = pg_connect(standby)
        assert query_one(sc, "SELECT pg_is_in_recovery()")[0] is True
        assert query_one(sc, "SHOW shared_preload_libraries")[0] == "outbox"
        assert query_one(sc, "SHOW outbox.bootstrap_servers")[0] == env.bootstrap

        # pause the primary's relay: the next events stay pending
        set_system(pc, "outbox.bootstrap_servers", "")
        wait_until(lambda: relay_status(pc)[0]["state"] == "not_configured", 20, "primary relay idle")
        pc.autocommit = False
        pending = emit_round_robin(pc, agg_type, N_AGGREGATES, PENDING_PER_AGG, "sb")
        pc.autocommit = True
        # seq numbers go on after the published ones
        pending = [(e, a, s + PUBLISHED_PER_AGG) for e, a, s in pending]
        pending_ids = [e for e, _, _ in pending]

        def standby_rows():
            return query_one(sc, "SELECT count(*) FILTER (WHERE NOT outbox.published(events)),"
                                 " count(*) FILTER (WHERE outbox.published(events))"
                                 " FROM outbox.events WHERE aggregate_type = %s", (agg_type,))
        wait_until(lambda: standby_rows() == (len(pending), len(published)), 30,
                   "the pending events to replicate to the standby")
        time.sleep(10 * STANDBY_POLL_MS / 1000)     # 10 poll intervals of a relay, if one ran
        assert standby_rows() == (len(pending), len(published))
        assert relay_pids(sc) == [], "a relay worker runs on the hot standby"
        assert relay_status(sc) == [], relay_status(sc)
        with pytest.raises(psycopg2.errors.ReadOnlySqlTransaction):
            query(sc, "SELECT outbox.emit('x', '1', 'x', '{}')")
        reader.poll(1.0)
        assert len(unique_messages(reader.snapshot())) == len(published), \
            "something was published while only the paused primary and the standby ran"
        sb_lines = sb_watcher.new_lines()
        assert not [ln for ln in sb_lines if "outbox relay" in ln], "\n".join(sb_lines)

        # the primary goes away; promote the standby
        pg_sh(primary, "stop")
        t0 = time.time()
        assert query_one(sc, "SELECT pg_promote(true, 60)")[0] is True
        promoted_s = time.time() - t0
        st = wait_relay_ready(standby, timeout=60)
        reader.settle_env = standby     # the promoted standby's relay sends from now on
        expected = {e: (a, s) for e, a, s in published + pending}
        raw = reader.read_until(len(expected), timeout=60, extra=2)
        msgs = unique_messages(raw)
        counts = id_counts(raw)
        count_check(counts, list(expected), "published + pending events after promotion")
        assert set(counts) == set(expected), f"unexpected: {sorted(set(counts) - set(expected))[:3]}"
        probs = order_problems(msgs, expected)
        assert not probs, "per-aggregate order broken:\n  " + "\n  ".join(probs[:10])
        last_s = max(m.recv_time for m in msgs if m.event_id in set(pending_ids)) - t0
        wait_until(lambda: query_one(sc, "SELECT count(*) FROM outbox.events WHERE aggregate_type = %s"
                                         " AND NOT outbox.published(events)", (agg_type,))[0] == 0,
                   20, "the promoted relay to mark the events published")
        st = relay_status(sc)[0]
        assert st["published"] == len(pending), st
        assert relay_pids(sc) == [st["pid"]]
        sb_lines = sb_watcher.new_lines()
        assert relay_exit_lines(sb_lines) == [] and error_lines_of(sb_lines, [st["pid"]]) == [], \
            "\n".join(sb_lines[-40:])
        # the promoted server accepts new events and relays them
        sc2 = pg_connect(standby, autocommit=False)
        more = emit_round_robin(sc2, agg_type, 2, 2, "post")
        sc2.close()
        raw = reader.read_until(len(expected) + len(more), timeout=30, extra=1)
        count_check(id_counts(raw), [e for e, _, _ in more], "events emitted after promotion")
        report(f"OUTBOX STANDBY: hot standby ran no relay (no process, empty outbox.status, 0 messages"
               f" over 10 poll intervals of a relay) with {len(pending)} pending events replicated; pg_promote() returned after"
               f" {promoted_s:.2f}s, all {len(pending)} pending events arrived {last_s:.2f}s after the"
               f" promotion started, each once, in order; the {len(published)} published on the old"
               f" primary were not re-sent")
        sc.close()
        pc.close()
    finally:
        for c in (standby, primary):
            pg_sh(c, "reset", check=False)
