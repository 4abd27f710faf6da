"""
Helpers of the lifecycle tests (test_15 .. test_18): extra throw-away clusters, relay pids and
log lines, a background emitter, per-event-id Kafka counts and table sizes.

Extra clusters live in directories derived from env.pg_dir and listen on env.pg_port + 20..40;
they are started with test/env/pg.sh (so they preload the library and point at the test Kafka)
and always reset when the `extra_cluster` context ends.
"""
import collections
import contextlib
import dataclasses
import re
import subprocess
import threading
import time
import uuid
from typing import Dict, List, Optional

import psycopg2
from confluent_kafka import Consumer, TopicPartition

from conftest import (PARTITIONS, Env, emit, pg_connect, pg_sh, query, query_one, relay_status,
                      unique_messages, wait_until)

PG_BINDIR = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True,
                           check=True).stdout.strip()

RELAY_BACKEND = "outbox relay"
EXIT_RE = re.compile(r'background worker "outbox relay" \(PID (\d+)\) exited')
PID_RE = re.compile(r"^\S+ \S+ \S+ \[(\d+)\] ")


# --------------------------------------------------------------------------- clusters

def other_cluster(env: Env, suffix: str, offset: int, database: Optional[str] = None) -> Env:
    """An Env for a second cluster: dir env.pg_dir-SUFFIX, port env.pg_port + offset."""
    assert 20 <= offset <= 40, offset
    return dataclasses.replace(env, pg_dir=f"{env.pg_dir}-{suffix}", pg_port=env.pg_port + offset,
                               pg_database=database or env.pg_database)


@contextlib.contextmanager
def extra_cluster(env: Env, suffix: str, offset: int, database: Optional[str] = None,
                  start: bool = True):
    """A fresh cluster (pg.sh start: preloads outbox, relay serves `database`), reset at the end."""
    other = other_cluster(env, suffix, offset, database)
    pg_sh(other, "reset", check=False)
    try:
        if start:
            pg_sh(other, "start")
        yield other
    finally:
        pg_sh(other, "reset", check=False)


def db_env(env: Env, database: str) -> Env:
    return dataclasses.replace(env, pg_database=database)


def connect_db(env: Env, database: str, autocommit: bool = True):
    return pg_connect(db_env(env, database), autocommit=autocommit)


def set_system(conn, name: str, value):
    """ALTER SYSTEM SET name = value (None: RESET), then reload."""
    if value is None:
        query(conn, f"ALTER SYSTEM RESET {name}")
    else:
        query(conn, f"ALTER SYSTEM SET {name} = %s", (str(value),))
    query(conn, "SELECT pg_reload_conf()")


def relay_pids(conn) -> List[int]:
    """pids of the running relay workers, from pg_stat_activity (works without the extension)."""
    return [r[0] for r in query(conn, "SELECT pid FROM pg_stat_activity WHERE backend_type = %s"
                                      " ORDER BY pid", (RELAY_BACKEND,))]


def relay_state(conn) -> Optional[str]:
    rows = relay_status(conn)
    return rows[0]["state"] if rows else None


# --------------------------------------------------------------------------- server log

def line_pid(line: str) -> Optional[int]:
    m = PID_RE.match(line)
    return int(m.group(1)) if m else None


def relay_exit_lines(lines: List[str]) -> List[str]:
    return [ln for ln in lines if EXIT_RE.search(ln)]


def error_lines_of(lines: List[str], pids) -> List[str]:
    """ERROR/FATAL/PANIC lines written by the given processes (or by any relay worker)."""
    pids = set(pids)
    out = []
    for ln in lines:
        if not any(s in ln for s in ("ERROR:", "FATAL:", "PANIC:")):
            continue
        if line_pid(ln) in pids or f"] {RELAY_BACKEND} " in ln:
            out.append(ln)
    return out


def server_crashes(lines: List[str]) -> List[str]:
    """Postmaster lines telling that a process crashed (signal) or that it reinitialized."""
    keys = ("terminated by signal", "was terminated", "all server processes terminated",
            "reinitializing")
    return [ln for ln in lines if any(k in ln for k in keys)]


# --------------------------------------------------------------------------- events

