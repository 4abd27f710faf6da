"""
The load of the inbox's fault schedule (test_37_inbox_fault_schedule.py): our relay's events, a
foreign producer's records, queue takers, and the checker that judges what the inbox applied.

Every record carries a unique token in its payload ({"token": ...}, or the bytes b"raw:<token>"
for a value that is not JSON); the handler and the takers write the token of each event they get
into a table, so the checker judges by content, not by counts.
"""
import json
import random
import threading
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import psycopg2
from confluent_kafka import Producer

from conftest import Env, pg_connect, query

APPLIED = "chaos37_applied"     # the handler's effects: one row per event it applied
TAKEN = "chaos37_taken"         # what the queue's takers committed
EMITTED = "chaos37_emitted"     # the relay load's tokens, written in the emitting transaction
HANDLER = "chaos37_apply"
APPLIED_B = "chaos37_applied_b"  # the batch handler's effects, likewise
BATCH_HANDLER = "chaos37_apply_batch"   # h(outbox.inbox_event[]): one INSERT per batch
MANAGE_TYPE = "chaos.manage"    # the handler manages its own subscription: must be 55006
CONNECTION_ERRORS = (psycopg2.OperationalError, psycopg2.InterfaceError)


def token_sql(alias: str) -> str:
    return (f"coalesce({alias}.payload->>'token', CASE WHEN {alias}.payload_bytes IS NOT NULL THEN"
            f" convert_from(substring({alias}.payload_bytes FROM 5), 'UTF8') END)")


def chaos_schema(conn, role: str):
    """The tables and the handler (owned by role, the subscriptions' owner)."""
    for t in (APPLIED, APPLIED_B, TAKEN):
        query(conn, f"DROP TABLE IF EXISTS {t}")
        query(conn, f"""CREATE TABLE {t} (id bigserial PRIMARY KEY, token text, key text,
                        topic text, kafka_partition int, kafka_offset bigint, event_id uuid)""")
        query(conn, f"ALTER TABLE {t} OWNER TO {role}")
    query(conn, f"DROP TABLE IF EXISTS {EMITTED}")
    query(conn, f"CREATE TABLE {EMITTED} (token text PRIMARY KEY)")
    query(conn, f"""CREATE OR REPLACE FUNCTION {HANDLER}(e outbox.inbox_event) RETURNS void
        LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
        BEGIN
            IF e.event_type = '{MANAGE_TYPE}' THEN
                -- a handler that manages its own subscription: refused with 55006
                IF e.payload->>'how' = 'unsubscribe' THEN
                    PERFORM outbox.unsubscribe(e.subscription);
                ELSE
                    PERFORM outbox.pause_subscription(e.subscription);
                END IF;
            END IF;
            INSERT INTO {APPLIED} (token, key, topic, kafka_partition, kafka_offset, event_id)
            VALUES ({token_sql('e')}, e.key, e.topic, e.kafka_partition, e.kafka_offset, e.event_id);
        END $$""")
    query(conn, f"ALTER FUNCTION {HANDLER}(outbox.inbox_event) OWNER TO {role}")
    # the batch handler a user would write: set-based, in batch order; a managing record in the
    # batch fails the whole call, and bisection must narrow it down to that record's dead letter
    query(conn, f"""CREATE OR REPLACE FUNCTION {BATCH_HANDLER}(events outbox.inbox_event[]) RETURNS void
        LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
        DECLARE
            e outbox.inbox_event;
        BEGIN
            FOREACH e IN ARRAY events LOOP
                IF e.event_type = '{MANAGE_TYPE}' THEN
                    IF e.payload->>'how' = 'unsubscribe' THEN
                        PERFORM outbox.unsubscribe(e.subscription);
                    ELSE
                        PERFORM outbox.pause_subscription(e.subscription);
                    END IF;
                END IF;
            END LOOP;
            INSERT INTO {APPLIED_B} (token, key, topic, kafka_partition, kafka_offset, event_id)
            SELECT {token_sql('x')}, x.key, x.topic, x.kafka_partition, x.kafka_offset, x.event_id
              FROM unnest(events) WITH ORDINALITY AS x
             ORDER BY x.ordinality;
        END $$""")
    query(conn, f"ALTER FUNCTION {BATCH_HANDLER}(outbox.inbox_event[]) OWNER TO {role}")


