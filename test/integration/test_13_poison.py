"""
Permanent errors (dead letters, schema 1.1) against the real broker and the mock cluster:

- payloads Kafka refuses: 1.1 MB and 10 MB (librdkafka refuses them before sending, > 1048588
  bytes) and one just small enough for librdkafka but too large for the broker (refused in the
  delivery report).  Each refused attempt counts in attempts and permanent_failures, sets
  last_error and a backoff; at outbox.max_attempts the row is marked failed, a WARNING names the
  batch, outbox.status counts it, later events of the same aggregate wait (hold) while other
  aggregates flow; retry_failed(id) and retry_failed() requeue, and once the cause is fixed the
  requeued events and the held-back ones arrive in order.  With on_failed_event = skip the later
  events go on without the failed one.
- a topic the broker refuses (mock: UNKNOWN_TOPIC_OR_PART and TOPIC_AUTHORIZATION_FAILED).
- a broker outage longer than outbox.delivery_timeout with max_attempts = 1: transient, never a
  dead letter.
Every poison row left behind is deleted, every setting restored.
"""
import collections
import re
import time
import uuid

from confluent_kafka import Producer

from conftest import (LogWatcher, admin, create_topics, emit, new_aggregate_type, query,
                      query_one, relay_cpu_while_idle, report, set_conf, wait_until)
from helpers_lifecycle import topic_message_count
from helpers_faults import (MOCK_KAFKA_PROPERTIES, Stream, check_delivery, mock_reader,
                            mock_topic, pump, read_all, relay_on_mock, row_summary,
                            status, wait_all_published, wait_setting)

MAX_ATTEMPTS = 3
TIME_LIMIT_MS = 5000            # message.timestamp.before.max.ms of the shared-refusal topic
BACKOFF_MAX = "1s"              # every retry of a failed event after 1 s (keeps the test short)
DEAD_LETTER_TIMEOUT = 60
FAILED_RE = re.compile(r"outbox relay marked (\d+) event\(s\) failed: each was refused (\d+) time\(s\)")


def event_state(conn, event_ids):
    with conn.cursor() as cur:
        cur.execute("""SELECT event_id::text, attempts, permanent_failures, last_error,
                              next_attempt_at, failed_at, published_at,
                              outbox.published(events) AS published, clock_timestamp()
                         FROM outbox.events WHERE event_id = ANY(%s::uuid[])""", (list(event_ids),))
        cols = [d[0] for d in cur.description]
        return {r[0]: dict(zip(cols, r)) for r in cur.fetchall()}


def dead_letter_lines(lines):
    """(events, times) of each 'marked N event(s) failed' WARNING."""
    out = []
    for ln in lines:
        m = FAILED_RE.search(ln)
        if m:
            assert "WARNING:" in ln, ln
            out.append((int(m.group(1)), int(m.group(2))))
    return out


def watch_until_failed(conn, poison_ids, timeout=DEAD_LETTER_TIMEOUT):
    """Poll the poison rows until all are marked failed.  Returns (final rows, every distinct
    intermediate state seen as {event_id: [(attempts, permanent_failures, failed?, backoff?)]})."""
    seen = collections.defaultdict(list)
    problems = []
    deadline = time.monotonic() + timeout
    while True:
        rows = event_state(conn, poison_ids)
        for eid, r in rows.items():
            st = (r["attempts"], r["permanent_failures"], r["failed_at"] is not None)
            if not seen[eid] or seen[eid][-1] != st:
                seen[eid].append(st)
                if 0 < r["permanent_failures"] < MAX_ATTEMPTS:
                    # a refused attempt that is not yet the last: backoff, no dead letter yet
                    if r["failed_at"] is not None:
                        problems.append(f"{eid}: failed_at set after {r['permanent_failures']} permanent failure(s)")
                    if r["next_attempt_at"] is None:
                        problems.append(f"{eid}: no backoff (next_attempt_at) after a refused attempt")
                    if not r["last_error"]:
                        problems.append(f"{eid}: no last_error after a refused attempt")
        if len(rows) == len(poison_ids) and all(r["failed_at"] is not None for r in rows.values()):
            return rows, dict(seen), problems
        if time.monotonic() > deadline:
            raise AssertionError(f"not all of {len(poison_ids)} poison events were marked failed within"
                                 f" {timeout}s: {[(r['attempts'], r['permanent_failures'], r['failed_at'], r['last_error']) for r in rows.values()]}")
        time.sleep(0.1)


