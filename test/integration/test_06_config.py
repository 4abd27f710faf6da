"""
outbox.* settings applied with pg_reload_conf() (SIGHUP), against the running relay:
bad librdkafka properties are a clear log line and a status, never a crash loop; an empty
bootstrap list idles the relay; a changed bootstrap list is picked up without a restart;
retention deletes published rows.
"""
import collections
import os
import signal
import time
from pathlib import Path

import psycopg2
import pytest

from conftest import (LogWatcher, create_topics, emit_round_robin, new_aggregate_type, pg_connect,
                      pg_sh, query, query_one, relay_status, report, server_major, set_conf,
                      unique_messages, wait_relay_ready, wait_until)
from helpers_security import wait_counts


# Observations of "nothing happens" span OBSERVE_POLLS passes of the relay, with outbox.poll_interval
# set to OBSERVE_POLL_MS for them (at the default, 1 s, they took 3 s each)
OBSERVE_POLL_MS = 100
OBSERVE_POLLS = 10


def state(conn):
    return relay_status(conn)[0]["state"]


def pending(conn, agg_type):
    return query_one(conn, "SELECT count(*) FROM outbox.events"
                           " WHERE aggregate_type = %s AND NOT outbox.published(events)", (agg_type,))[0]


def deliver_all(reader, emitted, timeout=60):
    msgs = unique_messages(reader.read_until(len(emitted), timeout=timeout, extra=1))
    got = collections.Counter(m.event_id for m in msgs)
    want = {e for e, _, _ in emitted}
    assert set(got) == want, f"missing {len(want - set(got))}, unexpected {len(set(got) - want)}"


def test_invalid_kafka_property_is_logged_once_and_fixed_by_reload(env, conn, prefix, reader_factory):
    agg_type = new_aggregate_type("badprop")
    topic = prefix + agg_type
    create_topics(env, [topic])
    reader = reader_factory([topic])
    pid = relay_status(conn)[0]["pid"]
    watcher = LogWatcher(env)
    try:
        # well-formed, so the reload accepts it; librdkafka refuses the value.  A short poll
        # interval makes the relay try again every OBSERVE_POLL_MS: the observation below spans
        # OBSERVE_POLLS of its passes
        set_conf(conn, kafka_properties="linger.ms=not-a-number", poll_interval=OBSERVE_POLL_MS)
        wait_until(lambda: state(conn) == "config_error", 20, "state config_error")
        emitted = emit_round_robin(conn, agg_type, 3, 3, "bad")
        conn.autocommit = True
        time.sleep(OBSERVE_POLLS * OBSERVE_POLL_MS / 1000)   # passes: still one log line, same worker
        assert pending(conn, agg_type) == len(emitted), "events were published with a refused config"
        st = relay_status(conn)[0]
        assert st["pid"] == pid, "the relay worker restarted (crash loop?)"
        assert 'invalid value for librdkafka property "linger.ms"' in (st["last_error"] or ""), st
        lines = [ln for ln in watcher.new_lines() if "cannot create its Kafka producer" in ln]
        assert len(lines) == 1, lines
        assert 'invalid value for librdkafka property "linger.ms"' in lines[0]

        # an unknown property is named too
        set_conf(conn, kafka_properties="no.such.property=1")
        wait_until(lambda: "unknown librdkafka property \"no.such.property\""
                   in (relay_status(conn)[0]["last_error"] or ""), 20, "the unknown-property error")
    finally:
        set_conf(conn, kafka_properties=None, poll_interval=None)
    wait_until(lambda: state(conn) in ("idle", "publishing"), 20, "the relay to recover")
    deliver_all(reader, emitted)
    assert relay_status(conn)[0]["pid"] == pid


