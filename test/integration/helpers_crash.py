"""
Helpers of test_10_crash.py and test_11_outage.py (reliability under crashes, broker outages,
shutdowns and reloads):

- EmitLoad: N sessions (threads, each with its own psycopg2 connection) emitting continuously
  over M aggregates, each aggregate owned by one session so its events are serialized and carry
  a per-aggregate sequence number.  Sessions reconnect after failures.  An event whose COMMIT
  returned is "committed"; one whose COMMIT raised is "unknown" (it may or may not exist).  A
  gate lets the test park every session while it restarts the server.  With rollback_share > 0
  that share of the transactions is rolled back after emit(): their events must never arrive.
- LightReader: a Kafka consumer polled by a background thread that keeps only
  (topic, partition, offset, key, event id) per message, for hundreds of thousands of messages.
- delivery_check(): nothing lost, nothing unexpected, per-aggregate order (first occurrences in
  strictly increasing sequence, every later copy a re-send), duplicates per crash.
"""
import collections
import json
import os
import random
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import psycopg2
from confluent_kafka import Consumer, TopicPartition

from conftest import (EMIT_SQL, Env, PARTITIONS, pg_connect, pg_sh, query, query_one,
                      relay_status, settle, wait_until)

# what a session sees when the server goes away (crash, restart, shutdown)
CONNECTION_ERRORS = (psycopg2.OperationalError, psycopg2.InterfaceError)


# --------------------------------------------------------------------------- load

