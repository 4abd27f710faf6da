"""
The load of the seeded fault schedule (test_32_fault_schedule.py): sessions that emit all the
time, and the history of every event they wrote, by content.

Every event carries its aggregate and a per-aggregate sequence number (seq): in the header "seq"
for emit() and emit_bytes(), in the row ("after") for capture().  Each aggregate belongs to one
session, which gives out its seqs in the order its transactions commit, so per aggregate the
commit order is the seq order (also when two transactions of one aggregate take their ids in the
other order: the "out_of_order" shape).  The history keeps one outcome byte per event:

    COMMITTED    COMMIT (or COMMIT PREPARED) returned
    ROLLED_BACK  rolled back (ROLLBACK, ROLLBACK TO SAVEPOINT, ROLLBACK PREPARED), or the
                 connection died before COMMIT was sent
    UNKNOWN      the connection died at COMMIT and its outcome could not be read back
    IN_FLIGHT    COMMIT sent, no answer yet

An outcome the connection lost at COMMIT is read back when the session reconnects: every
transaction inserts a row with its own number (its token) into a table of the run before COMMIT,
so the row exists if and only if the transaction committed; a prepared one is looked for in
pg_prepared_xacts first and finished.  (Not pg_xact_status() of its transaction id: after a
crash, an id whose WAL never reached the disk is given out again, and the answer is then the
other transaction's.)  So "unknown" is almost always resolved, and the session writes nothing
more for its aggregates until it is (a prepared transaction left behind would otherwise commit
after later events).

Two transactions of one aggregate that overlap in time (the out_of_order shape) have no order the
relay can know: it sees both committed, and sends them in id order, or sees the one committed
first alone, and sends it first.  The history marks such pairs, and the checker accepts either
order for them (and holds every other event to commit order).
"""
import json
import random
import threading
import time
from array import array
from collections import Counter
from typing import Callable, Dict, List, Optional, Tuple

import psycopg2

from conftest import Env, pg_connect

CONNECTION_ERRORS = (psycopg2.OperationalError, psycopg2.InterfaceError)

COMMITTED, ROLLED_BACK, UNKNOWN, IN_FLIGHT = 1, 2, 3, 4

EMIT_SQL = "SELECT outbox.emit(%s, %s, %s, %s::jsonb, %s::jsonb)"
EMIT_BYTES_SQL = "SELECT outbox.emit_bytes(%s, %s, %s, %s, %s::jsonb)"
CAPTURE_SQL = ("INSERT INTO {table} AS t (agg, seq, pad) VALUES (%s, %s, %s)"
               " ON CONFLICT (agg) DO UPDATE SET seq = EXCLUDED.seq, pad = EXCLUDED.pad")
# one statement for a large transaction: events in ordinality order, so ids follow seqs
BIG_SQL = """
SELECT count(CASE WHEN b THEN outbox.emit_bytes(%(t)s, a, 'chaos.big.bytes',
                                                 convert_to('chaos ' || a || ' ' || s, 'UTF8'),
                                                 jsonb_build_object('seq', s::text))
                  ELSE outbox.emit(%(t)s, a, 'chaos.big', jsonb_build_object('agg', a, 'seq', s),
                                   jsonb_build_object('seq', s::text)) END)
  FROM unnest(%(a)s::text[], %(s)s::int[], %(b)s::bool[]) WITH ORDINALITY AS u(a, s, b, o)
"""

# the shapes of a transaction, and their weights before the seed scales them
SHAPES = {
    "single": 40,           # one event (JSON, bytes, tombstone, or a 70 KB one now and then)
    "multi": 18,            # 2-30 events over a few aggregates, emit/emit_bytes/capture mixed
    "capture": 8,           # rows upserted into a table with the capture() trigger
    "savepoint": 8,         # part of the transaction rolled back to a savepoint
    "rollback": 6,          # the whole transaction rolled back
    "prepared": 5,          # PREPARE TRANSACTION, then COMMIT (or ROLLBACK) PREPARED
    "out_of_order": 6,      # two transactions of one aggregate, the later id commits first
    "big": 0.3,             # 1,000-10,000 events in one transaction
}


