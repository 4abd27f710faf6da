"""
outbox.delivery = exactly_once against the real broker: each relay transaction is one Kafka
transaction carrying a progress record in the progress topic, read back after any crash.

1. The mode starts (transactional.id outbox-<system id>-<database oid>, progress topic created
   with 1 partition and cleanup.policy = compact), delivers in order, and refuses a progress topic
   with several partitions or deletion retention (status config_error, one log line), then
   recovers when the setting is fixed.
2. Under 8 sessions of load: a crash injected at the two worst moments (events produced and
   acknowledged inside an open Kafka transaction; Kafka committed but Postgres not), kill -9 of
   the relay and of the postmaster, and a zombie producer with each of the relay's two
   transactional.ids.
   A read_committed consumer sees every committed event exactly once, in per-aggregate order;
   a read_uncommitted consumer does see the aborted copies (so the first check could fail).
3. With outbox.workers_per_database = 3 each relay has its own transactional.id; a crash between
   the two commits, then one of relay 3 with k lowered before it comes back (relays 1 and 2 read
   its record), then k = 1: every committed event once.
"""
import json
import random
import time

import psycopg2
import pytest
from confluent_kafka import KafkaException, Producer
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from conftest import (LogWatcher, create_topics, new_aggregate_type, pg_connect, pg_sh, poll_until,
                      query, query_one, relay_status, report, set_conf, topic_prefix, wait_relay_ready,
                      wait_until)
from helpers_crash import (EmitLoad, LightReader, assert_delivered, delivery_check, kill9,
                           pid_alive, postmaster_pid, sort_unknown,
                           start_pg_after_crash)

READY_LINE = "exactly-once delivery ready"


def transactional_id(conn) -> str:
    sysid = query_one(conn, "SELECT system_identifier FROM pg_catalog.pg_control_system()")[0]
    dboid = query_one(conn, "SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database()")[0]
    return f"outbox-{sysid}-{dboid}"


def probe(env, conn, topic: str, what: str, timeout: float = 60):
    """Emit probe events until one of them arrives on topic (read_committed).  Only this call's
    own events count: the reader starts at the topic's earliest offset, and the topic may hold
    earlier probes or the test's events, which prove nothing about the relay now."""
    agg = new_aggregate_type("probe")
    reader = LightReader(env, [topic])
    mine = set()
    try:
        deadline = time.monotonic() + timeout
        while not mine & reader.received_ids():
            assert time.monotonic() < deadline, f"no probe event arrived within {timeout}s ({what})"
            mine.add(str(query_one(conn, "SELECT outbox.emit(%s, 'p', 'probe', '{}', NULL, %s)",
                                   (agg, topic))[0]))
            poll_until(lambda: mine & reader.received_ids(), 0.5)
    finally:
        reader.close()


@pytest.fixture
def exactly_once(env, conn):
    """The relay in exactly_once mode for one test; at_least_once again after it."""
    watcher = LogWatcher(env)
    if query_one(conn, "SHOW outbox.delivery")[0] != "exactly_once":
        set_conf(conn, delivery="exactly_once")
        wait_until(lambda: any(READY_LINE in line for line in watcher.new_lines()), 90,
                   "the relay to start exactly-once delivery")
    yield watcher
    conn = pg_connect(env)      # the test's connection may have died with the server
    try:
        set_conf(conn, delivery=None, progress_topic=None)
        probe(env, conn, "it.eos.back", "back to at_least_once")
    finally:
        conn.close()


