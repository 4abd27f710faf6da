"""
Integration tests of the outbox extension against a real PostgreSQL server and
a real Kafka broker (test/env/pg.sh and test/env/kafka.sh).

Run with Debian's interpreter (it has psycopg2, confluent_kafka and pytest):

    /usr/bin/python3 -m pytest -v test/integration        (-s to see the metrics)

The servers are expected to be running already (the top-level runner starts
them); if one is not, the session starts it through its script.  The session
runs CREATE EXTENSION IF NOT EXISTS outbox.  Tests may stop/start/restart the
servers, but only through the scripts, and every test leaves both running.

Environment (same defaults as the scripts):
    OUTBOX_PG_DIR        /tmp/outbox-pg        OUTBOX_KAFKA_DIR              /tmp/outbox-kafka
    OUTBOX_PG_PORT       54329                 OUTBOX_KAFKA_PORT             19092
    OUTBOX_PG_DATABASE   outbox                OUTBOX_KAFKA_CONTROLLER_PORT  19093
    OUTBOX_KAFKA         127.0.0.1:$OUTBOX_KAFKA_PORT (what the relay is configured with)
    PGHOST/PGPORT/PGUSER/PGDATABASE  default 127.0.0.1 / $OUTBOX_PG_PORT / postgres / $OUTBOX_PG_DATABASE
"""
import collections
import json
import math
import os
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import psycopg2
import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, TIMESTAMP_CREATE_TIME, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

REPO = Path(__file__).resolve().parents[2]
KAFKA_SH = REPO / "test" / "env" / "kafka.sh"
PG_SH = REPO / "test" / "env" / "pg.sh"
OUT_DIR = REPO / "test" / "out"

PARTITIONS = 4
RELAY_READY_STATES = ("idle", "publishing")

# --------------------------------------------------------------------------- reporting

SUMMARY: List[str] = []             # metric lines, shown at the end and written to test/out


def report(line: str):
    """Print a metrics line (visible with -s) and keep it for the terminal summary and file."""
    print("\n" + line)
    SUMMARY.append(line)


def pytest_terminal_summary(terminalreporter):
    if SUMMARY:
        terminalreporter.section("outbox integration metrics")
        for line in SUMMARY:
            terminalreporter.write_line(line)


def pytest_sessionfinish(session):
    if SUMMARY:
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        (OUT_DIR / "integration-metrics.txt").write_text("\n".join(SUMMARY) + "\n")


# --------------------------------------------------------------------------- environment

@dataclass
class Env:
    pg_dir: str
    pg_port: int
    pg_database: str
    pg_host: str
    pg_user: str
    kafka_dir: str
    kafka_port: int
    kafka_controller_port: int
    bootstrap: str

    @property
    def server_log(self) -> Path:
        return Path(self.pg_dir) / "server.log"

    def script_env(self) -> Dict[str, str]:
        e = dict(os.environ)
        e.update(OUTBOX_PG_DIR=self.pg_dir, OUTBOX_PG_PORT=str(self.pg_port),
                 OUTBOX_PG_DATABASE=self.pg_database, OUTBOX_KAFKA_DIR=self.kafka_dir,
                 OUTBOX_KAFKA_PORT=str(self.kafka_port),
                 OUTBOX_KAFKA_CONTROLLER_PORT=str(self.kafka_controller_port),
                 OUTBOX_KAFKA=self.bootstrap)
        return e


def load_env() -> Env:
    g = os.environ.get
    pg_port = int(g("OUTBOX_PG_PORT", "54329"))
    pg_db = g("OUTBOX_PG_DATABASE", "outbox")
    kafka_port = int(g("OUTBOX_KAFKA_PORT", "19092"))
    env = Env(
        pg_dir=g("OUTBOX_PG_DIR", "/tmp/outbox-pg"),
        pg_port=pg_port,
        pg_database=pg_db,
        pg_host=g("PGHOST", "127.0.0.1"),
        pg_user=g("PGUSER", "postgres"),
        kafka_dir=g("OUTBOX_KAFKA_DIR", "/tmp/outbox-kafka"),
        kafka_port=kafka_port,
        kafka_controller_port=int(g("OUTBOX_KAFKA_CONTROLLER_PORT", "19093")),
        bootstrap=g("OUTBOX_KAFKA") or f"127.0.0.1:{kafka_port}",
    )
    # PGPORT/PGDATABASE must name the cluster the scripts manage and the relay serves
    if g("PGPORT") and int(g("PGPORT")) != pg_port:
        raise pytest.UsageError(f"PGPORT={g('PGPORT')} differs from OUTBOX_PG_PORT={pg_port}")
    if g("PGDATABASE") and g("PGDATABASE") != pg_db:
        raise pytest.UsageError(f"PGDATABASE={g('PGDATABASE')} differs from OUTBOX_PG_DATABASE={pg_db}"
                                " (the relay only serves outbox.database)")
    return env


