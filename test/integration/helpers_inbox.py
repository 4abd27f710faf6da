"""
Helpers of the inbox tests (test_31_inbox*.py): a role that subscribes (handlers never run as a
superuser), subscriptions made and dropped, records produced straight to Kafka (keys, headers,
values the relay would never send), the rows of outbox.inbox_status, and a registration load
(the project's example: a user registers, a mail service sends one welcome mail) with rolled-back
transactions and sessions that survive crashes.
"""
import hashlib
import json
import random
import threading
import time
import uuid
from typing import Dict, List, Optional, Set, Tuple

import psycopg2
from confluent_kafka import Producer

from conftest import Env, pg_connect, query, query_one, wait_until

APP_ROLE = "inbox_app"

APP_FUNCTIONS = [
    "outbox.subscribe(text, text[], regprocedure, text, boolean, text)",
    "outbox.unsubscribe(text)", "outbox.pause_subscription(text)",
    "outbox.resume_subscription(text)", "outbox.inbox_seek(text, text, integer, bigint)",
    "outbox.inbox_seek(text, text, integer, timestamptz)",
    "outbox.inbox_seek(text, text, integer, text)", "outbox.inbox_retry(text, text)",
    "outbox.inbox_take(text, integer)", "outbox.emit(text, text, text, jsonb, jsonb, text)",
]


def setup_app_role(conn, role: str = APP_ROLE):
    """A login role (no superuser) with USAGE on schema outbox, EXECUTE on the inbox's SQL API and
    CREATE on schema public, for handlers and their tables."""
    if not query(conn, "SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)):
        query(conn, f"CREATE ROLE {role} LOGIN")
    query(conn, f"GRANT USAGE ON SCHEMA outbox TO {role}")
    query(conn, f"GRANT CREATE, USAGE ON SCHEMA public TO {role}")
    for f in APP_FUNCTIONS:
        query(conn, f"GRANT EXECUTE ON FUNCTION {f} TO {role}")


def as_app(conn, sql: str, args=None, role: str = APP_ROLE):
    """Run sql as role (SET ROLE ... RESET ROLE) on conn; returns its rows."""
    query(conn, f"SET ROLE {role}")
    try:
        return query(conn, sql, args)
    finally:
        query(conn, "RESET ROLE")


def mail_handler(conn, table: str, fn: str, role: str = APP_ROLE, extra_sql: str = ""):
    """A table for the handler's effects and a handler fn(outbox.inbox_event) that inserts one row
    per call, both owned by role.  extra_sql runs in the handler before the insert (e.g. a RAISE
    for some keys)."""
    query(conn, f"DROP TABLE IF EXISTS {table}")
    query(conn, f"""CREATE TABLE {table} (
        id bigserial PRIMARY KEY, event_id uuid, key text, topic text, kafka_partition int,
        kafka_offset bigint, event_type text, aggregate_type text, headers jsonb, payload jsonb,
        payload_bytes bytea, kafka_timestamp timestamptz, subscription text,
        applied_by name DEFAULT current_user, at timestamptz DEFAULT clock_timestamp())""")
    query(conn, f"ALTER TABLE {table} OWNER TO {role}")
    query(conn, f"""CREATE OR REPLACE FUNCTION {fn}(e outbox.inbox_event) RETURNS void
        LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
        BEGIN
            {extra_sql}
            INSERT INTO {table} (event_id, key, topic, kafka_partition, kafka_offset, event_type,
                                 aggregate_type, headers, payload, payload_bytes, kafka_timestamp,
                                 subscription)
            VALUES (e.event_id, e.key, e.topic, e.kafka_partition, e.kafka_offset, e.event_type,
                    e.aggregate_type, e.headers, e.payload, e.payload_bytes, e.kafka_timestamp,
                    e.subscription);
        END $$""")
    query(conn, f"ALTER FUNCTION {fn}(outbox.inbox_event) OWNER TO {role}")


def subscribe(conn, name: str, topics: List[str], handler: Optional[str] = None,
              role: str = APP_ROLE, **options):
    """outbox.subscribe() as role; handler is a function name (its signature is added) or a
    signature."""
    args = ["%s", "%s", "%s::regprocedure"]
    values = [name, topics, None if handler is None else
              handler if "(" in handler else f"{handler}(outbox.inbox_event)"]
    for k, v in options.items():
        args.append(f"{k} => %s")
        values.append(v)
    as_app(conn, f"SELECT outbox.subscribe({', '.join(args)})", values, role=role)


def unsubscribe_all(conn):
    """Drop every subscription of conn's database (as a superuser), then every object the test
    roles own there and every privilege granted to them: a dump of the database must not name
    roles another cluster lacks (test_17 restores one elsewhere)."""
    for (name,) in query(conn, "SELECT name FROM outbox.subscriptions"):
        query(conn, "SELECT outbox.unsubscribe(%s)", (name,))
    for (role,) in query(conn, "SELECT rolname FROM pg_roles WHERE rolname IN (%s, 'inbox_other')",
                         (APP_ROLE,)):
        query(conn, f"DROP OWNED BY {role}")


def status(conn, subscription: str) -> List[dict]:
    with conn.cursor() as cur:
        cur.execute("SELECT * FROM outbox.inbox_status WHERE subscription = %s"
                    " ORDER BY topic, kafka_partition NULLS FIRST", (subscription,))
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, r)) for r in cur.fetchall()]


