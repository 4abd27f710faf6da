"""
The inbox's seeded fault schedule (issue 36's "Done when"; the relay's is test_32, the method
/work/shared/reference/fault-schedule.md).  One integer, the seed, draws the load, the faults,
their times and their parameters; the test prints it first; OUTBOX_CHAOS_SEED=<n> replays it
(thread timing still varies), OUTBOX_CHAOS_MINUTES (default 3) is the whole test's budget, shared
by the fixed seeds below and one random seed.

Load (helpers_inbox_chaos.py), in the database the relay serves:
- our relay: sessions emit with outbox.emit() (committed, rolled back, unknown at COMMIT), to
  topic R;
- a foreign confluent_kafka producer straight to topics A and B: records with a unique id
  header, an empty id (b""), a null id header, no headers, ce_id, an id that is not a uuid, two
  ids, odd headers (binary, nameless, null, non-UTF-8), a long header, a value that is not JSON,
  copies of id-carrying records at later offsets, and records whose handler calls
  outbox.unsubscribe() or outbox.pause_subscription() on its own subscription;
- subscription H (handler, hold, dedupe) on R, A and B: one row per event; subscription Q (queue
  mode) on R and A, drained by two takers with outbox.inbox_take() in their own transactions;
  subscription HB on R and A with a batch handler, h(outbox.inbox_event[]), one INSERT per batch
  (a managing record fails its batch: bisection narrows it down to that record's dead letter).

Faults: kill -9 and SIGTERM of an inbox worker and of the inbox launcher, pg_ctl restart -m fast
and -m immediate, kill -9 of the postmaster, reloads of outbox.inbox_workers_per_subscription
(1-3) and outbox.inbox_batch_size (1, 7, 500), pause/resume_subscription (with faults inside), the
broker stopped and started (kafka.sh), topic B deleted and created again: every partition of H on
B must stall (state stalled, last_error "created again", or "no longer has offset" where the new
topic is still shorter), then outbox.inbox_seek(H, B, NULL, '-infinity') and the new topic's
records are applied.

Checks: every relay event committed and every record Kafka acknowledged is applied exactly once
by H and taken exactly once by Q (by token; copies of an id once), except records of a deleted
generation of B (Kafka's loss when not applied before the deletion; at most once when they were)
and the managing records, which are H's only dead letters, each with SQLSTATE 55006; per key,
first applications (and takes) come in produce order within a partition.

A fast stop that hangs with only the checkpointer (and logger) left after a backend crash is
PostgreSQL's known hang (issue 38): ended with an immediate stop and counted; any other stuck stop
fails the test.  Waits are for conditions, with bounds far above what the product needs.
"""
import os
import random
import signal
import subprocess
import time
import uuid
from collections import Counter
from pathlib import Path

import psycopg2
import pytest

from conftest import REPO, admin, create_topics, kafka_sh, pg_connect, pg_sh, query, report, set_conf
from helpers_chaos import LogTail
from helpers_crash import pid_alive, postmaster_pid, start_pg_after_crash
from helpers_inbox import inbox_event_id, setup_app_role, status, subscribe, unsubscribe_all
from helpers_inbox_chaos import (APPLIED, APPLIED_B, BATCH_HANDLER, HANDLER, TAKEN, ForeignLoad, RelayLoad, Takers, check,
                                 chaos_schema, drop_schema)

# Seeds that found something (each stays, so that CI keeps trying it):
#   1  records with an empty (b"") or null id header collapsed: all hashed to one event_id, so
#      all but the first were dropped as duplicates, no dead letter (issue 36 #1;
#      inbox_event.c: an empty or null id is no id)
#   1  (again, 2026-12-07) a record lost to the per-event handler subscription, its id among the
#      seen ones: the test's own fault.  Its ids that are not uuids were "not-a-uuid-<token>", the
#      same in every run of a seed, and the seen ids outlive unsubscribe() by name (doc/inbox.md:
#      a re-subscribe applies no id twice), so a second run on one cluster dropped them as copies
#      (a replay of seed 1 twice: every such record of the second run).  Those ids now carry the
#      run's own tag, as do its topics; forensics() prints what the database holds around a loss.
FIXED_SEEDS = [1, 2]

_explicit = os.environ.get("OUTBOX_CHAOS_SEED")
SEEDS = [int(_explicit)] if _explicit else FIXED_SEEDS + [random.SystemRandom().randrange(10, 10 ** 6)]
MINUTES = float(os.environ.get("OUTBOX_CHAOS_MINUTES", "3"))