def run_script(env: Env, script: Path, *args: str, timeout: float = 120,
               check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["bash", str(script), *args], env=env.script_env(), capture_output=True,
                       text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{script.name} {' '.join(args)} failed ({p.returncode}):\n"
                             f"{p.stdout}\n{p.stderr}")
    return p


def kafka_sh(env: Env, *args: str, **kw) -> subprocess.CompletedProcess:
    return run_script(env, KAFKA_SH, *args, **kw)


def pg_sh(env: Env, *args: str, **kw) -> subprocess.CompletedProcess:
    """test/env/pg.sh ARGS; `stop` and `restart` go through stop_server(), which tells a stuck
    stop of PostgreSQL's own from one of the extension's."""
    if args in (("stop",), ("restart",)):
        stop_server(env, restart=args[0] == "restart", timeout=kw.get("timeout", 120) / 2)
        return subprocess.CompletedProcess(["pg.sh", *args], 0, "", "")
    return run_script(env, PG_SH, *args, **kw)


# --------------------------------------------------------------------------- stuck stops

# PostgreSQL (15 to 18) never ends a fast shutdown asked for between the restart after a backend
# crash ("terminated by signal 9", "all server processes terminated; reinitializing") and the
# start of redo: the postmaster waits in PM_WAIT_BACKENDS, FatalError still set, for a
# checkpointer that ignores the SIGTERM it got (18) or got no signal (15-17).  test/repro/ has
# the reproduction without the extension and the analysis.  Such a stop is counted, not failed.
POSTGRES_STOP_HANG = "a fast shutdown hung after a backend crash (PostgreSQL's own, test/repro/)"
POSTGRES_HANG_CHILDREN = ("checkpointer", "logger", "io worker")
STOP_HANGS = collections.Counter()          # POSTGRES_STOP_HANG -> times met in this session


def postmaster_children(pid: int) -> List[tuple]:
    """(pid, state, command line) of each child of process pid, from /proc."""
    kids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[1]) != pid:
                continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            kids.append((int(d), fields[0], cmd))
        except (OSError, ValueError):
            continue
    return sorted(kids)


def child_kind(cmd: str) -> str:
    """'checkpointer', 'io worker', 'outbox relay ...' from 'postgres: io worker 1'."""
    kind = cmd.split(":", 1)[1].strip() if cmd.startswith("postgres:") else cmd
    return "io worker" if kind.startswith("io worker") else kind


def process_stacks(pids: List[int]) -> str:
    """Each process's stack: gdb's backtrace of every thread, else the kernel's /proc/PID/stack."""
    out = []
    for pid in pids:
        text = ""
        try:
            p = subprocess.run(["gdb", "-batch", "-p", str(pid), "-ex", "thread apply all bt"],
                               capture_output=True, text=True, timeout=60)
            text = "\n".join(ln for ln in p.stdout.splitlines()
                             if ln.startswith(("#", "Thread")))
        except (OSError, subprocess.TimeoutExpired) as e:
            text = f"(gdb: {e})"
        if not text.strip() or text.startswith("(gdb"):
            try:
                with open(f"/proc/{pid}/stack") as f:
                    text += "\n(kernel stack)\n" + f.read()
            except OSError as e:
                text += f"\n(no /proc/{pid}/stack: {e})"
        out.append(f"--- process {pid}:\n{text.strip()}")
    return "\n".join(out)