class EmitLoad:
    """Sessions emitting one event per transaction, continuously, until stop()."""

    def __init__(self, env: Env, aggregate_type: str, sessions: int = 8, aggregates: int = 64,
                 tag: str = "agg", seed: int = 0, think_s: float = 0.0,
                 rollback_share: float = 0.0):
        self.env = env
        self.aggregate_type = aggregate_type
        self.sessions = sessions
        self.aggregates = [f"{tag}-{k}" for k in range(aggregates)]
        self.seed = seed
        self.think_s = think_s
        self.rollback_share = rollback_share
        self.rolled_back: Set[str] = set()   # emitted, then rolled back: must never arrive
        self._lock = threading.Lock()
        self.committed: Dict[str, Tuple[str, int]] = {}          # event_id -> (aggregate, seq)
        self.unknown: Dict[str, Tuple[str, int, int]] = {}       # event_id -> (aggregate, seq, epoch)
        self.epoch = 0                       # crashes so far; the test bumps it
        self.commits = [0] * sessions
        self.connection_losses = [0] * sessions
        self.lost_before_commit = [0] * sessions  # connection lost before COMMIT was sent
        self.connect_failures = [0] * sessions
        self.unexpected_errors: List[str] = []
        self.parked = [False] * sessions
        self.gate = threading.Event()
        self.gate.set()
        self._stop = threading.Event()
        self._threads: List[threading.Thread] = []
        self.started_at = None
        self.stopped_at = None

    # ---- control

    def start(self):
        self.started_at = time.monotonic()
        for s in range(self.sessions):
            t = threading.Thread(target=self._session, args=(s,), daemon=True, name=f"emit-{s}")
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 60):
        self._stop.set()
        self.gate.set()
        for t in self._threads:
            t.join(timeout)
        alive = [t.name for t in self._threads if t.is_alive()]
        assert not alive, f"emitting sessions did not stop: {alive}"
        self.stopped_at = time.monotonic()

    def close_gate(self):
        """Sessions that lose their connection from now on wait instead of reconnecting."""
        self.gate.clear()

    def open_gate(self):
        with self._lock:
            self.parked = [False] * self.sessions
        self.gate.set()

    def all_parked(self) -> bool:
        with self._lock:
            return all(self.parked)

    def commit_counts(self) -> List[int]:
        with self._lock:
            return list(self.commits)

    def wait_progress(self, each: int, timeout: float, what: str = "every session to commit"):
        """Wait until every session committed `each` more events than now."""
        base = self.commit_counts()
        wait_until(lambda: all(c - b >= each for c, b in zip(self.commit_counts(), base)),
                   timeout, f"{what} {each} more events (commits {self.commit_counts()},"
                   f" errors {self.unexpected_errors[:3]})", interval=0.05)

    def total_commits(self) -> int:
        with self._lock:
            return sum(self.commits)

    def snapshot(self):
        with self._lock:
            return dict(self.committed), dict(self.unknown)

    # ---- one session

    def _session(self, s: int):
        rng = random.Random(self.seed * 1000 + s)
        mine = [a for k, a in enumerate(self.aggregates) if k % self.sessions == s]
        next_seq = {a: 1 for a in mine}
        conn = None
        while not self._stop.is_set():
            if conn is None:
                if not self.gate.is_set():
                    with self._lock:
                        self.parked[s] = True
                    self.gate.wait(0.1)
                    continue
                try:
                    conn = pg_connect(self.env, autocommit=False)
                except psycopg2.Error:
                    with self._lock:
                        self.connect_failures[s] += 1
                    time.sleep(0.1)
                    continue
            agg = rng.choice(mine)
            seq = next_seq[agg]
            next_seq[agg] += 1         # a seq is never reused: gaps are fine, order is not
            try:
                with conn.cursor() as cur:
                    cur.execute(EMIT_SQL, (self.aggregate_type, agg, "crash.event",
                                           json.dumps({"agg": agg, "seq": seq, "session": s}),
                                           None, None))
                    event_id = str(cur.fetchone()[0])
            except psycopg2.Error as e:
                # COMMIT was not sent: the event does not exist
                with self._lock:
                    if isinstance(e, CONNECTION_ERRORS):
                        self.lost_before_commit[s] += 1
                        self.connection_losses[s] += 1
                    else:
                        self.unexpected_errors.append(f"emit: {type(e).__name__}: {e}")
                conn = self._drop(conn)
                continue
            if self.rollback_share and rng.random() < self.rollback_share:
                try:
                    conn.rollback()
                except psycopg2.Error:
                    conn = self._drop(conn)     # the event does not exist either way
                with self._lock:
                    self.rolled_back.add(event_id)
                continue
            try:
                conn.commit()
            except psycopg2.Error as e:
                with self._lock:
                    self.unknown[event_id] = (agg, seq, self.epoch)
                    self.connection_losses[s] += 1
                    if not isinstance(e, CONNECTION_ERRORS):
                        self.unexpected_errors.append(f"commit: {type(e).__name__}: {e}")
                conn = self._drop(conn)
                continue
            with self._lock:
                self.committed[event_id] = (agg, seq)
                self.commits[s] += 1
            if self.think_s:
                time.sleep(self.think_s)
        self._drop(conn)

    @staticmethod
    def _drop(conn):
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001
                pass
        return None


# --------------------------------------------------------------------------- Kafka