def test_malformed_or_reserved_kafka_properties_are_refused(env, conn):
    # ALTER SYSTEM checks the value at once; the message never quotes it (it may hold a secret)
    for value, detail in (("sasl.password", "item 1 is not of the form key=value"),
                          ("acks=1", 'property "acks" is set by the relay itself'),
                          # per-aggregate order needs the Java client's key -> partition mapping
                          ("partitioner=random", 'property "partitioner" is set by the relay itself'),
                          ("topic.partitioner=random",
                           'property "topic.partitioner" is set by the relay itself'),
                          ("TOPIC.ACKS=0", 'property "TOPIC.ACKS" is set by the relay itself'),
                          # the relay is no transactional producer: it would flap between states
                          ("transactional.id=x", 'property "transactional.id" is set by the relay itself'),
                          # a ';' inside a value is written \; (a user's try: 'ab;;cd=1' silently
                          # made the password 'ab' and a property 'cd')
                          ("sasl.password=ab;cd",
                           "item 2 is not of the form key=value (write a ';' inside a value as \\;)"),
                          ("linger.ms=5;;client.id=x",
                           "item 2 is empty (write a ';' inside a value as \\;)"),
                          ("sasl.password=ab;;cd=1", "item 2 is empty"),
                          (";linger.ms=5", "item 1 is empty")):
        with pytest.raises(psycopg2.errors.InvalidParameterValue) as e:
            query(conn, f"ALTER SYSTEM SET outbox.kafka_properties = '{value}'")
        assert detail in str(e.value), str(e.value)
        if "=" not in value:
            assert value not in str(e.value).replace("outbox.kafka_properties", ""), str(e.value)

    # the same values written into postgresql.conf: the reload logs them and keeps the old value
    conf = Path(env.pg_dir) / "data" / "postgresql.conf"
    original = conf.read_text()
    watcher = LogWatcher(env)
    try:
        for value, detail in (("sasl.password", "item 1 is not of the form key=value"),
                              ("acks=1", 'property "acks" is set by the relay itself')):
            conf.write_text(original + f"\noutbox.kafka_properties = '{value}'\n")
            query(conn, "SELECT pg_reload_conf()")
            wait_until(lambda: detail in "\n".join(watcher.new_lines()), 10,
                       f"the reload to refuse {value!r}")
            assert query_one(conn, "SHOW outbox.kafka_properties")[0] == ""
            assert state(conn) in ("idle", "publishing")
    finally:
        conf.write_text(original)
        query(conn, "SELECT pg_reload_conf()")


def test_kafka_properties_escapes(env, conn, prefix, reader_factory):
    r"""In outbox.kafka_properties \; is a ';' and \\ a backslash inside a key or value; any other
    backslash stays as written; blanks around keys and values go; one ';' at the end is allowed.
    SHOW gives the properties back escaped, so that the value read back means the same, secrets
    masked; the relay runs with them and delivers."""
    agg = new_aggregate_type("escapes")
    topic = prefix + agg
    create_topics(env, [topic])
    reader = reader_factory([topic])
    watcher = LogWatcher(env)
    cases = (
        (r"client.id=a\;b\\c\d;linger.ms=5;", r"client.id=a\;b\c\d;linger.ms=5"),
        (r" sasl.password = p\;w\\ ;client.id = x\\ ", r"sasl.password=********;client.id=x\\"),
        (r"client.id=C:\certs\;x", r"client.id=C:\certs\;x"),
    )
    def shows(value):
        return query_one(conn, "SHOW outbox.kafka_properties")[0] == value
    try:
        for i, (value, shown) in enumerate(cases):
            set_conf(conn, kafka_properties=value)
            wait_until(lambda: shows(shown), 20, f"SHOW {shown!r} after {value!r}")
            # what SHOW gives, set again, is the same properties
            if "********" not in shown:
                set_conf(conn, kafka_properties=shown)
                wait_until(lambda: shows(shown), 20, f"SHOW {shown!r} after setting it")
            wait_until(lambda: "Kafka settings changed" in "\n".join(watcher.new_lines()), 20,
                       f"the relay to apply {value!r}")
            watcher = LogWatcher(env)
            emitted = [e for e, _, _ in emit_round_robin(conn, agg, 2, 2, f"esc{i}")]
            counts = wait_counts(reader, {e: 1 for e in emitted}, timeout=60, extra=0)
            assert all(counts.get(e) for e in emitted), f"not delivered with {value!r}"
            assert state(conn) in ("idle", "publishing"), relay_status(conn)
    finally:
        set_conf(conn, kafka_properties=None)
    wait_until(lambda: state(conn) in ("idle", "publishing"), 20, "the relay after the reset")