def log_since_last_start(env: Env, tail_bytes: int = 4 << 20) -> List[str]:
    """The server log's lines since the postmaster last logged its start (its last 4 MB)."""
    try:
        with open(env.server_log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return []
    starts = [i for i, ln in enumerate(lines) if "starting PostgreSQL" in ln]
    return lines[starts[-1]:] if starts else lines


def stuck_stop_verdict(env: Env, pid: int) -> Optional[str]:
    """None if the stuck stop of postmaster pid is PostgreSQL's own hang (only the checkpointer,
    the logger or io workers left, and the log shows a crash restart that never reached
    "ready to accept connections"); else what is wrong, with the children and their stacks."""
    kids = postmaster_children(pid)
    kinds = [child_kind(cmd) for _, _, cmd in kids]
    lines = log_since_last_start(env)
    reinit = [i for i, ln in enumerate(lines) if "all server processes terminated; reinitializing" in ln]
    ready = [i for i, ln in enumerate(lines) if "database system is ready to accept connections" in ln]
    crashed = bool(reinit) and (not ready or reinit[-1] > ready[-1])
    if crashed and "checkpointer" in kinds and all(k in POSTGRES_HANG_CHILDREN for k in kinds):
        return None
    crash_lines = [ln for ln in lines if "terminated by signal" in ln or "reinitializing" in ln
                   or "shutdown request" in ln or "redo starts" in ln][-8:]
    return (f"postmaster {pid} stuck in a stop, not PostgreSQL's known hang"
            f" ({'after' if crashed else 'without'} a crash restart in the log; children:"
            f" {', '.join(kinds) or 'none'})\n"
            + "\n".join(f"  {k} {st} {cmd}" for k, st, cmd in kids)
            + "\nlog:\n" + "\n".join("  " + ln for ln in crash_lines)
            + "\n" + process_stacks([pid] + [k for k, _, _ in kids]))


def end_postmaster(env: Env, pid: int, timeout: float = 60):
    """An immediate shutdown (SIGQUIT) of postmaster pid, SIGKILL if that is not done in time;
    returns when the process is gone."""
    try:
        os.kill(pid, signal.SIGQUIT)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    if os.path.exists(f"/proc/{pid}"):
        os.kill(pid, signal.SIGKILL)
        while os.path.exists(f"/proc/{pid}"):
            time.sleep(0.1)


def stop_server(env: Env, mode: str = "fast", timeout: float = 60, restart: bool = False) -> str:
    """pg_ctl stop -m MODE, waiting up to timeout s (then pg.sh start again if restart).  Every
    stop that can hang goes through here.  A stop stuck past timeout is judged: PostgreSQL's own
    hang after a backend crash is counted (STOP_HANGS, a metrics line) and ended with an
    immediate shutdown; any other stuck stop fails with the postmaster's children and their
    stacks (the server is ended first, so that the next test has one to start).  Returns
    "stopped", "postgres_hang" or "not running"."""
    pid_file = Path(env.pg_dir) / "data" / "postmaster.pid"
    try:
        pid = int(pid_file.read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        pid = None
    outcome = "not running"
    if pid is not None and os.path.exists(f"/proc/{pid}"):
        p = run_script(env, PG_SH, "ctl", "stop", "-m", mode, "-w", "-t", str(int(timeout)),
                       check=False, timeout=timeout + 60)
        outcome = "stopped"
        if p.returncode != 0 and os.path.exists(f"/proc/{pid}"):
            verdict = stuck_stop_verdict(env, pid)
            if verdict is not None:
                end_postmaster(env, pid)
                raise AssertionError(f"pg_ctl stop -m {mode} not done in {timeout:.0f} s"
                                     f" ({p.stderr.strip()[-200:]}): {verdict}")
            STOP_HANGS[POSTGRES_STOP_HANG] += 1
            report(f"OUTBOX STOP HANG: pg_ctl stop -m {mode} not done in {timeout:.0f} s after a"
                   f" backend crash, only {', '.join(sorted({child_kind(c) for _, _, c in postmaster_children(pid)}))}"
                   f" left: PostgreSQL's own hang (test/repro/), ended with an immediate shutdown")
            end_postmaster(env, pid)
            outcome = "postgres_hang"
    if restart:
        run_script(env, PG_SH, "start", timeout=180)
    return outcome


def wait_until(pred: Callable[[], object], timeout: float, what: str, interval: float = 0.2):
    """Call pred until it returns something truthy; return that, or fail after timeout."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while True:
        try:
            v = pred()
            if v:
                return v
        except (psycopg2.Error, OSError) as e:  # server restarting: keep trying
            last_exc = e
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}"
                                 + (f" (last error: {last_exc})" if last_exc else ""))
        time.sleep(interval)


# --------------------------------------------------------------------------- PostgreSQL

def pg_connect(env: Env, autocommit: bool = True):
    conn = psycopg2.connect(host=env.pg_host, port=env.pg_port, user=env.pg_user,
                            dbname=env.pg_database, connect_timeout=10,
                            application_name="outbox-integration")
    conn.autocommit = autocommit
    return conn


def query(conn, sql: str, args=None) -> List[tuple]:
    with conn.cursor() as cur:
        cur.execute(sql, args)
        return cur.fetchall() if cur.description else []


def query_one(conn, sql: str, args=None):
    rows = query(conn, sql, args)
    assert len(rows) == 1, f"expected one row from {sql!r}, got {rows!r}"
    return rows[0]


def set_conf(conn, **settings):
    """ALTER SYSTEM SET outbox.<name> = value (None = RESET), then reload."""
    for name, value in settings.items():
        if value is None:
            query(conn, f"ALTER SYSTEM RESET outbox.{name}")
        else:
            query(conn, f"ALTER SYSTEM SET outbox.{name} = %s", (str(value),))
    query(conn, "SELECT pg_reload_conf()")


def relay_cpu_while_idle(conn, seconds: float = 5.0) -> float:
    """CPU seconds (all threads) the relay of conn's database used over seconds while the test
    emits nothing.  An idle relay sleeps between passes and uses a few hundredths; one that loops
    without sleeping uses most of a core.  Read from /proc: the server runs on this machine."""
    pid = relay_status(conn)[0]["pid"]

    def cpu():
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime, stime
    before = cpu()
    time.sleep(seconds)
    assert relay_status(conn)[0]["pid"] == pid, "the relay was replaced while measured"
    return cpu() - before


EMIT_SQL = "SELECT outbox.emit(%s, %s, %s, %s::jsonb, %s::jsonb, %s)"


def emit(cur, aggregate_type: str, aggregate_id: str, event_type: str,
         payload: Optional[dict], headers: Optional[dict] = None,
         topic: Optional[str] = None) -> str:
    """Call outbox.emit in the cursor's current transaction; return the event_id (str)."""
    cur.execute(EMIT_SQL, (aggregate_type, aggregate_id, event_type,
                           None if payload is None else json.dumps(payload),
                           None if headers is None else json.dumps(headers), topic))
    (event_id,) = cur.fetchone()
    assert event_id is not None
    return str(event_id)


def server_major(conn) -> int:
    """The server's PostgreSQL major (15, 16, 17, 18): some behaviour differs by release."""
    return query_one(conn, "SELECT current_setting('server_version_num')::int / 10000")[0]


def relay_status(conn) -> List[dict]:
    with conn.cursor() as cur:
        cur.execute("SELECT * FROM outbox.status")
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, r)) for r in cur.fetchall()]