def wait_rows(conn, sql: str, want: int, timeout: float, what: str, args=None) -> int:
    """Wait until the count query returns at least want; returns the count."""
    return wait_until(lambda: (lambda n: n if n >= want else None)(query_one(conn, sql, args)[0]),
                      timeout, what)


def wait_caught_up(conn, subscription: str, timeout: float = 60):
    """Wait until every partition of subscription runs with lag 0 (next_offset = high watermark)."""
    def done():
        rows = status(conn, subscription)
        return rows and all(r["state"] == "running" and r["lag"] == 0 for r in rows
                            if r["kafka_partition"] is not None and r["next_offset"] is not None) \
            and all(r["high_watermark"] in (0, None) for r in rows if r["next_offset"] is None)
    wait_until(done, timeout, f"subscription {subscription} to catch up "
                              f"(status {[(r['kafka_partition'], r['state'], r['lag']) for r in status(conn, subscription)]})")


def produce(env: Env, topic: str, records: List[Tuple[Optional[str], Optional[bytes], list]],
            partition: Optional[int] = None) -> List[Tuple[int, int]]:
    """Produce (key, value, headers) records to topic (to one partition if given) and wait for
    their acks; returns [(partition, offset)] in order."""
    acks: List[Tuple[int, int]] = []
    errors: List[str] = []
    p = Producer({"bootstrap.servers": env.bootstrap, "enable.idempotence": True,
                  "partitioner": "murmur2_random"})

    def report(err, msg):
        if err is not None:
            errors.append(str(err))
        else:
            acks.append((msg.partition(), msg.offset()))
    for key, value, headers in records:
        kw = {} if partition is None else {"partition": partition}
        p.produce(topic, key=None if key is None else key.encode(), value=value,
                  headers=headers or None, on_delivery=report, **kw)
        p.poll(0)
    assert p.flush(30) == 0, "records not acknowledged in 30 s"
    assert not errors, errors
    return acks


def inbox_event_id(raw: bytes) -> str:
    """The event_id the inbox gives an id header's value: the uuid itself, or, for any other id,
    the name-based uuid of its MD5 (inbox_event.c, hash_uuid)."""
    try:
        return str(uuid.UUID(raw.decode()))
    except (UnicodeDecodeError, ValueError):
        d = bytearray(hashlib.md5(raw).digest())
        d[6] = (d[6] & 0x0F) | 0x30
        d[8] = (d[8] & 0x3F) | 0x80
        return str(uuid.UUID(bytes=bytes(d)))


def relay_headers(event_id: str, event_type: str = "it.event", aggregate_type: str = "it") -> list:
    """The headers our relay sends (Debezium format)."""
    return [("id", event_id.encode()), ("event_type", event_type.encode()),
            ("aggregate_type", aggregate_type.encode())]


# --------------------------------------------------------------------------- registrations

CONNECTION_ERRORS = (psycopg2.OperationalError, psycopg2.InterfaceError)


