"""
A seeded random schedule of faults under load, and a checker of what the relay promises (issue 27;
the method: /work/shared/reference/fault-schedule.md, FoundationDB's simulation and Jepsen).

One integer, the seed, draws the load mix, the faults, their times and their parameters.  The
test prints it first; OUTBOX_CHAOS_SEED=<n> runs that seed again (thread timing still varies:
replay a failing seed a few times).

Load: 3-6 sessions emit all the time: single events (JSON, bytes, tombstones, 70 KB ones that
make the relay's barriers), transactions of 2-30 events, rows written through a capture()
trigger, savepoints rolled back, whole transactions rolled back, prepared transactions
(COMMIT or ROLLBACK PREPARED), two transactions of one aggregate whose later id commits first,
and now and then 1,000-10,000 events in one transaction.  Every event carries its aggregate and a
per-aggregate sequence number, and the load records each one's outcome: committed, rolled back,
or unknown (the connection died at COMMIT; read back with pg_xact_status() when the session
reconnects).  See helpers_chaos_load.py.

Faults (helpers_chaos_faults.py): the relay's crash hook at every named step of a batch with every
action (term, error, stop, kill; sometimes after a sleep, sometimes for one relay of k);
pg_terminate_backend() of a relay or of the launcher; kill -9 of a relay or of the postmaster;
pg_ctl restart -m fast and -m immediate; pause() (with other faults inside), resume(); reloads of
relay_mode, workers_per_database (1-3), delivery, batch_size (1 and 7 for a few seconds: the
BUGGIFY idea), retention (0-10 s, so the retention deletes all the time); this run's Kafka broker
frozen (SIGSTOP, with other faults inside) or killed and started again; replay(from, to).

Checks:
1. Every committed event arrives (judged by content: the retention deletes rows, the load's
   record is the truth).  At the end, and at checkpoints every few minutes for what was
   committed before them.
2. Per aggregate, first arrivals come in commit order.  The rule is the one of helpers_crash: a
   consumer drops copies by the id header, so order is judged on each event's first arrival; a
   copy (an at-least-once re-send, a replay) may land anywhere after its first arrival.  An event
   whose outcome stayed unknown may be missing, never out of order.
3. Nothing rolled back arrives.
4. exactly_once: a read_committed consumer sees no copy of an event inside the offsets that only
   exactly_once relays wrote (DeliveryWindows in helpers_chaos.py) if a copy of it is there
   already, replays excepted.  Across a switch of outbox.delivery the guarantee is narrower, and
   the test holds the relay to exactly that: a batch an at_least_once relay sent but a crash kept
   from being marked is sent again by the next relay, whichever delivery it runs (at_least_once
   keeps no record in Kafka to read back); the same holds for an exactly_once batch committed to
   Kafka whose relay is followed by an at_least_once one.  So copies whose earlier copy lies
   outside the exactly_once windows, and copies outside them, count as at-least-once duplicates.
5. The database's own accounting never says published for an event Kafka does not have: after
   every fault, each event outbox.published(e) calls published must reach the consumer; in each
   pause, with every relay paused and the sessions parked, every committed event that
   outbox.published(e) calls published (or that the retention deleted) must be in Kafka, and
   outbox.status.pending must count every event that is not published.

Lengths: OUTBOX_CHAOS_MINUTES (default 3) is the budget of the whole test: without
OUTBOX_CHAOS_SEED it is shared by the fixed seeds below and one random seed (printed, and in the
test's id).  A long local run: OUTBOX_CHAOS_SEED=<n> OUTBOX_CHAOS_MINUTES=30.
OUTBOX_CHAOS_RELAY_MODE (switch, snapshot, row) and OUTBOX_CHAOS_DELIVERY (switch,
at_least_once, exactly_once) fix a setting instead of switching it.

No assertion depends on time: every wait is for a condition, with bounds far above what the
product needs (a consumer reading what Kafka has: 180 s; the relay draining at the end: 900 s).
"""
import os
import random
from pathlib import Path

import pytest

from conftest import REPO, report
from helpers_chaos_faults import ChaosRun, make_plan
from helpers_chaos_load import COMMITTED, ROLLED_BACK, UNKNOWN

# Seeds that found something (each stays, so that CI keeps trying it):
#   1  two transactions of one aggregate that overlap arrive in id order when the relay reads
#      both committed: the rule for overlapping pairs (History.order_key), and the docs said
#      "commit order" for them
#   5  a reload of relay_mode in the middle of a transaction: its row-tracked last event passed
#      its snapshot-tracked ones (the row claim's ceiling, claim.c; test_34)
FIXED_SEEDS = [1, 5]

