"""
The reader, the windows of exactly_once delivery, and the checker of the seeded fault schedule
(test_32_fault_schedule.py); the faults are in helpers_chaos_faults.py, the load and its history
in helpers_chaos_load.py.

- ContentReader: a read_committed consumer, assigned every partition from the beginning (no group,
  no rebalance), that keeps per aggregate the seq and offset of every message in offset order.
- DeliveryWindows: the offsets (per partition) that only producers of outbox.delivery =
  exactly_once can have written.  A window opens at the high watermarks read once every relay of
  the database logged "exactly-once delivery ready" after the reload, and closes at those read
  just before the reload back to at_least_once.  Offsets between windows were written by
  at_least_once relays, or during a switch.
- analyse(): the invariants over the whole history (see the test's docstring for the rules).
"""
import collections
import json
import re
import threading
import time
from array import array
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from conftest import PARTITIONS, Env
from helpers_chaos_load import COMMITTED, IN_FLIGHT, ROLLED_BACK, UNKNOWN, History


# --------------------------------------------------------------------------- Kafka

class ContentReader:
    """Reads the run's topic with isolation.level = read_committed in a background thread."""

    def __init__(self, env: Env, topic: str, history: History, partitions: int = PARTITIONS):
        self.topic = topic
        self.history = history
        self.partitions = partitions
        n = len(history.names)
        self.seqs = [array("i") for _ in range(n)]
        self.offs = [array("q") for _ in range(n)]
        self.arrived = [bytearray() for _ in range(n)]     # [agg][seq] -> copies (at most 255)
        self.part_of = [-1] * n
        self.problems: List[str] = []
        self.errors = collections.Counter()
        self.messages = 0           # copies, consumer re-reads left out
        self.distinct = 0
        self.last = [-1] * partitions
        self.done = {p: 0 for p in range(partitions)}   # position once what came before it was kept
        self._stop = threading.Event()
        self.consumer = Consumer({
            "bootstrap.servers": env.bootstrap,
            "group.id": f"outbox-chaos-{time.time_ns()}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "fetch.wait.max.ms": 50,
            "reconnect.backoff.max.ms": 1000,
            "log_level": 2,         # the broker is killed and frozen on purpose
        })
        self.consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        self._thread = threading.Thread(target=self._run, daemon=True, name="chaos-reader")
        self._thread.start()

    def _content(self, m) -> Tuple[Optional[str], Optional[int]]:
        key = m.key()
        agg = None if key is None else key.decode()
        for k, v in m.headers() or []:
            if k == "seq":
                return agg, int(v)
        # capture(): the seq is in the row
        try:
            return agg, int(json.loads(m.value())["after"]["seq"])
        except (TypeError, ValueError, KeyError):
            return agg, None

    def _run(self):
        index = self.history.index
        while not self._stop.is_set():
            try:
                msgs = self.consumer.consume(num_messages=5000, timeout=0.2)
            except Exception as e:  # noqa: BLE001
                self.errors[f"consume: {e}"] += 1
                time.sleep(0.2)
                continue
            for m in msgs:
                err = m.error()
                if err is not None:
                    if err.code() != KafkaError._PARTITION_EOF:
                        self.errors[err.name()] += 1
                    continue
                p, off = m.partition(), m.offset()
                if off <= self.last[p]:
                    continue            # the consumer read it again (a reconnect)
                self.last[p] = off
                self.messages += 1
                name, seq = self._content(m)
                agg = index.get(name)
                if agg is None or seq is None:
                    self.problems.append(f"foreign message at {p}@{off}: key {name!r}")
                    continue
                if self.part_of[agg] != p:
                    if self.part_of[agg] >= 0:
                        self.problems.append(f"{name} on partitions {self.part_of[agg]} and {p}")
                    self.part_of[agg] = p
                self.seqs[agg].append(seq)
                self.offs[agg].append(off)
                row = self.arrived[agg]
                if len(row) <= seq:
                    row.extend(bytes(max(seq + 1 - len(row), len(row))))
                if row[seq] == 0:
                    self.distinct += 1
                if row[seq] < 255:
                    row[seq] += 1
            # every message returned before this position is kept now
            self.done = self.positions()

    def has(self, agg: int, seq: int) -> bool:
        row = self.arrived[agg]
        return seq < len(row) and row[seq] > 0

    def missing(self, events) -> List[Tuple[int, int]]:
        return [(a, s) for a, s in events if not self.has(a, s)]

    def positions(self) -> Dict[int, int]:
        got = self.consumer.position([TopicPartition(self.topic, p) for p in range(self.partitions)])
        return {tp.partition: max(tp.offset, 0) for tp in got}    # nothing read yet: < 0

    def reached(self, high: Dict[int, int]) -> bool:
        """The reader kept everything below these end offsets that it can read (read_committed:
        up to the last stable offset, which passes them once the transactions open then end).
        Judged on the position read after the reader kept a batch, not on the consumer's
        current position, which runs ahead of the batch being kept."""
        done = self.done
        return all(done[p] >= h for p, h in high.items())

    def close(self):
        self._stop.set()
        self._thread.join(10)
        try:
            self.consumer.close()
        except Exception:  # noqa: BLE001
            pass