def drop_schema(conn):
    query(conn, f"DROP TABLE IF EXISTS {APPLIED}, {APPLIED_B}, {TAKEN}, {EMITTED}")
    query(conn, f"DROP FUNCTION IF EXISTS {HANDLER}(outbox.inbox_event)")
    query(conn, f"DROP FUNCTION IF EXISTS {BATCH_HANDLER}(outbox.inbox_event[])")


def _close(conn):
    if conn is not None:
        try:
            conn.close()
        except Exception:  # noqa: BLE001
            pass
    return None


# --------------------------------------------------------------------------- our relay

class RelayLoad:
    """Sessions that emit through outbox.emit() (as helpers_inbox.RegistrationLoad does), each on
    keys of its own so that per key commit order is the session's order; each event's outcome is
    recorded: committed, rolled back, or unknown (COMMIT raised: the EMITTED row tells)."""

    def __init__(self, env: Env, aggregate_type: str, seed: int, sessions: int, think_s: float):
        self.env, self.agg, self.seed, self.n, self.think_s = env, aggregate_type, seed, sessions, think_s
        self.events: Dict[str, Tuple[str, int]] = {}    # token -> (key, seq)
        self.outcome: Dict[str, str] = {}               # token -> committed/rolled_back/unknown
        self.errors: List[str] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads: List[threading.Thread] = []

    def start(self):
        for s in range(self.n):
            t = threading.Thread(target=self._session, args=(s,), daemon=True, name=f"relay-load-{s}")
            t.start()
            self.threads.append(t)

    def stop(self):
        self.stopping.set()
        for t in self.threads:
            t.join(60)
        assert not any(t.is_alive() for t in self.threads), "the emitting sessions did not stop"

    def committed(self) -> int:
        with self.lock:
            return sum(1 for o in self.outcome.values() if o == "committed")

    def _session(self, s: int):
        rng = random.Random(self.seed * 1000 + s)
        seq = Counter()
        conn, n = None, 0
        while not self.stopping.is_set():
            if conn is None:
                try:
                    conn = pg_connect(self.env, autocommit=False)
                except psycopg2.Error:
                    time.sleep(0.2)
                    continue
            key = f"s{s}k{rng.randrange(6)}"
            tokens = []
            try:
                with conn.cursor() as cur:
                    for _ in range(rng.choice([1, 1, 2, 3])):
                        n += 1
                        seq[key] += 1
                        tok = f"r{self.seed}-{s}-{n}"
                        with self.lock:
                            self.events[tok] = (key, seq[key])
                            self.outcome[tok] = "rolled_back"      # until COMMIT returns
                        tokens.append(tok)
                        cur.execute("SELECT outbox.emit(%s, %s, 'chaos.relay', %s::jsonb)",
                                    (self.agg, key, json.dumps({"token": tok, "seq": seq[key]})))
                        cur.execute(f"INSERT INTO {EMITTED} (token) VALUES (%s)", (tok,))
                if rng.random() < 0.1:
                    conn.rollback()
                else:
                    try:
                        conn.commit()
                    except psycopg2.Error as e:
                        with self.lock:
                            for tok in tokens:
                                self.outcome[tok] = "unknown"
                            if not isinstance(e, CONNECTION_ERRORS):
                                self.errors.append(f"commit: {e}")
                        conn = _close(conn)
                        continue
                    with self.lock:
                        for tok in tokens:
                            self.outcome[tok] = "committed"
            except psycopg2.Error as e:
                if not isinstance(e, CONNECTION_ERRORS):
                    with self.lock:
                        self.errors.append(f"emit: {e}")
                conn = _close(conn)
                time.sleep(0.1)
                continue
            time.sleep(rng.uniform(0, 2 * self.think_s))
        _close(conn)

    def resolve(self, conn):
        """Unknown outcomes, read back: the EMITTED row commits with the events."""
        unknown = [t for t, o in self.outcome.items() if o == "unknown"]
        there = {r[0] for r in query(conn, f"SELECT token FROM {EMITTED} WHERE token = ANY(%s)",
                                     (unknown,))} if unknown else set()
        for t in unknown:
            self.outcome[t] = "resolved_committed" if t in there else "resolved_rolled_back"