def broker_refused_blob(env, key: str, headers: list, topic: str) -> int:
    """Length n of a payload {"blob": "x"*n} that librdkafka accepts (wire size within its
    message.max.bytes = 1048588) but the broker refuses (the record batch is larger than the
    broker's limit), checked with a producer configured like the relay's."""
    create_topics(env, [topic], partitions=1)
    p = Producer({"bootstrap.servers": env.bootstrap, "enable.idempotence": True, "acks": "all",
                  "message.max.bytes": 1048588, "linger.ms": 1})
    fixed = len(key) + sum(len(k) + len(v) for k, v in headers) + len('{"blob": ""}')
    n = 1048525 - fixed               # about the middle of the window (measured: ~80 bytes)
    for _ in range(8):
        value = ('{"blob": "' + "x" * n + '"}').encode()
        res = []
        try:
            p.produce(topic, value, key=key.encode(), headers=headers,
                      on_delivery=lambda err, msg: res.append(err))
        except Exception:  # noqa: BLE001  refused locally: too large for librdkafka
            n -= 20
            continue
        p.flush(30)
        assert res, "no delivery report for the size probe"
        if res[0] is None:
            n += 20                   # accepted by the broker: too small
            continue
        assert res[0].name() == "MSG_SIZE_TOO_LARGE", res[0]
        return n
    raise AssertionError("found no payload size that the broker refuses but librdkafka accepts")


def payload_poison_flow(env, conn, prefix, reader_factory, tag, poisons, later=2, allow_duplicates=False):
    """Stream 10 healthy aggregates; in one transaction emit, per (aggregate_id, payload) in
    poisons, the poison event followed by `later` normal events of the same aggregate.  Check the
    dead letters (attempt by attempt), hold, status, WARNINGs; then fix the payloads, requeue
    (the first with retry_failed(id), the rest with retry_failed()) and check that everything
    arrives in order.  Returns the figures."""
    agg_type = new_aggregate_type(f"poison_{tag}")
    topic = prefix + agg_type
    create_topics(env, [topic])
    reader = reader_factory([topic])
    before = status(conn)
    watcher = LogWatcher(env)
    stream = None
    poison, held = {}, {}
    fig = {}
    requeued_ok = False
    try:
        set_conf(conn, max_attempts=MAX_ATTEMPTS, retry_backoff_max=BACKOFF_MAX)
        wait_setting(conn, "max_attempts", str(MAX_ATTEMPTS))
        wait_setting(conn, "retry_backoff_max", BACKOFF_MAX)
        time.sleep(1)           # the relay applies the reload at its next loop
        stream = Stream(env, agg_type, 10, "flow", interval=0.02).start()
        pump(reader, 1.0)

        conn.autocommit = False
        with conn.cursor() as cur:
            for agg_id, payload in poisons:
                poison[emit(cur, agg_type, agg_id, "it.poison", payload)] = (agg_id, 1)
                for seq in range(2, later + 2):
                    held[emit(cur, agg_type, agg_id, "it.stream", {"agg": agg_id, "seq": seq})] = (agg_id, seq)
        conn.commit()
        conn.autocommit = True
        poison_at = time.time()

        rows, seen, problems = watch_until_failed(conn, list(poison))
        fig["dead_after"] = time.time() - poison_at
        assert not problems, problems
        for eid, r in rows.items():
            assert r["attempts"] == MAX_ATTEMPTS and r["permanent_failures"] == MAX_ATTEMPTS, (eid, r)
            assert "MSG_SIZE_TOO_LARGE" in (r["last_error"] or ""), (eid, r["last_error"])
            assert r["next_attempt_at"] is not None and not r["published"], (eid, r)
            # the permanent failures were counted one attempt at a time
            pfs = [st[1] for st in seen[eid]]
            assert pfs == sorted(pfs) and pfs[-1] == MAX_ATTEMPTS, seen[eid]
        fig["last_error"] = next(iter(rows.values()))["last_error"]

        # hold: the later events of the failed aggregates wait, the rest keeps flowing
        pump(reader, 2.5)
        hrows = event_state(conn, held)
        overtook = sorted(f"{held[e][0]} seq {held[e][1]}" for e, r in hrows.items()
                          if r["published"])
        overtaken_warnings = [ln for ln in watcher.new_lines() if "were acknowledged after an earlier event" in ln]
        assert not overtook, (f"later events overtook a failed event of their aggregate (on_failed_event ="
                              f" hold): {overtook}; relay log: {overtaken_warnings}")
        assert all(r["failed_at"] is None for r in hrows.values()), hrows
        flowing = [m for m in reader.snapshot() if m.key and m.key.startswith("flow-")
                   and m.recv_time >= poison_at]
        fig["flowing"] = len(flowing)
        st = status(conn)
        n = len(poison)
        assert st["failed"] - before["failed"] == n, (before, st)
        assert st["failed_events"] - before["failed_events"] == n, (before, st)
        assert st["delivery_errors"] - before["delivery_errors"] >= n * MAX_ATTEMPTS, (before, st)
        warns = dead_letter_lines(watcher.new_lines())
        fig["warnings"] = len(warns)
        assert sum(k for k, _ in warns) == n and all(t == MAX_ATTEMPTS for _, t in warns), warns
        assert flowing, "no event of other aggregates arrived while the poison events failed"

        # requeue: not an event that is not failed; then fix the payloads and retry
        first, *rest = list(poison)
        assert query_one(conn, "SELECT outbox.retry_failed(%s::uuid)", (next(iter(held)),))[0] is False
        query(conn, "UPDATE outbox.events SET payload = jsonb_build_object('agg', aggregate_id, 'seq', 1)"
                    " WHERE event_id = ANY(%s::uuid[])", (list(poison),))
        conn.autocommit = False
        assert query_one(conn, "SELECT outbox.retry_failed(%s::uuid)", (first,))[0] is True
        r = event_state(conn, [first])[first]
        assert r["failed_at"] is None and r["permanent_failures"] == 0 and r["next_attempt_at"] is None, r
        conn.commit()
        if rest:
            fig["requeued"] = query_one(conn, "SELECT outbox.retry_failed()")[0]
            rq = event_state(conn, rest)
            conn.commit()
            assert fig["requeued"] >= len(rest), fig
            assert all(x["failed_at"] is None and x["permanent_failures"] == 0 for x in rq.values()), rq
        conn.autocommit = True
        pump(reader, 1.0)
        requeued_ok = True
    finally:
        if stream is not None:
            stream.stop()
        conn.rollback()
        conn.autocommit = True
        set_conf(conn, max_attempts=None, retry_backoff_max=None)
        if not requeued_ok:
            query(conn, "DELETE FROM outbox.events WHERE aggregate_type = %s AND NOT outbox.published(events)",
                  (agg_type,))

    try:
        emitted = [(e, a, q) for e, (a, q) in {**poison, **held}.items()] + stream.emitted
        summary = wait_all_published(conn, agg_type, emitted, timeout=60)
        check = check_delivery(read_all(reader, emitted, timeout=30), emitted)
        after = status(conn)
        fig.update(check=check, after=after, before=before)
        check.assert_ok("the requeued poison events and the held-back ones", allow_duplicates=allow_duplicates)
        assert summary["failed"] == 0 and summary["unpublished"] == 0, summary
        flow_rows = query_one(conn, "SELECT count(*) FROM outbox.events WHERE aggregate_type = %s"
                                    " AND aggregate_id LIKE 'flow-%%' AND attempts > 0", (agg_type,))[0]
        assert flow_rows == 0, f"{flow_rows} events of healthy aggregates had failed attempts"
        assert after["failed_events"] <= before["failed_events"], (before, after)
    finally:
        query(conn, "DELETE FROM outbox.events WHERE aggregate_type = %s AND NOT outbox.published(events)", (agg_type,))
    return fig


