"""PostgreSQL restart (pg_ctl restart -m fast): the relay comes back and delivers everything."""
import collections

import psycopg2
import pytest

from conftest import (LogWatcher, create_topics, emit_round_robin, event_rows, new_aggregate_type,
                      order_problems, pg_connect, pg_sh, query, relay_status, report,
                      unique_messages, wait_relay_ready, wait_until)


def test_restart_then_emit(env, prefix, reader_factory):
    agg_type = new_aggregate_type("restart")
    topic = prefix + agg_type
    create_topics(env, [topic])
    reader = reader_factory([topic])

    conn = pg_connect(env, autocommit=False)
    before = relay_status(conn)[0]
    conn.rollback()
    # committed right before the restart: delivered at least once whatever the relay was doing
    before_restart = emit_round_robin(conn, agg_type, 5, 10, "pre")

    watcher = LogWatcher(env)
    pg_sh(env, "restart")
    with pytest.raises(psycopg2.Error):     # the old session is gone
        query(conn, "SELECT 1")
    conn.close()

    conn = wait_until(lambda: pg_connect(env, autocommit=False), 30, "a new connection")
    after = wait_relay_ready(env, timeout=30)
    assert after["pid"] != before["pid"], "the relay worker was not restarted"
    assert after["started_at"] > before["started_at"]

    after_restart = emit_round_robin(conn, agg_type, 10, 10, "post")
    assert len(after_restart) == 100
    conn.autocommit = True

    expected = {eid: (agg_id, seq) for eid, agg_id, seq in before_restart + after_restart}
    msgs = unique_messages(reader.read_until(len(expected), timeout=60, extra=3))
    counts = collections.Counter(m.event_id for m in msgs)
    assert set(counts) == set(expected), \
        (f"missing {sorted(set(expected) - set(counts))[:5]}, "
         f"unexpected {sorted(set(counts) - set(expected))[:5]}")
    post_ids = {e for e, _, _ in after_restart}
    post_dups = {e: c for e, c in counts.items() if c > 1 and e in post_ids}
    assert not post_dups, f"events emitted after the restart were delivered twice: {post_dups}"
    pre_dups = sum(c - 1 for e, c in counts.items() if e not in post_ids)
    report(f"OUTBOX RESTART: {len(before_restart)} events committed just before the restart were "
           f"re-delivered {pre_dups} extra time(s) (at-least-once allows this); "
           f"{len(after_restart)} emitted after it, delivered once each")
    assert all(m.key == expected[m.event_id][0] for m in msgs)
    probs = order_problems(msgs, expected)
    assert not probs, "per-aggregate order broken:\n  " + "\n  ".join(probs[:10])

    rows = wait_until(lambda: (lambda r: all(x["published"] for x in r.values()) and r)(
        event_rows(conn, agg_type)), 30, "published_at on every row")
    assert set(rows) == set(expected)
    conn.close()

    log = "\n".join(watcher.new_lines())
    assert "outbox relay started for database" in log, log[-3000:]


def test_pg_sh_start_right_after_a_crash(env):
    """The README says to run test/demo.sh (which runs test/env/pg.sh start) again after a crash.
    Right after kill -9 of the postmaster, pg.sh said "already running" and exited 0 while the
    server was down (a fresh user's try): pg_ctl status still found the dying postmaster. One
    pg.sh start must bring the server back, however soon after the crash it runs."""
    import os
    import signal
    from helpers_lifecycle import extra_cluster
    from conftest import pg_connect, pg_sh, query_one, wait_until
    with extra_cluster(env, "crashstart", 33, database="postgres") as other:
        c = wait_until(lambda: pg_connect(other), 30, "a connection")
        c.close()
        with open(f"{other.pg_dir}/data/postmaster.pid") as f:
            pid = int(f.readline())
        os.kill(pid, signal.SIGKILL)
        p = pg_sh(other, "start", check=False, timeout=120)
        assert p.returncode == 0, f"pg.sh start failed:\n{p.stdout}\n{p.stderr}"
        assert "already running" not in (p.stdout + p.stderr), (p.stdout, p.stderr)
        c = pg_connect(other)
        assert query_one(c, "SELECT 1")[0] == 1
        c.close()
