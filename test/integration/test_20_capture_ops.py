"""
outbox.capture() and the operations API end to end through Kafka.

- capture(): INSERT, UPDATE, DELETE, COPY on a table with a one-column key, a composite key
  (with ':' and '\\' in key values) and an explicit topic, and a partitioned table (one
  partition attached with another column order): every change is one event with the documented
  event_type, key, payload {"op","table","before","after"} and headers; a rolled-back change
  writes and publishes nothing.
- pause(): the batch in flight is finished (published rows are an id prefix, nothing failed),
  then nothing is published while events keep coming (state paused, one LOG line per worker);
  the pause survives `pg.sh restart`; resume() publishes everything, in id order per partition,
  without duplicates.
- replay(since) and replay(from_id, to_id): exactly one more copy of each kept event, same event
  ids, in id order; events deleted by retention are neither replayed nor counted.
- purge(older_than): deletes published rows at once, never pending or failed ones.
- pause() and resume() in two open transactions: the second waits for the first, and the one
  that commits last wins (the relay ends paused or running accordingly).
"""
import collections
import io
import threading
import time
from pathlib import Path

from conftest import (create_topics, event_rows, message_problems, new_aggregate_type,
                      order_problems, pg_connect, pg_sh, query, query_one, report,
                      unique_messages, wait_until)
from helpers_security import (Log, emit_many, id_counts, lines_of_pid, pending_count,
                              per_partition_id_order, published_ids, set_system, status,
                              unique, wait_all_published, wait_counts, wait_shown, wait_state)


# --------------------------------------------------------------------------- capture()

def _snap(conn, table: str, where: str, args=()):
    rows = query(conn, f"SELECT row_to_json(t)::jsonb FROM public.{table} AS t WHERE {where}", args)
    assert len(rows) == 1, rows
    return rows[0][0]