def test_exactly_once_starts_delivers_and_refuses_bad_progress_topics(env, conn, exactly_once):
    tid = transactional_id(conn)
    ready = [line for line in exactly_once.new_lines() if READY_LINE in line]
    assert f'transactional.id "{tid}" and "{tid}-alt"' in ready[-1], ready[-1]
    assert 'progress topic "_outbox_progress"' in ready[-1], ready[-1]

    admin = AdminClient({"bootstrap.servers": env.bootstrap})
    md = admin.list_topics("_outbox_progress", timeout=10).topics["_outbox_progress"]
    assert len(md.partitions) == 1
    res = ConfigResource(ConfigResource.Type.TOPIC, "_outbox_progress")
    cfg = list(admin.describe_configs([res]).values())[0].result(10)
    assert cfg["cleanup.policy"].value == "compact"

    # 600 events over 30 aggregates arrive once each, in order
    agg_type = new_aggregate_type("eos")
    topic = f"it.eos.{agg_type}"
    create_topics(env, [topic])
    reader = LightReader(env, [topic])
    reader.wait_assigned()
    present = {}
    with conn.cursor() as cur:
        for seq in range(1, 21):
            for a in range(30):
                cur.execute("SELECT outbox.emit(%s, %s, 'e', %s::jsonb, NULL, %s)::text",
                            (agg_type, f"a{a}", f'{{"seq": {seq}}}', topic))
                present[cur.fetchone()[0]] = (f"a{a}", seq)
    reader.wait_for(present, 60, extra=1)
    rows = reader.snapshot()
    reader.close()
    c = delivery_check(rows, present)
    assert_delivered(c, "exactly_once")
    assert c.duplicates == 0

    # the progress records: under the transactional.id, the last one names the database's state
    records = LightReader(env, ["_outbox_progress"])
    wait_until(lambda: any(r[3] == tid for r in records.snapshot()), 30, "a progress record")
    keys = {r[3] for r in records.snapshot()}
    records.close()
    assert f"{tid}.sentinel" in keys, keys

    # refusals: several partitions, deletion retention; a clear status and one log line each
    bad = {"it.eos.progress.parts": dict(num_partitions=3, config={"cleanup.policy": "compact"}),
           "it.eos.progress.delete": dict(num_partitions=1, config={"cleanup.policy": "delete"})}
    for f in admin.create_topics([NewTopic(t, replication_factor=1, **kw)
                                  for t, kw in bad.items()]).values():
        try:
            f.result(30)
        except KafkaException as e:
            assert "already exists" in str(e)
    for name, want in (("it.eos.progress.parts", "has 3 partitions, not 1"),
                       ("it.eos.progress.delete", "has cleanup.policy = delete")):
        watcher = LogWatcher(env)
        set_conf(conn, progress_topic=name)

        def refused():
            rows = relay_status(conn)
            return rows and rows[0]["state"] == "config_error" and want in (rows[0]["last_error"] or "")
        wait_until(refused, 60, f"the relay to refuse {name}")
        time.sleep(2)
        lines = [ln for ln in watcher.new_lines() if "cannot deliver exactly once" in ln]
        assert len(lines) == 1 and want in lines[0], lines
        n = query_one(conn, "SELECT count(*) FROM outbox.events WHERE aggregate_type = %s", (agg_type,))[0]
        assert n == 600
    set_conf(conn, progress_topic=None)
    wait_relay_ready(env, timeout=60)
    probe(env, conn, topic, "after the progress topic was fixed")
    report(f"OUTBOX EXACTLY-ONCE: transactional.id {tid}; 600 events over 30 aggregates arrived "
           f"once each in order; refused progress topics with 3 partitions and with "
           f"cleanup.policy = delete (config_error, one log line each)")


def events_to_arrive(load, unknown_exists):
    """Every event whose commit returned, and those whose commit failed in a crash but exist."""
    committed, _ = load.snapshot()
    assert not load.unexpected_errors, load.unexpected_errors[:10]
    present = dict(committed)
    present.update(unknown_exists)
    return present


def crash_point(env, name: str):
    """Ask the relay to kill itself with SIGKILL at the next moment called name."""
    open(f"{env.pg_dir}/data/outbox_crash_{name}", "w").close()