class History:
    """Every event written, by (aggregate index, seq), with its outcome."""

    def __init__(self):
        self.lock = threading.Lock()
        self.names: List[str] = []
        self.index: Dict[str, int] = {}
        self.outcome: List[bytearray] = []      # [agg][seq] -> outcome (0 = seq not used)
        self.next_seq: List[int] = []
        self.replays: List[bytearray] = []      # [agg][seq] -> times replay() covered it
        self.counts = Counter()
        self.committed_total = 0
        self.txn_of: List[array] = []           # [agg][seq] -> number of its transaction
        self.txns: List[list] = [[None, -1, 0.0, ""]]   # [shape, session, start, how it ended]
        self.pairs: List[set] = []              # [agg] -> seq n of each overlapping pair n, n+1

    def add_aggregate(self, name: str) -> int:
        i = len(self.names)
        self.names.append(name)
        self.index[name] = i
        self.outcome.append(bytearray(64))
        self.next_seq.append(1)
        self.replays.append(bytearray())
        self.txn_of.append(array("i", bytes(4 * 64)))
        self.pairs.append(set())
        return i

    def begin_txn(self, shape: str, session: int) -> int:
        with self.lock:
            self.txns.append([shape, session, time.time(), "open"])
            return len(self.txns) - 1

    def end_txn(self, txn: int, how: str):
        self.txns[txn][3] = how

    def describe(self, agg: int, seq: int) -> str:
        txn = self.txn_of[agg][seq] if seq < len(self.txn_of[agg]) else 0
        shape, session, start, how = self.txns[txn]
        return (f"{self.names[agg]} seq {seq}: transaction {txn} ({shape}, session {session},"
                f" began {time.strftime('%H:%M:%S', time.gmtime(start))}"
                f".{int(start * 1000) % 1000:03d} UTC, {how})")

    def order_key(self, agg: int, seq: int) -> int:
        """Commit order position: equal for the two events of an overlapping pair."""
        pairs = self.pairs[agg]
        if seq - 1 in pairs:
            return seq - 1
        return seq

    def take(self, agg: int, txn: int, n: int = 1) -> int:
        """The next n seqs of an aggregate (its owning session only) for transaction txn;
        returns the first."""
        first = self.next_seq[agg]
        self.next_seq[agg] = first + n
        need = first + n
        with self.lock:
            row = self.outcome[agg]
            if len(row) < need:
                grow = max(need - len(row), len(row))
                row.extend(bytes(grow))
                self.txn_of[agg].extend(array("i", bytes(4 * grow)))
            for seq in range(first, need):
                self.txn_of[agg][seq] = txn
        return first

    def set(self, events: List[Tuple[int, int]], code: int, count_as: Optional[str] = None):
        with self.lock:
            for agg, seq in events:
                old = self.outcome[agg][seq]
                if code == COMMITTED and old != COMMITTED:
                    self.committed_total += 1
                self.outcome[agg][seq] = code
            if count_as:
                self.counts[count_as] += len(events)

    def note_replay(self, agg: int, seq: int):
        with self.lock:
            row = self.replays[agg]
            if len(row) <= seq:
                row.extend(bytes(seq + 1 - len(row)))
            row[seq] = min(255, row[seq] + 1)

    def replays_of(self, agg: int, seq: int) -> int:
        row = self.replays[agg]
        return row[seq] if seq < len(row) else 0

    def committed(self, agg: int):
        """Seqs of the aggregate whose COMMIT returned (or was read back as committed)."""
        row = self.outcome[agg]
        return [s for s in range(1, self.next_seq[agg]) if row[s] == COMMITTED]

    def tally(self) -> Counter:
        c = Counter()
        with self.lock:
            for agg in range(len(self.names)):
                row = self.outcome[agg]
                for s in range(1, self.next_seq[agg]):
                    c[row[s]] += 1
        return c


class Pending:
    """A transaction whose COMMIT (or PREPARE, or COMMIT PREPARED) lost its connection."""

    def __init__(self, events, token, txn, gid=None, action=None):
        self.events, self.token, self.txn, self.gid, self.action = events, token, txn, gid, action


