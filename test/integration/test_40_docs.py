"""
The documentation, checked against the running server and a real broker (issue 29).

1. The consumer example (doc/examples/consumer.py) runs against the real Kafka broker, subscribed
   before its topic exists. It is stopped twice while events flow: once by its own test hook
   right after a database commit and before the offset commit (the window the `id` de-dup
   covers), once by SIGKILL at a moment the test does not choose. Every committed event must be
   applied exactly once: its id recorded once, its order counted once, nothing rolled back.
2. Drift: doc/configuration.md and the README's settings table against pg_settings (every
   outbox.* setting, its type, default, unit, context and range; nothing documented that the
   server lacks), and doc/sql-api.md against the catalog (every function of the extension with
   its signature; every column of its views and tables with its type). A failure names the drift.
"""
import os
import re
import signal
import subprocess
import sys
import uuid
from decimal import Decimal
from pathlib import Path

import psycopg2

from conftest import (REPO, emit, new_aggregate_type, pg_connect, query, report, wait_until)

CONSUMER = REPO / "doc" / "examples" / "consumer.py"
CONFIGURATION = REPO / "doc" / "configuration.md"
SQL_API = REPO / "doc" / "sql-api.md"
README = REPO / "README.md"

CUSTOMERS = 20
EVENTS_PER_TRANSACTION = 25
ROLLBACK_EVERY = 8          # every 8th transaction rolls back


# --------------------------------------------------------------------------- 1. the consumer

class ConsumerProcess:
    """doc/examples/consumer.py as a child process, its log in a file."""

    def __init__(self, env, topic, group, dsn, log_path, crash_after_batch=0):
        self.log_path = log_path
        e = dict(os.environ)
        e.pop("CONSUMER_CRASH_AFTER_BATCH", None)
        if crash_after_batch:
            e["CONSUMER_CRASH_AFTER_BATCH"] = str(crash_after_batch)
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            ["/usr/bin/python3", str(CONSUMER), "--bootstrap", env.bootstrap, "--topic", topic,
             "--group", group, "--dsn", dsn, "--batch-size", "50", "--instance-id", "docs-test"],
            stdout=self.log, stderr=subprocess.STDOUT, env=e)

    def text(self):
        return Path(self.log_path).read_text()

    def wait_exit(self, timeout):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the consumer did not exit within {timeout} s; its log ends:\n"
                                 f"{self.text()[-2000:]}") from None
        finally:
            self.log.close()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        return self.wait_exit(30)


def emit_transaction(conn, agg, n, rollback, committed, rolled_back, seq):
    """One transaction of n events over the customers, order.created but every tenth an
    order.shipped as the README's example emits it (no customer, no total: the example consumer
    must record it as processed and count nothing; a fresh user's try crashed it with a KeyError).
    Returns the next seq; committed maps an order.shipped to (None, None)."""
    with conn.cursor() as cur:
        ids = []
        for _ in range(n):
            if seq % 10 == 9:
                eid = emit(cur, agg, str(seq % CUSTOMERS), "order.shipped", {"carrier": "dhl"})
                ids.append((eid, None, None))
                seq += 1
                continue
            customer = f"customer-{seq % CUSTOMERS}"
            total = Decimal(seq % 97) + Decimal("0.25")
            eid = emit(cur, agg, str(seq % CUSTOMERS), "order.created",
                       {"customer": customer, "total": float(total)})
            ids.append((eid, customer, total))
            seq += 1
    if rollback:
        conn.rollback()
        rolled_back.update(eid for eid, _, _ in ids)
    else:
        conn.commit()
        committed.update({eid: (c, t) for eid, c, t in ids})
    return seq


def skipped_in(text):
    return sum(int(n) for n in re.findall(r"skipped (\d+) duplicate", text))