# --------------------------------------------------------------------------- the foreign producer

@dataclass
class Rec:
    token: str
    topic: str          # "A" or "B"
    gen: int            # B's generation (topic deleted and created again): 0, 1, ...
    key: str
    partition: int
    kind: str
    has_id: bool
    value: bytes
    headers: Optional[list]
    acked: List[int] = field(default_factory=list)      # offsets Kafka acknowledged (copies too)
    failed: int = 0


FOREIGN_KINDS = {   # kind: weight
    "id": 30, "empty_id": 10, "null_id": 10, "no_headers": 10, "ce_id": 5, "id_not_uuid": 5,
    "two_ids": 4, "odd_headers": 6, "long_header": 3, "raw_value": 5, "copy": 10, "manage": 1.5,
}
KEYS = 12
MANAGE_MAX = 8


class ForeignLoad:
    """A confluent_kafka producer writing straight to topics A and B (not through the relay):
    records with a unique id, an empty id (b""), a null id header, no headers, odd headers,
    values that are not JSON, copies of id-carrying records at later offsets, and a few records
    whose handler manages its own subscription.  Records are placed on partitions by key
    (key j -> j % partitions), so each key's records of a topic keep one partition."""

    def __init__(self, env: Env, topics: Dict[str, str], partitions: Dict[str, int], seed: int,
                 think_s: float, tag: str):
        self.env, self.topics, self.parts, self.think_s = env, topics, partitions, think_s
        self.rng = random.Random(seed * 7919 + 1)
        self.seed = seed
        # ids that are not uuids must be this run's own (tag): the seen ids outlive unsubscribe()
        # by name, so "not-a-uuid-f1-1874" of an earlier run of seed 1 on the same cluster made
        # this run's record of that token a copy, dropped (seen 2026-12-07, taken for a loss)
        self.tag = tag
        self.recs: Dict[str, Rec] = {}
        self.kinds = Counter()
        self.gen = 0
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.b_open = threading.Event()
        self.b_open.set()
        self.b_flushed = threading.Event()
        self.errors: List[str] = []
        self.n = 0
        self.manage = 0
        self.recent: Dict[Tuple[str, int], List[Rec]] = defaultdict(list)
        self.producer = Producer({"bootstrap.servers": env.bootstrap, "enable.idempotence": True,
                                  "allow.auto.create.topics": False, "linger.ms": 5,
                                  "message.timeout.ms": 240000})
        self.thread = threading.Thread(target=self._run, daemon=True, name="foreign-producer")

    def start(self):
        self.thread.start()

    def stop(self):
        self.stopping.set()
        self.thread.join(300)
        assert not self.thread.is_alive(), "the foreign producer did not stop"

    def close_b(self, timeout: float = 120) -> bool:
        """Stop producing to B and wait until every record sent there was acknowledged or failed."""
        self.b_flushed.clear()
        self.b_open.clear()
        return self.b_flushed.wait(timeout)

    def open_b(self):
        with self.lock:
            self.gen += 1
        self.b_open.set()

    def acked(self) -> int:
        with self.lock:
            return sum(1 for r in self.recs.values() if r.acked)

    def _report(self, rec: Rec):
        def cb(err, msg):
            with self.lock:
                if err is None:
                    rec.acked.append(msg.offset())
                else:
                    rec.failed += 1
                    self.errors.append(f"{rec.token}: {err}")
        return cb

    def _new(self, topic: str, kind: str) -> Rec:
        self.n += 1
        tok = f"f{self.seed}-{self.n}"
        j = self.rng.randrange(KEYS)
        key = f"{topic}{j}"
        part = j % self.parts[topic]
        value = json.dumps({"token": tok, "key": key, "n": self.n}).encode()
        uid = str(uuid.uuid4()).encode()
        et = [("event_type", b"chaos.foreign")]
        headers, has_id = None, False
        if kind == "id":
            headers, has_id = [("id", uid)] + et, True
        elif kind == "empty_id":
            headers = [("id", b"")] + et
        elif kind == "null_id":
            headers = [("id", None)] + et
        elif kind == "ce_id":
            headers, has_id = [("ce_id", uid), ("ce_type", b"chaos.foreign")], True
        elif kind == "id_not_uuid":
            headers, has_id = [("id", f"not-a-uuid-{self.tag}-{tok}".encode())] + et, True
        elif kind == "two_ids":
            headers, has_id = [("id", uid), ("id", str(uuid.uuid4()).encode())] + et, True
        elif kind == "odd_headers":
            headers, has_id = [("id", uid), ("x-bin", b"\xff\x00\xfe"), ("", b"no name"),
                               ("x-null", None), ("event_type", b"\xc3\x28")], True
        elif kind == "long_header":
            headers, has_id = [("id", uid), ("x-long", b"x" * 8000)] + et, True
        elif kind == "raw_value":
            value = f"raw:{tok}".encode()
            headers, has_id = [("id", uid)] + et, True
        elif kind == "manage":
            # a key of its own: with on_failed_event = hold nothing else waits behind it
            self.manage += 1
            key = f"m{self.manage}"
            part = self.manage % self.parts[topic]
            how = "unsubscribe" if self.manage % 2 else "pause"
            value = json.dumps({"token": tok, "key": key, "how": how}).encode()
            headers, has_id = [("id", uid), ("event_type", MANAGE_TYPE.encode())], True
        rec = Rec(tok, topic, self.gen if topic == "B" else 0, key, part, kind, has_id, value, headers)
        with self.lock:
            self.recs[tok] = rec
        return rec

    def _send(self, rec: Rec):
        while True:
            try:
                self.producer.produce(self.topics[rec.topic], key=rec.key.encode(), value=rec.value,
                                      headers=rec.headers, partition=rec.partition,
                                      on_delivery=self._report(rec))
                return
            except BufferError:
                self.producer.poll(0.1)

    def _run(self):
        names = list(FOREIGN_KINDS)
        weights = [FOREIGN_KINDS[k] for k in names]
        while not self.stopping.is_set():
            if not self.b_open.is_set() and not self.b_flushed.is_set():
                self.producer.flush(110)
                self.b_flushed.set()
            topic = "A" if self.rng.random() < 0.6 or not self.b_open.is_set() else "B"
            kind = self.rng.choices(names, weights)[0]
            if kind == "manage" and (topic != "A" or self.manage >= MANAGE_MAX):
                kind = "id"
            gen = self.gen if topic == "B" else 0
            pool = self.recent[(topic, gen)]
            if kind == "copy":
                if not pool:
                    continue
                rec = self.rng.choice(pool)        # the same record again, at a later offset
            else:
                rec = self._new(topic, kind)
                if rec.has_id and kind != "manage":
                    pool.append(rec)
                    del pool[:-50]
            self.kinds[kind] += 1
            self._send(rec)
            self.producer.poll(0)
            time.sleep(self.rng.uniform(0, 2 * self.think_s))
        self.producer.flush(240)


