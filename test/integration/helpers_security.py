"""
Helpers for test_20_capture_ops, test_21_security and test_22_sasl: settings changed with
ALTER SYSTEM + reload (and waited for), the relay's state and pid, server-log checks (lines of
the relay, worker exits, a whole-log grep for secrets), roles, and Kafka message counting by
event id.
"""
import collections
import json
import os
import subprocess
import time
import uuid
from typing import Dict, Iterable, List, Optional

import psycopg2

from conftest import (KAFKA_SH, Env, Received, pg_connect, query, query_one, relay_status,
                      settle, unique_messages, wait_until)

READY = ("idle", "publishing")

# the postmaster's line when a relay worker process ends (crash loop detector)
WORKER_EXIT = 'background worker "outbox relay"'


# --------------------------------------------------------------------------- settings

def alter_system(conn, name: str, value: Optional[str]):
    """ALTER SYSTEM SET name = value (None: RESET).  name is a full parameter name."""
    if value is None:
        query(conn, f"ALTER SYSTEM RESET {name}")
    else:
        query(conn, f"ALTER SYSTEM SET {name} = %s", (str(value),))


def reload(conn):
    query(conn, "SELECT pg_reload_conf()")


def set_system(conn, settings: Dict[str, Optional[str]]):
    """Several ALTER SYSTEM SET/RESET, then one reload."""
    for name, value in settings.items():
        alter_system(conn, name, value)
    reload(conn)


def wait_shown(env: Env, name: str, value: str, timeout: float = 20):
    """pg_reload_conf() is asynchronous: wait until a new session's SHOW gives value."""
    def seen():
        c = pg_connect(env)
        try:
            return query_one(c, f"SHOW {name}")[0] == value
        finally:
            c.close()
    wait_until(seen, timeout, f"SHOW {name} = {value!r} after the reload")


def wait_session_shows(conn, name: str, value: str, timeout: float = 20):
    """The same for an existing session (it applies a SIGHUP before its next statement)."""
    wait_until(lambda: query_one(conn, f"SHOW {name}")[0] == value, timeout,
               f"SHOW {name} = {value!r} in this session")


# --------------------------------------------------------------------------- relay

def status(conn) -> dict:
    rows = relay_status(conn)
    assert len(rows) == 1, f"expected one relay worker, outbox.status has {rows}"
    return rows[0]


def state(conn) -> Optional[str]:
    rows = relay_status(conn)
    return rows[0]["state"] if rows else None


def wait_state(conn, states, timeout: float = 30, what: str = "") -> dict:
    if isinstance(states, str):
        states = (states,)
    last = {}

    def ok():
        rows = relay_status(conn)
        last["rows"] = rows
        return rows[0] if len(rows) == 1 and rows[0]["state"] in states else None
    try:
        return wait_until(ok, timeout, what or f"relay state in {states}")
    except AssertionError as e:
        raise AssertionError(f"{e}; last outbox.status: {last.get('rows')}") from None


def wait_new_connection(env: Env, timeout: float = 60):
    return wait_until(lambda: pg_connect(env), timeout, "a connection to PostgreSQL")


def pending_count(conn, agg_type: str) -> int:
    return query_one(conn, "SELECT count(*) FROM outbox.events"
                           " WHERE aggregate_type = %s AND NOT outbox.published(events)", (agg_type,))[0]


def published_ids(conn, agg_type: str) -> List[int]:
    return [r[0] for r in query(conn, "SELECT id FROM outbox.events WHERE aggregate_type = %s"
                                      " AND outbox.published(events) ORDER BY id", (agg_type,))]


def wait_all_published(conn, agg_type: str, n: int, timeout: float = 60):
    wait_until(lambda: query_one(conn, "SELECT count(*) FROM outbox.events WHERE aggregate_type = %s"
                                       " AND outbox.published(events)", (agg_type,))[0] == n,
               timeout, f"{n} published rows of {agg_type}")


def emit_many(conn, agg_type: str, keys: List[str], per_key: int, topic: Optional[str] = None,
              tag: str = "e") -> List[tuple]:
    """One transaction per event, keys interleaved; returns [(event_id, key, seq)]."""
    out = []
    for seq in range(1, per_key + 1):
        for k in keys:
            eid = query_one(conn, "SELECT outbox.emit(%s, %s, %s, %s::jsonb, NULL, %s)::text",
                            (agg_type, k, f"{tag}.event",
                             json.dumps({"key": k, "seq": seq, "tag": tag}), topic))[0]
            out.append((eid, k, seq))
    return out


# --------------------------------------------------------------------------- server log

class Log:
    """The server log from a starting point on (LogWatcher that can also be re-read)."""

    def __init__(self, env: Env):
        self.path = env.server_log
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def lines(self) -> List[str]:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            return f.read().decode("utf-8", "replace").splitlines()

    def text(self) -> str:
        return "\n".join(self.lines())


def whole_log(env: Env) -> str:
    return env.server_log.read_bytes().decode("utf-8", "replace")