def test_refused_kafka_properties_at_server_start_stop_the_relay(env, prefix, reader_factory):
    """PostgreSQL only warns about an invalid value in postgresql.conf at start and uses the
    default: a relay that went on would connect without the TLS/SASL settings it was given
    (a trial saw 'idle' and a healthy monitoring query).  It must say config_error and publish
    nothing until a reload brings a valid value."""
    agg_type = new_aggregate_type("badstart")
    topic = prefix + agg_type
    create_topics(env, [topic])
    reader = reader_factory([topic])
    conf = Path(env.pg_dir) / "data" / "postgresql.conf"
    original = conf.read_text()
    conn = None
    try:
        conf.write_text(original + "\noutbox.kafka_properties = 'linger.ms=5;sasl.password=S3cret;oops'\n"
                        f"outbox.poll_interval = {OBSERVE_POLL_MS}\n")
        watcher = LogWatcher(env)
        pg_sh(env, "restart")
        conn = wait_until(lambda: pg_connect(env), 30, "a connection after the restart")
        st = wait_until(lambda: (lambda r: r[0] if r and r[0]["state"] == "config_error" else None)(
            relay_status(conn)), 30, "state config_error after a start with a refused value")
        assert "refused when the server started" in st["last_error"], st
        assert "item 3 is not of the form key=value" in st["last_error"], st
        emitted = emit_round_robin(conn, agg_type, 2, 3, "badstart")
        conn.autocommit = True
        time.sleep(OBSERVE_POLLS * OBSERVE_POLL_MS / 1000)   # passes: nothing sent
        assert pending(conn, agg_type) == len(emitted), "published without the configured properties"
        log = "\n".join(watcher.new_lines())
        assert "S3cret" not in log
        conf.write_text(original)
        query(conn, "SELECT pg_reload_conf()")
        deliver_all(reader, emitted)
        assert "outbox relay accepted the Kafka settings" in "\n".join(watcher.new_lines())
    finally:
        conf.write_text(original)
        if conn is not None:
            query(conn, "SELECT pg_reload_conf()")
            conn.close()
        wait_relay_ready(env)


def test_allowed_topics_with_an_empty_item_is_refused(env, conn):
    # "," would otherwise allow every topic, like the empty string; "a, ,b" is a typo
    for value in (",", " , ,, ", "orders.*, ,billing", "orders,", "   "):
        with pytest.raises(psycopg2.errors.InvalidParameterValue) as e:
            query(conn, "ALTER SYSTEM SET outbox.allowed_topics = %s", (value,))
        assert "empty item" in str(e.value), (value, str(e.value))
    try:
        query(conn, "ALTER SYSTEM SET outbox.allowed_topics = %s", (" orders.* , billing ",))
    finally:
        query(conn, "ALTER SYSTEM RESET outbox.allowed_topics")
    assert query_one(conn, "SHOW outbox.allowed_topics")[0] == ""


