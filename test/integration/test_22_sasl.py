r"""
SASL to Kafka: the relay publishes through a SASL_PLAINTEXT listener (mechanism PLAIN) with the
credentials in outbox.kafka_properties.

The integration runner starts Kafka without SASL, so this test restarts the broker itself with
test/env/kafka.sh and OUTBOX_KAFKA_SASL_PORT = <kafka port> + 5 (users admin/admin-secret and
outbox/outbox-secret), unless that listener is already there.  The PLAINTEXT port stays as it was
(the tests' consumers keep using it), and the broker is left running with both listeners.

- right password: events are delivered (read through the PLAINTEXT port), exactly once, with the
  documented key/headers/payload; the relay's only Kafka connection is to the SASL port.
- wrong password (reload): outbox.status says broker_down with an authentication error, the log
  gets a bounded number of relay lines while events keep being committed, the same worker keeps
  running (no exit), the events stay pending, no password appears in the log or the status;
  the right password again (reload): every held event is delivered once, in order per key.
- a password with a ';' and a backslash (user semi), written with the escapes \; and \\: it
  reaches the broker intact (events delivered through the SASL port), set by ALTER SYSTEM and
  in postgresql.conf (whose own escapes double the backslashes once more); written without the
  escape it is refused; no part of it shows in SHOW, pg_settings, outbox.status or the log.
"""
import time
from pathlib import Path

import psycopg2
import pytest
from confluent_kafka.admin import AdminClient

from conftest import (create_topics, event_rows, message_problems, new_aggregate_type,
                      order_problems, pg_connect, query, query_one, relay_status, report,
                      unique_messages, wait_relay_ready, wait_until)
from helpers_security import (Log, emit_many, entries, lines_of_pid, pending_count, port_open,
                              reload, run_kafka_sh, set_system, status, tcp_remote_ports,
                              wait_counts, wait_shown, wait_state, whole_log, worker_exits)

SASL_PORT_OFFSET = 5
GOOD_PASSWORD = "outbox-secret"
WRONG_PASSWORD = "wr0ng-Pa55w0rd"
PROPS = "security.protocol=SASL_PLAINTEXT;sasl.mechanisms=PLAIN;sasl.username=outbox;sasl.password={}"
# user semi of test/env/kafka.sh, and its password's parts that must never show
SEMI_PASSWORD = "Semi7;Colon7\\Back7"
SEMI_PARTS = ("Semi7", "Colon7", "Back7")
SEMI_PROPS = "security.protocol=SASL_PLAINTEXT;sasl.mechanisms=PLAIN;sasl.username=semi;sasl.password={}"
SEMI_SHOWN = ("security.protocol=SASL_PLAINTEXT;sasl.mechanisms=PLAIN;sasl.username=********;"
              "sasl.password=********")
WRONG_OBSERVE_S = 10           # time the relay runs with the wrong password
WRONG_EMIT_EVERY_S = 0.5       # events committed meanwhile (each one wakes the relay)
MAX_WRONG_ENTRIES = 4          # relay log entries (with DETAIL/HINT) in that time


def _sasl_client_works(port: int, password: str, user: str = "outbox") -> bool:
    a = AdminClient({"bootstrap.servers": f"127.0.0.1:{port}", "security.protocol": "SASL_PLAINTEXT",
                     "sasl.mechanisms": "PLAIN", "sasl.username": user, "sasl.password": password,
                     "log_level": 0})
    try:
        md = a.list_topics(timeout=5)
        return bool(md.brokers)
    except Exception:  # noqa: BLE001  (authentication refused: no metadata)
        return False


def ensure_sasl_listener(env, sport: int):
    """Restart the broker with the SASL listener unless it already has it; returns the seconds
    the restart took (None: not needed)."""
    props = Path(env.kafka_dir) / "server.properties"
    if port_open(sport) and props.exists() and \
            f"SASL_PLAINTEXT://127.0.0.1:{sport}" in props.read_text() and \
            "user_semi=" in props.read_text():
        return None
    t0 = time.monotonic()
    run_kafka_sh(env, "restart", extra_env={"OUTBOX_KAFKA_SASL_PORT": str(sport)})
    took = time.monotonic() - t0
    assert port_open(env.kafka_port) and port_open(sport), "the broker does not listen on both ports"
    return took