FAULTS = {
    "worker_sigkill": 5, "worker_sigterm": 4, "launcher_sigkill": 2, "launcher_sigterm": 3,
    "restart_fast": 2, "restart_immediate": 2, "postmaster_sigkill": 2, "reload_workers": 4,
    "reload_batch_size": 4, "pause": 3, "broker_stop": 0.7, "recreate_topic": 1.5,
}
INNER = ("worker_sigkill", "worker_sigterm", "launcher_sigterm", "reload_workers", "reload_batch_size")
SUB_H, SUB_Q, SUB_HB = "chaos37_h", "chaos37_q", "chaos37_hb"
PARTS = {"R": 4, "A": 3, "B": 2}


class InboxChaos:
    def __init__(self, env, seed: int, seconds: float):
        self.env, self.seed, self.seconds = env, seed, seconds
        self.rng = random.Random(seed)
        self.faults = {k: w * self.rng.uniform(0.5, 1.5) for k, w in FAULTS.items()}
        self.count, self.workarounds, self.stalls, self.skipped = Counter(), Counter(), Counter(), Counter()
        self.problems, self.timeline = [], []
        self.t0 = time.monotonic()
        self.conn = None
        self.log = LogTail(env.server_log)
        self.log_start = self.log.offset
        # topics of this run alone: a seed run again on the same cluster (in the same process
        # too) must not find the records of its earlier run, whose tokens are the same
        self.tag = tag = f"c37s{seed}x{uuid.uuid4().hex[:8]}"
        self.topics = {"R": f"outbox.event.it_{tag}", "A": f"it_{tag}_a", "B": f"it_{tag}_b"}
        self.agg = f"it_{tag}"

    # ------------------------------------------------------------------ servers
    def note(self, what):
        self.timeline.append(f"{time.monotonic() - self.t0:7.1f}s {what}")

    def pg_up(self) -> bool:
        try:
            return pid_alive(postmaster_pid(self.env))
        except (FileNotFoundError, ValueError):
            return False

    def keep_servers(self):
        if not self.pg_up():
            start_pg_after_crash(self.env, timeout=180)

    def db(self, fn, timeout: float = 300):
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.conn is None or self.conn.closed:
                    self.conn = pg_connect(self.env)
                return fn(self.conn)
            except (psycopg2.OperationalError, psycopg2.InterfaceError) as e:
                self.conn = None
                if time.monotonic() > deadline:
                    raise AssertionError(f"the database did not answer for {timeout} s: {e}")
                self.keep_servers()
                time.sleep(0.3)

    def q(self, sql, args=None):
        return self.db(lambda c: query(c, sql, args))

    def wait(self, pred, timeout, what, interval=0.2) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return True
            self.keep_servers()
            time.sleep(interval)
        self.problems.append(f"{time.monotonic() - self.t0:.0f}s: not within {timeout} s: {what}")
        return False

    def pids(self, backend_type):
        return [r[0] for r in self.q("SELECT pid FROM pg_stat_activity WHERE backend_type = %s",
                                     (backend_type,))]

    def states(self, sub):
        return self.db(lambda c: status(c, sub))

    # ------------------------------------------------------------------ setup
    def setup(self):
        c = pg_connect(self.env)
        try:
            setup_app_role(c)
            chaos_schema(c, "inbox_app")
            query(c, "SELECT outbox.resume()")
        finally:
            c.close()
        create_topics(self.env, [self.topics["R"]], partitions=PARTS["R"])
        create_topics(self.env, [self.topics["A"]], partitions=PARTS["A"])
        self.recreate_b_topic(first=True)
        c = pg_connect(self.env)
        try:
            subscribe(c, SUB_H, [self.topics[k] for k in "RAB"], HANDLER)
            subscribe(c, SUB_Q, [self.topics[k] for k in "RA"])
            subscribe(c, SUB_HB, [self.topics[k] for k in "RA"], f"{BATCH_HANDLER}(outbox.inbox_event[])")
        finally:
            c.close()
        self.relay = RelayLoad(self.env, self.agg, self.seed, self.rng.choice([2, 3]),
                               self.rng.uniform(0.02, 0.08))
        self.foreign = ForeignLoad(self.env, self.topics, PARTS, self.seed, self.rng.uniform(0.01, 0.04),
                                   self.tag)
        self.takers = Takers(self.env, SUB_Q, self.seed)
        self.relay.start()
        self.foreign.start()
        self.takers.start()

    def recreate_b_topic(self, first=False):
        a = admin(self.env)
        if not first:
            for f in a.delete_topics([self.topics["B"]], operation_timeout=60).values():
                f.result(60)
            self.wait(lambda: self.topics["B"] not in a.list_topics(timeout=10).topics, 120,
                      "topic B to be deleted")
        deadline = time.monotonic() + 120
        while True:     # "marked for deletion" for a moment after the delete returned
            try:
                create_topics(self.env, [self.topics["B"]], partitions=PARTS["B"])
                break
            except Exception:  # noqa: BLE001
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        md = a.list_topics(timeout=10).topics[self.topics["B"]]
        assert len(md.partitions) == PARTS["B"], f"topic B came back with {len(md.partitions)} partitions"

    # ------------------------------------------------------------------ faults
    def inject(self, kind):
        self.note(f"{kind} (relay committed {self.relay.committed()}, foreign acked {self.foreign.acked()})")
        getattr(self, "f_" + kind)()
        self.count[kind] += 1

    def inner(self):
        names = [k for k in INNER]
        for _ in range(self.rng.choice([0, 1, 1, 2])):
            time.sleep(self.rng.uniform(0, 1.5))
            self.inject(self.rng.choices(names, [self.faults[k] for k in names])[0])

    def signal_one(self, backend_type, sig):
        pids = []
        self.wait(lambda: pids.extend(self.pids(backend_type)) or pids, 120, f"a {backend_type} to run")
        if not pids:
            self.skipped[f"no {backend_type}"] += 1
            return
        victim = self.rng.choice(pids)
        try:
            os.kill(victim, sig)
        except ProcessLookupError:
            self.skipped["the process was gone"] += 1
            return
        self.wait(lambda: any(p != victim for p in self.pids(backend_type)), 180,
                  f"an inbox worker after {sig.name} of {backend_type} {victim}")

    def f_worker_sigkill(self):
        self.signal_one("outbox inbox", signal.SIGKILL)

    def f_worker_sigterm(self):
        self.signal_one("outbox inbox", signal.SIGTERM)

    def f_launcher_sigkill(self):
        self.signal_one("outbox inbox launcher", signal.SIGKILL)

    def f_launcher_sigterm(self):
        self.signal_one("outbox inbox launcher", signal.SIGTERM)

    def f_postmaster_sigkill(self):
        pm = postmaster_pid(self.env)
        kids = self.children(pm)
        os.kill(pm, signal.SIGKILL)
        self.wait(lambda: not pid_alive(pm), 60, "the killed postmaster to be gone", interval=0.05)
        # every orphan must notice the postmaster's death and exit (it holds the shared memory
        # that a new postmaster refuses to start beside)
        t0 = time.monotonic()
        left = lambda: [k for k in kids if pid_alive(int(k.split()[0]))]
        while left() and time.monotonic() - t0 < 60:
            time.sleep(0.1)
        if left():
            self.problems.append(f"orphans of the killed postmaster alive after 60 s: {left()}")
            self.note(f"orphans alive after 60 s: {left()}")
        start_pg_after_crash(self.env, timeout=300)

    @staticmethod
    def children(pm):
        return subprocess.run(["ps", "--ppid", str(pm), "-o", "pid=,args="], capture_output=True,
                              text=True).stdout.strip().splitlines()

    def f_restart_immediate(self):
        self.keep_servers()
        pg_sh(self.env, "ctl", "stop", "-m", "immediate", "-w", "-t", "60", check=False, timeout=90)
        start_pg_after_crash(self.env, timeout=180)

    def f_restart_fast(self):
        self.keep_servers()
        pm = postmaster_pid(self.env)
        p = pg_sh(self.env, "ctl", "stop", "-m", "fast", "-w", "-t", "60", check=False, timeout=90)
        if p.returncode != 0 and pid_alive(pm):
            kids = self.children(pm)
            if all(("checkpointer" in k or "logger" in k) for k in kids):
                self.workarounds["fast stop hung with only the checkpointer left (issue 38)"] += 1
                self.note(f"fast stop hung, children {kids}: PostgreSQL's hang, immediate stop")
            else:
                self.problems.append(f"a fast stop hung for 60 s with children {kids}")
            pg_sh(self.env, "ctl", "stop", "-m", "immediate", "-w", "-t", "60", check=False, timeout=90)
        start_pg_after_crash(self.env, timeout=180)

    def f_reload_workers(self):
        n = self.rng.randint(1, 3)
        self.db(lambda c: set_conf(c, inbox_workers_per_subscription=n))
        self.note(f"  workers_per_subscription {n}")

    def f_reload_batch_size(self):
        n = self.rng.choice([1, 7, 500])
        self.db(lambda c: set_conf(c, inbox_batch_size=n))
        self.note(f"  inbox_batch_size {n}")

    def f_pause(self):
        sub = self.rng.choice([SUB_H, SUB_Q, SUB_HB])
        self.q("SELECT outbox.pause_subscription(%s)", (sub,))
        self.wait(lambda: all(r["state"] == "paused" for r in self.states(sub)), 120, f"{sub} paused")
        self.inner()
        self.q("SELECT outbox.resume_subscription(%s)", (sub,))
        self.wait(lambda: not any(r["state"] == "paused" for r in self.states(sub)), 120, f"{sub} resumed")

    def f_broker_stop(self):
        kafka_sh(self.env, "stop", timeout=180)
        try:
            time.sleep(self.rng.uniform(0, 4))      # an outage's length, not a wait for a condition
            self.inner()
        finally:
            kafka_sh(self.env, "start", timeout=240)

    def b_rows(self):
        return [r for r in self.states(SUB_H) if r["topic"] == self.topics["B"]
                and r["kafka_partition"] is not None]

    def f_recreate_topic(self):
        if not self.foreign.close_b():
            self.problems.append("records to topic B not acknowledged in 120 s")
        gen_recs = [r for r in self.foreign.recs.values() if r.topic == "B" and r.gen == self.foreign.gen]
        if not any(r.acked for r in gen_recs):
            self.skipped["recreate: nothing in B yet"] += 1
            self.foreign.b_open.set()
            return
        # every partition of B applied from (else a new topic cannot be told from the old one)
        if not self.wait(lambda: len(self.b_rows()) == PARTS["B"] and all(
                (r["next_offset"] or 0) > 0 for r in self.b_rows()), 180, "H to apply from every partition of B"):
            self.foreign.b_open.set()
            return
        self.recreate_b_topic()
        self.foreign.open_b()
        def stalled():
            rows = self.b_rows()
            return len(rows) == PARTS["B"] and all(r["state"] == "stalled" for r in rows)
        ok = self.wait(stalled, 240, f"every partition of the re-created topic B to stall"
                                     f" ({[(r['kafka_partition'], r['state'], r['last_error']) for r in self.b_rows()]})")
        for r in self.b_rows():
            err = r["last_error"] or ""
            self.stalls["created again" if "created again" in err else
                        "no longer has offset" if "no longer has offset" in err else
                        f"{r['state']}: {err[:80]}"] += 1
            if r["state"] == "stalled" and "created again" not in err and "no longer has offset" not in err:
                self.problems.append(f"B partition {r['kafka_partition']} stalled with {err!r}")
        if ok:
            self.q("SELECT outbox.inbox_seek(%s, %s, NULL, '-infinity'::timestamptz)", (SUB_H, self.topics["B"]))
        else:
            for r in self.b_rows():
                if r["state"] == "stalled":
                    self.q("SELECT outbox.inbox_seek(%s, %s, %s, '-infinity'::timestamptz)",
                           (SUB_H, self.topics["B"], r["kafka_partition"]))
        self.wait(lambda: not any(r["state"] == "stalled" for r in self.b_rows()), 120,
                  "B's partitions to go on after inbox_seek")

    def after_fault(self):
        self.keep_servers()
        self.log.read()
        self.problems.extend(f"server log: {a}" for a in self.log.alarms)
        self.log.alarms.clear()
        subs = {r[0] for r in self.q("SELECT name FROM outbox.subscriptions")}
        if subs != {SUB_H, SUB_Q, SUB_HB}:
            raise AssertionError(f"subscriptions are {subs}: a handler's unsubscribe() took effect?")
        dead = self.q("SELECT subscription, coalesce(event_type, ''), sqlstate, left(error, 200)"
                      " FROM outbox.inbox_dead WHERE event_type IS DISTINCT FROM 'chaos.manage'"
                      " OR sqlstate <> '55006' OR subscription <> ALL(%s) LIMIT 5", ([SUB_H, SUB_HB],))
        if dead:
            raise AssertionError(f"unexpected dead letters: {dead}")

    # ------------------------------------------------------------------ the run
    def run(self):
        self.setup()
        try:
            self.wait(lambda: self.relay.committed() > 0 and self.foreign.acked() > 0, 120, "the first load")
            deadline = self.t0 + self.seconds
            names = list(self.faults)
            while time.monotonic() < deadline:
                time.sleep(self.rng.uniform(0, 3))
                self.inject(self.rng.choices(names, [self.faults[k] for k in names])[0])
                self.after_fault()
            return self.final()
        finally:
            self.teardown()

    def final(self):
        self.relay.stop()
        self.foreign.stop()
        self.keep_servers()
        self.q("SELECT outbox.resume_subscription(name) FROM outbox.subscriptions WHERE paused")
        self.db(self.relay.resolve)
        t0 = time.monotonic()
        # every expected token there (the checker then says which are missing, if any)
        relay_ok = {t for t, o in self.relay.outcome.items() if o in ("committed", "resolved_committed")}
        acked = {t for t, r in self.foreign.recs.items() if r.acked and (r.topic != "B" or r.gen == self.foreign.gen)}
        manage = {t for t, r in self.foreign.recs.items() if r.kind == "manage"}
        want_h = relay_ok | (acked - manage)
        want_q = relay_ok | {t for t in acked if self.foreign.recs[t].topic == "A"}
        want_hb = want_q - manage
        have = lambda table: {r[0] for r in self.q(f"SELECT DISTINCT token FROM {table}")}
        self.wait(lambda: want_h <= have(APPLIED), 300, f"H to apply every expected record ({len(want_h - have(APPLIED))} missing)", interval=1)
        self.wait(lambda: want_hb <= have(APPLIED_B), 300, f"HB to apply every expected record ({len(want_hb - have(APPLIED_B))} missing)", interval=1)
        self.wait(lambda: want_q <= have(TAKEN), 300, f"Q's takers to take every expected record ({len(want_q - have(TAKEN))} missing)", interval=1)
        self.wait(lambda: all(r["state"] == "running" and r["lag"] == 0 for s in (SUB_H, SUB_Q, SUB_HB)
                              for r in self.states(s) if r["kafka_partition"] is not None), 300,
                  "every partition to run with lag 0")
        self.wait(lambda: self.q("SELECT count(*) FROM outbox.inbox WHERE subscription = %s", (SUB_Q,))[0][0] == 0,
                  120, "the queue to be empty")
        self.drain_s = time.monotonic() - t0
        self.takers.stop()
        applied = self.q(f"SELECT id, token FROM {APPLIED}")
        taken = self.q(f"SELECT id, token FROM {TAKEN}")
        applied_b = self.q(f"SELECT id, token FROM {APPLIED_B}")
        dead = self.q("SELECT CASE subscription WHEN %s THEN 'handler' WHEN %s THEN 'batch' ELSE subscription END,"
                      " coalesce(payload->>'token', '?'), sqlstate, held, left(error, 200) FROM outbox.inbox_dead",
                      (SUB_H, SUB_HB))
        self.st = self.q("SELECT subscription, sum(applied), sum(duplicates) FROM outbox.inbox_status"
                         " GROUP BY subscription ORDER BY 1")
        problems, fig = check(self.relay, self.foreign, applied, taken, dead, ("R", "A", "B"), ("R", "A"),
                              applied_b, ("R", "A"))
        self.problems.extend(problems)
        self.problems.extend(f"load: {e}" for e in self.relay.errors[:5] + self.takers.errors[:5])
        for sub, table, want in ((SUB_H, APPLIED, want_h), (SUB_HB, APPLIED_B, want_hb)):
            for tok in sorted(want - have(table))[:3]:
                self.problems.append(self.forensics(sub, table, tok))
        return fig

    def forensics(self, sub, table, tok):
        """What the database holds around a lost record: the neighbours its subscription applied
        in its partition, whether its id is among the seen ones, the partition's offsets row, and
        the server log's lines about that partition."""
        rec = self.foreign.recs.get(tok)
        if rec is None:
            return f"forensics {sub} {tok}: a relay event (topic R)"
        topic = self.topics[rec.topic]
        lo, hi = min(rec.acked) - 12, max(rec.acked) + 12
        near = self.q(f"SELECT kafka_offset, token FROM {table} WHERE topic = %s AND kafka_partition = %s"
                      f" AND kafka_offset BETWEEN %s AND %s ORDER BY kafka_offset",
                      (topic, rec.partition, lo, hi))
        seen = None
        headers = dict(rec.headers or [])
        raw = headers.get("id") or headers.get("ce_id")
        if rec.has_id and raw:
            seen = self.q("SELECT count(*) FROM outbox.inbox_seen WHERE subscription = %s AND event_id = %s",
                          (sub, inbox_event_id(raw)))[0][0]
        offs = self.q("SELECT next_offset, applied, duplicates, witness_offset FROM outbox.inbox_offsets"
                      " WHERE subscription = %s AND topic = %s AND kafka_partition = %s",
                      (sub, topic, rec.partition))
        with open(self.env.server_log, "rb") as f:
            f.seek(self.log_start)
            lines = f.read().decode("utf-8", "replace").splitlines()
        log = [line for line in lines
               if sub in line and (topic in line or "offset" in line or "ended" in line)][-12:]
        return (f"forensics {sub} {tok} ({rec.topic} p{rec.partition} @{rec.acked} {rec.kind}):"
                f" applied around it {[(o, t) for o, t in near]}; id seen {seen}; offsets {offs};"
                f" log: " + " | ".join(l.strip()[:300] for l in log))

    def teardown(self):
        for x in (self.relay, self.foreign, self.takers):
            if hasattr(x, "stopping"):
                x.stopping.set()
        if kafka_sh(self.env, "status", check=False).returncode != 0:
            kafka_sh(self.env, "start", timeout=240)
        self.keep_servers()
        def reset(c):
            set_conf(c, inbox_workers_per_subscription=None, inbox_batch_size=None)
            unsubscribe_all(c)
            drop_schema(c)
        self.db(reset)
        if self.conn is not None:
            self.conn.close()


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed{s}" for s in SEEDS])
def test_inbox_fault_schedule(env, seed):
    seconds = MINUTES * 60 / len(SEEDS)
    print(f"\nOUTBOX_CHAOS_SEED={seed} (OUTBOX_CHAOS_MINUTES={seconds / 60:.2f})", flush=True)
    run = InboxChaos(env, seed, seconds)
    out = Path(os.environ.get("OUTBOX_TEST_OUT", REPO / "test" / "out"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        fig = run.run()
    except BaseException:
        (out / f"inbox-chaos-seed{seed}.txt").write_text("failed\n" + "\n".join(run.problems + run.timeline))
        print("timeline:\n  " + "\n  ".join(run.timeline[-40:]))
        raise
    f = run.foreign
    text = (f"INBOX FAULT SCHEDULE seed {seed} ({seconds / 60:.1f} min): faults"
            f" {sum(run.count.values())} ({', '.join(f'{k} {v}' for k, v in sorted(run.count.items()))});"
            f" re-created topic stalls: {dict(run.stalls) or 'none'}; PostgreSQL's fast-stop hang:"
            f" {sum(run.workarounds.values())}; skipped {dict(run.skipped) or 'none'}\n"
            f"  load: relay {fig['relay events committed']} committed, {fig['relay events never committed']}"
            f" not; foreign {fig['foreign records acknowledged']} records acknowledged"
            f" ({', '.join(f'{k} {v}' for k, v in sorted(f.kinds.items()))}), {fig['foreign copies acknowledged']}"
            f" copies; takes {dict(run.takers.takes)}\n"
            f"  handler: {fig['handler expected']} expected, {fig['handler applied']} applied, lost"
            f" {fig['handler lost']}, twice {fig['handler twice']}; deleted topic: {fig['handler old-topic applied']}"
            f" applied before, {fig['handler old-topic lost with the topic']} lost with it;"
            f" dead letters {fig['handler dead letters (55006)']} (55006)\n"
            f"  batch handler: {fig['batch expected']} expected, {fig['batch applied']} applied, lost"
            f" {fig['batch lost']}, twice {fig['batch twice']}; dead letters"
            f" {fig['batch dead letters (55006)']} (55006)\n"
            f"  queue: {fig['queue expected']} expected, {fig['queue applied']} taken, lost {fig['queue lost']},"
            f" twice {fig['queue twice']}; inbox_status {run.st}; drained in {run.drain_s:.0f} s")
    report(text)
    (out / f"inbox-chaos-seed{seed}.txt").write_text(text + "\n\nproblems:\n" + "\n".join(run.problems)
                                                     + "\n\ntimeline:\n" + "\n".join(run.timeline) + "\n")
    assert not run.problems, f"seed {seed} (OUTBOX_CHAOS_SEED={seed}):\n  " + "\n  ".join(run.problems[:30])