def test_capture_trigger_end_to_end(env, prefix, reader_factory):
    t0 = time.monotonic()
    tag = unique("cap")
    agg1, agg2, agg3 = (new_aggregate_type(x) for x in ("cap", "capkey", "cappart"))
    topic1, topic2, topic3 = prefix + agg1, f"it.capture.{tag}", prefix + agg3
    t1, t2, t3 = f"{tag}_orders", f"{tag}_lines", f"{tag}_parted"
    create_topics(env, [topic1, topic2, topic3])
    reader = reader_factory([topic1, topic2, topic3])
    conn = pg_connect(env)
    query(conn, "SET TimeZone = 'UTC'")     # capture() renders rows in UTC: compare alike
    exp = []            # (aggregate_type, aggregate_id, event_type, topic column, payload)

    def expect(agg, key, table, op, before, after, topic=None):
        exp.append((agg, key, f"{table}.{op}", topic,
                    {"op": op, "table": f"public.{table}", "before": before, "after": after}))

    try:
        query(conn, f"""
            CREATE TABLE public.{t1} (id int PRIMARY KEY, customer text, total numeric(10,2),
                                      tags text[], at timestamptz, raw bytea, note text);
            CREATE TRIGGER outbox_capture AFTER INSERT OR UPDATE OR DELETE ON public.{t1}
                FOR EACH ROW EXECUTE FUNCTION outbox.capture('{agg1}', 'id');
            CREATE TABLE public.{t2} (region text, num int, qty int, PRIMARY KEY (region, num));
            CREATE TRIGGER outbox_capture AFTER INSERT OR UPDATE OR DELETE ON public.{t2}
                FOR EACH ROW EXECUTE FUNCTION outbox.capture('{agg2}', 'region, num', '{topic2}');
            CREATE TABLE public.{t3} (id int NOT NULL, kind text NOT NULL, v int) PARTITION BY LIST (kind);
            CREATE TABLE public.{t3}_a PARTITION OF public.{t3} FOR VALUES IN ('a');
            CREATE TRIGGER outbox_capture AFTER INSERT OR UPDATE OR DELETE ON public.{t3}
                FOR EACH ROW EXECUTE FUNCTION outbox.capture('{agg3}', 'id');
            -- attached later, columns in another order: the trigger is cloned onto it
            CREATE TABLE public.{t3}_b (v int, id int NOT NULL, kind text NOT NULL);
            ALTER TABLE public.{t3} ATTACH PARTITION public.{t3}_b FOR VALUES IN ('b');
        """)

        # one-column key, routed topic: INSERT (2 rows), UPDATE, DELETE, COPY
        query(conn, f"""INSERT INTO public.{t1} VALUES
            (1, 'ada', 99.90, ARRAY['a', 'b'], '2024-05-06 07:08:09.123456+00', '\\x00ff'::bytea, NULL),
            (2, 'bob', 5.00, '{{}}', NULL, NULL, 'x')""")
        expect(agg1, "1", t1, "created", None, _snap(conn, t1, "id = 1"))
        expect(agg1, "2", t1, "created", None, _snap(conn, t1, "id = 2"))
        before = _snap(conn, t1, "id = 1")
        query(conn, f"UPDATE public.{t1} SET total = 100.00, note = 'paid' WHERE id = 1")
        expect(agg1, "1", t1, "updated", before, _snap(conn, t1, "id = 1"))
        # a writer with other output settings: the same rendering (timestamps in UTC, hex bytea)
        odd = pg_connect(env)
        try:
            query(odd, "SET TimeZone = 'America/New_York'; SET DateStyle = 'German';"
                       " SET bytea_output = 'escape'")
            before = _snap(conn, t1, "id = 1")
            query(odd, f"UPDATE public.{t1} SET note = 'odd session' WHERE id = 1")
            expect(agg1, "1", t1, "updated", before, _snap(conn, t1, "id = 1"))
        finally:
            odd.close()
        before = _snap(conn, t1, "id = 2")
        query(conn, f"DELETE FROM public.{t1} WHERE id = 2")
        expect(agg1, "2", t1, "deleted", before, None)
        with conn.cursor() as cur:
            cur.copy_expert(f"COPY public.{t1} (id, customer, total) FROM STDIN",
                            io.StringIO("3\tcy\t1.50\n4\tdi\t2.25\n5\tev\t\\N\n"))
        for i in (3, 4, 5):
            expect(agg1, str(i), t1, "created", None, _snap(conn, t1, "id = %s", (i,)))

        # a rolled-back transaction: nothing written, nothing published
        rb = pg_connect(env, autocommit=False)
        try:
            query(rb, f"INSERT INTO public.{t1} (id, customer) VALUES (6, 'gone')")
            query(rb, f"UPDATE public.{t1} SET note = 'rolled back' WHERE id = 1")
            query(rb, f"DELETE FROM public.{t1} WHERE id = 3")
            assert query_one(rb, "SELECT count(*) FROM outbox.events WHERE aggregate_type = %s",
                             (agg1,))[0] == len(exp) + 3, "capture did not write in the transaction"
            rb.rollback()
        finally:
            rb.close()

        # composite key with ':' and '\' in values, explicit topic
        query(conn, f"INSERT INTO public.{t2} VALUES ('a:b', 2, 1), ('c\\d', 3, 1), ('plain', 1, 1)")
        keys = {("a:b", 2): "a\\:b:2", ("c\\d", 3): "c\\\\d:3", ("plain", 1): "plain:1"}
        for (region, num), key in keys.items():
            expect(agg2, key, t2, "created", None,
                   _snap(conn, t2, "region = %s AND num = %s", (region, num)), topic2)
        before = _snap(conn, t2, "region = 'a:b'")
        query(conn, f"UPDATE public.{t2} SET qty = 7 WHERE region = 'a:b'")
        expect(agg2, "a\\:b:2", t2, "updated", before, _snap(conn, t2, "region = 'a:b'"), topic2)
        before = _snap(conn, t2, "region = 'plain'")
        query(conn, f"DELETE FROM public.{t2} WHERE region = 'plain'")
        expect(agg2, "plain:1", t2, "deleted", before, None, topic2)
        # a changed key: deleted under the old key, created under the new one
        before = _snap(conn, t2, "region = 'c\\d'")
        query(conn, f"UPDATE public.{t2} SET num = 4 WHERE region = 'c\\d'")
        expect(agg2, "c\\\\d:3", t2, "deleted", before, None, topic2)
        expect(agg2, "c\\\\d:4", t2, "created", None, _snap(conn, t2, "region = 'c\\d'"), topic2)

        # partitioned table: events name the root table
        query(conn, f"INSERT INTO public.{t3} VALUES (1, 'a', 1), (2, 'b', 1)")
        expect(agg3, "1", t3, "created", None, _snap(conn, t3, "id = 1"))
        expect(agg3, "2", t3, "created", None, _snap(conn, t3, "id = 2"))
        before = _snap(conn, t3, "id = 2")
        query(conn, f"UPDATE public.{t3} SET v = 2 WHERE id = 2")
        expect(agg3, "2", t3, "updated", before, _snap(conn, t3, "id = 2"))
        before = _snap(conn, t3, "id = 1")
        query(conn, f"DELETE FROM public.{t3} WHERE id = 1")
        expect(agg3, "1", t3, "deleted", before, None)

        # the rows, in commit order, are exactly the expected events
        rows = {}
        agg_of = {}
        for a in (agg1, agg2, agg3):
            r = event_rows(conn, a)
            rows.update(r)
            agg_of.update({eid: a for eid in r})
        ordered = sorted(rows.values(), key=lambda r: r["id"])
        got = [(agg_of[r["event_id"]], r["aggregate_id"], r["event_type"], r["topic"], r["payload"])
               for r in ordered]
        problems = []
        if len(got) != len(exp):
            problems.append(f"{len(got)} events written, expected {len(exp)}")
        for i, (g, e) in enumerate(zip(got, exp)):
            if g != e:
                problems.append(f"event #{i + 1}:\n      got      {g}\n      expected {e}")
        assert not problems, "captured events differ:\n  " + "\n  ".join(problems[:10])

        # Kafka: each event once, as documented, in id order per partition
        want = {eid: 1 for eid in rows}
        counts = wait_counts(reader, want, timeout=60, extra=2)
        msgs = unique_messages(reader.snapshot())
        assert set(counts) == set(want), \
            f"missing {set(want) - set(counts)}, unexpected {set(counts) - set(want)}"
        topic_of = {agg1: topic1, agg2: topic2, agg3: topic3}
        mproblems = []
        for m in msgs:
            r = rows[m.event_id]
            mproblems += message_problems(
                m, event_id=m.event_id, aggregate_type=agg_of[m.event_id],
                aggregate_id=r["aggregate_id"], event_type=r["event_type"], payload=r["payload"],
                headers=None, topic=topic_of[agg_of[m.event_id]], created_ms=r["created_ms"])
        mproblems += per_partition_id_order(msgs, {eid: r["id"] for eid, r in rows.items()})
        assert not mproblems, "\n".join(mproblems[:20])
        # numeric exact in the message value (99.90 keeps its scale), bytea as hex
        first = next(m for m in msgs if m.event_id == ordered[0]["event_id"])
        assert b'"total": 99.90' in first.value and b'"raw": "\\\\x00ff"' in first.value, first.value
        report(f"OUTBOX CAPTURE: {len(exp)} captured events (INSERT/UPDATE/DELETE/COPY, composite key,"
               f" partitioned) delivered once each with documented type/key/payload/headers;"
               f" 3 rolled-back changes published nothing; {time.monotonic() - t0:.1f}s")
    finally:
        query(conn, f"DROP TABLE IF EXISTS public.{t1}, public.{t2}, public.{t3}")
        conn.close()