def report_payload(fig, what):
    c = fig["check"]
    report(f"OUTBOX POISON {what}: marked failed after {MAX_ATTEMPTS} refusals in {fig['dead_after']:.1f}s"
           f" ({fig['last_error']}; {fig['warnings']} WARNING line(s)); {fig['flowing']} events of 10 other"
           f" aggregates arrived meanwhile; after fixing and retry_failed: {c.expected} events,"
           f" {len(c.missing)} lost, {c.duplicates} duplicate(s), order problems {len(c.order_problems)};"
           f" status failed +{fig['after']['failed'] - fig['before']['failed']}")


def test_oversized_payloads_dead_letter_hold_and_retry(env, conn, prefix, reader_factory):
    """1.1 MB and 10 MB: librdkafka refuses them at produce time (> message.max.bytes)."""
    fig = payload_poison_flow(env, conn, prefix, reader_factory, "big",
                              [("big-1", {"blob": "x" * 1_100_000}),
                               ("big-2", {"blob": "y" * 10_000_000})])
    report_payload(fig, "payloads 1.1 MB and 10 MB")


def test_payload_refused_by_broker_holds_back_its_aggregate(env, conn, prefix, reader_factory):
    """A payload small enough for librdkafka but too large for the broker: the refusal comes in
    the delivery report, after the later events of its aggregate were already handed to
    librdkafka in the same batch.  They must still not overtake it."""
    agg_probe = [("id", str(uuid.uuid4()).encode()), ("event_type", b"it.poison"),
                 ("aggregate_type", b"it_poison_edge_0123456789")]
    n = broker_refused_blob(env, "edge-1", agg_probe, f"it_sizeprobe_{uuid.uuid4().hex[:8]}")
    # each refusal stops librdkafka (gapless guarantee) and the relay rebuilds its producer;
    # events of other aggregates that were in flight then are sent again: duplicates are
    # allowed here (at-least-once), reordering is not
    fig = payload_poison_flow(env, conn, prefix, reader_factory, "edge",
                              [("edge-1", {"blob": "x" * n})], allow_duplicates=True)
    report_payload(fig, f"payload of {n + 12} bytes (refused by the broker, not by librdkafka)")