def test_exactly_once_survives_the_worst_moments_and_a_zombie(env, conn, exactly_once):
    seed = int(time.time()) % 100000
    rng = random.Random(seed)
    agg_type = new_aggregate_type("eoscrash")
    topic = topic_prefix(conn) + agg_type       # EmitLoad routes by aggregate type
    create_topics(env, [topic])
    tid = transactional_id(conn)
    committed_reader = LightReader(env, [topic])
    uncommitted_reader = LightReader(env, [topic], {"isolation.level": "read_uncommitted"})
    load = EmitLoad(env, agg_type, sessions=8, aggregates=64, tag="eo", seed=seed, think_s=0.002)
    plan = ["mid_transaction", "after_kafka_commit", "relay", "postmaster",
            "after_kafka_commit", "mid_transaction", "zombie", "zombie-alt"]
    timeline, recorded_now = [], 0
    unknown_exists, unknown_missing = {}, set()
    zombie_errors = {}          # kind -> the zombie's commit error
    try:
        committed_reader.wait_assigned()
        uncommitted_reader.wait_assigned()
        load.start()
        load.wait_progress(30, 60, "every session to commit (first)")
        t0 = time.monotonic()
        for n, kind in enumerate(plan):
            load.wait_progress(20, 60, f"every session to commit, before {kind},")
            time.sleep(rng.uniform(0.2, 1.5))
            old_relay = wait_relay_ready(env, timeout=90)["pid"]
            watcher = LogWatcher(env)
            if kind.startswith("zombie"):
                # a second producer with the relay's transactional.id: it fences the relay, opens
                # a transaction with an event of its own, and is fenced in turn
                # (the relay, fenced, starts again within a second or two and fences the zombie:
                # at its produce, or at its commit)
                # (either of the two ids the relay uses in turn)
                zombie = Producer({"bootstrap.servers": env.bootstrap,
                                   "transactional.id": tid + kind[len("zombie"):]})
                zombie.init_transactions(30)
                try:
                    zombie.begin_transaction()
                    zombie.produce(topic, key=b"eo-0", value=b'{"zombie": true}',
                                   headers=[("id", b"00000000-0000-0000-0000-00000000dead")])
                    zombie.flush(10)
                    wait_until(lambda: "_FENCED" in "\n".join(watcher.new_lines()), 60,
                               "the relay to be fenced")
                    time.sleep(2)
                    zombie.commit_transaction(10)
                except KafkaException as e:
                    zombie_errors[kind] = str(e)
                log = "\n".join(watcher.new_lines())
                assert "Kafka producer failed fatally" in log and "_FENCED" in log, log[-3000:]
                # the WARNING says why (the fencing came through the transactional API, whose
                # error text once left the DETAIL line empty)
                lines = log.splitlines()
                details = [next((d for d in lines[i + 1:i + 4] if "DETAIL:" in d), "")
                           for i, ln in enumerate(lines) if "Kafka producer failed fatally" in ln]
                assert details and all(d.partition("DETAIL:")[2].strip() for d in details), details
                wait_until(lambda: READY_LINE in "\n".join(watcher.new_lines()).split("_FENCED")[-1],
                           90, "the relay to start again after it was fenced")
                timeline.append(f"{kind} at {time.monotonic() - t0:.1f}s")
                continue
            load.close_gate()
            if kind in ("mid_transaction", "after_kafka_commit"):
                crash_point(env, kind)
            elif kind == "relay":
                kill9(old_relay)
            else:
                pm = postmaster_pid(env)
                kill9(pm)
                wait_until(lambda: not pid_alive(old_relay), 60, "the orphaned relay to exit")
                start_pg_after_crash(env)
            wait_until(load.all_parked, 60, f"every session to lose its connection ({kind})",
                       interval=0.02)
            relay = wait_relay_ready(env, timeout=90)
            assert relay["pid"] != old_relay
            log = "\n".join(watcher.new_lines())
            if kind in ("mid_transaction", "after_kafka_commit"):
                assert f'crashing at "{kind}"' in log, log[-3000:]
            if kind == "after_kafka_commit":
                assert "committed to Kafka but not recorded in the database; recorded it now" in log \
                    or "committed to Kafka but not marked published; marked them now" in log, log[-3000:]
                recorded_now += 1
            exist, missing = sort_unknown(env, load)
            unknown_exists.update(exist)
            unknown_missing |= missing
            timeline.append(f"{kind} at {time.monotonic() - t0:.1f}s")
            load.epoch += 1
            load.open_gate()
        load.wait_progress(20, 60, "every session to commit, after the last crash,")
    finally:
        load.open_gate()
        load.stop()
    present = events_to_arrive(load, unknown_exists)
    committed_reader.wait_for(present, 120, extra=3)
    uncommitted_reader.wait_for(present, 30, extra=1)
    rows = committed_reader.snapshot()
    raw = uncommitted_reader.snapshot()
    committed_reader.close()
    uncommitted_reader.close()
    c = delivery_check(rows, present, unknown_missing)
    raw_c = delivery_check(raw, present, unknown_missing | {"00000000-0000-0000-0000-00000000dead"})
    report(f"OUTBOX EXACTLY-ONCE CRASHES (seed {seed}): {', '.join(timeline)}; {len(present)} events "
           f"committed; read_committed: {c.distinct} distinct, {len(c.lost)} lost, {c.reorderings} "
           f"reordered, {c.duplicates} duplicates; read_uncommitted saw {raw_c.duplicates} aborted "
           f"copies; {recorded_now} crash(es) between the Kafka and the Postgres commit recorded "
           f"from the progress record; zombies' commits: {zombie_errors}")
    assert_delivered(c, "exactly_once")
    assert c.duplicates == 0, f"{c.duplicates} duplicates seen by a read_committed consumer"
    assert "00000000-0000-0000-0000-00000000dead" not in {r[4] for r in rows}, "the zombie's event arrived"
    assert set(zombie_errors) == {"zombie", "zombie-alt"}, f"a zombie committed its transaction: {zombie_errors}"
    assert raw_c.duplicates > 0, "the crashes aborted nothing that a read_uncommitted consumer saw"
    assert recorded_now == 2