# --------------------------------------------------------------------------- pause / resume

def test_pause_survives_restart_and_resume_publishes_in_order(env, prefix, reader_factory):
    agg = new_aggregate_type("pause")
    topic = prefix + agg
    create_topics(env, [topic])
    reader = reader_factory([topic])
    conn = pg_connect(env)
    log = Log(env)
    keys = [f"k{i}" for i in range(8)]
    paused = False
    try:
        # a backlog that is being published when pause() commits
        n0 = 3000
        query(conn, "SELECT outbox.emit(%s, 'k' || mod(g, 8), 'pause.event',"
                    " jsonb_build_object('key', 'k' || mod(g, 8), 'seq', g)) FROM generate_series(1, %s) g",
              (agg, n0))
        query(conn, "SELECT outbox.pause()")
        paused = True
        t_pause = time.monotonic()
        st = wait_state(conn, "paused", 30, "state paused after outbox.pause()")
        pid1 = st["pid"]
        pub0 = published_ids(conn, agg)
        rows0 = query(conn, "SELECT id, outbox.published(events), attempts FROM outbox.events"
                            " WHERE aggregate_type = %s ORDER BY id", (agg,))
        assert len(rows0) == n0
        # the batch in flight was finished and marked, not aborted: an id prefix is published,
        # nothing failed
        flags = [p for _, p, _ in rows0]
        assert flags == sorted(flags, reverse=True), "published rows are not an id prefix"
        assert all(a == 0 for _, _, a in rows0), "a batch was aborted by the pause"

        # events keep coming while paused: nothing is published
        more = []
        for i in range(3):
            more += emit_many(conn, agg, keys, 1, tag=f"paused{i}")
            time.sleep(1.0)
        time.sleep(1.0)
        assert published_ids(conn, agg) == pub0, "events were published while paused"
        st = status(conn)
        assert st["state"] == "paused" and st["pid"] == pid1, st
        assert query_one(conn, "SELECT paused FROM outbox.relay")[0] is True
        reader.read_until(len(pub0), timeout=30, extra=1.5)
        got = id_counts(reader.snapshot())
        assert sum(got.values()) == len(pub0), \
            f"{sum(got.values())} messages in Kafka, {len(pub0)} events were published before the pause"
        paused_lines = [ln for ln in log.lines() if "outbox relay is paused" in ln]
        assert len(paused_lines) == 1, paused_lines

        # the pause survives a restart
        log2 = Log(env)
        conn.close()
        pg_sh(env, "restart")
        conn = wait_until(lambda: pg_connect(env), 30, "a connection after the restart")
        st = wait_state(conn, "paused", 60, "state paused after the restart")
        pid2 = st["pid"]
        assert pid2 != pid1
        more += emit_many(conn, agg, keys, 1, tag="after_restart")
        time.sleep(3.0)                     # several poll intervals
        assert published_ids(conn, agg) == pub0, "events were published after the restart while paused"
        assert pending_count(conn, agg) == n0 - len(pub0) + len(more)
        assert status(conn)["state"] == "paused"
        lines2 = log2.lines()
        paused2 = [ln for ln in lines_of_pid(lines2, pid2) if "outbox relay is paused" in ln]
        assert len(paused2) == 1, paused2
        reader.poll(0.5)
        assert sum(id_counts(reader.snapshot()).values()) == len(pub0), "messages arrived while paused"

        # resume: everything, in id order per partition, once
        log3 = Log(env)
        t_resume = time.time()
        query(conn, "SELECT outbox.resume()")
        paused = False
        all_rows = event_rows(conn, agg)
        want = {eid: 1 for eid in all_rows}
        counts = wait_counts(reader, want, timeout=90, extra=2)
        msgs = unique_messages(reader.snapshot())
        missing = set(want) - set(counts)
        assert not missing, f"{len(missing)} of {len(want)} events not delivered after resume()"
        dups = {e: c for e, c in counts.items() if c != 1}
        assert not dups, f"{len(dups)} events delivered more than once: {list(dups.items())[:5]}"
        probs = per_partition_id_order(msgs, {e: r["id"] for e, r in all_rows.items()})
        # per key: arrival order = id order (= commit order, one session)
        probs += order_problems(msgs, {e: (r["aggregate_id"], r["id"]) for e, r in all_rows.items()})
        assert not probs, "order broken:\n  " + "\n  ".join(p[:300] for p in probs[:10])
        last = max(m.recv_time for m in msgs)
        wait_state(conn, ("idle", "publishing"), 30)
        resumed = [ln for ln in log3.lines() if "outbox relay resumed" in ln]
        assert len(resumed) == 1, resumed
        report(f"OUTBOX PAUSE: {len(pub0)} of {n0} backlog events were published before pause() took"
               f" effect (batch finished, id prefix, no failure); {len(more)} more emitted while paused:"
               f" 0 published, also across `pg.sh restart` (1 'paused' LOG line per worker); resume()"
               f" delivered all {len(want)} in {last - t_resume:.1f}s, 0 duplicates, id order per partition")
    finally:
        if paused:
            c = wait_until(lambda: pg_connect(env), 30, "a connection")
            query(c, "SELECT outbox.resume()")
            c.close()
        conn.close()