class HighWatermarks:
    """End offsets of the topic's partitions, everything written (read_uncommitted)."""

    def __init__(self, env: Env, topic: str, partitions: int = PARTITIONS):
        self.topic, self.partitions = topic, partitions
        self.consumer = Consumer({"bootstrap.servers": env.bootstrap,
                                  "group.id": f"outbox-chaos-wm-{time.time_ns()}",
                                  "enable.auto.commit": False,
                                  "isolation.level": "read_uncommitted", "log_level": 2})

    def read(self, timeout: float = 10) -> Dict[int, int]:
        return {p: self.consumer.get_watermark_offsets(TopicPartition(self.topic, p),
                                                        timeout=timeout)[1]
                for p in range(self.partitions)}

    def close(self):
        try:
            self.consumer.close()
        except Exception:  # noqa: BLE001
            pass


# --------------------------------------------------------------------------- server log

LINE_RE = re.compile(r"^\S+ \S+ \S+ \[(\d+)\] ")
READY = "exactly-once delivery ready"
RECONNECT = "Kafka settings changed, reconnecting"
HOOK_RE = re.compile(r'outbox relay: (.*?) at "(\w+)"(?: after \d+ ms)? as asked by the file')
ALARMS = ("were acknowledged after an earlier event of the same aggregate failed",
          "PANIC:", "TRAP:", "was terminated by signal 11", "was terminated by signal 6")


class LogTail:
    """The server log, read on demand from where the last read stopped."""

    def __init__(self, path):
        self.path = path
        try:
            with open(path, "rb") as f:
                f.seek(0, 2)
                self.offset = f.tell()
        except FileNotFoundError:
            self.offset = 0
        self.lineno = 0
        self.ready: List[Tuple[int, int]] = []          # (lineno, pid) of READY lines
        self.hooks: List[Tuple[int, str, str]] = []     # (lineno, step, what it did)
        self.alarms: List[str] = []

    def read(self):
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        cut = data.rfind(b"\n") + 1
        self.offset += cut
        for raw in data[:cut].decode("utf-8", "replace").splitlines():
            self.lineno += 1
            if READY in raw:
                m = LINE_RE.match(raw)
                if m:
                    self.ready.append((self.lineno, int(m.group(1))))
            elif "as asked by the file" in raw:
                m = HOOK_RE.search(raw)
                if m:
                    self.hooks.append((self.lineno, m.group(2), m.group(1)))
            elif any(a in raw for a in ALARMS):
                self.alarms.append(raw)
        return self.lineno

    def ready_pids_since(self, lineno: int) -> Set[int]:
        return {pid for n, pid in self.ready if n > lineno}

    def hook_fired_since(self, lineno: int, step: str) -> Optional[str]:
        for n, s, what in self.hooks:
            if n > lineno and s == step:
                return what
        return None


# --------------------------------------------------------------------------- windows

class DeliveryWindows:
    """Offset ranges per partition written only by exactly_once producers (see the module
    docstring)."""

    def __init__(self):
        self.windows: List[List[Optional[Dict[int, int]]]] = []    # [start, end or None]
        self.state = "off"          # off | pending | on
        self.pending_line = 0       # log line number of the reload to exactly_once
        self.opened_at = 0.0
        self.seconds = 0.0          # time spent in windows

    def to_exactly_once(self, lineno: int):
        if self.state == "off":
            self.state, self.pending_line = "pending", lineno

    def to_at_least_once(self, high: Dict[int, int]):
        if self.state == "on":
            self.windows[-1][1] = high
            self.seconds += time.monotonic() - self.opened_at
        self.state = "off"

    def open(self, high: Dict[int, int]):
        self.windows.append([high, None])
        self.state = "on"
        self.opened_at = time.monotonic()

    def close_all(self, high: Dict[int, int]):
        self.to_at_least_once(high)

    def contains(self, part: int, off: int) -> bool:
        for start, end in self.windows:
            if off >= start.get(part, 0) and (end is None or off < end.get(part, 0)):
                return True
        return False