def test_skip_lets_later_events_pass_a_failed_one(env, conn, prefix, reader_factory):
    agg_type = new_aggregate_type("poison_skip")
    topic = prefix + agg_type
    create_topics(env, [topic])
    reader = reader_factory([topic])
    before = status(conn)
    watcher = LogWatcher(env)
    try:
        set_conf(conn, max_attempts=1, on_failed_event="skip")
        wait_setting(conn, "on_failed_event", "skip")
        time.sleep(1)           # the relay applies the reload at its next loop
        conn.autocommit = False
        with conn.cursor() as cur:
            s1 = emit(cur, agg_type, "skip-1", "it.poison", {"blob": "x" * 1_100_000})
            s2 = emit(cur, agg_type, "skip-1", "it.stream", {"agg": "skip-1", "seq": 2})
            s3 = emit(cur, agg_type, "skip-1", "it.stream", {"agg": "skip-1", "seq": 3})
        conn.commit()
        conn.autocommit = True
        rows, _, problems = watch_until_failed(conn, [s1], timeout=30)
        assert rows[s1]["permanent_failures"] == 1 and rows[s1]["attempts"] == 1, rows
        msgs = read_all(reader, [(s2, "skip-1", 2), (s3, "skip-1", 3)], timeout=30, extra=1)
        check = check_delivery(msgs, [(s2, "skip-1", 2), (s3, "skip-1", 3)])
        check.assert_ok("events after a failed one with on_failed_event = skip", allow_duplicates=False)
        assert s1 not in {m.event_id for m in msgs}
        warns = [ln for ln in watcher.new_lines() if FAILED_RE.search(ln)]
        hints = [ln for ln in watcher.new_lines() if "HINT:" in ln and "retry_failed()" in ln]
        report(f"OUTBOX POISON skip: the failed event stays failed, the 2 later events of its aggregate"
               f" were delivered ({check.received} messages); {len(warns)} WARNING line(s)")
        assert dead_letter_lines(watcher.new_lines()) == [(1, 1)]
        assert hints and all("on_failed_event = hold" not in h for h in hints), hints
        assert status(conn)["failed"] - before["failed"] == 1
    finally:
        set_conf(conn, max_attempts=None, on_failed_event=None)
        query(conn, "DELETE FROM outbox.events WHERE aggregate_type = %s AND NOT outbox.published(events)", (agg_type,))


def test_held_event_does_not_slow_the_others(env, conn, prefix, reader_factory):
    """One event held behind a dead letter (on_failed_event = hold) must not slow the other
    aggregates down.  It is due to the row-tracked claim, which takes nothing while its blocker
    is failed; the relay then slept a poll interval before each snapshot batch: with
    poll_interval 5 s and batch_size 100, 3,000 events took 150 s.  Now they drain at once."""
    agg_type = new_aggregate_type("poison_hold")
    topic = prefix + agg_type
    create_topics(env, [topic])
    reader = reader_factory([topic])
    n = 3000
    try:
        set_conf(conn, max_attempts=1, poll_interval="5s", batch_size=100)
        wait_setting(conn, "batch_size", "100")
        time.sleep(1)           # the relay applies the reload at its next loop
        poison = query_one(conn, "SELECT outbox.emit(%s, 'held-1', 'it.poison', jsonb_build_object('blob', repeat('x', 1100000)))",
                           (agg_type,))[0]
        watch_until_failed(conn, [poison], timeout=30)
        held = query_one(conn, "SELECT outbox.emit(%s, 'held-1', 'it.after', '{}')", (agg_type,))[0]
        time.sleep(1)           # the held event is taken out of the snapshot batches (demoted)
        start = time.monotonic()
        query(conn, "SELECT outbox.emit(%s, 'other-' || (g %% 50), 'it.other', jsonb_build_object('n', g))"
                    "  FROM generate_series(1, %s) g", (agg_type, n))
        wait_until(lambda: query_one(conn, "SELECT count(*) FROM outbox.events e WHERE aggregate_type = %s"
                                           " AND aggregate_id <> 'held-1' AND NOT outbox.published(e)",
                                     (agg_type,))[0] == 0,
                   60, f"{n} events of other aggregates to be published beside a held one")
        took = time.monotonic() - start
        got = {m.event_id for m in reader.read_until(n, timeout=60, extra=1)}
        assert poison not in got and held not in got, "the failed event or the one behind it went out"
        st = status(conn)
        # the held event stays due to the row-tracked claim, which takes nothing: the relay must
        # still sleep between passes, not turn from that claim to the snapshot batch and back
        idle_cpu = relay_cpu_while_idle(conn)
        report(f"OUTBOX POISON hold: {n} events of other aggregates drained in {took:.1f} s beside one"
               f" held behind a dead letter (poll_interval 5 s, batch_size 100: {n // 100} batches;"
               f" one batch per poll interval would take {n // 100 * 5} s); state {st['state']};"
               f" then {idle_cpu:.2f} s of CPU in 5 s while only the held event waits")
        assert len(got) >= n, f"{len(got)} of {n} events arrived"
        assert idle_cpu < 1.0, f"the relay used {idle_cpu:.2f} s of CPU in 5 s: it does not sleep"
    finally:
        set_conf(conn, max_attempts=None, poll_interval=None, batch_size=None)
        query(conn, "DELETE FROM outbox.events WHERE aggregate_type = %s AND NOT outbox.published(events)", (agg_type,))

