"""
The seeded fault schedule itself (test_32_fault_schedule.py): the plan a seed draws, the faults
(the nemesis), and the run that interleaves them with the checks.

One random.Random(seed) draws the plan (sessions, aggregates, shape and fault weights, the
starting settings) and then, in the main thread only, every fault, its time and its parameters;
each emitting session has its own Random(seed * 1000 + session).  What the seed cannot fix is
thread timing, so a failing seed should be replayed a few times.
"""
import glob
import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import psycopg2
from confluent_kafka import Consumer, TopicPartition

from conftest import (POSTGRES_STOP_HANG, Env, create_topics, end_postmaster, kafka_sh,
                      pg_connect, pg_sh, query, query_one, server_major, set_conf, stop_server,
                      stuck_stop_verdict, topic_prefix)
from helpers_chaos import (ContentReader, DeliveryWindows, HighWatermarks, LogTail, analyse,
                           committed_snapshot)
from helpers_chaos_load import SHAPES, ChaosLoad
from helpers_crash import pid_alive, postmaster_pid, start_pg_after_crash

# weights before the seed scales each by 0.5-1.5
FAULTS = {
    "hook": 22,                 # the relay's crash hook at a named step (fault_point.c)
    "relay_sigterm": 8,         # pg_terminate_backend() of a relay
    "launcher_sigterm": 2,      # of the launcher (its relays stop too)
    "relay_sigkill": 4,         # kill -9 of a relay: the postmaster restarts every backend
    "postmaster_sigkill": 3,    # kill -9 of the postmaster, started again
    "restart_fast": 3,          # pg_ctl restart -m fast
    "restart_immediate": 3,     # pg_ctl restart -m immediate
    "pause": 6,                 # pause(), the accounting checked while paused, resume()
    "reload_relay_mode": 5,
    "reload_workers": 4,        # outbox.workers_per_database 1..3
    "reload_delivery": 5,
    "reload_batch_size": 8,     # 1 and 7 for a few seconds (BUGGIFY), else 50..20000
    "reload_retention": 3,      # 0..10 s: deletes run all the time
    "broker_freeze": 5,         # SIGSTOP of this run's Kafka broker, then SIGCONT
    "broker_kill": 0.6,         # kill -9 of the broker, started again (20-40 s each)
    "replay": 5,                # replay(from_id, to_id) of recent events
}
# faults injected inside another one (a pause, a frozen or dead broker)
INNER = ("hook", "relay_sigterm", "relay_sigkill", "restart_fast", "restart_immediate",
         "reload_delivery", "reload_batch_size", "reload_workers", "reload_relay_mode")
HOOK_STEPS = ("claim_start", "snapshot_start", "mid_cursor", "after_produce", "after_ack",
              "before_commit", "vacuum_start")
HOOK_STEPS_EO = ("mid_transaction", "after_kafka_commit")
HOOK_ACTIONS = ("term", "error", "stop", "kill", "pass")     # pass: a window held open (sleep)
SETTINGS = ("relay_mode", "delivery", "workers_per_database", "batch_size", "retention")


@dataclass
class Plan:
    seed: int
    seconds: float
    relay_mode: str             # switch | snapshot | row
    delivery: str               # switch | at_least_once | exactly_once
    sessions: int = 4
    aggregates: int = 16
    think_s: float = 0.01
    shapes: Dict[str, float] = field(default_factory=dict)
    faults: Dict[str, float] = field(default_factory=dict)
    start: Dict[str, object] = field(default_factory=dict)
    gap_s: float = 1.0
    max_backlog: int = 3000        # the check after each fault reads every unpublished row
    checkpoint_s: float = 240
    long_freeze: bool = False
    rng_state: tuple = ()       # where the plan's draws left the seed's Random: the schedule's


def make_plan(seed: int, seconds: float, relay_mode: str, delivery: str) -> Plan:
    rng = random.Random(seed)
    p = Plan(seed=seed, seconds=seconds, relay_mode=relay_mode, delivery=delivery)
    p.sessions = rng.randint(3, 6)
    p.aggregates = rng.choice([4, 8, 16, 32])
    p.think_s = rng.choice([0.01, 0.02, 0.04])
    p.shapes = {k: w * rng.uniform(0.5, 1.5) for k, w in SHAPES.items()}
    p.faults = {k: w * rng.uniform(0.5, 1.5) for k, w in FAULTS.items()}
    if relay_mode != "switch":
        p.faults["reload_relay_mode"] = 0
    if delivery != "switch":
        p.faults["reload_delivery"] = 0
    p.start = {
        "relay_mode": rng.choice(["snapshot", "row"]) if relay_mode == "switch" else relay_mode,
        "delivery": (rng.choice(["at_least_once", "exactly_once"]) if delivery == "switch"
                     else delivery),
        "workers_per_database": rng.choice([1, 1, 2]),
        "batch_size": rng.choice([100, 1000, 5000]),
        "retention": rng.choice([0, 1, 2, 5]),
    }
    p.gap_s = rng.uniform(0.1, 0.8)
    p.long_freeze = seconds >= 600
    p.rng_state = rng.getstate()
    return p