def entries(lines: List[str]) -> List[str]:
    """Log entries: each line joined with its DETAIL/HINT/CONTEXT/STATEMENT lines (same pid)
    and with continuation lines of a multi-line message (no timestamp)."""
    out: List[str] = []
    for ln in lines:
        if out and (not ln[:4].isdigit() or
                    (line_pid(ln) == line_pid(out[-1]) and
                     any(f" {k}:  " in ln for k in ("DETAIL", "HINT", "CONTEXT", "STATEMENT")))):
            out[-1] += "\n" + ln
        else:
            out.append(ln)
    return out


def relay_lines(lines: List[str]) -> List[str]:
    return [ln for ln in lines if "outbox relay" in ln]


def worker_exits(lines: List[str]) -> List[str]:
    return [ln for ln in lines if WORKER_EXIT in ln and "exited" in ln]


def line_pid(line: str) -> Optional[int]:
    try:
        return int(line.split("[", 1)[1].split("]", 1)[0])
    except (IndexError, ValueError):
        return None


def lines_of_pid(lines: List[str], pid: int) -> List[str]:
    return [ln for ln in lines if line_pid(ln) == pid]


# --------------------------------------------------------------------------- roles

def drop_role(conn, role: str):
    """Drop a role and everything it owns or was granted in this database (idempotent)."""
    if query(conn, "SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)):
        query(conn, f'DROP OWNED BY "{role}"')
        query(conn, f'DROP ROLE "{role}"')


def unique(tag: str) -> str:
    return f"{tag}_{uuid.uuid4().hex[:8]}"


# --------------------------------------------------------------------------- Kafka

def id_counts(msgs: Iterable[Received]) -> collections.Counter:
    """Messages per event id (consumer-side re-deliveries of one offset dropped)."""
    return collections.Counter(m.event_id for m in unique_messages(list(msgs)))


def wait_counts(reader, want: Dict[str, int], timeout: float = 60, extra: float = 2.0
                ) -> collections.Counter:
    """Poll until every event id in want has at least its count, then until the relay settled
    and the topics are read to their end, for at most `extra` seconds (conftest.settle: surplus
    copies would show); return the counts of all messages read."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        c = id_counts(reader.snapshot())
        if all(c.get(k, 0) >= v for k, v in want.items()):
            break
        reader.poll(0.2)
    settle(reader, extra, lambda: reader.poll(0.1))
    return id_counts(reader.snapshot())


def count_problems(counts: collections.Counter, want: Dict[str, int], what: str) -> List[str]:
    p = []
    for eid, n in want.items():
        if counts.get(eid, 0) != n:
            p.append(f"{what}: event {eid} arrived {counts.get(eid, 0)} time(s), expected {n}")
    return p


def per_partition_id_order(msgs: List[Received], row_id: Dict[str, int]) -> List[str]:
    """Within each partition (offset order), the given events must appear in ascending id."""
    problems = []
    last: Dict[tuple, tuple] = {}
    for m in unique_messages(msgs):
        if m.event_id not in row_id:
            continue
        k = (m.topic, m.partition)
        i = row_id[m.event_id]
        if k in last and last[k][0] > i:
            problems.append(f"{m.topic}[{m.partition}]@{m.offset}: id {i} after id {last[k][0]}"
                            f" (@{last[k][1]})")
        last[k] = (i, m.offset)
    return problems


def run_kafka_sh(env: Env, *args: str, extra_env: Optional[Dict[str, str]] = None,
                 timeout: float = 180) -> subprocess.CompletedProcess:
    """test/env/kafka.sh with the session's environment plus extra_env (e.g. the SASL port)."""
    e = env.script_env()
    e.pop("OUTBOX_KAFKA_SASL_PORT", None)
    e.update(extra_env or {})
    p = subprocess.run(["bash", str(KAFKA_SH), *args], env=e, capture_output=True, text=True,
                       timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"kafka.sh {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    import socket
    s = socket.socket()
    s.settimeout(1)
    try:
        s.connect((host, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def sqlstate_of(exc: psycopg2.Error) -> str:
    return exc.pgcode or ""


def full_error(exc: psycopg2.Error) -> str:
    """Everything the client gets about an error: message, detail, hint, context."""
    d = exc.diag
    return "\n".join(x for x in (str(exc), d.message_primary, d.message_detail, d.message_hint,
                                 d.context, d.statement_position) if x)


def safe_unlink(path: str):
    try:
        os.unlink(path)
    except OSError:
        pass


def tcp_remote_ports(pid: int) -> Optional[set]:
    """Remote ports of the established TCP connections of a process (127.0.0.1 / IPv4), from
    /proc; None when this user cannot look at the process's file descriptors (not root)."""
    try:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except PermissionError:
        return None
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    # cols: sl local rem st ... inode (index 9); st 01 = ESTABLISHED
                    if cols[3] == "01" and cols[9] in inodes:
                        ports.add(int(cols[2].rsplit(":", 1)[1], 16))
        except OSError:
            pass
    return ports