def test_bootstrap_servers_with_an_empty_item_or_a_bad_port_is_refused(env, conn):
    # ",,," would leave the relay with no broker while it looks configured
    shown = query_one(conn, "SHOW outbox.bootstrap_servers")[0]
    for value in (",,,", "127.0.0.1:1,", "a:1,, b:2", " "):
        with pytest.raises(psycopg2.errors.InvalidParameterValue) as e:
            query(conn, "ALTER SYSTEM SET outbox.bootstrap_servers = %s", (value,))
        assert "empty item" in str(e.value), str(e.value)
    # librdkafka reads "kafka:notaport" as port 0 and only fails to connect
    for value in ("kafka:notaport", "a:1,b:0", "h:70000", "h:", "SASL_SSL://h:x9093"):
        with pytest.raises(psycopg2.errors.InvalidParameterValue) as e:
            query(conn, "ALTER SYSTEM SET outbox.bootstrap_servers = %s", (value,))
        assert "no valid port" in str(e.value), (value, str(e.value))
    try:
        for value in ("h", "PLAINTEXT://h:9092", "[::1]:9092, b:65535", "[::1]"):
            query(conn, "ALTER SYSTEM SET outbox.bootstrap_servers = %s", (value,))
    finally:
        query(conn, "ALTER SYSTEM RESET outbox.bootstrap_servers")
    assert query_one(conn, "SHOW outbox.bootstrap_servers")[0] == shown


def test_empty_bootstrap_servers_idles_then_reload_resumes(env, conn, prefix, reader_factory):
    agg_type = new_aggregate_type("nobootstrap")
    topic = prefix + agg_type
    create_topics(env, [topic])
    reader = reader_factory([topic])
    watcher = LogWatcher(env)
    try:
        set_conf(conn, bootstrap_servers="", poll_interval=OBSERVE_POLL_MS)
        wait_until(lambda: state(conn) == "not_configured", 20, "state not_configured")
        emitted = emit_round_robin(conn, agg_type, 2, 5, "idle")
        conn.autocommit = True
        time.sleep(OBSERVE_POLLS * OBSERVE_POLL_MS / 1000)   # passes: nothing sent, one log line
        assert pending(conn, agg_type) == len(emitted)
        idle_lines = [ln for ln in watcher.new_lines() if "outbox.bootstrap_servers is empty" in ln]
        assert len(idle_lines) == 1, idle_lines
    finally:
        set_conf(conn, bootstrap_servers=None, poll_interval=None)
    deliver_all(reader, emitted)


def test_bootstrap_servers_change_applies_without_restart(env, conn, prefix, reader_factory):
    agg_type = new_aggregate_type("rebootstrap")
    topic = prefix + agg_type
    create_topics(env, [topic])
    reader = reader_factory([topic])
    pid = relay_status(conn)[0]["pid"]
    watcher = LogWatcher(env)
    try:
        set_conf(conn, bootstrap_servers="127.0.0.1:1")      # nothing listens there
        # pg_reload_conf() only signals: wait until the relay has dropped its producer, or the
        # first events may still go out through the old one (CI once saw 9 of 10 pending)
        wait_until(lambda: any("Kafka settings changed, reconnecting" in l
                               for l in watcher.new_lines()), 20, "the relay to apply the reload")
        emitted = emit_round_robin(conn, agg_type, 2, 5, "moved")
        conn.autocommit = True
        wait_until(lambda: state(conn) == "broker_down", 30, "state broker_down")
        assert pending(conn, agg_type) == len(emitted)
    finally:
        set_conf(conn, bootstrap_servers=None)
    deliver_all(reader, emitted)
    assert relay_status(conn)[0]["pid"] == pid, "a reload must not restart the worker"
    log = "\n".join(watcher.new_lines())
    assert log.count("Kafka settings changed, reconnecting") >= 2, log[-3000:]