class LightReader:
    """A consumer in a fresh group reading topics from the beginning, polled in the background."""

    def __init__(self, env: Env, topics: List[str], config: Optional[dict] = None):
        self.topics = list(topics)
        self.rows: List[Tuple[str, int, int, Optional[str], Optional[str]]] = []
        self.times: List[float] = []    # time.monotonic() each row was read, in rows' order
        self.errors: List[str] = []
        self.assigned = set()
        self.settle_env = env       # whose relay settle() waits for (conftest.py, issue 28)
        self._ids = collections.Counter()
        self._strings = {}              # one str object per topic and key, not one per message
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.consumer = Consumer({
            "bootstrap.servers": env.bootstrap,
            "group.id": f"outbox-it-crash-{uuid.uuid4()}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "session.timeout.ms": 30000,
            "fetch.wait.max.ms": 50,
            "topic.metadata.refresh.interval.ms": 2000,
            **(config or {}),
        })
        self.consumer.subscribe(self.topics, on_assign=self._on_assign)
        self._thread = threading.Thread(target=self._run, daemon=True, name="light-reader")
        self._thread.start()

    def _on_assign(self, consumer, partitions):
        self.assigned.update((p.topic, p.partition) for p in partitions)

    def _run(self):
        while not self._stop.is_set():
            try:
                msgs = self.consumer.consume(num_messages=2000, timeout=0.2)
            except Exception as e:  # noqa: BLE001
                self.errors.append(f"consume: {e}")
                time.sleep(0.2)
                continue
            got = []
            strings = self._strings
            for m in msgs:
                if m.error() is not None:
                    self.errors.append(str(m.error()))
                    continue
                eid = None
                for k, v in m.headers() or []:
                    if k == "id":
                        eid = v.decode()
                        break
                key = m.key()
                if key is not None:
                    key = strings.setdefault(key, key.decode())
                topic = m.topic()
                got.append((strings.setdefault(topic, topic), m.partition(), m.offset(), key, eid))
            if got:
                now = time.monotonic()
                with self._lock:
                    self.rows.extend(got)
                    self.times.extend([now] * len(got))
                    self._ids.update(r[4] for r in got)

    def wait_assigned(self, timeout: float = 30, partitions: int = PARTITIONS):
        want = partitions * len(self.topics)
        wait_until(lambda: len(self.assigned) >= want, timeout,
                   f"consumer assignment of {want} partitions", interval=0.1)

    def received_ids(self) -> Set[str]:
        with self._lock:
            return set(self._ids)

    def missing(self, ids) -> Set[str]:
        with self._lock:
            return {i for i in ids if i not in self._ids}

    def wait_for(self, ids, timeout: float, extra: float = 3.0) -> Set[str]:
        """Wait until every id arrived (or timeout), then until the relay settled and the topics
        are read to their end, for at most `extra` more seconds (conftest.settle); return the
        missing."""
        ids = set(ids)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ids = self.missing(ids)
            if not ids:
                break
            time.sleep(0.2)
        settle(self, extra, lambda: time.sleep(0.1))
        return self.missing(ids)

    def snapshot(self):
        with self._lock:
            return list(self.rows)

    def arrivals(self, ids) -> List[float]:
        """The times (time.monotonic()) at which the events of ids were read, sorted."""
        with self._lock:
            return sorted(t for r, t in zip(self.rows, self.times) if r[4] in ids)

    def close(self):
        self._stop.set()
        self._thread.join(10)
        try:
            self.consumer.close()
        except Exception:  # noqa: BLE001
            pass


class Watermarks:
    """High watermarks (end offsets) of a topic's partitions."""

    def __init__(self, env: Env, topic: str, partitions: int = PARTITIONS):
        self.topic = topic
        self.partitions = partitions
        self.consumer = Consumer({"bootstrap.servers": env.bootstrap,
                                  "group.id": f"outbox-it-wm-{uuid.uuid4()}",
                                  "enable.auto.commit": False})

    def high(self) -> Dict[Tuple[str, int], int]:
        out = {}
        for p in range(self.partitions):
            _low, high = self.consumer.get_watermark_offsets(TopicPartition(self.topic, p),
                                                             timeout=10)
            out[(self.topic, p)] = high
        return out

    def close(self):
        try:
            self.consumer.close()
        except Exception:  # noqa: BLE001
            pass


# --------------------------------------------------------------------------- checks

@dataclass
class DeliveryCheck:
    received: int = 0                       # messages (with consumer-side re-reads removed)
    distinct: int = 0
    lost: List[str] = field(default_factory=list)
    ghosts: List[str] = field(default_factory=list)       # arrived, but known not to exist
    unexpected: List[str] = field(default_factory=list)   # arrived, never emitted by us
    order_problems: List[str] = field(default_factory=list)
    reorderings: int = 0
    duplicates: int = 0
    dups_by_region: Dict[int, int] = field(default_factory=dict)  # -1 = before the first boundary