# --------------------------------------------------------------------------- queue takers

class Takers:
    """Sessions that drain the queue-mode subscription with outbox.inbox_take() in their own
    transactions, writing each taken event's token into TAKEN; one take in ten is rolled back
    (the events come back)."""

    def __init__(self, env: Env, subscription: str, seed: int, n: int = 2):
        self.env, self.sub, self.seed, self.n = env, subscription, seed, n
        self.stopping = threading.Event()
        self.errors: List[str] = []
        self.takes = Counter()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True, name=f"taker-{i}")
                        for i in range(n)]

    def start(self):
        for t in self.threads:
            t.start()

    def stop(self):
        self.stopping.set()
        for t in self.threads:
            t.join(60)

    def _run(self, i: int):
        rng = random.Random(self.seed * 31 + i)
        conn = None
        while not self.stopping.is_set():
            if conn is None:
                try:
                    conn = pg_connect(self.env, autocommit=False)
                except psycopg2.Error:
                    time.sleep(0.2)
                    continue
            try:
                with conn.cursor() as cur:
                    cur.execute(f"INSERT INTO {TAKEN} (token, key, topic, kafka_partition, kafka_offset,"
                                f" event_id) SELECT {token_sql('i')}, i.key, i.topic, i.kafka_partition,"
                                f" i.kafka_offset, i.event_id FROM outbox.inbox_take(%s, %s) i",
                                (self.sub, rng.randint(1, 20)))
                    got = cur.rowcount
                if rng.random() < 0.1:
                    conn.rollback()
                    self.takes["rolled back"] += 1
                else:
                    conn.commit()
                    self.takes["committed"] += 1
                if got == 0:
                    time.sleep(0.05)
            except psycopg2.Error as e:
                if not isinstance(e, CONNECTION_ERRORS) and "terminating connection" not in str(e):
                    self.errors.append(f"take: {e}")
                conn = _close(conn)
                time.sleep(0.1)
        _close(conn)