def wait_relay_ready(env: Env, timeout: float = 60) -> dict:
    """Wait until exactly one relay worker serves our database and is idle or publishing."""
    last = []

    def ready():
        conn = pg_connect(env)
        try:
            rows = relay_status(conn)
        finally:
            conn.close()
        last[:] = rows
        if len(rows) == 1 and rows[0]["database"] == env.pg_database \
                and rows[0]["state"] in RELAY_READY_STATES:
            return rows[0]
        return None
    try:
        return wait_until(ready, timeout, "the outbox relay to be idle/publishing")
    except AssertionError as e:
        raise AssertionError(f"{e}; last outbox.status: {last}") from None


def delivery_errors(status_row: dict) -> int:
    """Failed delivery attempts counted by outbox.status: column delivery_errors from schema 1.1
    on (where failed counts dead-lettered events), failed in 1.0."""
    return status_row["delivery_errors"] if "delivery_errors" in status_row else status_row["failed"]


def topic_prefix(conn) -> str:
    return query_one(conn, "SHOW outbox.topic_prefix")[0]


class LogWatcher:
    """Lines appended to the server log since construction."""

    def __init__(self, env: Env):
        self.path = env.server_log
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def new_lines(self) -> List[str]:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            return f.read().decode("utf-8", "replace").splitlines()


# --------------------------------------------------------------------------- Kafka

def admin(env: Env) -> AdminClient:
    return AdminClient({"bootstrap.servers": env.bootstrap})