class Tx:
    """One transaction on an autocommit connection (BEGIN ... COMMIT sent by hand, so that
    PREPARE TRANSACTION and COMMIT PREPARED are plain statements)."""

    def __init__(self, session: "Session", conn, shape: str):
        self.s = session
        self.cur = conn.cursor()
        self.events: List[Tuple[int, int]] = []
        self.marks: List[int] = []          # len(events) at each savepoint
        self.state = "open"
        self.txn = session.load.history.begin_txn(shape, session.s)
        self.gid = None
        self.action = None
        self.cur.execute("BEGIN")

    # ---- writes

    def emit(self, agg: int, kind: str = "json"):
        seq = self.s.load.history.take(agg, self.txn)
        self.emit_seq(agg, seq, kind)

    def emit_seq(self, agg: int, seq: int, kind: str):
        load = self.s.load
        name = load.history.names[agg]
        headers = json.dumps({"seq": str(seq)})
        self.events.append((agg, seq))
        if kind == "capture":
            self.cur.execute(load.capture_sql, (name, seq, "c" * self.s.rng.randrange(0, 200)))
        elif kind == "bytes":
            value = b"\x00chaos\x00" + f"{name} {seq}".encode() + bytes(self.s.rng.randrange(0, 64))
            self.cur.execute(EMIT_BYTES_SQL, (load.aggregate_type, name, "chaos.bytes",
                                              psycopg2.Binary(value), headers))
        elif kind == "tombstone":
            self.cur.execute(EMIT_SQL, (load.aggregate_type, name, "chaos.tombstone", None, headers))
        else:
            pad = "x" * (70000 if kind == "large" else self.s.rng.randrange(0, 300))
            self.cur.execute(EMIT_SQL, (load.aggregate_type, name, f"chaos.{kind}",
                                        json.dumps({"agg": name, "seq": seq, "pad": pad}), headers))

    def big(self, aggs: List[int], n: int, bytes_share: float):
        h = self.s.load.history
        names, seqs, kinds = [], [], []
        for _ in range(n):
            agg = self.s.rng.choice(aggs)
            seq = h.take(agg, self.txn)
            self.events.append((agg, seq))
            names.append(h.names[agg])
            seqs.append(seq)
            kinds.append(self.s.rng.random() < bytes_share)
        self.cur.execute(BIG_SQL, {"t": self.s.load.aggregate_type, "a": names, "s": seqs, "b": kinds})

    def savepoint(self):
        self.marks.append(len(self.events))
        self.cur.execute(f"SAVEPOINT s{len(self.marks)}")

    def rollback_to_savepoint(self):
        n = self.marks[-1]
        self.cur.execute(f"ROLLBACK TO SAVEPOINT s{len(self.marks)}")
        self.s.load.history.set(self.events[n:], ROLLED_BACK, "rolled_back_savepoint")
        del self.events[n:]

    # ---- ends

    def _token(self):
        """The row that exists if and only if this transaction commits."""
        self.cur.execute(self.s.load.token_sql, (self.txn,))

    def _end(self, how: str):
        self.state = "done"
        self.s.load.history.end_txn(self.txn, how)

    def commit(self):
        self._token()
        h = self.s.load.history
        h.set(self.events, IN_FLIGHT)
        self.state = "committing"
        self.cur.execute("COMMIT")
        self._end("committed")
        h.set(self.events, COMMITTED, "committed")

    def rollback(self, count_as="rolled_back_transaction"):
        self.cur.execute("ROLLBACK")
        self._end("rolled back")
        self.s.load.history.set(self.events, ROLLED_BACK, count_as)

    def prepare(self, gid: str):
        self._token()
        self.gid = gid
        self.s.load.history.set(self.events, IN_FLIGHT)
        self.state = "preparing"
        self.cur.execute("PREPARE TRANSACTION %s", (gid,))
        self.state = "prepared"

    def finish_prepared(self, commit: bool):
        self.action = "COMMIT" if commit else "ROLLBACK"
        self.state = "finishing"
        self.cur.execute(f"{self.action} PREPARED %s", (self.gid,))
        self._end(f"{self.action} PREPARED")
        if commit:
            self.s.load.history.set(self.events, COMMITTED, "committed")
        else:
            self.s.load.history.set(self.events, ROLLED_BACK, "rolled_back_prepared")

    def lost(self):
        """The connection died: what happened to this transaction's events?"""
        h = self.s.load.history
        if self.state == "open":
            # COMMIT (or PREPARE) was never sent: the server rolled it back
            h.set(self.events, ROLLED_BACK, "rolled_back_by_fault")
            self._end("connection lost before COMMIT")
        elif self.state in ("committing", "preparing", "prepared", "finishing"):
            h.set(self.events, UNKNOWN, "unknown_at_commit")
            self.s.pending.append(Pending(self.events, self.txn, self.txn, self.gid,
                                          self.action or "COMMIT"))
            self._end(f"connection lost while {self.state}")