def test_exactly_once_dead_letters_replay_and_internal_topics(env, conn, exactly_once):
    """Found by a README-only trial of exactly_once:
    (a) outbox.progress_topic = '__consumer_offsets' was accepted (now 22023);
    (b) a dead letter (a 2 MB event) followed by 1 MB events under load stalled the whole
        database: the events that failed only because their transaction was aborted were
        marked failed with a backoff, and the state showed broker_down;
    (c) outbox.replay() done before a restart was undone by the restart: the last progress
        record (row-tracked events, by id) marked the replayed events published again."""
    with conn.cursor() as cur:
        for name in ("__consumer_offsets", "__transaction_state"):
            with pytest.raises(psycopg2.Error) as e:
                cur.execute(f"ALTER SYSTEM SET outbox.progress_topic = '{name}'")
            assert e.value.pgcode == "22023" and "internal topics" in str(e.value), str(e.value)

    # (b) a dead letter, then large events of other aggregates, among small ones
    agg_type = new_aggregate_type("eosdl")
    topic = f"it.eos.{agg_type}"
    create_topics(env, [topic])
    reader = LightReader(env, [topic])
    reader.wait_assigned()
    set_conf(conn, max_attempts=2)
    states = set()
    present, dead = {}, []
    try:
        with conn.cursor() as cur:
            def emit_one(agg, seq, size=0):
                payload = {"seq": seq, "pad": "x" * size} if size else {"seq": seq}
                cur.execute("SELECT outbox.emit(%s, %s, 'e', %s::jsonb, NULL, %s)::text",
                            (agg_type, agg, json.dumps(payload), topic))
                return cur.fetchone()[0]
            dead.append(emit_one("X", 1, 2_000_000))
            dead.append(emit_one("X", 2))
            for seq in range(1, 41):
                for a in range(10):
                    present[emit_one(f"a{a}", seq)] = (f"a{a}", seq)
                if seq == 10:
                    for b in ("B1", "B2", "B3"):
                        present[emit_one(b, 1, 1_048_300)] = (b, 1)
                        present[emit_one(b, 2)] = (b, 2)
                states.update(r["state"] for r in relay_status(conn))
                time.sleep(0.05)
        deadline = time.monotonic() + 90
        while reader.missing(present) and time.monotonic() < deadline:
            states.update(r["state"] for r in relay_status(conn))
            time.sleep(0.2)
        reader.wait_for(present, 5, extra=1)
        rows = reader.snapshot()
        failed_at = query_one(conn, "SELECT failed_at IS NOT NULL FROM outbox.events WHERE event_id = %s",
                              (dead[0],))[0]
    finally:
        reader.close()
        set_conf(conn, max_attempts=None)
    c = delivery_check(rows, present, set(dead))
    assert_delivered(c, "exactly_once with a dead letter")
    assert c.duplicates == 0
    assert failed_at, "the 2 MB event did not become a dead letter"
    assert "broker_down" not in states, f"states seen: {states}"

    # (c) replay, then a restart before the relay sent the copies
    agg_type = new_aggregate_type("eosrp")
    topic = f"it.eos.{agg_type}"
    create_topics(env, [topic], partitions=1)
    reader = LightReader(env, [topic])
    try:
        wait_until(lambda: reader.assigned, 30, "the consumer's assignment")
        ids = [query_one(conn, "SELECT outbox.emit(%s, 'R', 'e', %s::jsonb, NULL, %s)::text",
                         (agg_type, json.dumps({"n": n}), topic))[0] for n in range(3)]
        wait_until(lambda: len(reader.snapshot()) >= 3, 60, "the 3 events")
        lo, hi = query_one(conn, "SELECT min(id), max(id) FROM outbox.events WHERE aggregate_type = %s",
                           (agg_type,))
        assert query_one(conn, "SELECT outbox.replay(%s, %s)", (lo, hi))[0] == 3
        wait_until(lambda: len(reader.snapshot()) >= 6, 60, "the first replay's copies")
        query(conn, "SELECT outbox.pause()")
        wait_until(lambda: relay_status(conn)[0]["state"] == "paused", 30, "the relay to pause")
        assert query_one(conn, "SELECT outbox.replay(%s, %s)", (lo, hi))[0] == 3
        pg_sh(env, "restart")
        conn2 = pg_connect(env)
        try:
            query(conn2, "SELECT outbox.resume()")
            wait_until(lambda: len(reader.snapshot()) >= 9, 60, "the second replay's copies (after a restart)")
        finally:
            conn2.close()
        time.sleep(1)
        got = [r[4] for r in reader.snapshot()]
    finally:
        reader.close()
    assert got == ids * 3, got
    report(f"OUTBOX EXACTLY-ONCE DEAD LETTER: a 2 MB event became a dead letter (max_attempts 2), "
           f"{len(present)} other events (three of 1 MB) arrived once each in order, states {sorted(states)}; "
           f"replay() before a restart sent its copies after it ({len(got)} messages for 3 events)")


