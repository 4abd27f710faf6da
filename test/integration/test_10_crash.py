"""
PostgreSQL crashes under load.  Eight sessions emit continuously over 64 aggregates (each
aggregate owned by one session, a per-aggregate sequence number in every payload) while the
postmaster is killed with SIGKILL at random moments, and, separately, only the relay worker is
killed with SIGKILL (which PostgreSQL handles as a crash of the whole server: it terminates every
backend, reinitializes shared memory and runs crash recovery).

Every event whose COMMIT returned must arrive; an event whose COMMIT raised (unknown outcome)
must arrive if and only if it exists in outbox.events after the restart; per aggregate the first
occurrences arrive in strictly increasing sequence and every other copy is a re-send; a crash
re-sends at most the batch in flight (outbox.batch_size).
"""
import random
import time

from conftest import (create_topics, new_aggregate_type, pg_connect, query_one,
                      relay_status, report, wait_relay_ready, wait_until, LogWatcher)
from helpers_crash import (EmitLoad, LightReader, Watermarks, assert_delivered, delivery_check,
                           kill9, pid_alive, postmaster_pid, sort_unknown,
                           start_pg_after_crash)

SESSIONS = 8
AGGREGATES = 64
POSTMASTER_KILLS = 10
RELAY_KILLS = 3
DELIVERY_TIMEOUT_S = 180        # from the last crash to the last event received