# --------------------------------------------------------------------------- the checker

def first_applications(rows) -> Tuple[Dict[str, int], Counter]:
    """rows (id, token): the id of each token's first row, and each token's count."""
    first: Dict[str, int] = {}
    count = Counter()
    for rid, tok in rows:
        count[tok] += 1
        if tok not in first or rid < first[tok]:
            first[tok] = rid
    return first, count


def order_violations(first: Dict[str, int], sequences: Dict[tuple, List[str]], what: str) -> List[str]:
    """Each sequence is one key's tokens in produce order (within a partition): the first
    applications of those present must come in that order."""
    out = []
    for k, toks in sequences.items():
        seen = [(first[t], t) for t in toks if t in first]
        for (a, ta), (b, tb) in zip(seen, seen[1:]):
            if b < a:
                out.append(f"{what}: key {k}: {tb} (produced after {ta}) applied before it")
                break
    return out


def check(relay: RelayLoad, foreign: ForeignLoad, applied_rows, taken_rows, dead_rows,
          h_topics: Tuple[str, ...], q_topics: Tuple[str, ...], batch_rows=None,
          b_topics: Tuple[str, ...] = ()):
    """Judge the history (batch_rows: what the batch handler applied, from b_topics).
    Returns (problems, figures)."""
    problems: List[str] = []
    fig = Counter()
    relay_ok = {t for t, o in relay.outcome.items() if o in ("committed", "resolved_committed")}
    relay_never = {t for t, o in relay.outcome.items() if o not in ("committed", "resolved_committed")}
    recs = {t: r for t, r in foreign.recs.items() if r.acked}
    manage = {t for t, r in recs.items() if r.kind == "manage"}
    last_gen = foreign.gen
    # per key sequences, in produce order
    seqs = defaultdict(list)
    for t in sorted(relay_ok, key=lambda t: relay.events[t][1]):
        seqs[("R", relay.events[t][0])].append(t)
    for t, r in sorted(recs.items(), key=lambda x: min(x[1].acked)):
        seqs[(r.topic, r.gen, r.partition, r.key)].append(t)

    def judge(rows, topics, name, with_handler):
        first, count = first_applications(rows)
        expect, maybe, old = set(), set(), set()
        # a record whose delivery report failed may still be in Kafka: applied once at most
        maybe |= {t for t, r in foreign.recs.items() if not r.acked and r.topic in topics}
        if "R" in topics:
            expect |= relay_ok
        for t, r in recs.items():
            if r.topic not in topics:
                continue
            if with_handler and t in manage:
                continue
            if r.topic == "B" and r.gen < last_gen:
                old.add(t)          # lost with the deleted topic: Kafka's loss, not the inbox's
            else:
                expect.add(t)
        maybe |= old
        lost = sorted(expect - set(count))
        twice = sorted(t for t, n in count.items() if n > 1)
        unexpected = sorted(t for t in count if t not in expect and t not in maybe)
        fig[f"{name} expected"] = len(expect)
        fig[f"{name} applied"] = sum(count.values())
        fig[f"{name} lost"] = len(lost)
        fig[f"{name} twice"] = len(twice)
        fig[f"{name} old-topic applied"] = len(old & set(count))
        fig[f"{name} old-topic lost with the topic"] = len(old - set(count))
        if lost:
            problems.append(f"{name}: {len(lost)} lost, e.g. "
                            + ", ".join(f"{t} {describe(t, relay, recs)}" for t in lost[:5]))
        if twice:
            problems.append(f"{name}: {len(twice)} applied more than once, e.g. "
                            + ", ".join(f"{t} x{count[t]} {describe(t, relay, recs)}" for t in twice[:5]))
        if unexpected:
            bad = [t for t in unexpected if t in relay_never or t in manage]
            problems.append(f"{name}: {len(unexpected)} applied that must not be ({len(bad)} rolled back,"
                            f" unknown-not-committed or managing), e.g. {unexpected[:5]}")
        problems.extend(order_violations(first, {k: v for k, v in seqs.items()
                                                 if (k[0] in topics)}, name))

    judge(applied_rows, h_topics, "handler", True)
    judge(taken_rows, q_topics, "queue", False)
    handlers = ["handler"]
    if batch_rows is not None:
        judge(batch_rows, b_topics, "batch", True)
        handlers.append("batch")
    # dead letters: exactly the records whose handler managed its own subscription, with 55006,
    # once per subscription with a handler
    dead_tokens = {h: Counter() for h in handlers}
    for sub, tok, sqlstate, held, error in dead_rows:
        if sub in dead_tokens and tok in manage and sqlstate == "55006" and not held:
            dead_tokens[sub][tok] += 1
        else:
            problems.append(f"unexpected dead letter: {sub} {tok} {sqlstate} held={held} {error}")
    for h in handlers:
        mine = {t for t in manage if recs[t].topic in (h_topics if h == "handler" else b_topics)}
        fig[f"{h} dead letters (55006)"] = sum(dead_tokens[h].values())
        if set(dead_tokens[h]) != mine or any(n > 1 for n in dead_tokens[h].values()):
            problems.append(f"{h}: the {len(mine)} managing records are not each one dead letter with"
                            f" 55006: {dict(dead_tokens[h])} of {sorted(mine)}")
    fig["relay events committed"] = len(relay_ok)
    fig["relay events never committed"] = len(relay_never)
    fig["foreign records acknowledged"] = len(recs)
    fig["foreign copies acknowledged"] = sum(len(r.acked) - 1 for r in recs.values())
    return problems, fig


def describe(tok: str, relay: RelayLoad, recs: Dict[str, Rec]) -> str:
    if tok in relay.events:
        return f"(relay {relay.events[tok]}, {relay.outcome.get(tok)})"
    r = recs.get(tok)
    if r is None:
        return "(?)"
    return f"({r.topic} gen {r.gen} p{r.partition} @{r.acked} {r.kind} key {r.key})"