@pytest.mark.full_only
def test_last_error_follows_a_new_bootstrap_servers(env, conn):
    """While Kafka is unreachable and nothing is pending, a new outbox.bootstrap_servers that is
    unreachable too must show its own error in outbox.status: a user's try saw last_error name the
    old host long after the change (the state stayed broker_down, so nothing updated it)."""
    watcher = LogWatcher(env)
    try:
        set_conf(conn, bootstrap_servers="127.0.0.1:1")      # nothing listens there
        wait_until(lambda: state(conn) == "broker_down" and
                   "127.0.0.1:1" in (relay_status(conn)[0]["last_error"] or ""), 30,
                   "broker_down with an error naming 127.0.0.1:1")
        set_conf(conn, bootstrap_servers="127.0.0.1:2")
        wait_until(lambda: any("Kafka settings changed, reconnecting" in l
                               for l in watcher.new_lines()), 20, "the relay to apply the reload")
        st = wait_until(lambda: (lambda s: s if "127.0.0.1:2" in (s["last_error"] or "") else None)(
            relay_status(conn)[0]), 30, "last_error to name the new bootstrap server 127.0.0.1:2")
        assert st["state"] == "broker_down", st
        report(f"OUTBOX CONFIG last_error after a new bootstrap_servers: {st['last_error']!r}")
        # from broker_down to config_error: Kafka was not reached (a fresh user saw the relay log
        # "reached Kafka again" right after it refused an unknown property)
        set_conf(conn, kafka_properties="no.such.property=1")
        wait_until(lambda: state(conn) == "config_error", 30, "config_error for an unknown property")
        reached = [ln for ln in watcher.new_lines() if "reached Kafka again" in ln]
        assert not reached, reached
    finally:
        set_conf(conn, bootstrap_servers=None, kafka_properties=None)
    wait_until(lambda: state(conn) in ("idle", "publishing"), 60, "the relay back on the real broker")


def test_retention_deletes_published_events(env, conn, prefix, reader_factory):
    agg_type = new_aggregate_type("retention")
    topic = prefix + agg_type
    create_topics(env, [topic])
    reader = reader_factory([topic])
    try:
        set_conf(conn, retention="2s")
        emitted = emit_round_robin(conn, agg_type, 2, 10, "ret")
        conn.autocommit = True
        deliver_all(reader, emitted)
        wait_until(lambda: query_one(conn, "SELECT count(*) FROM outbox.events"
                                           " WHERE aggregate_type = %s", (agg_type,))[0] == 0,
                   20, "published events to be deleted after outbox.retention")

        # retention 0: deleted as soon as Kafka acknowledged them
        set_conf(conn, retention="0")
        more = emit_round_robin(conn, agg_type, 2, 10, "ret0")
        conn.autocommit = True
        deliver_all(reader, emitted + more)
        wait_until(lambda: query_one(conn, "SELECT count(*) FROM outbox.events"
                                           " WHERE aggregate_type = %s", (agg_type,))[0] == 0,
                   10, "events to be deleted on acknowledgement")
    finally:
        set_conf(conn, retention=None)


def test_first_event_to_an_auto_created_topic_is_no_failed_attempt(env, conn):
    # the broker creates the topic when the relay first asks for it; that first answer says
    # "unknown topic", which must not count as an attempt (with max_attempts = 1 it would
    # make the event a dead letter)
    agg_type = new_aggregate_type("autocreate")
    topic = "it.autocreate." + agg_type
    try:
        set_conf(conn, max_attempts=1)
        time.sleep(1)
        event_id = query_one(conn, "SELECT outbox.emit(%s, 'a1', 'created', '{}', NULL, %s)",
                             (agg_type, topic))[0]
        row = wait_until(lambda: (lambda r: r if r[0] or r[2] is not None else None)(
            query_one(conn, "SELECT outbox.published(events), attempts, failed_at, last_error FROM outbox.events"
                            " WHERE event_id = %s", (event_id,))), 30, "the event to be published")
        assert row[0] and row[1] == 0 and row[2] is None, \
            f"first event to a new topic: published {row[0]}, attempts {row[1]}, failed_at {row[2]}, {row[3]!r}"
    finally:
        set_conf(conn, max_attempts=None)
        query(conn, "DELETE FROM outbox.events WHERE aggregate_type = %s AND NOT outbox.published(events)",
              (agg_type,))