def test_consumer_example_applies_each_event_once(env, prefix, tmp_path):
    agg = new_aggregate_type("docs")
    topic = prefix + agg                    # not created: the consumer starts before it exists
    target = f"docs_consumer_{uuid.uuid4().hex[:8]}"
    group = f"docs-consumer-{uuid.uuid4().hex[:8]}"
    admin = pg_connect(env)
    query(admin, f'CREATE DATABASE "{target}"')
    dsn = f"host={env.pg_host} port={env.pg_port} user={env.pg_user} dbname={target}"
    emitter = pg_connect(env, autocommit=False)
    committed, rolled_back = {}, set()
    procs = []

    def applied_count():
        with psycopg2.connect(dsn) as c, c.cursor() as cur:
            cur.execute("SELECT count(*) FROM processed_events")
            return cur.fetchone()[0]
    try:
        # A: subscribes before the topic exists, then exits by its hook after its 2nd batch's
        # database commit, before committing that batch's offsets
        a = ConsumerProcess(env, topic, group, dsn, tmp_path / "a.log", crash_after_batch=2)
        procs.append(a)
        wait_until(lambda: "does not exist yet" in a.text(), 60,
                   "the consumer to report that its topic does not exist yet")
        seq = 0
        for t in range(40):
            seq = emit_transaction(emitter, agg, EVENTS_PER_TRANSACTION, t % ROLLBACK_EVERY == 7,
                                   committed, rolled_back, seq)
        phase1 = len(committed)
        rc_a = a.wait_exit(120)
        assert rc_a == 70 and "CONSUMER_CRASH_AFTER_BATCH" in a.text(), \
            f"consumer A should have exited by its hook (rc {rc_a}):\n{a.text()[-2000:]}"
        applied_by_a = applied_count()

        # B: reads A's last batch again (skipped by id), then is killed mid-stream
        b = ConsumerProcess(env, topic, group, dsn, tmp_path / "b.log")
        procs.append(b)
        for t in range(40, 80):
            seq = emit_transaction(emitter, agg, EVENTS_PER_TRANSACTION, t % ROLLBACK_EVERY == 7,
                                   committed, rolled_back, seq)
            if t == 50:
                wait_until(lambda: applied_count() > phase1, 120,
                           "consumer B to apply events of the second phase")
                rc_b = b.kill()
        assert rc_b == -signal.SIGKILL, f"consumer B: rc {rc_b}"
        applied_by_b = applied_count()

        # C: picks up after the kill and drains the rest
        c = ConsumerProcess(env, topic, group, dsn, tmp_path / "c.log")
        procs.append(c)
        wait_until(lambda: applied_count() >= len(committed), 180,
                   f"all {len(committed)} committed events to be applied")
        c.proc.send_signal(signal.SIGTERM)
        rc_c = c.wait_exit(60)
        assert rc_c == 0, f"consumer C did not stop cleanly on SIGTERM (rc {rc_c}):\n{c.text()[-2000:]}"

        with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
            cur.execute("SELECT event_id::text FROM processed_events")
            processed = [r[0] for r in cur.fetchall()]
            cur.execute("SELECT customer, orders, revenue FROM customer_orders")
            orders = {r[0]: (r[1], r[2]) for r in cur.fetchall()}
        expected = {}
        for customer, total in committed.values():
            if customer is None:
                continue                # order.shipped: processed, nothing counted
            n, s = expected.get(customer, (0, Decimal(0)))
            expected[customer] = (n + 1, s + total)
        skipped = skipped_in(b.text()) + skipped_in(c.text())
        report(f"OUTBOX DOCS CONSUMER EXAMPLE: {len(committed)} committed events"
               f" ({len(rolled_back)} rolled back) applied by A {applied_by_a}, by B up to"
               f" {applied_by_b}, then C; copies skipped by id: {skipped}; processed {len(processed)},"
               f" distinct {len(set(processed))}")
        assert len(processed) == len(set(processed))
        missing = set(committed) - set(processed)
        assert not missing, f"{len(missing)} committed events never applied, e.g. {sorted(missing)[:3]}"
        extra = set(processed) - set(committed)
        assert not extra, (f"{len(extra)} applied events were never committed"
                           f" ({len(extra & rolled_back)} rolled back), e.g. {sorted(extra)[:3]}")
        assert orders == expected, \
            f"orders per customer differ (an event applied twice or not at all): {orders} vs {expected}"
        assert skipped >= 1, ("no copy was ever skipped: the restart after A's hook should have"
                              " delivered A's last batch again")
        assert "Unknown topic or partition" in a.text()
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.kill()
        emitter.close()
        query(admin, f'DROP DATABASE IF EXISTS "{target}" WITH (FORCE)')
        admin.close()