class ChaosRun:
    """One seed: setup, the schedule with its checks, the final check, teardown."""

    def __init__(self, env: Env, plan: Plan, say: Callable[[str], None] = print):
        self.env, self.plan, self.say = env, plan, say
        self.rng = random.Random()
        self.rng.setstate(plan.rng_state)
        self.faults = Counter()         # injected, by kind
        self.hook_detail = Counter()    # step:action of the hook faults that fired
        self.checks = Counter()
        self.skipped = Counter()        # faults drawn but not injected, and why
        self.workarounds = Counter()    # what the run did about faults of the servers themselves
        self.stopping_since = None
        self.seconds = Counter()        # time spent per fault kind (inner faults counted twice)
        self.low_marks = [0, 0, 0]      # check_published: lowest unpublished id of the last checks
        self.known_published = set()    # ids above those seen published (and sent to the verifier)
        self.problems: List[str] = []
        self.settings = dict(plan.start)
        self.windows = DeliveryWindows()
        self.broker_down = False
        self.broker_frozen_pid: Optional[int] = None
        self.broker_fault_in_episode = False
        self.episode = 0
        self.timeline: List[str] = []
        self.t0 = time.monotonic()
        self.load: Optional[ChaosLoad] = None
        self.conn = None
        self.reader: Optional[ContentReader] = None
        self.marks: Optional[HighWatermarks] = None
        self.tag = f"chaos{plan.seed}_{os.getpid() % 10000}"
        self.aggregate_type = f"it_{self.tag}"
        self.table = f"public.{self.tag}_rows"
        self.tokens = f"public.{self.tag}_tokens"
        self.log = LogTail(env.server_log)

    # ------------------------------------------------------------------ servers and the database

    def pg_up(self) -> bool:
        try:
            pid = postmaster_pid(self.env)
        except (FileNotFoundError, ValueError):
            return False
        return pid_alive(pid)

    def keep_servers(self):
        """Whatever the last fault left (a crash hook's "stop" may come at any time): a running
        server.  (The broker faults restore the broker themselves, teardown() once more.)"""
        self.unstick_shutdown()
        if not self.pg_up():
            start_pg_after_crash(self.env, timeout=180)

    def unstick_shutdown(self):
        """PostgreSQL (15 to 18) never finishes a fast shutdown requested after a backend crash,
        before the restart's redo began: the postmaster waits for a checkpointer it did not ask
        to exit (test/repro/).  A postmaster seen "stopping" in postmaster.pid for 60 s, far
        beyond any fast shutdown here, is judged by conftest.stuck_stop_verdict(): PostgreSQL's
        hang is counted, any other (an outbox process still alive, say) is a problem of the run,
        with the children and their stacks; either way it then gets SIGQUIT (an immediate
        shutdown, which ends it)."""
        try:
            with open(os.path.join(self.env.pg_dir, "data", "postmaster.pid")) as f:
                lines = f.read().splitlines()
            pid, state = int(lines[0]), lines[7].strip() if len(lines) > 7 else ""
        except (OSError, ValueError, IndexError):
            return
        if state != "stopping" or not pid_alive(pid):
            self.stopping_since = None
            return
        if self.stopping_since is None or self.stopping_since[0] != pid:
            self.stopping_since = (pid, time.monotonic())
        elif time.monotonic() - self.stopping_since[1] > 60:
            verdict = stuck_stop_verdict(self.env, pid)
            self.note(f"postmaster {pid} stuck in a fast shutdown for 60 s: SIGQUIT")
            if verdict is None:
                self.workarounds[POSTGRES_STOP_HANG + ": SIGQUIT"] += 1
            else:
                self.problems.append(f"episode {self.episode}: {verdict}")
            self.stopping_since = None
            end_postmaster(self.env, pid)

    def postmaster(self) -> int:
        """The running postmaster's pid (the server started first if a fault stopped it)."""
        deadline = time.monotonic() + 300
        while True:
            self.keep_servers()
            try:
                pid = postmaster_pid(self.env)
                if pid_alive(pid):
                    return pid
            except (FileNotFoundError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError("no running postmaster for 300 s")
            time.sleep(0.2)

    def restore_broker(self):
        if self.broker_frozen_pid is not None:
            self.thaw(self.broker_frozen_pid)
        if self.broker_down:
            kafka_sh(self.env, "start", timeout=240)
            self.broker_down = False

    def db(self, fn, timeout: float = 300, autocommit: bool = True):
        """fn(conn) on the run's connection (a new one after connection errors: the server may
        be restarting); the servers are kept up meanwhile.  fn must leave no transaction open."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.conn is None or self.conn.closed:
                    t0 = time.monotonic()
                    self.conn = pg_connect(self.env, autocommit=True)
                    self.seconds["(connecting)"] += time.monotonic() - t0
                self.conn.autocommit = autocommit
                try:
                    return fn(self.conn)
                finally:
                    if not self.conn.closed:
                        self.conn.rollback()
                        self.conn.autocommit = True
            except (psycopg2.OperationalError, psycopg2.InterfaceError) as e:
                try:
                    self.conn.close()
                except Exception:  # noqa: BLE001
                    pass
                self.conn = None
                if time.monotonic() > deadline:
                    raise AssertionError(f"the database did not answer for {timeout} s: {e}")
                t0 = time.monotonic()
                self.keep_servers()
                time.sleep(0.2)
                self.seconds["(waiting for the server)"] += time.monotonic() - t0

    def wait(self, pred, timeout: float, what: str, interval: float = 0.1):
        """Wait for a condition about the product; keep the servers up meanwhile."""
        deadline = time.monotonic() + timeout
        while True:
            v = pred()
            if v:
                return v
            if time.monotonic() > deadline:
                return None
            self.keep_servers()
            time.sleep(interval)

    def high(self) -> Dict[int, int]:
        deadline = time.monotonic() + 240
        while True:
            try:
                return self.marks.read()
            except Exception:  # noqa: BLE001  (the broker restarting)
                if time.monotonic() > deadline:
                    raise
                self.keep_servers()
                time.sleep(0.5)

    def relays(self) -> List[tuple]:
        return self.db(lambda c: query(c, "SELECT pid, worker FROM outbox.worker_buckets()"
                                          " WHERE worker IS NOT NULL ORDER BY worker"))

    def set(self, **kw):
        self.db(lambda c: set_conf(c, **kw))
        self.settings.update(kw)

    # ------------------------------------------------------------------ setup and teardown

    def setup(self):
        env = self.env
        c = pg_connect(env)
        try:
            self.major = server_major(c)
            self.topic = topic_prefix(c) + self.aggregate_type
            prepared_ok = int(query_one(c, "SHOW max_prepared_transactions")[0]) > 0
            query(c, f"CREATE TABLE {self.table} (agg text PRIMARY KEY, seq int NOT NULL, pad text)")
            query(c, f"CREATE TABLE {self.tokens} (token int PRIMARY KEY)")
            query(c, f"CREATE TRIGGER aa_chaos AFTER INSERT OR UPDATE ON {self.table} FOR EACH ROW"
                     f" EXECUTE FUNCTION outbox.capture('{self.aggregate_type}', 'agg')")
            query(c, "SELECT outbox.resume()")
        finally:
            c.close()
        if not prepared_ok:
            self.say("max_prepared_transactions = 0: the prepared shape is left out")
        create_topics(env, [self.topic])
        self.set(**self.plan.start)
        if self.plan.start["delivery"] == "exactly_once":
            self.windows.to_exactly_once(self.log.read())
        self.marks = HighWatermarks(env, self.topic)
        self.load = ChaosLoad(env, self.aggregate_type, self.table, self.tokens, self.plan.seed,
                              self.plan.sessions, self.plan.aggregates, self.plan.think_s,
                              self.plan.shapes, self.plan.max_backlog,
                              backlog=lambda: self.load.history.committed_total - self.reader.distinct,
                              prepared_ok=prepared_ok)
        self.reader = ContentReader(env, self.topic, self.load.history)
        self.load.start()

    def teardown(self):
        try:
            self.restore_broker()
            self.keep_servers()
        finally:
            self.remove_hook_files()
            if self.load is not None and not self.load.stopping.is_set():
                self.load.stopping.set()
                self.load.gate.set()
                for s in self.load.sessions:
                    s.thread.join(30)

            def reset(c):
                set_conf(c, **{k: None for k in SETTINGS})
                query(c, "SELECT outbox.resume()")
                for (gid,) in query(c, "SELECT gid FROM pg_prepared_xacts WHERE gid LIKE %s",
                                    (f"chaos{self.plan.seed}-%",)):
                    query(c, f"ROLLBACK PREPARED '{gid}'")
                query(c, f"DROP TABLE IF EXISTS {self.table}, {self.tokens}")
            self.db(reset)
            if self.conn is not None:
                self.conn.close()
            for x in (self.reader, self.marks):
                if x is not None:
                    x.close()

    def remove_hook_files(self):
        for f in glob.glob(os.path.join(self.env.pg_dir, "data", "outbox_crash_*")):
            try:
                os.unlink(f)
            except FileNotFoundError:
                pass

    # ------------------------------------------------------------------ the schedule

    def run(self):
        self.setup()
        self.check_lock = threading.Lock()
        self.check_wanted = threading.Event()
        self.check_episode = None
        self.verifier_stop = False
        self.verifier_conn = None
        self.verifier_marks = HighWatermarks(self.env, self.topic)
        verifier = threading.Thread(target=self.verifier, daemon=True, name="chaos-verifier")
        verifier.start()
        try:
            self.wait(lambda: self.load.history.committed_total > 0, 120, "the first commits")
            self.note("load running")
            deadline = self.t0 + self.plan.seconds
            next_checkpoint = time.monotonic() + self.plan.checkpoint_s
            while time.monotonic() < deadline:
                time.sleep(self.rng.uniform(0, self.plan.gap_s))
                self.one_episode()
                if time.monotonic() > next_checkpoint and time.monotonic() < deadline - 30:
                    self.checkpoint()
                    next_checkpoint = time.monotonic() + self.plan.checkpoint_s
            self.stop_verifier(verifier)
            return self.final()
        finally:
            self.stop_verifier(verifier)
            self.verifier_marks.close()
            self.teardown()

    def stop_verifier(self, verifier: threading.Thread):
        """One more check of invariant 5, then the thread ends."""
        self.verifier_stop = True
        with self.check_lock:
            self.check_episode = self.episode
        self.check_wanted.set()
        verifier.join(900)

    def note(self, what: str):
        now = time.time()
        self.timeline.append(f"{time.monotonic() - self.t0:7.1f}s"
                             f" {time.strftime('%H:%M:%S', time.gmtime(now))}.{int(now * 1000) % 1000:03d}"
                             f" {what}")

    def one_episode(self):
        self.episode += 1
        self.broker_fault_in_episode = False
        names = [k for k, w in self.plan.faults.items() if w > 0]
        kind = self.rng.choices(names, [self.plan.faults[k] for k in names])[0]
        self.inject(kind)
        self.after_fault()

    def inject(self, kind: str):
        t0 = time.monotonic()
        getattr(self, "f_" + kind)()
        self.seconds[kind] += time.monotonic() - t0

    def count(self, kind: str, detail: str = ""):
        self.faults[kind] += 1
        self.note(kind + (f" {detail}" if detail else ""))

    def inner_faults(self, leave_out=()):
        """0-2 faults inside a pause or a broker fault."""
        names = [k for k in INNER if self.plan.faults.get(k, 0) > 0 and k not in leave_out]
        for _ in range(self.rng.choice([0, 0, 1, 1, 2])):
            time.sleep(self.rng.uniform(0, 1.5))
            self.inject(self.rng.choices(names, [self.plan.faults[k] for k in names])[0])

    def after_fault(self):
        t0 = time.monotonic()
        self.keep_servers()
        self.log.read()
        self.seconds["(check: servers, log)"] += time.monotonic() - t0
        for line in self.log.alarms:
            self.problems.append(f"server log: {line}")
        self.log.alarms.clear()
        t0 = time.monotonic()
        self.update_windows()
        self.seconds["(check: windows)"] += time.monotonic() - t0
        with self.check_lock:
            self.check_episode = self.episode
        self.check_wanted.set()

    # ------------------------------------------------------------------ faults: processes

    def some_relay(self) -> Optional[tuple]:
        rows = self.wait(self.relays, 10, "a running relay")
        if not rows:
            self.skipped["no relay to signal"] += 1
            return None
        return self.rng.choice(rows)

    def f_relay_sigterm(self):
        r = self.some_relay()
        if r:
            self.db(lambda c: query(c, "SELECT pg_terminate_backend(%s)", (r[0],)))
            self.count("relay_sigterm")

    def f_launcher_sigterm(self):
        rows = self.db(lambda c: query(c, "SELECT pid FROM pg_stat_activity"
                                          " WHERE backend_type = 'outbox launcher'"))
        if rows:
            self.db(lambda c: query(c, "SELECT pg_terminate_backend(%s)", (rows[0][0],)))
            self.count("launcher_sigterm")

    def f_relay_sigkill(self):
        r = self.some_relay()
        if r:
            try:
                os.kill(r[0], signal.SIGKILL)
                self.count("relay_sigkill")
            except ProcessLookupError:
                self.skipped["no relay to signal"] += 1

    def f_postmaster_sigkill(self):
        os.kill(self.postmaster(), signal.SIGKILL)
        self.count("postmaster_sigkill")
        start_pg_after_crash(self.env, timeout=180)

    def _restart(self, mode: str):
        """pg_ctl stop -m mode, then start: a stop stuck for 90 s is PostgreSQL's hang (counted)
        or a problem of the run (conftest.stop_server)."""
        self.keep_servers()
        self.count(f"restart_{mode}")
        try:
            if stop_server(self.env, mode, timeout=90) == "postgres_hang":
                self.workarounds[POSTGRES_STOP_HANG + ": SIGQUIT"] += 1
        except AssertionError as e:
            self.problems.append(f"episode {self.episode}: {e}")
        self.keep_servers()

    def f_restart_fast(self):
        self._restart("fast")

    def f_restart_immediate(self):
        self._restart("immediate")

    # ------------------------------------------------------------------ faults: the crash hook

    def f_hook(self):
        eo = self.settings["delivery"] == "exactly_once"
        steps = HOOK_STEPS + HOOK_STEPS_EO if eo else HOOK_STEPS
        step = self.rng.choice(steps)
        action = self.rng.choice(HOOK_ACTIONS)
        sleep_ms = self.rng.choice([0, 0, 0, 50, 300, 1500])
        if action == "pass":
            sleep_ms = self.rng.choice([50, 300, 1500])    # commits land in the held window
        k = int(self.settings["workers_per_database"])
        relay = self.rng.randint(1, k) if k > 1 and self.rng.random() < 0.5 else None
        text = (f"relay {relay}\n" if relay else "") + (f"sleep {sleep_ms} " if sleep_ms else "") \
            + ("" if action == "kill" else action)
        line = self.log.read()
        postmaster = self.postmaster()
        path = os.path.join(self.env.pg_dir, "data", f"outbox_crash_{step}")
        with open(path, "w") as f:
            f.write(text + "\n")
        fired = self.wait(lambda: self.hook_fired(line, step), 6 + sleep_ms / 1000,
                          f"the hook at {step}", interval=0.05)
        if not fired:
            try:
                os.unlink(path)
                self.skipped["hook not reached in time (file removed)"] += 1
                return
            except FileNotFoundError:   # it acted just now
                self.wait(lambda: self.hook_fired(line, step), 30, f"the hook at {step}")
        self.count("hook", f"{step}:{action} ({text.strip()!r})")
        self.hook_detail[f"{step}:{action}"] += 1
        if action == "stop":
            # the relay sent the postmaster SIGQUIT: wait for that postmaster to go (the
            # waits above may have started the next one already), then start it again
            self.wait(lambda: not pid_alive(postmaster), 60, "the server to stop")
            self.keep_servers()

    def hook_fired(self, line: int, step: str) -> Optional[str]:
        self.log.read()
        return self.log.hook_fired_since(line, step)

    # ------------------------------------------------------------------ faults: operations

    def f_pause(self):
        self.db(lambda c: query(c, "SELECT outbox.pause()"))
        self.count("pause")
        try:
            self.inner_faults(leave_out=("hook",))     # a paused relay reaches no step
            self.keep_servers()
            t0 = time.monotonic()
            paused = self.wait(self.all_paused, 180, "every relay paused", interval=0.2)
            self.seconds["(pause: waiting for state paused)"] += time.monotonic() - t0
            if not paused:
                self.problems.append(f"episode {self.episode}: the relays did not all reach"
                                     f" state paused in 180 s: {self.status_rows()}")
            else:
                self.accounting_check()
        finally:
            self.db(lambda c: query(c, "SELECT outbox.resume()"))

    def status_rows(self):
        return self.db(lambda c: query(c, "SELECT pid, state, pending FROM outbox.status"))

    def all_paused(self) -> bool:
        rows = self.status_rows()
        return bool(rows) and all(r[0] is not None and r[1] == "paused" for r in rows)

    def f_replay(self):
        def replay(c):
            c.autocommit = False
            for _ in range(5):
                try:
                    with c.cursor() as cur:
                        cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                        cur.execute("SELECT max(id) FROM outbox.events WHERE aggregate_type = %s",
                                    (self.aggregate_type,))
                        top = cur.fetchone()[0]
                        if top is None:
                            c.rollback()
                            return None
                        lo = max(1, top - self.rng.randint(0, 20000))
                        hi = lo + self.rng.randint(0, 2000)
                        cur.execute(
                            "SELECT aggregate_id, coalesce(headers->>'seq',"
                            "       payload->'after'->>'seq')::int"
                            "  FROM outbox.events e WHERE id BETWEEN %s AND %s"
                            "   AND aggregate_type = %s AND outbox.published(e)",
                            (lo, hi, self.aggregate_type))
                        rows = cur.fetchall()
                        cur.execute("SELECT outbox.replay(%s, %s)", (lo, hi))
                        n = cur.fetchone()[0]
                    c.commit()
                    return rows, n
                except psycopg2.extensions.TransactionRollbackError:
                    c.rollback()
            return None
        got = self.db(replay)
        if got is None:
            self.skipped["replay found no events"] += 1
            return
        rows, n = got
        h = self.load.history
        for name, seq in rows:
            h.note_replay(h.index[name], seq)
        self.count("replay")
        self.checks["replayed events"] += n

    # ------------------------------------------------------------------ faults: settings

    def f_reload_relay_mode(self):
        self.set(relay_mode="row" if self.settings["relay_mode"] == "snapshot" else "snapshot")
        self.count("reload_relay_mode")

    def f_reload_workers(self):
        k = self.rng.choice([x for x in (1, 1, 2, 3) if x != int(self.settings["workers_per_database"])])
        self.set(workers_per_database=k)
        self.count("reload_workers")

    def f_reload_retention(self):
        self.set(retention=self.rng.choice([0, 1, 2, 5, 10]))
        self.count("reload_retention")

    def f_reload_batch_size(self):
        size = self.rng.choice([1, 7, 1, 7, 50, 500, 5000, 20000])
        self.set(batch_size=size)
        self.count("reload_batch_size")
        if size in (1, 7):
            # the rare path made common for a few seconds, then a size the relay drains with
            time.sleep(self.rng.uniform(0.5, 3))
            self.set(batch_size=self.rng.choice([100, 1000, 5000]))

    def f_reload_delivery(self):
        if self.settings["delivery"] == "exactly_once":
            self.windows.to_at_least_once(self.high())
            self.set(delivery="at_least_once")
        else:
            line = self.log.read()
            self.set(delivery="exactly_once")
            self.windows.to_exactly_once(line)
            self.wait(self.eo_ready, 10, "exactly_once ready", interval=0.2)
        self.count("reload_delivery")

    def eo_ready(self) -> bool:
        """Every running relay logged "exactly-once delivery ready" since the reload."""
        self.log.read()
        ready = self.log.ready_pids_since(self.windows.pending_line)
        pids = {r[0] for r in self.relays()}
        return bool(pids) and pids <= ready

    def update_windows(self):
        if self.windows.state != "pending" or self.broker_fault_in_episode:
            return      # a broker fault in this episode: a late copy may still land; next time
        if self.eo_ready():
            self.windows.open(self.high())
            self.note(f"exactly_once window {len(self.windows.windows)} opens")

    # ------------------------------------------------------------------ faults: the broker

    def broker_pid(self) -> int:
        with open(os.path.join(self.env.kafka_dir, "broker.pid")) as f:
            return int(f.read().strip())

    def freeze_limit(self) -> float:
        """The longest freeze the single-node test broker takes without fencing itself: past
        broker.session.timeout.ms (4 s in kafka.sh) its KRaft controller fences it when it wakes
        and moves every partition through an unclean election; a transaction coordinator
        sending markers then skips the partitions that have no leader for that moment ("likely
        deleted"), and the transactions stay open on them for good: read_committed consumers
        (and exactly_once relays reading their progress back) stop at the last stable offset
        (KAFKA-20716; a run of seed 5 ended so).  Longer outages are broker_kill's."""
        try:
            with open(os.path.join(self.env.kafka_dir, "server.properties")) as f:
                for line in f:
                    if line.startswith("broker.session.timeout.ms="):
                        return int(line.split("=", 1)[1]) / 1000 - 1.5
        except (OSError, ValueError):
            pass
        return 2.5

    def f_broker_freeze(self):
        hold = self.rng.uniform(0.2, max(0.5, self.freeze_limit()))
        pid = self.broker_pid()
        self.broker_fault_in_episode = True
        self.broker_frozen_pid = pid
        os.kill(pid, signal.SIGSTOP)
        # the broker wakes at the end of the hold whatever the faults inside take
        timer = threading.Timer(hold, self.thaw, (pid,))
        timer.start()
        self.count("broker_freeze", f"{hold:.1f} s")
        try:
            self.inner_faults(leave_out=("hook",))     # a relay waiting for Kafka reaches none
            timer.join()
        finally:
            timer.cancel()
            self.thaw(pid)

    def thaw(self, pid: int):
        if self.broker_frozen_pid == pid:
            os.kill(pid, signal.SIGCONT)
            self.broker_frozen_pid = None

    def f_broker_kill(self):
        self.broker_fault_in_episode = True
        os.kill(self.broker_pid(), signal.SIGKILL)
        self.broker_down = True
        self.count("broker_kill")
        hold = self.rng.uniform(0, 4)
        if self.plan.long_freeze and self.rng.random() < 0.1:
            hold = self.rng.uniform(31, 40)     # past outbox.delivery_timeout (30 s)
        end = time.monotonic() + hold
        try:
            self.inner_faults()
            time.sleep(max(0.0, end - time.monotonic()))
        finally:
            kafka_sh(self.env, "start", timeout=240)
            self.broker_down = False

    # ------------------------------------------------------------------ checks

    def published_in_db(self, c, unpublished: bool = False):
        return query(c, "SELECT aggregate_id, coalesce(headers->>'seq', payload->'after'->>'seq')::int"
                        "  FROM outbox.events e WHERE aggregate_type = %s AND "
                        + ("NOT " if unpublished else "") + "outbox.published(e)",
                     (self.aggregate_type,))

    def wait_arrived(self, events, timeout: float = 180, interval: float = 0.1) -> list:
        """Wait until the reader has every event, or has read all that Kafka held when the
        wait began (events already in Kafka then, by the database's account, can only be
        missing if they are not); return the events it lacks.  timeout only bounds a consumer
        that cannot read (the broker gone)."""
        left = self.reader.missing(events)
        if not left:
            return left
        high = self.high()
        deadline = time.monotonic() + timeout
        while left and time.monotonic() < deadline:
            if self.reader.reached(high):
                return self.reader.missing(left)
            self.keep_servers()
            time.sleep(interval)
            left = self.reader.missing(left)
        return left

    def expect_arrived(self, events, what: str):
        """Each event the database counts as published must reach a read_committed consumer
        (it is in Kafka already: the wait is for the consumer)."""
        miss = self.wait_arrived(events)
        if miss:
            h = self.load.history
            self.problems.append(f"episode {self.episode}: {what}: {len(miss)} event(s) not in"
                                 f" Kafka, e.g. " + "; ".join(h.describe(a, s) for a, s in miss[:5]))

    def verifier_query(self, sql: str, args) -> list:
        """A query of the verifier thread, on its own connection, again after connection
        errors (the main thread keeps the server up)."""
        deadline = time.monotonic() + 600
        while True:
            try:
                if self.verifier_conn is None or self.verifier_conn.closed:
                    self.verifier_conn = pg_connect(self.env)
                return query(self.verifier_conn, sql, args)
            except (psycopg2.OperationalError, psycopg2.InterfaceError) as e:
                try:
                    self.verifier_conn.close()
                except Exception:  # noqa: BLE001
                    pass
                self.verifier_conn = None
                if time.monotonic() > deadline:
                    raise AssertionError(f"the verifier found no server for 600 s: {e}")
                time.sleep(0.3)

    def check_published(self, episode: int):
        """Invariant 5 after every fault: every event outbox.published(e) calls published is
        in Kafka.  Runs in the verifier thread, after the fault of episode (or, when faults
        came faster than the checks, after the latest of them), while the next faults go on:
        the database, then the end offsets are read, then the consumer is waited for."""
        t0 = time.monotonic()
        floor = min(self.low_marks)
        self.known_published = {i for i in self.known_published if i >= floor}
        # outbox.published(e) costs tens of microseconds a row (it reads pg_control for each):
        # asked only of the rows not yet seen published (the hashed <> ALL runs first)
        rows = self.verifier_query(
            "SELECT id, aggregate_id, coalesce(headers->>'seq', payload->'after'->>'seq')::int,"
            "       outbox.published(e)"
            "  FROM outbox.events e WHERE aggregate_type = %s AND id >= %s"
            "   AND id <> ALL (%s::bigint[])",
            (self.aggregate_type, floor, list(self.known_published)))
        t1 = time.monotonic()
        # rows below the lowest id still unpublished at one of the last 3 checks were all
        # published then (and are in Kafka, or that check failed); only a transaction that
        # committed its low ids later than that is left to the pause and final checks
        waiting = [r[0] for r in rows if not r[3]]
        self.known_published.update(r[0] for r in rows if r[3])
        self.low_marks = self.low_marks[1:] + [
            min(waiting) if waiting
            else max(max((r[0] for r in rows), default=floor - 1), max(self.known_published, default=0)) + 1]
        idx = self.load.history.index
        self.checks["published checks"] += 1
        self.checks["published rows checked"] += len(rows) - len(waiting)
        events = self.reader.missing([(idx[a], s) for _, a, s, pub in rows if pub])
        self.seconds["(verifier: query)"] += t1 - t0
        if events:
            self.wait_published(episode, events, self.verifier_high())

    def broker_unavailable(self) -> bool:
        return self.broker_down or self.broker_frozen_pid is not None

    def verifier_high(self) -> Dict[int, int]:
        deadline = time.monotonic() + 600
        while True:
            try:
                return self.verifier_marks.read()
            except Exception:  # noqa: BLE001  (the broker restarting)
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def verifier(self):
        """The thread that checks invariant 5 after the faults (check_published)."""
        try:
            while True:
                self.check_wanted.wait(0.5)
                with self.check_lock:
                    self.check_wanted.clear()
                    episode, self.check_episode = self.check_episode, None
                if episode is None:
                    if self.verifier_stop:
                        return
                    continue
                self.check_published(episode)
        except Exception as e:  # noqa: BLE001
            self.problems.append(f"the verifier failed: {type(e).__name__}: {e}")
        finally:
            if self.verifier_conn is not None:
                self.verifier_conn.close()

    def wait_published(self, episode: int, events, high: Dict[int, int]):
        """Waits for the events the database called published when the check ran, until they
        arrived or the reader kept all Kafka held then.  The bound (180 s) counts only time in
        which the broker could answer."""
        waited = 0.0
        while True:
            events = self.reader.missing(events)
            if not events or self.reader.reached(high) or waited > 180:
                break
            time.sleep(0.1)
            if not self.broker_unavailable():
                waited += 0.1
        events = self.reader.missing(events)
        if events:
            h = self.load.history
            self.problems.append(
                f"episode {episode}: outbox.published(e) says published: {len(events)}"
                f" event(s) not in Kafka" + (" (waited 180 s)" if waited > 180 else "")
                + ", e.g. " + "; ".join(h.describe(a, s) for a, s in events[:5]))

    def accounting_check(self):
        """While every relay is paused and the sessions are parked: every committed event is
        in Kafka unless outbox.published(e) says it is not, and outbox.status.pending counts
        every event that is not published."""
        t0 = time.monotonic()
        parked = self.load.park(180)
        self.seconds["(pause: parking the sessions)"] += time.monotonic() - t0
        if not parked:
            self.load.unpark()
            self.checks["accounting skipped (sessions not parked)"] += 1
            return
        try:
            t0 = time.monotonic()
            committed = committed_snapshot(self.load.history)

            def read(c):
                c.autocommit = False
                with c.cursor() as cur:
                    cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                    cur.execute("SELECT pending FROM outbox.status WHERE pending IS NOT NULL LIMIT 1")
                    pending = cur.fetchone()
                    unpublished = self.published_in_db(c, unpublished=True)
                    cur.execute("SELECT count(*) FROM outbox.events e"
                                " WHERE NOT outbox.published(e) AND failed_at IS NULL")
                    n = cur.fetchone()[0]
                c.commit()
                return (pending[0] if pending else None), unpublished, n
            pending, unpublished, n = self.db(read)
        finally:
            self.load.unpark()
            self.seconds["(pause: reading the accounting)"] += time.monotonic() - t0
        t0 = time.monotonic()
        idx = self.load.history.index
        held = {(idx[a], s) for a, s in unpublished}
        must = [(a, s) for a, seqs in committed.items() for s in seqs if (a, s) not in held]
        self.checks["accounting checks"] += 1
        self.expect_arrived(must, "committed and not unpublished (relay paused)")
        self.seconds["(pause: waiting for the consumer)"] += time.monotonic() - t0
        if pending is not None and pending < n:
            self.problems.append(f"episode {self.episode}: outbox.status.pending = {pending},"
                                 f" but {n} events are not published (relay paused)")
        if pending is not None:
            missing = len(self.reader.missing([(a, s) for a, seqs in committed.items() for s in seqs]))
            if pending < missing:
                self.problems.append(f"episode {self.episode}: outbox.status.pending = {pending},"
                                     f" but {missing} committed events are not in Kafka")

    def stable_offsets(self) -> str:
        """Where read_committed readers stop (the last stable offset) against the end: a
        transaction left open for good on a partition (a hanging transaction) shows here."""
        out = []
        for topic in (self.topic, "_outbox_progress"):
            got = {}
            for iso in ("read_committed", "read_uncommitted"):
                c = Consumer({"bootstrap.servers": self.env.bootstrap, "group.id": "chaos-lso",
                              "isolation.level": iso, "log_level": 2})
                try:
                    md = c.list_topics(topic, timeout=10).topics.get(topic)
                    parts = sorted(md.partitions) if md and md.partitions else []
                    got[iso] = [c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                                for p in parts]
                except Exception as e:  # noqa: BLE001
                    got[iso] = str(e)
                finally:
                    c.close()
            out.append(f"{topic}: last stable offsets {got['read_committed']},"
                       f" end offsets {got['read_uncommitted']}")
        return "; ".join(out)

    def wait_drained(self, events, timeout: float = 900) -> bool:
        """Wait until every event arrived, or the relay says nothing is pending and the
        consumer has read all Kafka holds (then a missing event is lost: nothing will send it).
        timeout only bounds a relay that makes no progress at all."""
        left = self.reader.missing(events)
        deadline = time.monotonic() + timeout
        while left and time.monotonic() < deadline:
            rows = self.status_rows()
            if rows and all(r[2] == 0 for r in rows) and self.reader.reached(self.high()):
                left = self.reader.missing(left)
                break
            self.keep_servers()
            time.sleep(0.5)
            left = self.reader.missing(left)
        return not left

    def checkpoint(self):
        """Everything committed so far arrives; order, rolled-back and exactly_once rules hold."""
        self.note("checkpoint")
        committed = committed_snapshot(self.load.history)
        flat = [(a, s) for a, seqs in committed.items() for s in seqs]
        self.db(lambda c: query(c, "SELECT outbox.resume()"))
        ok = self.wait_drained(flat)
        a = analyse(self.load.history, self.reader, self.windows, must_have=committed)
        self.checks["checkpoints"] += 1
        for p in a.problems():
            self.problems.append(f"checkpoint at episode {self.episode}"
                                 + ("" if ok else " (waited 900 s)") + f": {p}")

    def final(self):
        """No more faults: every committed event must arrive, the relay must drain."""
        self.note("final check")
        self.remove_hook_files()
        self.restore_broker()
        self.keep_servers()
        self.db(lambda c: (query(c, "SELECT outbox.resume()"), set_conf(c, batch_size=None)))
        self.settings["batch_size"] = 5000
        self.load.finish()
        committed = committed_snapshot(self.load.history)
        flat = [(a, s) for a, seqs in committed.items() for s in seqs]
        drained = self.wait_drained(flat)
        drained = self.wait(lambda: all(r[2] == 0 for r in self.status_rows()), 900,
                            "nothing pending") and drained
        high = self.high()
        caught_up = self.wait(lambda: self.reader.reached(high),
                              240, "the consumer to reach the end", 0.2)
        self.windows.close_all(self.high())
        a = analyse(self.load.history, self.reader, self.windows)
        if not drained:
            self.problems.append(f"the relay did not send everything: {self.status_rows()};"
                                 f" {self.stable_offsets()}")
        if not caught_up:
            self.problems.append(f"the consumer did not reach the end offsets {high}:"
                                 f" {self.reader.positions()}")
        left = self.db(lambda c: self.published_in_db(c, unpublished=True))
        if left:
            self.problems.append(f"{len(left)} events still not published after the drain")
        self.problems.extend(a.problems())
        self.problems.extend(self.reader.problems[:10])
        self.problems.extend(f"load: {e}" for e in self.load.unexpected[:10])
        self.log.read()
        self.problems.extend(f"server log: {x}" for x in self.log.alarms)
        return a