def test_event_routed_to_the_progress_topic_is_a_dead_letter(env, conn, prefix):
    """emit() refuses outbox.progress_topic (42501, pg_regress emit), but an event emitted before
    the setting named its topic still names it: the relay marks it failed and never produces it
    there (a record in the progress topic could make an exactly_once relay skip events)."""
    agg_type = new_aggregate_type("poison_progress")
    topic = prefix + agg_type
    create_topics(env, [topic])
    try:
        set_conf(conn, max_attempts=1)
        wait_setting(conn, "max_attempts", "1")
        query(conn, "SELECT outbox.pause()")
        ev = query_one(conn, "SELECT outbox.emit(%s, 'p-1', 'it.routed', '{}', NULL, %s)", (agg_type, topic))[0]
        set_conf(conn, progress_topic=topic)
        wait_setting(conn, "progress_topic", topic)
        time.sleep(1)           # the relay applies the reload at its next loop
        query(conn, "SELECT outbox.resume()")
        rows, _, _ = watch_until_failed(conn, [ev], timeout=30)
        r = rows[ev]
        assert "progress topic" in (r["last_error"] or ""), r
        assert not r["published"], r
        # and nothing reached that topic
        held = topic_message_count(env, topic)
        report(f"OUTBOX POISON progress topic: an older event routed to outbox.progress_topic was marked"
               f" failed ({r['last_error']!r}); the topic holds {held} messages")
        assert held == 0, f"{held} messages produced to the progress topic"
    finally:
        query(conn, "SELECT outbox.resume()")
        set_conf(conn, max_attempts=None, progress_topic=None)
        query(conn, "DELETE FROM outbox.events WHERE aggregate_type = %s AND NOT outbox.published(events)", (agg_type,))

def create_limited_topic(env, name: str, config: dict):
    """A 1-partition topic with topic-level limits (every event shares one partition)."""
    from confluent_kafka.admin import NewTopic
    client = admin(env)         # kept alive until the answer came
    client.create_topics([NewTopic(name, num_partitions=1, replication_factor=1, config=config)],
                         operation_timeout=30)[name].result(30)
    create_topics(env, [name], partitions=1)       # waits for the leader