# --------------------------------------------------------------------------- replay

def _pause_resume_race(env, first: str, second: str) -> dict:
    """Session A runs outbox.<first>() and holds its transaction open; session B then runs
    outbox.<second>() (it must wait for A); A commits, then B.  Returns what B's call waited for
    and the relay row and state afterwards."""
    a = pg_connect(env, autocommit=False)
    b = pg_connect(env, autocommit=False)
    done = threading.Event()
    errors = []

    def run_b():
        try:
            query(b, f"SELECT outbox.{second}()")
            done.set()
            time.sleep(0.3)
            b.commit()
        except Exception as e:          # noqa: BLE001  (reported by the caller)
            errors.append(e)
            done.set()
    watch = pg_connect(env)
    try:
        query(a, f"SELECT outbox.{first}()")
        b_pid = b.get_backend_pid()
        t = threading.Thread(target=run_b)
        t.start()

        # B waits for A's row lock: its backend shows a Lock wait while its call has not returned
        # (a thread merely slow to start would show neither)
        def b_state():
            if done.is_set():
                return "returned"
            row = query(watch, "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (b_pid,))
            return "waits for a lock" if row and row[0][0] == "Lock" else None
        blocked = wait_until(b_state, 30, f"outbox.{second}() to return or wait for a lock") \
            == "waits for a lock" and not done.is_set()
        a.commit()
        t.join(10)
        assert not errors, errors
        row = query_one(a, "SELECT paused FROM outbox.relay")
        a.commit()
        return dict(blocked=blocked, paused=row[0])
    finally:
        watch.close()
        a.close()
        b.close()


def test_concurrent_pause_and_resume_the_later_commit_wins(env):
    conn = pg_connect(env)
    try:
        query(conn, "SELECT outbox.resume()")
        wait_state(conn, ("idle", "publishing"), what="relay running before the race")
        r1 = _pause_resume_race(env, "pause", "resume")
        st1 = wait_state(conn, ("idle", "publishing"), what="relay running: resume committed last")
        r2 = _pause_resume_race(env, "resume", "pause")
        st2 = wait_state(conn, "paused", what="relay paused: pause committed last")
        report(f"OUTBOX PAUSE/RESUME RACE: pause then resume -> paused={r1['paused']} (B waited for A:"
               f" {r1['blocked']}), state {st1['state']}; resume then pause -> paused={r2['paused']}"
               f" (B waited: {r2['blocked']}), state {st2['state']}")
        assert r1 == dict(blocked=True, paused=False), r1
        assert r2 == dict(blocked=True, paused=True), r2
    finally:
        query(conn, "SELECT outbox.resume()")
        wait_state(conn, ("idle", "publishing"), what="relay resumed after the test")
        conn.close()


def documented_alert_query() -> str:
    """The alert query of doc/operations.md's "Monitoring" section, exactly as printed there."""
    text = (Path(__file__).resolve().parents[2] / "doc" / "operations.md").read_text()
    start = text.index("-- no relay, or a relay that is not delivering")
    return text[start:text.index("```", start)]


def test_documented_alert_query(env):
    sql = documented_alert_query()
    conn = pg_connect(env)
    try:
        wait_state(conn, ("idle", "publishing"), what="relay running")
        healthy = query_one(conn, sql)[0]
        query(conn, "SELECT outbox.pause()")
        wait_state(conn, "paused", what="relay paused")
        paused = query_one(conn, sql)[0]
    finally:
        query(conn, "SELECT outbox.resume()")
        wait_state(conn, ("idle", "publishing"), what="relay resumed after the test")
        conn.close()
    report(f"OUTBOX MONITORING QUERY (doc/operations.md): running -> {healthy!r}, paused -> {paused!r}")
    assert healthy is None, healthy
    assert paused is not None and paused.startswith("relay paused"), paused


def _occurrence_order(msgs, row_id, occurrence):
    """Per partition, the n-th copies of events (offset order) must be in ascending id."""
    seen = collections.Counter()
    picked = []
    for m in sorted(unique_messages(msgs), key=lambda m: (m.topic, m.partition, m.offset)):
        seen[m.event_id] += 1
        if seen[m.event_id] == occurrence:
            picked.append(m)
    return per_partition_id_order(picked, row_id)


def test_replay_republishes_kept_events_with_same_ids(env, prefix, reader_factory):
    agg = new_aggregate_type("replay")
    topic = prefix + agg
    create_topics(env, [topic])
    reader = reader_factory([topic])
    conn = pg_connect(env)
    keys = ["r1", "r2", "r3"]
    try:
        since = query_one(conn, "SELECT clock_timestamp()")[0]
        # A1: published, then deleted by retention
        set_system(conn, {"outbox.retention": "1"})
        wait_shown(env, "outbox.retention", "1s")
        time.sleep(0.5)
        a1 = emit_many(conn, agg, keys, 2, tag="a1")
        a1_ids = [e for e, _, _ in a1]
        wait_until(lambda: query_one(conn, "SELECT count(*) FROM outbox.events WHERE event_id = ANY(%s::uuid[])",
                                     (a1_ids,))[0] == 0, 30, "retention to delete the first events")
        # A2: published and kept
        set_system(conn, {"outbox.retention": "-1"})
        wait_shown(env, "outbox.retention", "-1")
        time.sleep(1.0)
        a2 = emit_many(conn, agg, keys, 4, tag="a2")
        a2_ids = [e for e, _, _ in a2]
        wait_all_published(conn, agg, len(a2))
        rows = event_rows(conn, agg)
        assert set(rows) == set(a2_ids)
        row_id = {e: r["id"] for e, r in rows.items()}
        counts = wait_counts(reader, {e: 1 for e in a1_ids + a2_ids}, timeout=60, extra=1)
        assert not [e for e in a1_ids + a2_ids if counts.get(e) != 1], counts

        # replay(since): the kept events once more; the deleted ones are not counted
        n = query_one(conn, "SELECT outbox.replay(%s)", (since,))[0]
        assert n == len(a2), f"replay(since) returned {n}, {len(a2)} events are kept ({len(a1)} were deleted)"
        want = {**{e: 1 for e in a1_ids}, **{e: 2 for e in a2_ids}}
        counts = wait_counts(reader, want, timeout=60, extra=2)
        probs = [p for p in (f"{e}: {counts.get(e, 0)} copies, expected {w}"
                             for e, w in want.items() if counts.get(e, 0) != w)]
        assert not probs, "replay(since):\n  " + "\n  ".join(probs[:10])
        assert set(counts) == set(want)
        probs = _occurrence_order(reader.snapshot(), row_id, 2)
        assert not probs, "replayed copies out of id order:\n  " + "\n  ".join(probs[:10])
        wait_all_published(conn, agg, len(a2))

        # replay(from_id, to_id) over a range that begins among the deleted events
        lo = min(row_id.values()) - len(a1)
        hi = row_id[a2_ids[5]]
        n = query_one(conn, "SELECT outbox.replay(%s::bigint, %s::bigint)", (lo, hi))[0]
        assert n == 6, f"replay({lo}, {hi}) returned {n}, expected 6 kept events in the range"
        for e in a2_ids[:6]:
            want[e] = 3
        counts = wait_counts(reader, want, timeout=60, extra=2)
        probs = [f"{e}: {counts.get(e, 0)} copies, expected {w}" for e, w in want.items()
                 if counts.get(e, 0) != w]
        assert not probs, "replay(from_id, to_id):\n  " + "\n  ".join(probs[:10])
        probs = _occurrence_order(reader.snapshot(), row_id, 3)
        assert not probs, "replayed copies out of id order:\n  " + "\n  ".join(probs[:10])
        # the copies carry the same event (id header, key, payload)
        for m in unique_messages(reader.snapshot()):
            r = rows.get(m.event_id)
            if r is not None:
                assert m.key == r["aggregate_id"] and m.json() == r["payload"], m
        wait_all_published(conn, agg, len(a2))
        report(f"OUTBOX REPLAY: replay(since) requeued {len(a2)} kept events (not the {len(a1)} deleted"
               f" by retention), each arrived exactly once more with the same id, in id order;"
               f" replay(from_id, to_id) requeued 6, exactly one more copy each")
    finally:
        set_system(conn, {"outbox.retention": None})
        conn.close()


# --------------------------------------------------------------------------- purge

def test_purge_deletes_published_never_pending_or_failed(env, prefix, reader_factory):
    agg = new_aggregate_type("purge")
    topic = prefix + agg
    create_topics(env, [topic])
    reader = reader_factory([topic])
    conn = pg_connect(env)
    paused = False
    failed_id = None
    try:
        set_system(conn, {"outbox.retention": "-1"})
        wait_shown(env, "outbox.retention", "-1")
        time.sleep(1.0)
        query(conn, "SELECT outbox.purge('0')")        # start from no published rows at all
        p1 = emit_many(conn, agg, ["p1", "p2"], 3, tag="p1")
        wait_all_published(conn, agg, len(p1))
        query(conn, "SELECT outbox.pause()")
        paused = True
        wait_state(conn, "paused", 30)
        p2 = emit_many(conn, agg, ["p1", "p2"], 2, tag="p2")
        (failed_id,) = [e for e, _, _ in emit_many(conn, agg, ["p3"], 1, tag="p3")]
        query(conn, "UPDATE outbox.events SET failed_at = clock_timestamp(), attempts = 10,"
                    " permanent_failures = 10, last_error = 'test: marked failed'"
                    " WHERE event_id = %s", (failed_id,))

        assert query_one(conn, "SELECT outbox.purge('1 hour')")[0] == 0
        assert len(event_rows(conn, agg)) == len(p1) + len(p2) + 1
        n = query_one(conn, "SELECT outbox.purge('0')")[0]
        assert n == len(p1), f"purge('0') deleted {n} rows, {len(p1)} were published"
        left = event_rows(conn, agg)          # at once, not at the relay's next cleanup
        assert set(left) == {e for e, _, _ in p2} | {failed_id}, \
            "purge() must delete the published rows at once and keep pending and failed ones"
        assert all(not r["published"] for r in left.values())

        query(conn, "DELETE FROM outbox.events WHERE event_id = %s", (failed_id,))
        failed_id = None
        query(conn, "SELECT outbox.resume()")
        paused = False
        counts = wait_counts(reader, {e: 1 for e, _, _ in p1 + p2}, timeout=60, extra=1)
        assert set(counts) == {e for e, _, _ in p1 + p2}
        report(f"OUTBOX PURGE: purge('1 hour') deleted 0, purge('0') deleted exactly the {len(p1)}"
               f" published rows at once; {len(p2)} pending and 1 failed row kept; pending delivered after resume()")
    finally:
        if failed_id is not None:
            query(conn, "DELETE FROM outbox.events WHERE event_id = %s", (failed_id,))
        if paused:
            query(conn, "SELECT outbox.resume()")
        set_system(conn, {"outbox.retention": None})
        conn.close()