class Emitter(threading.Thread):
    """Emits one event per transaction, aggregates round robin, until stop().

    Records every committed event as (event_id, aggregate_id, seq, phase, commit time, phase at
    start) with the phase the test had set when the commit returned, and when the emit began (a
    thread starved on a busy machine can see the commit return after the next phase was set);
    a failing emit (e.g. extension dropped) is counted
    and retried, so seq numbers of an aggregate are gap-free over committed events."""

    def __init__(self, env: Env, agg_type: str, n_aggregates: int, tag: str,
                 pause: float = 0.002):
        super().__init__(daemon=True)
        self.env, self.agg_type, self.n, self.tag, self.pause = env, agg_type, n_aggregates, tag, pause
        self.phase = "start"
        self.committed: List[tuple] = []
        self.errors: List[str] = []
        self._stop_evt = threading.Event()
        self._lock = threading.Lock()

    def run(self):
        conn = pg_connect(self.env, autocommit=False)
        seqs = collections.Counter()
        k = 0
        try:
            while not self._stop_evt.is_set():
                agg_id = f"{self.tag}-{k % self.n}"
                started = self.phase
                try:
                    with conn.cursor() as cur:
                        eid = emit(cur, self.agg_type, agg_id, "it.lifecycle",
                                   {"agg": agg_id, "seq": seqs[agg_id] + 1})
                    conn.commit()
                except psycopg2.Error as e:
                    conn.rollback()
                    with self._lock:
                        self.errors.append(f"{self.phase}: {str(e).strip().splitlines()[0]}")
                    time.sleep(0.05)
                    continue
                seqs[agg_id] += 1
                k += 1
                with self._lock:
                    self.committed.append((eid, agg_id, seqs[agg_id], self.phase, time.time(), started))
                if self.pause:
                    time.sleep(self.pause)
        finally:
            conn.close()

    def count(self, phase: Optional[str] = None) -> int:
        with self._lock:
            return sum(1 for c in self.committed if phase is None or c[3] == phase)

    def wait_count(self, n: int, phase: Optional[str] = None, timeout: float = 30):
        wait_until(lambda: self.count(phase) >= n, timeout, f"{n} committed events ({phase})",
                   interval=0.05)

    def stop(self) -> List[tuple]:
        self._stop_evt.set()
        self.join(30)
        assert not self.is_alive(), "the emitter thread did not stop"
        with self._lock:
            return list(self.committed)


def expected_map(events) -> Dict[str, tuple]:
    """{event_id: (aggregate_id, seq)} of [(event_id, aggregate_id, seq, ...)]."""
    return {e[0]: (e[1], e[2]) for e in events}


def id_counts(msgs) -> collections.Counter:
    """How often each event id is in Kafka (consumer re-reads of one offset not counted)."""
    return collections.Counter(m.event_id for m in unique_messages(msgs))


def order_violations(msgs, expected: Dict[str, tuple]) -> List[str]:
    """Per key, the first occurrences of expected events (in partition offset order) must have
    strictly increasing seq numbers.  Works when some expected events never arrived."""
    seen = set()
    last: Dict[str, tuple] = {}
    problems = []
    for m in unique_messages(msgs):
        if m.event_id not in expected or m.event_id in seen:
            continue
        seen.add(m.event_id)
        agg_id, seq = expected[m.event_id]
        if m.key != agg_id:
            problems.append(f"event {m.event_id}: key {m.key!r}, expected {agg_id!r}")
        prev = last.get(agg_id)
        if prev is not None and seq <= prev[0]:
            problems.append(f"{agg_id}: seq {seq} at offset {m.partition}@{m.offset} after seq "
                            f"{prev[0]} at {prev[1]}")
        last[agg_id] = (seq, f"{m.partition}@{m.offset}")
    return problems


def count_check(counts: collections.Counter, expected_ids, what: str):
    """Every expected id exactly once."""
    missing = [e for e in expected_ids if counts.get(e, 0) == 0]
    dups = {e: counts[e] for e in expected_ids if counts.get(e, 0) > 1}
    assert not missing and not dups, (f"{what}: {len(missing)} of {len(expected_ids)} missing "
                                      f"(e.g. {missing[:3]}), {len(dups)} duplicated (e.g. "
                                      f"{list(dups.items())[:3]})")


# --------------------------------------------------------------------------- Kafka

def topic_message_count(env: Env, topic: str, partitions: int = PARTITIONS) -> int:
    """Messages in a topic: the sum over partitions of high - low watermark (no compaction,
    no transactions: every produced record counts once, duplicates included)."""
    c = Consumer({"bootstrap.servers": env.bootstrap, "group.id": f"outbox-it-wm-{uuid.uuid4()}",
                  "enable.auto.commit": False})
    try:
        total = 0
        for p in range(partitions):
            low, high = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False)
            total += high - low
        return total
    finally:
        c.close()


# --------------------------------------------------------------------------- sizes

EVENTS_INDEXES = ("events_pkey", "events_event_id_key", "events_pending_idx", "events_retry_idx")


def table_sizes(conn) -> Dict[str, int]:
    """Bytes of outbox.events (heap), each of its indexes, and the live row count."""
    sizes = {"rows": query_one(conn, "SELECT count(*) FROM outbox.events")[0],
             "heap": query_one(conn, "SELECT pg_relation_size('outbox.events')")[0],
             "indexes": query_one(conn, "SELECT pg_indexes_size('outbox.events')")[0]}
    for name, size in query(conn, "SELECT c.relname, pg_relation_size(c.oid) FROM pg_index i"
                                  " JOIN pg_class c ON c.oid = i.indexrelid"
                                  " WHERE i.indrelid = 'outbox.events'::regclass"):
        sizes[name] = size
    return sizes


def fmt_sizes(s: Dict[str, int]) -> str:
    mb = lambda b: f"{b / 1048576:.1f}MB"   # noqa: E731
    parts = [f"rows={s['rows']}", f"heap={mb(s['heap'])}", f"indexes={mb(s['indexes'])}"]
    parts += [f"{n}={mb(s[n])}" for n in EVENTS_INDEXES if n in s]
    return " ".join(parts)


def timed(fn, *args, **kw):
    t0 = time.monotonic()
    fn(*args, **kw)
    return time.monotonic() - t0