def delivery_check(rows, present: Dict[str, Tuple[str, int]], absent: Set[str] = frozenset(),
                   boundaries: Optional[List[Dict[Tuple[str, int], int]]] = None) -> DeliveryCheck:
    """
    rows: (topic, partition, offset, key, event_id) as read; present: event_id -> (aggregate, seq)
    of every event that must arrive; absent: events that must not arrive.  boundaries[k] are the
    partitions' end offsets just before crash k: a re-sent copy at an offset past boundaries[k]
    (and not past boundaries[k+1]) counts as a duplicate of crash k.
    """
    c = DeliveryCheck()
    uniq = {}
    for r in rows:
        uniq[(r[0], r[1], r[2])] = r
    ordered = [uniq[k] for k in sorted(uniq)]
    c.received = len(ordered)
    counts = collections.Counter(r[4] for r in ordered)
    c.distinct = len(counts)
    c.lost = sorted(set(present) - set(counts))
    c.ghosts = sorted(set(counts) & set(absent))
    c.unexpected = sorted(set(counts) - set(present) - set(absent))
    c.duplicates = sum(n - 1 for n in counts.values())

    seen: Set[str] = set()
    last_seq: Dict[str, int] = {}
    partition_of: Dict[str, Tuple[str, int]] = {}
    dups = collections.Counter()
    for topic, part, off, key, eid in ordered:
        info = present.get(eid)
        if info is None:
            continue                    # reported as ghost/unexpected
        agg, seq = info[0], info[1]
        if key != agg:
            c.order_problems.append(f"{eid}: key {key!r}, expected {agg!r}")
            continue
        if partition_of.setdefault(agg, (topic, part)) != (topic, part):
            c.order_problems.append(f"{agg}: in {partition_of[agg]} and in {(topic, part)}")
        if eid in seen:
            region = -1
            for k, b in enumerate(boundaries or []):
                if off >= b.get((topic, part), 0):
                    region = k
            dups[region] += 1
            continue                    # a re-send of an already seen seq
        seen.add(eid)
        if agg in last_seq and seq <= last_seq[agg]:
            c.reorderings += 1
            c.order_problems.append(f"{agg}: seq {seq} at {topic}[{part}]@{off} after seq {last_seq[agg]}")
        last_seq[agg] = max(seq, last_seq.get(agg, 0))
    c.dups_by_region = dict(dups)
    return c


def assert_delivered(c: DeliveryCheck, what: str):
    show = lambda xs: ", ".join(map(str, xs[:5])) + (" ..." if len(xs) > 5 else "")  # noqa: E731
    assert not c.lost, f"{what}: {len(c.lost)} event(s) lost: {show(c.lost)}"
    assert not c.ghosts, f"{what}: {len(c.ghosts)} event(s) that do not exist arrived: {show(c.ghosts)}"
    assert not c.unexpected, f"{what}: {len(c.unexpected)} unexpected event(s): {show(c.unexpected)}"
    assert not c.order_problems, (f"{what}: per-aggregate order broken ({c.reorderings} reorderings):\n  "
                                  + "\n  ".join(c.order_problems[:10]))


# --------------------------------------------------------------------------- servers

def postmaster_pid(env: Env) -> int:
    with open(os.path.join(env.pg_dir, "data", "postmaster.pid")) as f:
        return int(f.readline().strip())


def pid_alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def kill9(pid: int):
    os.kill(pid, signal.SIGKILL)


def start_pg_after_crash(env: Env, timeout: float = 120) -> int:
    """pg.sh start until it works: orphaned backends of a killed postmaster must exit before the
    old shared memory can be released.  Returns the number of attempts."""
    deadline = time.monotonic() + timeout
    attempts = 0
    while True:
        attempts += 1
        p = pg_sh(env, "start", check=False, timeout=90)
        if p.returncode == 0:
            return attempts
        if time.monotonic() > deadline:
            raise AssertionError(f"pg.sh start failed {attempts} times in {timeout}s after a crash:\n"
                                 f"{p.stdout}\n{p.stderr}")
        time.sleep(0.5)