# --------------------------------------------------------------------------- analysis

@dataclass
class Analysis:
    arrived_distinct: int = 0
    copies: int = 0
    lost: List[str] = field(default_factory=list)
    ghosts: List[str] = field(default_factory=list)         # rolled back, yet arrived
    reorders: List[str] = field(default_factory=list)
    eo_duplicates: List[str] = field(default_factory=list)  # copies a read_committed consumer
                                                            # must not see
    dups_at_least_once: int = 0     # copies outside exactly_once windows
    dups_exactly_once: int = 0      # copies inside them (replays' copies excluded)
    replay_copies: int = 0
    unknown_arrived: int = 0
    unknown_missing: int = 0

    def problems(self) -> List[str]:
        out = []
        for name in ("lost", "ghosts", "reorders", "eo_duplicates"):
            xs = getattr(self, name)
            if xs:
                out.append(f"{len(xs)} {name}: " + "; ".join(xs[:8]) + (" ..." if len(xs) > 8 else ""))
        return out


def analyse(history: History, reader: ContentReader, windows: DeliveryWindows,
            must_have: Optional[Dict[int, List[int]]] = None) -> Analysis:
    """
    Judge every message read so far.  must_have: per aggregate the seqs that must have arrived
    (None: every committed event).

    Order is judged on first arrivals, as a consumer that drops copies by the id header sees
    them: per aggregate they must come in strictly increasing seq (= commit order); a copy of an
    event already seen (at-least-once re-sends, replay()) is not an order problem wherever it
    lands.  An event whose commit outcome is unknown may be missing, never out of order.  The two
    events of an overlapping pair (History.order_key) may come in either order.
    """
    a = Analysis()
    for agg in range(len(history.names)):
        name = history.names[agg]
        outcome = history.outcome[agg]
        seqs, offs = reader.seqs[agg], reader.offs[agg]
        part = reader.part_of[agg]
        seen: Dict[int, int] = {}
        eo_copies: Dict[int, int] = collections.Counter()
        last_first = 0          # order key of the latest first arrival
        last_seq = 0
        for i in range(min(len(seqs), len(offs))):     # the reader may be appending
            s, off = seqs[i], offs[i]
            oc = outcome[s] if s < len(outcome) else 0
            if oc == ROLLED_BACK or oc == 0:
                if s not in seen:
                    a.ghosts.append(f"{name} seq {s} ({'rolled back' if oc else 'never written'})"
                                    f" at {part}@{off}")
                seen[s] = seen.get(s, 0) + 1
                continue
            in_eo = windows.contains(part, off)
            if s in seen:
                a.copies += 1
                if history.replays_of(agg, s):
                    a.replay_copies += 1
                elif in_eo:
                    a.dups_exactly_once += 1
                else:
                    a.dups_at_least_once += 1
                if in_eo and eo_copies[s] >= 1 + history.replays_of(agg, s):
                    a.eo_duplicates.append(f"{name} seq {s}: copy {seen[s] + 1} at {part}@{off}"
                                           f" inside an exactly_once window, after a copy there")
            else:
                a.arrived_distinct += 1
                a.copies += 1
                if oc in (UNKNOWN, IN_FLIGHT):
                    a.unknown_arrived += 1
                key = history.order_key(agg, s)
                if key < last_first:
                    near = ", ".join(f"{seqs[j]}@{offs[j]}" for j in range(max(0, i - 12), i + 3)
                                     if j < len(offs))
                    a.reorders.append(f"{name}: seq {s} first arrived at {part}@{off},"
                                      f" after seq {last_seq} [{history.describe(agg, s)};"
                                      f" {history.describe(agg, last_seq)}; arrivals seq@offset:"
                                      f" {near}]")
                if key >= last_first:
                    last_first, last_seq = key, s
            seen[s] = seen.get(s, 0) + 1
            if in_eo:
                eo_copies[s] += 1
        wanted = must_have.get(agg, ()) if must_have is not None else history.committed(agg)
        for s in wanted:
            if s not in seen:
                a.lost.append(history.describe(agg, s))
        if must_have is None:
            a.unknown_missing += sum(1 for s in range(1, history.next_seq[agg])
                                     if outcome[s] == UNKNOWN and s not in seen)
    return a


def committed_snapshot(history: History) -> Dict[int, List[int]]:
    return {agg: history.committed(agg) for agg in range(len(history.names))}