# --------------------------------------------------------------------------- Markdown tables

def md_tables(text):
    """(header cells, rows of cells, first line number) of every table in text."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-:| ]+\|$", lines[i + 1]):
            header = split_row(lines[i])
            rows, j = [], i + 2
            while j < len(lines) and lines[j].startswith("|"):
                rows.append(split_row(lines[j]))
                j += 1
            out.append((header, rows, i + 1))
            i = j
        else:
            i += 1
    return out


def split_row(line):
    """Cells of a table row; '\\|' inside a cell is a literal bar."""
    cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [c.strip().replace("\\|", "|") for c in cells]


def unquote(cell):
    """`x` -> x; `''` -> ''; — -> ''."""
    c = cell.strip()
    if c in ("—", "-", ""):
        return ""
    c = c.replace("`", "")
    return "" if c == "''" else c


# --------------------------------------------------------------------------- 2. settings

def server_settings(conn):
    rows = query(conn, """SELECT name, vartype, boot_val, coalesce(unit, ''), context, min_val,
                                 max_val, enumvals FROM pg_settings
                           WHERE name LIKE 'outbox.%' ORDER BY name""")
    return {r[0]: dict(type=r[1], default=r[2] or "", unit=r[3], context=r[4], min=r[5], max=r[6],
                       enumvals=r[7]) for r in rows}


def settings_table(path, first_cell, needed):
    """The rows of the table of path whose header starts with first_cell and has the columns
    needed, as {setting: {column: cell}}; problems for a missing table or duplicate rows."""
    for header, rows, line in md_tables(path.read_text()):
        if header and header[0] == first_cell and all(n in header for n in needed):
            out, problems = {}, []
            for r in rows:
                name = unquote(r[0])
                if name in out:
                    problems.append(f"{path.name}:{line}: {name} is listed twice")
                out[name] = dict(zip(header, r))
            return out, problems
    return {}, [f"{path.name}: no table with the columns {[first_cell] + needed}"]


def range_of(s):
    if s["type"] == "enum":
        return ", ".join(s["enumvals"])
    if s["min"] is not None:
        return f"{s['min']} – {s['max']}"
    return ""


def test_configuration_page_matches_pg_settings(conn):
    server = server_settings(conn)
    doc, problems = settings_table(CONFIGURATION, "setting",
                                   ["type", "default", "unit", "context", "range"])
    for name, s in server.items():
        d = doc.get(name)
        if d is None:
            problems.append(f"doc/configuration.md: {name} is missing (the server has it:"
                            f" {s['type']}, default {s['default']!r}, context {s['context']})")
            continue
        want = dict(type=s["type"], default=s["default"], unit=s["unit"], context=s["context"],
                    range=range_of(s))
        for col, value in want.items():
            got = unquote(d[col])
            if col == "range":
                got = ", ".join(x.strip() for x in got.split(",")) if s["type"] == "enum" else got
            if got != value:
                problems.append(f"doc/configuration.md: {name} {col}: documented {got!r},"
                                f" server {value!r}")
    for name in doc:
        if name not in server:
            problems.append(f"doc/configuration.md: {name} is documented but the server has no"
                            " such setting")
    headings = "\n".join(l for l in CONFIGURATION.read_text().splitlines() if l.startswith("#"))
    for name in server:
        if f"`{name}`" not in headings:
            problems.append(f"doc/configuration.md: {name} has no section of its own (a heading)")
    report(f"OUTBOX DOCS DRIFT configuration.md: {len(server)} settings on the server,"
           f" {len(doc)} documented, {len(problems)} problem(s)")
    assert not problems, "doc/configuration.md drifted from pg_settings:\n  " + "\n  ".join(problems)


README_APPLIES = {"postmaster": "restart", "sighup": "reload", "superuser": "reload or superuser SET",
                  "user": "SET by any user"}


def test_readme_settings_table_matches_pg_settings(conn):
    server = server_settings(conn)
    doc, problems = settings_table(README, "setting", ["default", "unit", "applies"])
    for name, s in server.items():
        d = doc.get(name)
        if d is None:
            problems.append(f"README.md: {name} is missing from the settings table")
            continue
        want = dict(default=s["default"], unit=s["unit"], applies=README_APPLIES[s["context"]])
        for col, value in want.items():
            got = unquote(d[col])
            if got != value:
                problems.append(f"README.md: {name} {col}: documented {got!r}, server {value!r}")
    for name in doc:
        if name not in server:
            problems.append(f"README.md: {name} is in the settings table but the server has no"
                            " such setting")
    report(f"OUTBOX DOCS DRIFT README settings: {len(server)} settings, {len(doc)} in the table,"
           f" {len(problems)} problem(s)")
    assert not problems, "README.md's settings table drifted from pg_settings:\n  " + "\n  ".join(problems)


# --------------------------------------------------------------------------- 2. SQL API

EXTENSION_OBJECTS = """
SELECT d.classid::regclass::text, d.objid
  FROM pg_depend d
 WHERE d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e'
   AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'outbox')