def test_crash_under_load(env, prefix):
    seed = int(time.time()) % 100000
    rng = random.Random(seed)
    agg_type = new_aggregate_type("crash")
    topic = prefix + agg_type
    create_topics(env, [topic])
    conn = pg_connect(env)
    batch_size = int(query_one(conn, "SHOW outbox.batch_size")[0])
    conn.close()

    reader = LightReader(env, [topic])
    marks = Watermarks(env, topic)
    load = EmitLoad(env, agg_type, SESSIONS, AGGREGATES, tag="acct", seed=seed)
    plan = ["postmaster"] * POSTMASTER_KILLS + ["relay"] * RELAY_KILLS
    rng.shuffle(plan)
    boundaries = []             # partition end offsets just before each crash
    crashes = []                # per crash: kind, recovery time, start attempts, unknown events
    unknown_exists, unknown_missing = {}, set()
    try:
        reader.wait_assigned()
        load.start()
        load.wait_progress(50, 60, "every session to commit (first)")
        t_first = time.monotonic()
        for n, kind in enumerate(plan):
            load.wait_progress(20, 60, f"every session to commit, before crash {n},")
            time.sleep(rng.uniform(0.3, 3.0))
            pm = postmaster_pid(env)
            old_relay = wait_relay_ready(env, timeout=60)["pid"]
            watcher = LogWatcher(env)
            load.close_gate()
            info = {"kind": kind}
            if kind == "postmaster":
                kill9(pm)
                t_kill = time.monotonic()
                wait_until(load.all_parked, 60, f"every session to lose its connection (crash {n})",
                           interval=0.02)
                # the orphaned relay stops at its next wait (WL_EXIT_ON_PM_DEATH); only then is the
                # partitions' end where the next relay starts re-sending
                wait_until(lambda: not pid_alive(old_relay), 60, "the orphaned relay to exit",
                           interval=0.02)
                boundaries.append(marks.high())
                info["start_attempts"] = start_pg_after_crash(env)
            else:
                boundaries.append(marks.high())
                kill9(old_relay)
                t_kill = time.monotonic()
                # PostgreSQL: a background worker that dies of a signal is a crash of the server
                wait_until(load.all_parked, 60,
                           f"every session to lose its connection after the relay was killed (crash {n})",
                           interval=0.02)
            relay = wait_relay_ready(env, timeout=60)
            info["recovery_s"] = time.monotonic() - t_kill
            assert relay["pid"] != old_relay, f"crash {n}: the relay was not restarted"
            log = "\n".join(watcher.new_lines())
            if kind == "relay":
                assert postmaster_pid(env) == pm and pid_alive(pm), \
                    f"crash {n}: the postmaster did not survive the relay's death"
                assert f'background worker "outbox relay" (PID {old_relay}) was terminated by signal 9' \
                    in log, log[-3000:]
                assert "terminating any other active server processes" in log, log[-3000:]
                assert "all server processes terminated; reinitializing" in log, log[-3000:]
            else:
                assert postmaster_pid(env) != pm
            assert "outbox relay started for database" in log, log[-3000:]

            # which unknown-outcome events of this crash exist (checked long before retention)
            exist, missing = sort_unknown(env, load)
            unknown_exists.update(exist)
            unknown_missing |= missing
            info["unknown"] = len(exist) + len(missing)
            info["unknown_exist"] = len(exist)
            crashes.append(info)
            load.epoch += 1
            load.open_gate()
        load.wait_progress(20, 60, "every session to commit, after the last crash,")
        load_s = time.monotonic() - t_first
    finally:
        load.open_gate()
        load.stop()
    t_end = time.monotonic()

    committed, _ = load.snapshot()
    assert not load.unexpected_errors, load.unexpected_errors[:10]
    present = dict(committed)
    present.update(unknown_exists)
    missing = reader.wait_for(present, DELIVERY_TIMEOUT_S, extra=3)
    drain_s = time.monotonic() - t_end
    rows = reader.snapshot()
    reader.close()
    marks.close()
    assert not reader.errors, reader.errors[:5]
    c = delivery_check(rows, present, unknown_missing, boundaries)
    assert len(missing) == len(c.lost)

    per_crash = [c.dups_by_region.get(k, 0) for k in range(len(plan))]
    report(f"OUTBOX CRASH: {len(plan)} crashes survived ({POSTMASTER_KILLS} postmaster SIGKILL, "
           f"{RELAY_KILLS} relay-worker SIGKILL; order {','.join(k[0] for k in plan)}; seed {seed}); "
           f"{SESSIONS} sessions over {AGGREGATES} aggregates for {load_s:.0f}s, "
           f"{len(committed)} events committed ({len(committed) / load_s:.0f}/s)")
    report(f"OUTBOX CRASH: COMMIT raised for {sum(x['unknown'] for x in crashes)} event(s) "
           f"(unknown outcome): {len(unknown_exists)} existed after the restart and arrived, "
           f"{len(unknown_missing)} did not exist and did not arrive; "
           f"{sum(load.lost_before_commit)} transaction(s) lost before COMMIT; "
           f"{sum(load.connection_losses)} connection losses, {sum(load.connect_failures)} failed reconnects")
    report(f"OUTBOX CRASH: {len(present)} events expected, {c.distinct} distinct received, "
           f"{len(c.lost)} lost, {c.reorderings} reorderings, {c.duplicates} duplicates "
           f"(per crash, p = postmaster, r = relay: "
           f"{' '.join(f'{k[0]}{d}' for k, d in zip(plan, per_crash))}; max {max(per_crash)}, "
           f"batch_size {batch_size}; "
           f"without a crash: {c.dups_by_region.get(-1, 0)}); last event {drain_s:.1f}s after the load stopped")
    report("OUTBOX CRASH: recovery (kill to relay ready) "
           + ", ".join(f"{x['kind'][0]}{x['recovery_s']:.1f}s"
                       + (f"/{x['start_attempts']} start(s)" if 'start_attempts' in x else "")
                       for x in crashes)
           + "; a SIGKILLed relay worker makes the postmaster terminate every backend and "
             "reinitialize (crash recovery), all sessions lost their connections")

    assert_delivered(c, "crash test")
    assert c.reorderings == 0
    assert c.dups_by_region.get(-1, 0) == 0, \
        f"{c.dups_by_region[-1]} duplicates before the first crash (no failure to explain them)"
    assert max(per_crash) <= batch_size, \
        f"a crash re-sent more than outbox.batch_size = {batch_size} events: {per_crash}"
    assert c.duplicates == sum(per_crash) + c.dups_by_region.get(-1, 0)

    conn = pg_connect(env)
    try:
        wait_until(lambda: query_one(conn, "SELECT count(*) FROM outbox.events WHERE aggregate_type = %s"
                                           " AND NOT outbox.published(events)", (agg_type,))[0] == 0,
                   30, "every event of the test to be marked published")
        st = relay_status(conn)[0]
        assert st["state"] in ("idle", "publishing"), st
    finally:
        conn.close()