def test_a_shared_refusal_counts_only_against_its_cause(env, conn, prefix, reader_factory):
    """A broker refuses a partition's whole record batch.  One event too large for its topic
    (max.message.bytes 100000) committed with small events of other aggregates on the same
    partition: only the large one may become a dead letter (a consumer-side trial saw all eight
    marked failed).  The same for an event older than the topic's
    message.timestamp.before.max.ms (INVALID_TIMESTAMP: permanent, it only gets older), sent
    with a fresh one."""
    agg_type = new_aggregate_type("poison_shared")
    size_topic, time_topic = f"it.shared.size.{agg_type}", f"it.shared.time.{agg_type}"
    create_limited_topic(env, size_topic, {"max.message.bytes": "100000"})
    # The fresh event must reach the broker alone before it is itself older than the limit.  It
    # takes the relay well under a second: one shared refusal, then a retry alone.  With 3 s, 1
    # run in 4 failed here: the relay dropped the refusal's report when the producer stopped
    # (gapless guarantee), sent both again blind with a new producer, and the fresh event aged
    # past the limit (fixed in outbox_producer_abort_batch).  5 s keeps that check sharp.
    create_limited_topic(env, time_topic, {"message.timestamp.before.max.ms": str(TIME_LIMIT_MS)})
    reader = reader_factory([size_topic, time_topic], wait=False)
    reader.wait_assigned(partitions=1)
    try:
        set_conf(conn, max_attempts=MAX_ATTEMPTS, retry_backoff_max=BACKOFF_MAX)
        wait_setting(conn, "max_attempts", str(MAX_ATTEMPTS))
        time.sleep(1)           # the relay applies the reload at its next loop
        conn.autocommit = False
        good = []
        with conn.cursor() as cur:
            good.append((emit(cur, agg_type, "A1", "it.small", {"agg": "A1", "seq": 1}, topic=size_topic), "A1", 1))
            big = emit(cur, agg_type, "B1", "it.big", {"pad": "x" * 150_000}, topic=size_topic)
            good.append((emit(cur, agg_type, "C1", "it.small", {"agg": "C1", "seq": 1}, topic=size_topic), "C1", 1))
            good += [(emit(cur, agg_type, f"D{i}", "it.small", {"agg": f"D{i}", "seq": 1}, topic=size_topic), f"D{i}", 1)
                     for i in range(1, 6)]
        conn.commit()

        # the old event waits (paused) until the topic refuses its timestamp, then goes out in one
        # batch with a fresh one
        conn.autocommit = True
        query(conn, "SELECT outbox.pause()")
        with conn.cursor() as cur:
            old = emit(cur, agg_type, "T1", "it.old", {"n": 1}, topic=time_topic)
        time.sleep(TIME_LIMIT_MS / 1000 + 1)
        conn.autocommit = False
        with conn.cursor() as cur:
            good.append((emit(cur, agg_type, "T2", "it.fresh", {"agg": "T2", "seq": 1}, topic=time_topic), "T2", 1))
            cur.execute("SELECT outbox.resume()")
        conn.commit()
        conn.autocommit = True

        rows, _, problems = watch_until_failed(conn, [big, old])
        msgs = read_all(reader, good, timeout=60, extra=1)
        check = check_delivery(msgs, good, partitions=1)
        states = event_state(conn, [e for e, _, _ in good])
        created = dict(query(conn, """SELECT event_id::text, created_at FROM outbox.events
                                       WHERE event_id = ANY(%s::uuid[])""", ([e for e, _, _ in good],)))
        wrongly_failed = [(r["event_id"], r["attempts"], r["permanent_failures"], r["last_error"],
                           f"created {created.get(r['event_id'])}, failed {r['failed_at']}")
                          for r in states.values() if r["permanent_failures"] or r["failed_at"]]
        report(f"OUTBOX POISON shared refusal: a 150 KB event (topic max.message.bytes 100000) with 7"
               f" small events of other aggregates on its partition, and an event older than the"
               f" topic's message.timestamp.before.max.ms with a fresh one: dead letters"
               f" {sorted(r['last_error'].split(' (')[-1] for r in rows.values())}; others: {check.received}"
               f" messages of {len(good)}, {len(wrongly_failed)} counted as refused")
        assert not problems, problems
        assert all(r["permanent_failures"] == MAX_ATTEMPTS for r in rows.values()), rows
        assert "MSG_SIZE_TOO_LARGE" in rows[big]["last_error"], rows[big]
        assert "INVALID_TIMESTAMP" in rows[old]["last_error"], rows[old]
        assert not wrongly_failed, wrongly_failed
        check.assert_ok("events refused together with a poison event", allow_duplicates=False)
        assert not ({big, old} & {m.event_id for m in msgs})
    finally:
        conn.autocommit = True
        query(conn, "SELECT outbox.resume()")
        set_conf(conn, max_attempts=None, retry_backoff_max=None)
        query(conn, "DELETE FROM outbox.events WHERE aggregate_type = %s AND NOT outbox.published(events)",
              (agg_type,))