def test_transaction_timeout_does_not_end_the_relay(env, prefix, reader_factory):
    """A batch's transaction stays open while Kafka acknowledges it.  PostgreSQL 17's
    transaction_timeout, set for the server (or a database or role), ended the relay with FATAL
    in a loop whenever Kafka was slow (a trial: every 16 s during an outage).  The relay turns
    it off for itself; here it is 1 s while the broker is frozen for 4 s mid-batch."""
    conn = pg_connect(env)
    major = server_major(conn)
    if major < 17:
        conn.close()
        pytest.skip("transaction_timeout exists from PostgreSQL 17 on")
    agg_type = new_aggregate_type("txtimeout")
    topic = prefix + agg_type
    create_topics(env, [topic])
    reader = reader_factory([topic])
    broker = None
    watcher = LogWatcher(env)
    try:
        query(conn, "ALTER SYSTEM SET transaction_timeout = '1s'")
        query(conn, f"ALTER DATABASE \"{env.pg_database}\" SET transaction_timeout = '1s'")
        query(conn, "SELECT pg_reload_conf()")
        pg_sh(env, "restart")           # the relay connects again, under the database's setting
        conn = wait_until(lambda: pg_connect(env), 30, "a connection after the restart")
        pid = wait_relay_ready(env)["pid"]
        with open(Path(env.kafka_dir) / "broker.pid") as f:
            broker = int(f.read().strip())
        os.kill(broker, signal.SIGSTOP)
        emitted = emit_round_robin(conn, agg_type, 3, 5, "txt")
        conn.autocommit = True
        time.sleep(4)
        os.kill(broker, signal.SIGCONT)
        broker = None
        deliver_all(reader, emitted)
        st = relay_status(conn)[0]
        lines = watcher.new_lines()
        timeouts = [ln for ln in lines if "transaction timeout" in ln]
        assert not timeouts, "\n".join(timeouts)
        assert st["pid"] == pid, (pid, st)
    finally:
        if broker is not None:
            os.kill(broker, signal.SIGCONT)
        c = wait_until(lambda: pg_connect(env), 30, "a connection")
        query(c, "ALTER SYSTEM RESET transaction_timeout")
        query(c, f"ALTER DATABASE \"{env.pg_database}\" RESET transaction_timeout")
        query(c, "SELECT pg_reload_conf()")
        c.close()
        conn.close()
        wait_relay_ready(env)


def test_refused_kafka_properties_on_the_command_line_stop_the_relay(env, prefix, reader_factory):
    """Like a refused value in postgresql.conf, one given on the command line (-c, as some
    service managers pass settings) must not make the relay connect without it (a trial saw
    events published over plaintext).  No reload brings the command line back: the relay
    waits in config_error until a valid value is loaded."""
    agg_type = new_aggregate_type("badargv")
    topic = prefix + agg_type
    create_topics(env, [topic])
    reader = reader_factory([topic])
    conn = None
    try:
        pg_sh(env, "stop")
        pg_sh(env, "ctl", "start", "-w", "-l", str(Path(env.pg_dir) / "server.log"),
              "-o", f"-c outbox.kafka_properties='security.protocol=ssl;oops' -c outbox.poll_interval={OBSERVE_POLL_MS}")
        conn = wait_until(lambda: pg_connect(env), 30, "a connection after the start")
        st = wait_until(lambda: (lambda r: r[0] if r and r[0]["state"] == "config_error" else None)(
            relay_status(conn)), 30, "state config_error after a start with a refused -c value")
        assert "refused when the server started" in st["last_error"], st
        emitted = emit_round_robin(conn, agg_type, 2, 3, "badargv")
        conn.autocommit = True
        query(conn, "SELECT pg_reload_conf()")      # a reload refuses nothing: still refused
        time.sleep(OBSERVE_POLLS * OBSERVE_POLL_MS / 1000)   # passes: still refused, nothing sent
        assert relay_status(conn)[0]["state"] == "config_error", relay_status(conn)
        assert pending(conn, agg_type) == len(emitted), "published without the given properties"
        set_conf(conn, kafka_properties="linger.ms=3")
        deliver_all(reader, emitted)
    finally:
        c = conn or wait_until(lambda: pg_connect(env), 30, "a connection")
        set_conf(c, kafka_properties=None)
        c.close()
        # pg_ctl restart would reuse the -c option: stop, then start plainly
        pg_sh(env, "stop")
        pg_sh(env, "start")
        wait_relay_ready(env)