def test_exactly_once_ignores_the_record_of_a_dropped_extension(env, conn, exactly_once):
    """Found by a README-only trial: after DROP and CREATE EXTENSION outbox, event ids and row
    positions start over, and the last progress record (written for the old outbox.events) was
    read back at the next start and marked the new events published although Kafka never got
    them.  Each record now names its table: the old one is ignored (LOG line), and the events
    written while paused and across a restart all arrive."""
    agg_type = new_aggregate_type("eosre")
    topic = f"it.eos.{agg_type}"
    create_topics(env, [topic])
    probe(env, conn, topic, "a batch (and its progress record) for the current outbox.events")

    query(conn, "DROP EXTENSION outbox CASCADE")
    query(conn, "CREATE EXTENSION outbox")
    query_one(conn, "SELECT outbox.pause()")
    present = {}
    for seq in range(1, 5):
        (eid,) = query_one(conn, "SELECT outbox.emit(%s, 'a', 'e', %s::jsonb, NULL, %s)::text",
                           (agg_type, json.dumps({"seq": seq}), topic))
        present[eid] = ("a", seq)
    watcher = LogWatcher(env)
    pg_sh(env, "restart")
    wait_until(lambda: any(READY_LINE in ln for ln in watcher.new_lines()), 90,
               "the relay to start exactly-once delivery after the restart")
    c = pg_connect(env)
    try:
        reader = LightReader(env, [topic])
        reader.wait_assigned()
        query_one(c, "SELECT outbox.resume()")
        reader.wait_for(present, 60, extra=1)
        rows = reader.snapshot()
        reader.close()
        # the probe's events share the topic: only the four count
        check = delivery_check([r for r in rows if r[4] in present], present)
        assert_delivered(check, "exactly_once after CREATE EXTENSION again")
        assert check.duplicates == 0, check
        lines = watcher.new_lines()
        assert any("written for an earlier outbox.events; ignored" in ln for ln in lines), lines[-40:]
        assert not any("committed to Kafka but not marked published" in ln for ln in lines), lines[-40:]
        n = query_one(c, "SELECT count(*) FROM outbox.events e WHERE e.aggregate_type = %s"
                         " AND outbox.published(e)", (agg_type,))[0]
        assert n == 4, n
    finally:
        c.close()
    report("OUTBOX EXACTLY-ONCE re-created extension: the old table's progress record was ignored "
           "(LOG), 4 events written while paused across a restart arrived once each")


def relays_ready(env, k: int):
    """The k relays of the database, each idle or publishing: {worker: pid}, else None."""
    c = pg_connect(env)
    try:
        rows = query(c, "SELECT worker, workers, pid, state FROM outbox.status")
    finally:
        c.close()
    if len(rows) == k and all(r[1] == k and r[3] in ("idle", "publishing") for r in rows):
        return {r[0]: r[2] for r in rows}
    return None