def relay_pid(env: Env) -> Optional[int]:
    conn = pg_connect(env)
    try:
        rows = relay_status(conn)
        return rows[0]["pid"] if rows else None
    finally:
        conn.close()


class StatusMonitor:
    """Samples outbox.status in the background: peak pending, states seen."""

    def __init__(self, env: Env, interval: float = 0.5):
        self.env = env
        self.interval = interval
        self.peak_pending = 0
        self.states = collections.Counter()
        self.samples: List[tuple] = []      # (time.time(), state, pending, published)
        self.last = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="status-monitor")
        self._thread.start()

    def _run(self):
        conn = None
        while not self._stop.is_set():
            try:
                if conn is None:
                    conn = pg_connect(self.env)
                rows = relay_status(conn)
                if rows:
                    r = rows[0]
                    self.last = r
                    self.samples.append((time.time(), r["state"], r["pending"], r["published"]))
                    self.states[r["state"]] += 1
                    if r["pending"] is not None:
                        self.peak_pending = max(self.peak_pending, r["pending"])
            except psycopg2.Error:
                try:
                    conn and conn.close()
                except Exception:  # noqa: BLE001
                    pass
                conn = None
            self._stop.wait(self.interval)
        if conn is not None:
            conn.close()

    def close(self):
        self._stop.set()
        self._thread.join(10)


def log_marker(env: Env, text: str):
    """Write a line into the server log (to order test events against the server's lines)."""
    conn = pg_connect(env)
    try:
        query(conn, "DO $$BEGIN RAISE LOG '%%', " + "%s" + "; END$$", (text,))
    finally:
        conn.close()


def unpublished_upto(env: Env, aggregate_type: str, max_id: int) -> int:
    conn = pg_connect(env)
    try:
        return query_one(conn, "SELECT count(*) FROM outbox.events WHERE aggregate_type = %s"
                               " AND id <= %s AND NOT outbox.published(events)",
                         (aggregate_type, max_id))[0]
    finally:
        conn.close()


def sort_unknown(env: Env, load: EmitLoad) -> Tuple[Dict[str, Tuple[str, int]], Set[str]]:
    """The events of this crash (load.epoch) whose COMMIT raised: (those that exist after the
    restart -> (aggregate, seq), they must arrive; those that do not, they must not).  Checked
    long before any retention could delete them."""
    _, unknown = load.snapshot()
    mine = {e: v for e, v in unknown.items() if v[2] == load.epoch}
    conn = pg_connect(env)
    try:
        exist = {r[0] for r in query(conn, "SELECT event_id::text FROM outbox.events"
                                           " WHERE event_id = ANY(%s::uuid[])", (list(mine),))}
    finally:
        conn.close()
    return {e: v[:2] for e, v in mine.items() if e in exist}, set(mine) - exist


def kill_postgres_under_load(env: Env, load: EmitLoad) -> Tuple[Dict[str, Tuple[str, int]], Set[str]]:
    """kill -9 of the postmaster while load runs: park the sessions, wait for the orphaned relay
    to exit, start the server again, let the sessions go on; returns sort_unknown()'s answer."""
    old_relay = relay_pid(env)
    load.close_gate()
    kill9(postmaster_pid(env))
    wait_until(load.all_parked, 60, "every session to lose its connection", interval=0.02)
    if old_relay:
        wait_until(lambda: not pid_alive(old_relay), 60, "the orphaned relay to exit", interval=0.02)
    start_pg_after_crash(env)
    exist, missing = sort_unknown(env, load)
    load.epoch += 1
    load.open_gate()
    return exist, missing