def create_topics(env: Env, names: List[str], partitions: int = PARTITIONS, timeout: float = 30):
    """Create topics (idempotent) and wait until every partition has a leader."""
    a = admin(env)
    futures = a.create_topics([NewTopic(n, num_partitions=partitions, replication_factor=1)
                               for n in names], operation_timeout=timeout)
    for name, fut in futures.items():
        try:
            fut.result(timeout)
        except Exception as e:  # noqa: BLE001
            err = e.args[0] if e.args else None
            if not (isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS):
                raise

    def all_led():
        md = a.list_topics(timeout=5)
        for n in names:
            t = md.topics.get(n)
            if t is None or t.error is not None or len(t.partitions) != partitions:
                return False
            if any(p.leader < 0 for p in t.partitions.values()):
                return False
        return True
    wait_until(all_led, timeout, f"topics {names} to have {partitions} led partitions")


@dataclass
class Received:
    topic: str
    partition: int
    offset: int
    key: Optional[str]
    value: Optional[bytes]
    headers: List[tuple]            # [(name, bytes)] in wire order
    timestamp_type: int
    timestamp_ms: int
    recv_time: float                # time.time() when the consumer returned it

    @property
    def header_dict(self) -> Dict[str, str]:
        return {k: (v.decode() if v is not None else None) for k, v in self.headers}

    @property
    def event_id(self) -> Optional[str]:
        return self.header_dict.get("id")

    def json(self):
        return None if self.value is None else json.loads(self.value)


class TopicReader:
    """A consumer in a fresh group reading the given topics from the beginning."""

    def __init__(self, env: Env, topics: List[str]):
        self.topics = list(topics)
        self.messages: List[Received] = []
        self.offsets = set()        # (topic, partition, offset) of every message seen
        self.errors: List[str] = []
        self.assigned = set()
        self.settle_env = env       # whose relay settle() waits for (issue 28)
        self._lock = threading.Lock()
        self.consumer = Consumer({
            "bootstrap.servers": env.bootstrap,
            "group.id": f"outbox-it-{uuid.uuid4()}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "session.timeout.ms": 30000,
            "fetch.wait.max.ms": 50,
            "topic.metadata.refresh.interval.ms": 2000,
        })
        self.consumer.subscribe(self.topics, on_assign=self._on_assign)

    def _on_assign(self, consumer, partitions):
        self.assigned.update((p.topic, p.partition) for p in partitions)

    def poll(self, timeout: float = 0.2) -> int:
        msgs = self.consumer.consume(num_messages=1000, timeout=timeout)
        now = time.time()
        got = []
        for m in msgs:
            if m.error() is not None:
                self.errors.append(str(m.error()))
                continue
            ts_type, ts = m.timestamp()
            got.append(Received(topic=m.topic(), partition=m.partition(), offset=m.offset(),
                                key=None if m.key() is None else m.key().decode(),
                                value=m.value(), headers=list(m.headers() or []),
                                timestamp_type=ts_type, timestamp_ms=ts, recv_time=now))
        if got:
            with self._lock:
                self.messages.extend(got)
                self.offsets.update((m.topic, m.partition, m.offset) for m in got)
        return len(got)

    def count(self) -> int:
        """Distinct messages (topic, partition, offset) seen so far.  A consumer-side re-delivery
        (the same offset again after a rebalance) does not count, so that read_until() never
        stops early on re-deliveries while a message is still missing."""
        with self._lock:
            return len(self.offsets)

    def wait_assigned(self, timeout: float = 30, partitions: int = PARTITIONS):
        want = partitions * len(self.topics)

        def done():
            self.poll(0.2)
            return len(self.assigned) >= want
        wait_until(done, timeout, f"consumer assignment of {want} partitions", interval=0)

    def read_until(self, expected: int, timeout: float, extra: float = 3.0) -> List[Received]:
        """Poll until `expected` messages arrived or timeout, then until the relay has settled
        and everything the topics hold is read, for at most `extra` more seconds (settle())."""
        deadline = time.monotonic() + timeout
        while self.count() < expected and time.monotonic() < deadline:
            self.poll(0.2)
        settle(self, extra, lambda: self.poll(0.1))
        return self.snapshot()

    def snapshot(self) -> List[Received]:
        with self._lock:
            return list(self.messages)

    def close(self):
        try:
            self.consumer.close()
        except Exception:  # noqa: BLE001
            pass