class Session:
    """One emitting session (a thread with up to two connections)."""

    def __init__(self, load: "ChaosLoad", s: int, aggs: List[int]):
        self.load, self.s, self.aggs = load, s, aggs
        self.rng = random.Random(load.seed * 1000 + s)
        self.conn = None
        self.conn2 = None
        self.open: List[Tx] = []
        self.pending: List[Pending] = []
        self.gids = 0
        self.thread = threading.Thread(target=self.run, daemon=True, name=f"chaos-emit-{s}")

    # ---- connection handling

    def drop(self):
        for tx in self.open:
            tx.lost()
        self.open = []
        for c in (self.conn, self.conn2):
            if c is not None:
                try:
                    c.close()
                except Exception:  # noqa: BLE001
                    pass
        self.conn = self.conn2 = None

    def connect(self) -> bool:
        try:
            if self.conn is None:
                self.conn = pg_connect(self.load.env, autocommit=True)
            if self.conn2 is None:
                self.conn2 = pg_connect(self.load.env, autocommit=True)
            return True
        except psycopg2.Error:
            self.drop()
            self.load.connect_failures += 1
            time.sleep(0.2)
            return False

    def resolve(self) -> bool:
        """Read back the outcome of every transaction whose COMMIT lost its connection."""
        h = self.load.history
        cur = self.conn.cursor()
        for p in list(self.pending):
            status = None
            if p.gid is not None:
                cur.execute("SELECT 1 FROM pg_prepared_xacts WHERE gid = %s", (p.gid,))
                if cur.fetchone():
                    cur.execute(f"{p.action} PREPARED %s", (p.gid,))
                    status = "committed" if p.action == "COMMIT" else "aborted"
            if status is None:
                cur.execute(self.load.token_found_sql, (p.token,))
                status = "committed" if cur.fetchone() else "aborted"
            self.pending.remove(p)
            how = h.txns[p.txn][3]
            if status == "committed":
                h.set(p.events, COMMITTED, "resolved_committed")
                h.end_txn(p.txn, how + ", read back: committed")
            else:
                h.set(p.events, ROLLED_BACK, "resolved_rolled_back")
                h.end_txn(p.txn, how + ", read back: rolled back")
        return True

    # ---- the loop

    def run(self):
        load = self.load
        names = list(load.shape_weights)
        weights = [load.shape_weights[n] for n in names]
        while not load.stopping.is_set():
            if self.conn is None and not self.connect():
                continue
            try:
                if self.pending and not self.resolve():
                    time.sleep(0.1)
                    continue
            except psycopg2.Error:
                self.drop()
                continue
            if not load.gate.is_set() or (load.finishing.is_set() and not self.pending):
                load.parked[self.s] = True
                load.gate.wait(0.05)
                if load.finishing.is_set():
                    time.sleep(0.05)
                continue
            load.parked[self.s] = False
            load.throttle()
            shape = self.rng.choices(names, weights)[0]
            self.shape = shape
            try:
                getattr(self, "shape_" + shape)()
                load.shapes[shape] += 1
            except CONNECTION_ERRORS:
                self.drop()
                continue
            except psycopg2.Error as e:
                load.unexpected.append(f"{shape}: {type(e).__name__}: {str(e).strip()}")
                self.drop()
                continue
            self.open = []
            if load.think_s:
                time.sleep(self.rng.uniform(0, load.think_s))
        self.drop()

    def _tx(self, conn=None) -> Tx:
        tx = Tx(self, conn or self.conn, self.shape)
        self.open.append(tx)
        return tx

    def _kind(self) -> str:
        r = self.rng.random()
        if r < 0.01:
            return "large"
        if r < 0.05:
            return "tombstone"
        if r < 0.25:
            return "bytes"
        return "json"

    # ---- shapes

    def shape_single(self):
        tx = self._tx()
        tx.emit(self.rng.choice(self.aggs), self._kind())
        tx.commit()

    def _some_events(self, tx: Tx, n: int, capture_share: float):
        few = self.rng.sample(self.aggs, min(len(self.aggs), self.rng.randint(1, 5)))
        for _ in range(n):
            kind = "capture" if self.rng.random() < capture_share else self._kind()
            tx.emit(self.rng.choice(few), kind)

    def shape_multi(self):
        tx = self._tx()
        self._some_events(tx, self.rng.randint(2, 30), 0.2)
        tx.commit()

    def shape_capture(self):
        tx = self._tx()
        self._some_events(tx, self.rng.randint(1, 10), 1.0)
        tx.commit()

    def shape_savepoint(self):
        tx = self._tx()
        self._some_events(tx, self.rng.randint(0, 5), 0.2)
        tx.savepoint()
        self._some_events(tx, self.rng.randint(1, 8), 0.2)
        tx.rollback_to_savepoint()
        self._some_events(tx, self.rng.randint(1, 5), 0.2)
        tx.commit()

    def shape_rollback(self):
        tx = self._tx()
        self._some_events(tx, self.rng.randint(1, 20), 0.2)
        tx.rollback()

    def shape_prepared(self):
        if not self.load.prepared_ok:
            return self.shape_multi()
        tx = self._tx()
        self._some_events(tx, self.rng.randint(1, 10), 0.2)
        self.gids += 1
        tx.prepare(f"{self.load.gid_prefix}-{self.s}-{self.gids}")
        # the transaction is prepared: its outcome is decided below, on the other connection
        tx.cur = self.conn2.cursor()
        tx.finish_prepared(self.rng.random() < 0.75)

    def shape_out_of_order(self):
        agg = self.rng.choice(self.aggs)
        h = self.load.history
        first = self._tx(self.conn)
        early = h.take(agg, first.txn, 2)
        with h.lock:
            h.pairs[agg].add(early)
        first.emit_seq(agg, early + 1, self._kind())       # smaller id, commits second
        if self.rng.random() < 0.5:
            others = [a for a in self.aggs if a != agg]
            if others:
                first.emit(self.rng.choice(others), self._kind())
        second = self._tx(self.conn2)
        h.txn_of[agg][early] = second.txn
        second.emit_seq(agg, early, self._kind())           # larger id, commits first
        second.commit()
        first.commit()

    def shape_big(self):
        tx = self._tx()
        tx.big(self.aggs, self.rng.randint(1000, 10000), self.rng.choice([0.0, 0.3]))
        tx.commit()