def topic_refused(env, conn, prefix, error, name, extra_properties=""):
    """On the mock: events of aggregate 'refused' go to a topic the cluster refuses with `error`,
    a stream of 10 other aggregates flows to a good topic.  Returns a dict of what happened."""
    agg_type = new_aggregate_type(f"poison_{name}")
    good, bad = prefix + agg_type, prefix + agg_type + ".refused"
    res = {}
    with relay_on_mock(env, conn, kafka_properties=MOCK_KAFKA_PROPERTIES + extra_properties,
                       max_attempts=MAX_ATTEMPTS, retry_backoff_max=BACKOFF_MAX,
                       delivery_timeout="2s") as mc:
        mock_topic(mc, good)
        mock_topic(mc, bad)
        mc.topic_error(bad, error)
        reader = mock_reader(env, mc, [good, bad])
        before = status(conn)
        watcher = LogWatcher(env)
        stream = Stream(env, agg_type, 10, "flow", interval=0.02).start()
        ids = []
        try:
            pump(reader, 1.0)
            conn.autocommit = False
            with conn.cursor() as cur:
                for seq in (1, 2, 3):
                    ids.append(emit(cur, agg_type, "refused", "it.stream",
                                    {"agg": "refused", "seq": seq}, topic=bad))
            conn.commit()
            conn.autocommit = True
            t0 = time.time()
            try:
                rows, seen, problems = watch_until_failed(conn, ids[:1], timeout=25)
                res["dead_after"] = time.time() - t0
            except AssertionError as e:
                res["not_dead"] = str(e)
                rows = event_state(conn, ids)
                problems, seen = [], {}
            res.update(rows=rows, problems=problems, seen=seen, ids=ids)
            if "not_dead" not in res:
                pump(reader, 2.0)
                res["held"] = event_state(conn, ids[1:])
                res["status"] = status(conn)
                res["before"] = before
                res["warns"] = dead_letter_lines(watcher.new_lines())
                mc.topic_error(bad, "NO_ERROR")
                res["requeued"] = query_one(conn, "SELECT outbox.retry_failed(%s::uuid)", (ids[0],))[0]
                pump(reader, 1.0)
        finally:
            stream.stop()
            conn.autocommit = True
        try:
            emitted = [(e, "refused", i + 1) for i, e in enumerate(ids)] + stream.emitted
            if "not_dead" not in res:
                res["summary"] = wait_all_published(conn, agg_type, emitted, timeout=60)
                res["check"] = check_delivery(read_all(reader, emitted, timeout=30), emitted)
            res["lines"] = watcher.new_lines()
            flow = [m for m in read_all(reader, stream.emitted, timeout=30, extra=0.5)
                    if m.key != "refused"]
            res["flow"] = check_delivery(flow, stream.emitted)
        finally:
            reader.close()
            query(conn, "DELETE FROM outbox.events WHERE aggregate_type = %s AND NOT outbox.published(events)",
                  (agg_type,))
    return res


def report_topic_refusal(res, error):
    first = res["rows"][res["ids"][0]]
    down = [ln for ln in res["lines"] if "cannot deliver events to Kafka" in ln]
    if "dead_after" in res:
        c = res["check"]
        what = (f"marked failed after {res['dead_after']:.1f}s ({first['last_error']}), later events"
                f" held; after fixing and retry_failed: {c.expected} events, {len(c.missing)} lost,"
                f" {c.duplicates} duplicate(s), order problems {len(c.order_problems)}")
    else:
        what = (f"NOT marked failed within 25 s: attempts {first['attempts']}, permanent_failures"
                f" {first['permanent_failures']}, last_error {first['last_error']!r}")
    f = res["flow"]
    report(f"OUTBOX POISON topic {error} (mock): {what}; {len(down)} 'cannot deliver events to Kafka'"
           f" WARNING(s); other aggregates: {f.expected} events, {len(f.missing)} lost,"
           f" order problems {len(f.order_problems)}")


def assert_topic_refusal_dead_letters(res, error, name):
    rows = res["rows"]
    first = rows[res["ids"][0]]
    assert "not_dead" not in res, (
        f"{name}: an event whose topic the cluster refuses ({error}) was never marked failed:"
        f" attempts {first['attempts']}, permanent_failures {first['permanent_failures']},"
        f" last_error {first['last_error']!r}")
    assert not res["problems"], res["problems"]
    assert first["permanent_failures"] == MAX_ATTEMPTS and first["attempts"] >= MAX_ATTEMPTS, first
    held = res["held"]
    assert all(not r["published"] for r in held.values()), f"{name}: overtaken: {held}"
    st, before = res["status"], res["before"]
    # (the counters are server-wide: other aggregates' dead letters may add to them)
    assert st["failed"] - before["failed"] >= 1 and st["failed_events"] - before["failed_events"] >= 1, (before, st)
    assert sum(n for n, _ in res["warns"]) == 1, res["warns"]
    assert res["requeued"] is True
    res["check"].assert_ok(f"{name} after retry_failed")
    assert res["summary"]["failed"] == 0 and res["summary"]["unpublished"] == 0, res["summary"]


def test_unknown_topic_dead_letters_then_retry_delivers_in_order(env, conn, prefix):
    # librdkafka fails a message to a topic the cluster says does not exist only after
    # topic.metadata.propagation.max.ms (30 s, = the default delivery_timeout); shortened here
    res = topic_refused(env, conn, prefix, "UNKNOWN_TOPIC_OR_PART", "unknown_topic",
                        ";topic.metadata.propagation.max.ms=1000")
    report_topic_refusal(res, "UNKNOWN_TOPIC_OR_PART")
    assert_topic_refusal_dead_letters(res, "UNKNOWN_TOPIC_OR_PART", "unknown topic")
    res["flow"].assert_ok("other aggregates while a topic was refused")