_explicit = os.environ.get("OUTBOX_CHAOS_SEED")
SEEDS = [int(_explicit)] if _explicit else FIXED_SEEDS + [random.SystemRandom().randrange(10, 10 ** 6)]
MINUTES = float(os.environ.get("OUTBOX_CHAOS_MINUTES", "3"))
RELAY_MODE = os.environ.get("OUTBOX_CHAOS_RELAY_MODE", "switch")
DELIVERY = os.environ.get("OUTBOX_CHAOS_DELIVERY", "switch")


def summary(run: ChaosRun, a) -> str:
    h = run.load.history
    t = h.tally()
    c = h.counts
    faults = ", ".join(f"{k} {v}" for k, v in sorted(run.faults.items()))
    hooks = ", ".join(f"{k} {v}" for k, v in sorted(run.hook_detail.items()))
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(run.skipped.items())) or "none"
    workarounds = ", ".join(f"{k} {v}" for k, v in sorted(run.workarounds.items())) or "none"
    shapes = ", ".join(f"{k} {v}" for k, v in sorted(run.load.shapes.items()))
    checks = ", ".join(f"{k} {v}" for k, v in sorted(run.checks.items()))
    return (
        f"OUTBOX FAULT SCHEDULE seed {run.plan.seed} (PostgreSQL {run.major}, relay_mode"
        f" {run.plan.relay_mode}, delivery {run.plan.delivery}, {run.plan.seconds / 60:.1f} min,"
        f" {run.plan.sessions} sessions x {run.plan.aggregates} aggregates, start {run.plan.start}):\n"
        f"  faults injected: {sum(run.faults.values())} ({faults})\n"
        f"  crash hook by step:action: {hooks or 'none'}\n"
        f"  drawn but not injected: {skipped}\n"
        f"  done about the servers' own faults: {workarounds}\n"
        f"  transactions by shape: {shapes}\n"
        f"  events: {t[COMMITTED]} committed ({c['resolved_committed']} of them read back after"
        f" the connection died at COMMIT), {t[ROLLED_BACK]} rolled back (savepoint"
        f" {c['rolled_back_savepoint']}, transaction {c['rolled_back_transaction']}, prepared"
        f" {c['rolled_back_prepared']}, connection lost before COMMIT {c['rolled_back_by_fault']},"
        f" read back as rolled back {c['resolved_rolled_back']}), {t[UNKNOWN]} unknown"
        f" ({a.unknown_arrived} of the unknown or in-flight arrived)\n"
        f"  delivered: {a.arrived_distinct} distinct, {a.copies} messages; lost {len(a.lost)},"
        f" reordered {len(a.reorders)}, rolled back but arrived {len(a.ghosts)}\n"
        f"  duplicates: at_least_once (or across a switch) {a.dups_at_least_once}, inside"
        f" exactly_once windows {a.dups_exactly_once} (of which not allowed"
        f" {len(a.eo_duplicates)}), copies from replay() {a.replay_copies};"
        f" {len(run.windows.windows)} exactly_once windows, {run.windows.seconds:.0f} s\n"
        f"  checks: {checks}; load held back by the backlog {run.load.throttled_s:.0f} s\n"
        f"  seconds by kind: " + ", ".join(f"{k} {v:.0f}" for k, v in run.seconds.most_common()))


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed{s}" for s in SEEDS])
def test_fault_schedule(env, seed):
    seconds = MINUTES * 60 / len(SEEDS)
    print(f"\nOUTBOX_CHAOS_SEED={seed} (OUTBOX_CHAOS_MINUTES={seconds / 60:.2f},"
          f" OUTBOX_CHAOS_RELAY_MODE={RELAY_MODE}, OUTBOX_CHAOS_DELIVERY={DELIVERY})", flush=True)
    plan = make_plan(seed, seconds, RELAY_MODE, DELIVERY)
    run = ChaosRun(env, plan)
    out = Path(os.environ.get("OUTBOX_TEST_OUT", REPO / "test" / "out"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        a = run.run()
    except BaseException:
        (out / f"chaos-seed{seed}.txt").write_text("the run failed\n\nproblems:\n" + "\n".join(run.problems)
                                                   + "\n\ntimeline:\n" + "\n".join(run.timeline) + "\n")
        print("timeline (last 40):\n  " + "\n  ".join(run.timeline[-40:]))
        raise
    text = summary(run, a)
    report(text)
    (out / f"chaos-seed{seed}.txt").write_text(text + "\n\nproblems:\n" + "\n".join(run.problems)
                                               + "\n\ntimeline:\n" + "\n".join(run.timeline) + "\n")
    if run.problems:
        print(f"timeline (last 60; all of it in {out}/chaos-seed{seed}.txt):\n  "
              + "\n  ".join(run.timeline[-60:]))
    assert not run.problems, (f"seed {seed} (replay: OUTBOX_CHAOS_SEED={seed}):\n  "
                              + "\n  ".join(run.problems[:30]))