def test_exactly_once_with_k_relays(env, conn, exactly_once):
    """exactly_once with outbox.workers_per_database = k: each relay has its own transactional.id
    ("-w<n>" after the database's for relay n > 1), so none fences another.  Under 8 sessions of
    load: a crash between the Kafka and the Postgres commit of any relay (the server restarts),
    the same crash of relay 3 followed by an immediate shutdown, k = 2 written meanwhile (relay 3
    never comes back to read its record: relays 1 and 2 read it and mark its events published, or
    they would send them again), then k = 1 on reload.  A read_committed consumer sees every
    committed event once, in per-aggregate order."""
    tid = transactional_id(conn)
    agg_type = new_aggregate_type("eosk")
    topic = topic_prefix(conn) + agg_type
    create_topics(env, [topic])
    reader = LightReader(env, [topic])
    load = EmitLoad(env, agg_type, sessions=8, aggregates=64, tag="ek", seed=28, think_s=0.002)
    unknown_exists, unknown_missing = {}, set()
    try:
        watcher = LogWatcher(env)
        set_conf(conn, workers_per_database=3)
        wait_until(lambda: relays_ready(env, 3), 90, "3 exactly-once relays")
        wait_until(lambda: sum(READY_LINE in ln for ln in watcher.new_lines()) >= 3, 90,
                   "3 exactly-once ready lines")
        ready = [ln for ln in watcher.new_lines() if READY_LINE in ln]
        for n, own in ((1, tid), (2, f"{tid}-w2"), (3, f"{tid}-w3")):
            assert any(f'transactional.id "{own}" and "{own}-alt"' in ln for ln in ready), (n, ready)
        reader.wait_assigned()
        load.start()
        load.wait_progress(30, 60, "every session to commit (first)")

        for step, (order, k_after) in enumerate((("", 3), ("relay 3\nstop", 2))):
            load.wait_progress(20, 60, f"every session to commit, before crash {step + 1},")
            watcher = LogWatcher(env)
            pids = wait_until(lambda: relays_ready(env, 3), 60, "3 relays before the crash")
            load.close_gate()
            if k_after != 3:
                query(conn, f"ALTER SYSTEM SET outbox.workers_per_database = {k_after}")
            with open(f"{env.pg_dir}/data/outbox_crash_after_kafka_commit", "w") as f:
                f.write(order)
            wait_until(load.all_parked, 60, f"every session to lose its connection (crash {step + 1})",
                       interval=0.02)
            if order:
                wait_until(lambda: all(not pid_alive(p) for p in pids.values()), 60,
                           "the relays to end with the server")
                start_pg_after_crash(env)
            conn = wait_until(lambda: pg_connect(env), 60, "a connection after the crash")
            wait_until(lambda: relays_ready(env, k_after), 90, f"{k_after} relays after crash {step + 1}")
            log = "\n".join(watcher.new_lines())
            assert 'crashing at "after_kafka_commit"' in log, log[-3000:]
            assert "committed to Kafka but not marked published; marked them now" in log \
                or (not order and "committed to Kafka but not recorded in the database" in log), log[-3000:]
            exist, missing = sort_unknown(env, load)
            unknown_exists.update(exist)
            unknown_missing |= missing
            load.epoch += 1
            load.open_gate()
        load.wait_progress(20, 60, "every session to commit with 2 relays")
        set_conf(conn, workers_per_database=1)
        wait_until(lambda: relays_ready(env, 1), 60, "1 relay after the reload")
        load.wait_progress(20, 60, "every session to commit with 1 relay")
    finally:
        load.open_gate()
        load.stop()
        c = pg_connect(env)
        try:
            set_conf(c, workers_per_database=None)
        finally:
            c.close()
    present = events_to_arrive(load, unknown_exists)
    reader.wait_for(present, 120, extra=3)
    rows = reader.snapshot()
    reader.close()
    c = delivery_check(rows, present, unknown_missing)
    report(f"OUTBOX EXACTLY-ONCE k RELAYS: 3 relays, transactional.ids {tid}, -w2, -w3; a crash after a"
           f" Kafka commit (server restarted, k = 3), then relay 3 crashed there with an immediate"
           f" shutdown and k = 2 on start (its record read by relays 1 and 2), then k = 1 on reload:"
           f" {len(present)} events committed; read_committed: {c.distinct} distinct, {len(c.lost)} lost,"
           f" {c.reorderings} reordered, {c.duplicates} duplicates")
    assert_delivered(c, "exactly_once with k relays")
    assert c.duplicates == 0, f"{c.duplicates} duplicates seen by a read_committed consumer"