def test_relay_publishes_through_sasl(env, prefix, reader_factory):
    sport = env.kafka_port + SASL_PORT_OFFSET
    figures = {}
    problems = []               # product faults that do not stop the test
    figures["broker_restart_s"] = ensure_sasl_listener(env, sport)
    wait_relay_ready(env, 90)              # it was connected to the PLAINTEXT port
    # the listener enforces the passwords (so that the wrong-password case below can fail)
    assert _sasl_client_works(sport, GOOD_PASSWORD), "the SASL listener refuses outbox/outbox-secret"
    assert not _sasl_client_works(sport, WRONG_PASSWORD), "the SASL listener accepts a wrong password"

    agg = new_aggregate_type("sasl")
    topic = prefix + agg
    create_topics(env, [topic])
    reader = reader_factory([topic])       # through the PLAINTEXT port
    conn = pg_connect(env)
    keys = ["s1", "s2", "s3"]
    sasl_servers = f"127.0.0.1:{sport}"
    try:
        pid = status(conn)["pid"]

        # 1. the right password: delivered through the SASL listener
        log = Log(env)
        set_system(conn, {"outbox.bootstrap_servers": sasl_servers,
                          "outbox.kafka_properties": PROPS.format(GOOD_PASSWORD)})
        wait_shown(env, "outbox.bootstrap_servers", sasl_servers)
        wait_until(lambda: "Kafka settings changed" in log.text(), 20, "the relay to apply the settings")
        t0 = time.monotonic()
        ok = emit_many(conn, agg, keys, 3, tag="sasl_ok")
        counts = wait_counts(reader, {e: 1 for e, _, _ in ok}, timeout=60, extra=1)
        figures["first_delivery_s"] = time.monotonic() - t0
        wrong = {e: counts.get(e, 0) for e, _, _ in ok if counts.get(e, 0) != 1}
        assert not wrong, f"with SASL, events arrived this many times (expected 1): {wrong}"
        wait_until(lambda: pending_count(conn, agg) == 0, 30, "the events marked published")
        st = status(conn)
        assert st["pid"] == pid and st["state"] in ("idle", "publishing"), st
        ports = tcp_remote_ports(pid)
        # the test runs as root or as the cluster's owner (test/env/pg.sh), so the relay's sockets
        # are always readable: a check skipped here would be one that passes silently
        assert ports is not None, f"cannot read the sockets of the relay (pid {pid}) in /proc"
        assert sport in ports and env.kafka_port not in ports, \
            f"the relay's Kafka connections go to ports {sorted(ports)}, expected {sport} only"
        figures["ports"] = f"connected to {sport}, not to {env.kafka_port}"

        # 2. a wrong password: broker_down with an authentication error, bounded log, same worker,
        #    nothing lost while events keep coming
        log2 = Log(env)
        set_system(conn, {"outbox.kafka_properties": PROPS.format(WRONG_PASSWORD)})
        # the reload is asynchronous: an event committed before the relay applied it may still
        # go out with the old producer
        wait_until(lambda: "Kafka settings changed" in log2.text(), 20,
                   "the relay to apply the wrong password")
        t_wrong = time.monotonic()
        held = []
        i = 0
        while time.monotonic() - t_wrong < WRONG_OBSERVE_S:
            held += emit_many(conn, agg, [keys[i % len(keys)]], 1, tag=f"held{i}")
            i += 1
            time.sleep(WRONG_EMIT_EVERY_S)
        st = wait_state(conn, "broker_down", 30, "state broker_down with the wrong password")
        assert st["pid"] == pid, f"the relay worker was replaced: {st}"
        if "authentication" not in (st["last_error"] or "").lower():
            problems.append(f"outbox.status does not name the authentication failure: state"
                            f" {st['state']!r}, last_error {st['last_error']!r}")
        assert pending_count(conn, agg) == len(held), "events were published with the wrong password"
        reader.poll(0.5)
        got = {m.event_id for m in reader.snapshot()}
        assert not got & {e for e, _, _ in held}, "events arrived in Kafka with the wrong password"
        lines2 = log2.lines()
        relay_entries = entries(lines_of_pid(lines2, pid))
        assert not worker_exits(lines2), worker_exits(lines2)
        if not any("authentication" in e.lower() for e in relay_entries):
            problems.append("the relay's log lines do not name the authentication failure:\n    "
                            + "\n    ".join(relay_entries))
        assert len(relay_entries) <= MAX_WRONG_ENTRIES, \
            (f"{len(relay_entries)} relay log entries in {WRONG_OBSERVE_S}s with the wrong password"
             f" (at most {MAX_WRONG_ENTRIES}):\n" + "\n".join(relay_entries))
        leaked = [ln for ln in lines2 if GOOD_PASSWORD in ln or WRONG_PASSWORD in ln]
        assert not leaked, "a password is in the server log:\n" + "\n".join(leaked)
        assert GOOD_PASSWORD not in repr(st) and WRONG_PASSWORD not in repr(st), st
        figures["wrong"] = (len(relay_entries), st["last_error"], len(held))

        # 3. the right password again: everything held is delivered, once, in order per key
        log3 = Log(env)
        set_system(conn, {"outbox.kafka_properties": PROPS.format(GOOD_PASSWORD)})
        t_fix = time.monotonic()
        want = {e: 1 for e, _, _ in ok + held}
        counts = wait_counts(reader, want, timeout=90, extra=1)
        figures["recover_s"] = time.monotonic() - t_fix
        bad = {e: counts.get(e, 0) for e in want if counts.get(e, 0) != 1}
        assert not bad, f"{len(bad)} events not delivered exactly once after the fix: {list(bad.items())[:5]}"
        wait_until(lambda: pending_count(conn, agg) == 0, 30, "the held events marked published")
        st = wait_state(conn, ("idle", "publishing"), 30)
        assert st["pid"] == pid, f"the relay worker was replaced: {st}"
        assert not worker_exits(log3.lines())
        rows = event_rows(conn, agg)
        msgs = [m for m in unique_messages(reader.snapshot()) if m.event_id in rows]
        probs = []
        for m in msgs:
            r = rows[m.event_id]
            probs += message_problems(m, event_id=m.event_id, aggregate_type=agg,
                                      aggregate_id=r["aggregate_id"], event_type=r["event_type"],
                                      payload=r["payload"], headers=None, topic=topic,
                                      created_ms=r["created_ms"])
        probs += order_problems(msgs, {e: (r["aggregate_id"], r["id"]) for e, r in rows.items()})
        assert not probs, "\n".join(probs[:10])
    finally:
        set_system(conn, {"outbox.bootstrap_servers": None, "outbox.kafka_properties": None})
        wait_shown(env, "outbox.bootstrap_servers", env.bootstrap)
        conn.close()
        wait_relay_ready(env, 60)
    n_entries, last_error, n_held = figures["wrong"]
    restart = figures["broker_restart_s"]
    report(f"OUTBOX SASL: broker {'restarted with' if restart else 'already had'} SASL_PLAINTEXT on"
           f" {sport}{f' ({restart:.1f}s)' if restart else ''}; PLAIN outbox/outbox-secret: 9 events"
           f" delivered once in {figures['first_delivery_s']:.1f}s ({figures['ports']}); wrong password"
           f" for {WRONG_OBSERVE_S}s with {n_held} commits: broker_down, {n_entries} relay log entries,"
           f" same worker, 0 published, last_error {last_error!r}; right password again: all delivered"
           f" once, in order, in {figures['recover_s']:.1f}s")
    assert not problems, "\n  ".join(["with a wrong SASL password:"] + problems)