def test_unauthorized_topic_dead_letters(env, conn, prefix):
    """TOPIC_AUTHORIZATION_FAILED in the topic's metadata (what a broker answers when an ACL
    denies the topic).  The README lists a refused topic as a permanent error."""
    res = topic_refused(env, conn, prefix, "TOPIC_AUTHORIZATION_FAILED", "unauthorized")
    report_topic_refusal(res, "TOPIC_AUTHORIZATION_FAILED")
    res["flow"].assert_ok("other aggregates while a topic was refused")
    assert_topic_refusal_dead_letters(res, "TOPIC_AUTHORIZATION_FAILED", "unauthorized topic")


def test_outage_longer_than_delivery_timeout_never_dead_letters(env, conn, prefix):
    agg_type = new_aggregate_type("poison_outage")
    topic = prefix + agg_type
    with relay_on_mock(env, conn, max_attempts=1, retry_backoff_max=BACKOFF_MAX,
                       delivery_timeout="2s") as mc:
        mock_topic(mc, topic)
        reader = mock_reader(env, mc, [topic])
        before = status(conn)
        watcher = LogWatcher(env)
        stream = Stream(env, agg_type, 10, "out", interval=0.02).start()
        try:
            pump(reader, 1.0)
            mc.down("all")
            t_down = time.monotonic()
            pump(reader, 7.0)           # > 3 x delivery_timeout
            tried = row_summary(conn, agg_type)
            mc.up("all")
            outage = time.monotonic() - t_down
            pump(reader, 2.0)
        finally:
            stream.stop()
            mc.up("all")
        try:
            emitted = stream.emitted
            summary = wait_all_published(conn, agg_type, emitted, timeout=60)
            msgs = read_all(reader, emitted, timeout=30)
            check = check_delivery(msgs, emitted)
            errs = query(conn, "SELECT DISTINCT last_error FROM outbox.events WHERE aggregate_type = %s"
                               " AND last_error IS NOT NULL", (agg_type,))
            after = status(conn)
        finally:
            reader.close()
            query(conn, "DELETE FROM outbox.events WHERE aggregate_type = %s AND NOT outbox.published(events)",
                  (agg_type,))
    report(f"OUTBOX POISON outage: all mock brokers down {outage:.1f}s with delivery_timeout 2s,"
           f" max_attempts 1: {tried['rows_retried']} events had failed attempts (max {summary['max_attempts']}),"
           f" errors {[e[0] for e in errs]}; failed_at set on {summary['failed']}; {check.expected} events,"
           f" {len(check.missing)} lost, {check.duplicates} duplicate(s), order problems {len(check.order_problems)}")
    assert tried["rows_retried"] > 0 and summary["max_attempts"] >= 1, \
        "no delivery attempt failed: the outage was not longer than outbox.delivery_timeout"
    assert summary["failed"] == 0 and summary["permanent_failures"] == 0, summary
    assert after["failed"] == before["failed"], (before, after)
    assert not dead_letter_lines(watcher.new_lines())
    check.assert_ok("events through an outage longer than delivery_timeout")


def test_last_error_is_cut_at_a_character_boundary(env, conn):
    """outbox.status.last_error keeps OUTBOX_ERROR_LEN - 1 = 255 bytes. A byte count alone cut a
    multibyte character in two (issue 27, finding 4), and the status views then returned invalid
    UTF-8. The relay's error for an illegal topic quotes the topic: two runs of 2-byte characters,
    starting one byte apart, put a character across the cut whatever the error's prefix is."""
    agg = new_aggregate_type("mbcut")
    try:
        for topic in ("a" + "é" * 200, "bc" + "é" * 200):
            query(conn, "INSERT INTO outbox.events (aggregate_type, aggregate_id, event_type, payload, topic)"
                        " VALUES (%s, 'k', 'it.mb', '{}', %s)", (agg, topic))

            def quoted():
                rows = query(conn, "SELECT last_error::bytea FROM outbox.status")
                mark = ('"' + topic[:10]).encode()
                raw = [bytes(r[0]) for r in rows if r[0] is not None and mark in bytes(r[0])]
                return raw[0] if raw else None

            raw = wait_until(quoted, 30, "the relay's last_error to quote the illegal topic")
            assert len(raw) <= 255, len(raw)
            text = raw.decode("utf-8")          # raises on a character cut in two
            assert topic[:100] in text, text
            query(conn, "DELETE FROM outbox.events WHERE aggregate_type = %s", (agg,))
    finally:
        query(conn, "DELETE FROM outbox.events WHERE aggregate_type = %s", (agg,))