"""


def split_top(s):
    """Split at commas outside parentheses."""
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


class Canon:
    """Canonical type names, as the server spells them (timestamptz -> timestamp with time zone)."""

    def __init__(self, conn):
        self.conn = conn
        self.cache = {}

    def type(self, t):
        t = t.strip()
        if t.upper().startswith("SETOF "):
            return "SETOF " + self.type(t[6:])
        if t not in self.cache:
            try:
                self.cache[t] = query(self.conn, "SELECT %s::regtype::text", (t,))[0][0]
            except psycopg2.Error:
                self.cache[t] = f"<no type {t}>"
        return self.cache[t]


def parse_args(text, canon):
    """'a text, b jsonb DEFAULT NULL, OUT c int' -> ([(a, text, None), (b, jsonb, 'null')], [(c, integer)])."""
    ins, outs = [], []
    for item in split_top(text):
        mode = "IN"
        m = re.match(r"^(IN|OUT|INOUT|VARIADIC)\s+(.*)$", item)
        if m:
            mode, item = m.group(1), m.group(2)
        default = None
        m = re.match(r"^(.*?)\s+DEFAULT\s+(.*)$", item, re.IGNORECASE)
        if m:
            item, default = m.group(1), re.sub(r"::[\w .]+$", "", m.group(2)).strip().lower()
        name, _, typ = item.partition(" ")
        entry = (name, canon.type(typ))
        if mode == "OUT":
            outs.append(entry)
        else:
            ins.append(entry + (default,))
    return ins, outs


def render(name, ins, outs, result):
    args = ", ".join(f"{n} {t}" + (f" DEFAULT {d}" if d else "") for n, t, d in ins)
    if outs:
        return f"outbox.{name}({args}) RETURNS TABLE ({', '.join(f'{n} {t}' for n, t in outs)})"
    return f"outbox.{name}({args}) RETURNS {result}"


def server_functions(conn, canon):
    rows = query(conn, f"""SELECT p.proname, pg_get_function_arguments(p.oid), pg_get_function_result(p.oid)
                             FROM ({EXTENSION_OBJECTS}) o JOIN pg_proc p ON p.oid = o.objid
                            WHERE o.classid = 'pg_proc' ORDER BY 1, 2""")
    out = []
    for name, args, result in rows:
        ins, outs = parse_args(args, canon)
        out.append((name, ins, outs, "SETOF record" if outs else canon.type(result)))
    return out


SIGNATURE = re.compile(r"`outbox\.(\w+)\((.*?)\)\s+RETURNS\s+([^`]+)`")


def doc_functions(text, canon):
    out = []
    for line in text.splitlines():
        if not line.startswith("#"):
            continue
        for m in SIGNATURE.finditer(line):
            name, args, result = m.group(1), m.group(2), m.group(3).strip()
            ins, outs = parse_args(args, canon)
            t = re.match(r"^TABLE\s*\((.*)\)$", result, re.IGNORECASE)
            if t:
                outs = [(n, ty) for n, ty, _ in parse_args(t.group(1), canon)[0]]
                result = "SETOF record"
            else:
                result = canon.type(result)
            out.append((name, ins, outs, result))
    return out


def doc_section_columns(text, relname):
    """{column: type} of the tables under the heading that names `outbox.relname`, None if no
    such heading."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(#+)\s", line)
        if m and f"`outbox.{relname}`" in line:
            level = len(m.group(1))
            body = []
            for l2 in lines[i + 1:]:
                m2 = re.match(r"^(#+)\s", l2)
                if m2 and len(m2.group(1)) <= level:
                    break
                body.append(l2)
            cols = {}
            for header, rows, _ in md_tables("\n".join(body)):
                if header[:2] == ["column", "type"]:
                    for r in rows:
                        cols[unquote(r[0])] = unquote(r[1])
            return cols
    return None