class RegistrationLoad:
    """Sessions that register users in database env.pg_database: one transaction inserts the user
    and emits user.registered (aggregate type 'user', key = user id) with outbox.emit(); a share of
    them is rolled back.  COMMIT returned: committed; COMMIT raised: unknown (the user row tells
    afterwards); rolled back: must never yield a mail.  Sessions reconnect after a crash; a gate
    parks them while the test restarts the server."""

    def __init__(self, env: Env, aggregate_type: str = "user", sessions: int = 4,
                 rollback_share: float = 0.1, seed: int = 0, think_s: float = 0.0):
        self.env, self.sessions, self.rollback_share = env, sessions, rollback_share
        self.aggregate_type = aggregate_type
        self.seed, self.think_s = seed, think_s
        self.committed: Set[str] = set()
        self.unknown: Set[str] = set()
        self.rolled_back: Set[str] = set()
        self.commits = [0] * sessions
        self.errors: List[str] = []
        self.parked = [False] * sessions
        self.gate = threading.Event()
        self.gate.set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: List[threading.Thread] = []

    def start(self):
        for s in range(self.sessions):
            t = threading.Thread(target=self._session, args=(s,), daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self):
        self._stop.set()
        self.gate.set()
        for t in self._threads:
            t.join(60)
        assert not any(t.is_alive() for t in self._threads), "registering sessions did not stop"

    def close_gate(self):
        self.gate.clear()

    def open_gate(self):
        with self._lock:
            self.parked = [False] * self.sessions
        self.gate.set()

    def all_parked(self) -> bool:
        with self._lock:
            return all(self.parked)

    def total(self) -> int:
        with self._lock:
            return sum(self.commits)

    def wait_progress(self, each: int, timeout: float, what: str = "every session to commit"):
        with self._lock:
            base = list(self.commits)
        wait_until(lambda: all(c - b >= each for c, b in zip(list(self.commits), base)), timeout,
                   f"{what} {each} more registrations (errors {self.errors[:3]})", interval=0.05)

    def _session(self, s: int):
        rng = random.Random(self.seed * 1000 + s)
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
                    time.sleep(0.1)
                    continue
            user_id = f"u-{uuid.uuid4().hex[:12]}"
            try:
                with conn.cursor() as cur:
                    cur.execute("INSERT INTO users (id, email) VALUES (%s, %s)",
                                (user_id, f"{user_id}@example.com"))
                    cur.execute("SELECT outbox.emit(%s, %s, 'user.registered', %s::jsonb)",
                                (self.aggregate_type, user_id,
                                 json.dumps({"user": user_id, "session": s})))
            except psycopg2.Error as e:
                if not isinstance(e, CONNECTION_ERRORS):
                    with self._lock:
                        self.errors.append(f"register: {e}")
                conn = self._drop(conn)
                continue
            if rng.random() < self.rollback_share:
                try:
                    conn.rollback()
                except psycopg2.Error:
                    conn = self._drop(conn)
                with self._lock:
                    self.rolled_back.add(user_id)
                continue
            try:
                conn.commit()
            except psycopg2.Error as e:
                with self._lock:
                    self.unknown.add(user_id)
                    if not isinstance(e, CONNECTION_ERRORS):
                        self.errors.append(f"commit: {e}")
                conn = self._drop(conn)
                continue
            with self._lock:
                self.committed.add(user_id)
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


def registration_schema(users_conn, mail_conn, role: str = APP_ROLE):
    """Database users: the users table (the registration writes it).  Database mail: the mail
    table and the handler send_welcome_mail() that queues one mail row per user.registered."""
    query(users_conn, "CREATE TABLE IF NOT EXISTS users (id text PRIMARY KEY, email text NOT NULL)")
    setup_app_role(mail_conn, role)
    query(mail_conn, "DROP TABLE IF EXISTS mail_queue")
    query(mail_conn, """CREATE TABLE mail_queue (id bigserial PRIMARY KEY, user_id text NOT NULL,
                        event_id uuid, kafka_partition int, kafka_offset bigint,
                        queued_at timestamptz DEFAULT clock_timestamp())""")
    query(mail_conn, f"ALTER TABLE mail_queue OWNER TO {role}")
    query(mail_conn, """CREATE OR REPLACE FUNCTION send_welcome_mail(e outbox.inbox_event)
        RETURNS void LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
        BEGIN
            IF e.event_type = 'user.registered' THEN
                INSERT INTO mail_queue (user_id, event_id, kafka_partition, kafka_offset)
                VALUES (e.payload->>'user', e.event_id, e.kafka_partition, e.kafka_offset);
            END IF;
        END $$""")
    query(mail_conn, f"ALTER FUNCTION send_welcome_mail(outbox.inbox_event) OWNER TO {role}")


def mail_counts(mail_conn) -> Dict[str, int]:
    return dict(query(mail_conn, "SELECT user_id, count(*) FROM mail_queue GROUP BY user_id"))


def existing_users(users_conn, ids) -> Set[str]:
    ids = list(ids)
    if not ids:
        return set()
    return {r[0] for r in query(users_conn, "SELECT id FROM users WHERE id = ANY(%s)", (ids,))}