class ChaosLoad:
    """N sessions emitting until stop(), each owning its own aggregates."""

    def __init__(self, env: Env, aggregate_type: str, capture_table: str, token_table: str,
                 seed: int,
                 sessions: int, aggregates_per_session: int, think_s: float,
                 shape_weights: Dict[str, float], max_backlog: int,
                 backlog: Callable[[], int], prepared_ok: bool):
        self.env = env
        self.aggregate_type = aggregate_type
        self.capture_sql = CAPTURE_SQL.format(table=capture_table)
        self.token_sql = f"INSERT INTO {token_table} (token) VALUES (%s)"
        self.token_found_sql = f"SELECT 1 FROM {token_table} WHERE token = %s"
        self.seed = seed
        self.think_s = think_s
        self.shape_weights = shape_weights
        self.max_backlog = max_backlog
        self.backlog = backlog
        self.prepared_ok = prepared_ok
        self.gid_prefix = f"chaos{seed}-{int(time.time())}"
        self.history = History()
        self.stopping = threading.Event()
        self.finishing = threading.Event()      # finish what is pending, then stop writing
        self.gate = threading.Event()
        self.gate.set()
        self.parked = [False] * sessions
        self.shapes = Counter()
        self.unexpected: List[str] = []
        self.connect_failures = 0
        self.throttled_s = 0.0
        self.sessions = []
        for s in range(sessions):
            aggs = [self.history.add_aggregate(f"s{s}-a{k}") for k in range(aggregates_per_session)]
            self.sessions.append(Session(self, s, aggs))

    def start(self):
        for s in self.sessions:
            s.thread.start()

    def throttle(self):
        """Hold the sessions while the relay is far behind (a paused relay, a frozen broker,
        batch_size 1): the backlog stays bounded, so the checks' waits do."""
        t0 = time.monotonic()
        while self.backlog() > self.max_backlog and self.gate.is_set() \
                and not self.stopping.is_set() and not self.finishing.is_set():
            time.sleep(0.05)
        self.throttled_s += time.monotonic() - t0

    def park(self, timeout: float = 180) -> bool:
        """Close the gate and wait until every session is between transactions with nothing
        pending (so the history is final for all it wrote)."""
        self.gate.clear()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.parked) and not any(s.pending or s.open for s in self.sessions):
                return True
            time.sleep(0.02)
        return False

    def unpark(self):
        self.parked = [False] * len(self.sessions)
        self.gate.set()

    def finish(self, timeout: float = 300):
        """Stop starting transactions, resolve every pending outcome, then stop the threads."""
        self.finishing.set()
        self.gate.clear()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.parked) and not any(s.pending or s.open for s in self.sessions):
                break
            time.sleep(0.05)
        self.stopping.set()
        self.gate.set()
        for s in self.sessions:
            s.thread.join(30)
        alive = [s.thread.name for s in self.sessions if s.thread.is_alive()]
        assert not alive, f"emitting sessions did not stop: {alive}"
        left = [p for s in self.sessions for p in s.pending]
        for p in left:              # the server never came back for them: unknown for good
            self.history.set(p.events, UNKNOWN, "unresolved")