def test_sql_api_page_matches_the_catalog(conn):
    canon = Canon(conn)
    text = SQL_API.read_text()
    problems = []
    server = server_functions(conn, canon)
    doc = doc_functions(text, canon)
    key = lambda f: (f[0], tuple(t for _, t, _ in f[1]))       # noqa: E731  name and IN types
    doc_by_key = {}
    for f in doc:
        if key(f) in doc_by_key:
            problems.append(f"doc/sql-api.md: {render(*f)} is documented twice")
        doc_by_key[key(f)] = f
    for f in server:
        d = doc_by_key.pop(key(f), None)
        if d is None:
            problems.append(f"doc/sql-api.md: missing {render(*f)} (no heading with this signature)")
        elif d != f:
            problems.append(f"doc/sql-api.md: documented {render(*d)}, the server has {render(*f)}")
    for d in doc_by_key.values():
        problems.append(f"doc/sql-api.md: documents {render(*d)}, which the server does not have")

    rels = query(conn, f"""SELECT c.relname, c.relkind FROM ({EXTENSION_OBJECTS}) o
                             JOIN pg_class c ON c.oid = o.objid
                            WHERE o.classid = 'pg_class' ORDER BY 1""")
    columns = 0
    for relname, relkind in rels:
        if relkind == "S":
            if f"`outbox.{relname}`" not in text:
                problems.append(f"doc/sql-api.md: sequence outbox.{relname} is never named")
            continue
        doc_cols = doc_section_columns(text, relname)
        kind = {"r": "table", "v": "view"}.get(relkind, relkind)
        if doc_cols is None:
            problems.append(f"doc/sql-api.md: {kind} outbox.{relname} has no section (a heading naming it)")
            continue
        cols = query(conn, """SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute
                               WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped
                               ORDER BY attnum""", (f"outbox.{relname}",))
        for col, typ in cols:
            columns += 1
            if col not in doc_cols:
                problems.append(f"doc/sql-api.md: column {col} ({typ}) of {kind} outbox.{relname}"
                                " is missing from its table")
            elif canon.type(doc_cols[col]) != typ:
                problems.append(f"doc/sql-api.md: column outbox.{relname}.{col}: documented"
                                f" {doc_cols[col]!r}, the server has {typ!r}")
        for col in set(doc_cols) - {c for c, _ in cols}:
            problems.append(f"doc/sql-api.md: documents column outbox.{relname}.{col}, which the"
                            " server does not have")
    report(f"OUTBOX DOCS DRIFT sql-api.md: {len(server)} functions, {len(rels)} relations,"
           f" {columns} columns checked, {len(problems)} problem(s)")
    assert not problems, "doc/sql-api.md drifted from the catalog:\n  " + "\n  ".join(problems)


if __name__ == "__main__":
    sys.exit("run with pytest (test/run.sh integration)")