@pytest.fixture
def reader_factory(env):
    readers = []

    def make(topics: List[str], wait: bool = True) -> TopicReader:
        r = TopicReader(env, topics)
        readers.append(r)
        if wait:
            r.wait_assigned()
        return r
    yield make
    for r in readers:
        r.close()


def unique_messages(msgs: List[Received]) -> List[Received]:
    """Drop consumer-side re-deliveries (same topic/partition/offset), keep offset order."""
    seen = set()
    out = []
    for m in sorted(msgs, key=lambda m: (m.topic, m.partition, m.offset)):
        k = (m.topic, m.partition, m.offset)
        if k not in seen:
            seen.add(k)
            out.append(m)
    return out


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (org.apache.kafka.common.utils.Utils.murmur2), as unsigned 32 bit."""
    m, r, mask = 0x5BD1E995, 24, 0xFFFFFFFF
    length = len(data)
    h = (0x9747B28C ^ length) & mask
    for i in range(length // 4):
        k = int.from_bytes(data[4 * i:4 * i + 4], "little")
        k = (k * m) & mask
        k ^= k >> r
        k = (k * m) & mask
        h = (h * m) & mask
        h ^= k
    rest = length % 4
    tail = data[length - rest:]
    if rest == 3:
        h ^= tail[2] << 16
    if rest >= 2:
        h ^= tail[1] << 8
    if rest >= 1:
        h ^= tail[0]
        h = (h * m) & mask
    h ^= h >> 13
    h = (h * m) & mask
    h ^= h >> 15
    return h


def java_partition(key: str, partitions: int = PARTITIONS) -> int:
    """The partition the Java client's default partitioner picks for a non-null key."""
    return (murmur2(key.encode()) & 0x7FFFFFFF) % partitions


# --------------------------------------------------------------------------- fixtures

def ensure_servers_running(env: Env):
    if kafka_sh(env, "status", check=False).returncode != 0:
        kafka_sh(env, "start", timeout=180)
    if pg_sh(env, "status", check=False).returncode != 0:
        pg_sh(env, "start")


@pytest.fixture(scope="session")
def env() -> Env:
    e = load_env()
    ensure_servers_running(e)
    conn = pg_connect(e)
    try:
        query(conn, "CREATE EXTENSION IF NOT EXISTS outbox")
        db = query_one(conn, "SHOW outbox.database")[0]
        servers = query_one(conn, "SHOW outbox.bootstrap_servers")[0]
    finally:
        conn.close()
    assert db == e.pg_database, \
        f"the relay serves database {db!r}, the tests use {e.pg_database!r}"
    assert servers == e.bootstrap, \
        (f"the relay publishes to {servers!r} but the tests read from {e.bootstrap!r}:"
         " set OUTBOX_KAFKA (or OUTBOX_KAFKA_PORT) to match the cluster's outbox.bootstrap_servers")
    wait_relay_ready(e)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    return e


@pytest.fixture(autouse=True)
def servers_left_running(env):
    """Every test leaves Kafka and PostgreSQL running, with a ready relay."""
    yield
    ensure_servers_running(env)
    wait_relay_ready(env)


@pytest.fixture
def conn(env):
    c = pg_connect(env)
    yield c
    c.close()


@pytest.fixture
def prefix(conn) -> str:
    return topic_prefix(conn)


def new_aggregate_type(tag: str) -> str:
    return f"it_{tag}_{uuid.uuid4().hex[:10]}"