def kafka_escaped(value: str) -> str:
    """value as written in outbox.kafka_properties: a backslash as \\\\, ';' as \\;."""
    return value.replace("\\", "\\\\").replace(";", "\\;")


def test_password_with_semicolon_and_backslash(env, prefix, reader_factory):
    """A password with a ';' and a backslash reaches librdkafka intact and never shows (a user's
    try: 'ab;cd', '"ab;cd"' and 'ab\\;cd' were all refused, and 'ab;;cd=1' silently made the
    password 'ab' and a property 'cd')."""
    sport = env.kafka_port + SASL_PORT_OFFSET
    ensure_sasl_listener(env, sport)
    wait_relay_ready(env, 90)
    assert _sasl_client_works(sport, SEMI_PASSWORD, "semi"), "the SASL listener refuses user semi"
    assert not _sasl_client_works(sport, SEMI_PASSWORD.split(";")[0], "semi"), \
        "the SASL listener accepts the password cut at its ';'"

    agg = new_aggregate_type("semi")
    topic = prefix + agg
    create_topics(env, [topic])
    reader = reader_factory([topic])
    conn = pg_connect(env)
    conf = Path(env.pg_dir) / "data" / "postgresql.conf"
    original_conf = conf.read_text()
    sasl_servers = f"127.0.0.1:{sport}"
    escaped = kafka_escaped(SEMI_PASSWORD)
    leaks = []

    def look(where, lines):
        """No part of the password in SHOW, pg_settings, outbox.status or the given log lines."""
        seen = {"SHOW": query_one(conn, "SHOW outbox.kafka_properties")[0],
                "pg_settings": repr(query(conn, "SELECT * FROM pg_settings"
                                                " WHERE name = 'outbox.kafka_properties'")),
                "outbox.status": repr(relay_status(conn))}
        seen.update({f"log: {ln}": ln for ln in lines})
        leaks.extend(f"{where}: {k}" for k, text in seen.items()
                     if any(p in text for p in SEMI_PARTS))
        return seen["SHOW"]

    def delivered_through_sasl(tag):
        ok = emit_many(conn, agg, ["k1", "k2"], 2, tag=tag)
        counts = wait_counts(reader, {e: 1 for e, _, _ in ok}, timeout=60, extra=0.5)
        missing = [e for e, _, _ in ok if counts.get(e, 0) < 1]
        assert not missing, f"{tag}: {len(missing)} of {len(ok)} events not delivered through SASL"
        wait_until(lambda: pending_count(conn, agg) == 0, 30, f"{tag}: the events marked published")
        ports = tcp_remote_ports(status(conn)["pid"])
        assert ports is None or (sport in ports and env.kafka_port not in ports), ports

    try:
        # written without the escape: refused, and the message quotes no part of it
        for bad in (SEMI_PROPS.format(SEMI_PASSWORD),
                    SEMI_PROPS.format(SEMI_PASSWORD.replace(";", ";;") + "=1")):
            with pytest.raises(psycopg2.errors.InvalidParameterValue) as e:
                query(conn, "ALTER SYSTEM SET outbox.kafka_properties = %s", (bad,))
            msg = str(e.value) + (e.value.diag.message_detail or "")
            assert "\\;" in msg, msg
            assert not any(p in msg for p in SEMI_PARTS), msg

        # 1. ALTER SYSTEM, with \; and \\
        log = Log(env)
        set_system(conn, {"outbox.bootstrap_servers": sasl_servers,
                          "outbox.kafka_properties": SEMI_PROPS.format(escaped)})
        wait_shown(env, "outbox.bootstrap_servers", sasl_servers)
        wait_until(lambda: "Kafka settings changed" in log.text(), 20, "the relay to apply the settings")
        delivered_through_sasl("alter_system")
        shown = look("ALTER SYSTEM", log.lines())
        assert shown == SEMI_SHOWN, shown

        # back to PLAINTEXT, so that the file's value is a change the relay applies
        log = Log(env)
        set_system(conn, {"outbox.bootstrap_servers": None, "outbox.kafka_properties": None})
        wait_shown(env, "outbox.bootstrap_servers", env.bootstrap)
        wait_until(lambda: "Kafka settings changed" in log.text(), 20, "the relay to go back to PLAINTEXT")

        # 2. postgresql.conf: its own escapes halve the backslashes once more
        log = Log(env)
        in_file = SEMI_PROPS.format(escaped).replace("\\", "\\\\")
        conf.write_text(original_conf + f"\noutbox.bootstrap_servers = '{sasl_servers}'"
                                        f"\noutbox.kafka_properties = '{in_file}'\n")
        reload(conn)
        wait_shown(env, "outbox.bootstrap_servers", sasl_servers)
        wait_until(lambda: "Kafka settings changed" in log.text(), 20, "the relay to apply the file")
        delivered_through_sasl("postgresql.conf")
        shown = look("postgresql.conf", log.lines())
        assert shown == SEMI_SHOWN, shown
    finally:
        conf.write_text(original_conf)
        set_system(conn, {"outbox.bootstrap_servers": None, "outbox.kafka_properties": None})
        wait_shown(env, "outbox.bootstrap_servers", env.bootstrap)
        conn.close()
        wait_relay_ready(env, 60)
    text = whole_log(env)
    leaks += [f"server log: {ln}" for ln in text.splitlines() if any(p in ln for p in SEMI_PARTS)]
    assert not leaks, "a part of the password showed:\n  " + "\n  ".join(leaks[:20])
    report("OUTBOX SASL password with ';' and a backslash (user semi): written with \\; and \\\\,"
           " delivered through the SASL port, set by ALTER SYSTEM and in postgresql.conf; unescaped"
           " it is refused (22023, the message names the escape); no part of it in SHOW,"
           " pg_settings, outbox.status or the server log")