def percentile(sorted_values: List[float], p: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    assert sorted_values
    k = max(0, min(len(sorted_values) - 1, math.ceil(p / 100.0 * len(sorted_values)) - 1))
    return sorted_values[k]


# --------------------------------------------------------------------------- checks

RESERVED_HEADERS = ("id", "event_type", "aggregate_type")


def message_problems(m: Received, *, event_id: str, aggregate_type: str, aggregate_id: str,
                     event_type: str, payload, headers: Optional[dict], topic: str,
                     created_ms: Optional[int]) -> List[str]:
    """Everything wrong with one Kafka message compared with the event it should carry."""
    p = []
    where = f"event {event_id} at {m.topic}[{m.partition}]@{m.offset}"
    if m.topic != topic:
        p.append(f"{where}: topic {m.topic!r}, expected {topic!r}")
    if m.key != aggregate_id:
        p.append(f"{where}: key {m.key!r}, expected {aggregate_id!r}")
    names = [h[0] for h in m.headers]
    if names[:3] != list(RESERVED_HEADERS):
        p.append(f"{where}: first headers {names[:3]}, expected {list(RESERVED_HEADERS)}")
    if len(names) != len(set(names)):
        p.append(f"{where}: duplicate header names {names}")
    hd = m.header_dict
    for name, want in (("id", event_id), ("event_type", event_type),
                       ("aggregate_type", aggregate_type)):
        if hd.get(name) != want:
            p.append(f"{where}: header {name}={hd.get(name)!r}, expected {want!r}")
    user = {k: v for k, v in hd.items() if k not in RESERVED_HEADERS}
    if user != (headers or {}):
        p.append(f"{where}: user headers {user!r}, expected {headers or {}!r}")
    if payload is None:
        if m.value is not None:
            p.append(f"{where}: value {m.value!r}, expected a tombstone (None)")
    else:
        try:
            got = json.loads(m.value) if m.value is not None else None
        except ValueError as e:
            got = f"<not JSON: {e}: {m.value!r}>"
        if got != payload:
            p.append(f"{where}: payload {got!r}, expected {payload!r}")
    if m.timestamp_type != TIMESTAMP_CREATE_TIME:
        p.append(f"{where}: timestamp type {m.timestamp_type}, expected CreateTime")
    if created_ms is not None and m.timestamp_ms != created_ms:
        p.append(f"{where}: timestamp {m.timestamp_ms}, expected created_at {created_ms} ms")
    return p


def event_rows(conn, aggregate_type: str) -> Dict[str, dict]:
    """outbox.events rows of one aggregate_type by event_id, with created_at in Unix ms."""
    with conn.cursor() as cur:
        cur.execute("""
            SELECT event_id::text, id, aggregate_id, event_type, topic, payload, headers,
                   floor(extract(epoch FROM created_at) * 1000)::bigint AS created_ms,
                   published_at, outbox.published(events) AS published, attempts, last_error
              FROM outbox.events WHERE aggregate_type = %s ORDER BY id""", (aggregate_type,))
        cols = [d[0] for d in cur.description]
        return {r[0]: dict(zip(cols, r)) for r in cur.fetchall()}


def assert_no_problems(problems: List[str], what: str, show: int = 20):
    assert not problems, (f"{len(problems)} problem(s) with {what}:\n  "
                          + "\n  ".join(problems[:show])
                          + (f"\n  ... and {len(problems) - show} more" if len(problems) > show else ""))


def emit_round_robin(conn, agg_type, n_aggregates, per_aggregate, tag, event_type="it.event"):
    """One transaction per event, aggregates interleaved; returns [(event_id, agg_id, seq)]."""
    out = []
    for seq in range(1, per_aggregate + 1):
        for k in range(n_aggregates):
            agg_id = f"{tag}-{k}"
            with conn.cursor() as cur:
                eid = emit(cur, agg_type, agg_id, event_type, {"agg": agg_id, "seq": seq})
            conn.commit()
            out.append((eid, agg_id, seq))
    return out


def order_problems(msgs, expected):
    """Per aggregate, first occurrences in offset order must follow the commit order."""
    problems = []
    got = collections.defaultdict(list)
    seen = set()
    for m in msgs:                       # msgs are in (partition, offset) order
        if m.event_id in seen:
            continue
        seen.add(m.event_id)
        got[m.key].append(expected[m.event_id][1])
    want = collections.defaultdict(list)      # one session, so commit order = seq order
    for agg_id, seq in expected.values():
        want[agg_id].append(seq)
    for agg_id, seqs in want.items():
        if got.get(agg_id) != sorted(seqs):
            problems.append(f"{agg_id}: arrived {got.get(agg_id)}, committed {sorted(seqs)}")
    return problems


# =========================================================================== issue 28: failure context
# A failed test says what the server and the relay were doing: the tail of the server log and
# outbox.status / outbox.cluster_status(), read over a fresh connection with short timeouts (the
# server may be down, or the test's own connection broken).  Added to the failure's report.

FAILURE_LOG_LINES = 60


def _rows_text(cur, sql: str) -> str:
    cur.execute(sql)
    cols = [d[0] for d in cur.description]
    rows = cur.fetchall()
    if not rows:
        return "  (no rows)"
    return "\n".join("  " + ", ".join(f"{c}={v!r}" for c, v in zip(cols, r)) for r in rows)


def failure_context(env: Env) -> str:
    """The server log's last lines and the relay's status, as text for a failure report."""
    parts = []
    try:
        with open(env.server_log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            lines = f.read().decode("utf-8", "replace").splitlines()[-FAILURE_LOG_LINES:]
        parts.append(f"--- {env.server_log}, last {len(lines)} lines\n" + "\n".join(lines))
    except OSError as e:
        parts.append(f"--- {env.server_log}: {e}")
    try:
        c = psycopg2.connect(host=env.pg_host, port=env.pg_port, user=env.pg_user,
                             dbname=env.pg_database, connect_timeout=5,
                             application_name="outbox-integration-failure",
                             options="-c statement_timeout=5000 -c lock_timeout=2000")
        c.autocommit = True
        try:
            with c.cursor() as cur:
                for title, sql in (("outbox.status", "SELECT * FROM outbox.status"),
                                   ("outbox.cluster_status()", "SELECT * FROM outbox.cluster_status()")):
                    try:
                        parts.append(f"--- {title}\n" + _rows_text(cur, sql))
                    except psycopg2.Error as e:
                        parts.append(f"--- {title}: {str(e).strip()}")
        finally:
            c.close()
    except psycopg2.Error as e:
        parts.append(f"--- outbox.status: no connection to {env.pg_host}:{env.pg_port}: {str(e).strip()}")
    return "\n".join(parts)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if not rep.failed or getattr(item, "_outbox_context_reported", False):
        return
    item._outbox_context_reported = True
    try:
        env = getattr(item, "funcargs", {}).get("env") or load_env()
        text = failure_context(env)
    except Exception as e:  # noqa: BLE001  never hide the failure itself
        text = f"(no context: {type(e).__name__}: {e})"
    rep.sections.append(("outbox: server log tail and relay status", text))


def poll_until(pred: Callable[[], object], timeout: float, interval: float = 0.05):
    """Call pred until it returns something truthy or timeout passed; return its last value.
    For a wait whose end is not a failure (wait_until's is)."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() >= deadline:
            return v
        time.sleep(interval)


# Waiting for duplicates and extras.  A reader that has seen what it expected kept reading for a
# fixed `extra` number of seconds, in case a copy or an unexpected event still came.  Copies come
# from a relay that sends again what it did not mark published: once the relay of the cluster
# the events came from (reader.settle_env) has nothing pending (every event it sent is marked),
# nothing more can come, and what has come is in the topics up to their current end offsets.
# settle() waits for exactly that, for at most `extra` seconds: a relay that keeps events
# pending on purpose (paused, held behind a failed one) gets the whole `extra`, as before.

def relay_settled(env: Env) -> bool:
    """The relays of env's database have no pending event (outbox.status)."""
    try:
        c = pg_connect(env)
        try:
            rows = relay_status(c)
        finally:
            c.close()
    except psycopg2.Error:
        return False
    return bool(rows) and all(r.get("pending") == 0 for r in rows)


def caught_up(consumer, partitions) -> bool:
    """The consumer's position is at the end offset of each (topic, partition) that holds
    messages (the position passes transaction markers, a last offset seen would not).  False
    while a broker cannot say (a restarted broker's leaders not elected yet, say)."""
    try:
        for topic, part in partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, part), timeout=5, cached=False)
            if high <= low:
                continue
            pos = consumer.position([TopicPartition(topic, part)])[0].offset
            if pos < high:
                return False
    except KafkaException:
        return False
    return True


def settle(reader, extra: float, poll: Callable[[], object]):
    """Wait until reader.settle_env's relay has settled and reader read every message its topics
    hold, for at most extra seconds; poll() reads meanwhile (or sleeps, for a reader polled in
    the background)."""
    deadline = time.monotonic() + extra
    settle_env = getattr(reader, "settle_env", None)    # a reader made some other way: the whole extra
    while time.monotonic() < deadline:
        if settle_env is not None and relay_settled(settle_env):
            break
        poll()
    else:
        return
    partitions = sorted(reader.assigned)
    while time.monotonic() < deadline and not caught_up(reader.consumer, partitions):
        poll()
# =========================================================================== end of issue 28 section
