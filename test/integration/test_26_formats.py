"""
The consumers' formats, checked with Java clients nobody here wrote (test/java/ClientCheck.java,
run with the jars of test/java/pom.xml):

(a) kafka-clients' KafkaConsumer reads 10,000 events over 1,000 aggregates on a 7-partition topic:
    every record sits on the partition Java's producer computes for its key
    (Utils.toPositive(Utils.murmur2(key)) % 7), carries the documented headers (id, event_type,
    aggregate_type, then the event's own), has created_at as its CreateTime timestamp and the
    payload as its value, in commit order per aggregate.
(b) outbox.message_format = 'cloudevents': the CloudEvents SDK's CloudEventDeserializer parses
    every event as a CloudEvent with the right id, type, source, subject, time and data, takes the
    per-event overrides (ce_source, ce_type, an extension), and outbox.ce_source on reload.
(c) emit_bytes(): values arrive byte for byte, 0x00 bytes, invalid UTF-8 and a 1 MB value
    included; NULL is a tombstone.
(d) Trace context: sqlcommenter comments and SET LOCAL outbox.traceparent give the expected
    traceparent/tracestate headers at the consumer; a malformed comment changes nothing.
"""
import base64
import datetime
import json
import random
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from conftest import (REPO, TopicReader, create_topics, new_aggregate_type, pg_connect, pg_sh,
                      query, query_one, relay_status, report, wait_relay_ready, wait_until)
from helpers_lifecycle import set_system

CLIENTS_SH = REPO / "test" / "java" / "clients.sh"
PARTITIONS = 7
TP1 = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
TP2 = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
# the Confluent wire format: magic byte 0, schema id 7 (4 bytes, big-endian), then Avro data
CONFLUENT_BYTES = bytes([0, 0, 0, 0, 7, 2, 10, 0, 255, 0])
BIG_VALUE_BYTES = 1_048_000      # as test_14: the limit is 1048588 for the whole record batch


def java_read(env, topic: str, count: int, mode: str, timeout: int = 120):
    """The records of topic as ClientCheck prints them (one dict per record)."""
    p = subprocess.run(["bash", str(CLIENTS_SH), "run", env.bootstrap, topic, str(count), mode,
                        str(timeout)], capture_output=True, text=True, timeout=timeout + 120)
    assert p.returncode == 0, f"ClientCheck failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def b64(s):
    return None if s is None else base64.b64decode(s)


def new_topic(env, tag: str) -> str:
    """A new topic of PARTITIONS partitions, it.<tag>.<random>."""
    name = f"it.{tag}.{uuid.uuid4().hex[:10]}"
    create_topics(env, [name], partitions=PARTITIONS)
    return name


def wait_published(conn, agg_type: str, n: int, timeout: float = 120):
    def done():
        return query_one(conn, "SELECT count(*) FROM outbox.events e WHERE aggregate_type = %s"
                               " AND outbox.published(e)", (agg_type,))[0] >= n
    wait_until(done, timeout, f"{n} events of {agg_type} published")


def rows_by_id(conn, agg_type: str):
    return {str(r[0]): r for r in query(conn, """
        SELECT event_id, aggregate_id, event_type, payload, headers, created_at,
               floor(extract(epoch FROM created_at) * 1000)::bigint, payload_bytes
          FROM outbox.events WHERE aggregate_type = %s ORDER BY id""", (agg_type,))}


def set_format(env, conn, probe_topic: str, *, fmt: str, ce_source=None, expect_source=None):
    """Set outbox.message_format (and outbox.ce_source) and wait until the relay produces with
    them: a probe event per try, until one arrives in that shape (a reload reaches the relay
    between its batches, some time after pg_reload_conf() returned)."""
    set_system(conn, "outbox.message_format", None if fmt == "debezium" else fmt)
    set_system(conn, "outbox.ce_source", ce_source)
    probe_type = new_aggregate_type("fmtprobe")
    reader = TopicReader(env, [probe_topic])
    mine = set()            # this call's probes: the topic holds earlier ones, of other formats
    try:
        reader.wait_assigned(partitions=PARTITIONS)
        deadline = time.monotonic() + 60
        while True:
            mine.add(str(query_one(conn, "SELECT outbox.emit(%s, 'probe', 'probe', '{}', NULL, %s)",
                                   (probe_type, probe_topic))[0]))
            end = time.monotonic() + 1
            while time.monotonic() < end:
                if reader.poll(0.2) and any((m.header_dict.get("id") or m.header_dict.get("ce_id")) in mine
                                            for m in reader.snapshot()):
                    break
            for m in reader.snapshot():
                h = m.header_dict
                if (h.get("id") or h.get("ce_id")) not in mine:
                    continue
                if fmt == "cloudevents" and h.get("ce_specversion") == "1.0" and \
                        (expect_source is None or h.get("ce_source") == expect_source):
                    return
                if fmt == "debezium" and "id" in h and "ce_id" not in h:
                    return
            assert time.monotonic() < deadline, f"the relay did not switch to {fmt} within 60 s"
    finally:
        reader.close()


def test_java_consumer_partitions_headers_timestamps(env, conn):
    agg_type = new_aggregate_type("java")
    topic = new_topic(env, "java")
    # keys with non-ASCII characters too: murmur2 is over the key's UTF-8 bytes
    for part in range(10):
        query(conn, """
            SELECT outbox.emit(%s, CASE WHEN g %% 10 = 0 THEN 'Kunde-ü€-' ELSE 'acct-' END || (g %% 1000),
                               'account.changed', jsonb_build_object('seq', g / 1000, 'note', 'ü€'),
                               CASE WHEN g %% 3 = 0 THEN jsonb_build_object('tenant', 't' || g %% 7) END,
                               %s)
              FROM generate_series(%s, %s) g""", (agg_type, topic, part * 1000, part * 1000 + 999))
    wait_published(conn, agg_type, 10000)
    rows = rows_by_id(conn, agg_type)

    t0 = time.monotonic()
    recs = java_read(env, topic, 10000, "records")
    took = time.monotonic() - t0
    problems = []
    seqs = {}
    for r in recs:
        headers = [(k, b64(v).decode()) for k, v in r["headers"]]
        h = dict(headers)
        row = rows.get(h.get("id"))
        if row is None:
            problems.append(f"offset {r['partition']}/{r['offset']}: unknown id header {h.get('id')}")
            continue
        _, agg_id, event_type, payload, user_headers, _, created_ms, _ = row
        key = b64(r["key"]).decode()
        if r["partition"] != r["java_partition"]:
            problems.append(f"{key}: partition {r['partition']}, Java's partitioner says {r['java_partition']}")
        want = [("id", h["id"]), ("event_type", event_type), ("aggregate_type", agg_type)]
        want += sorted((user_headers or {}).items())
        if headers != want:
            problems.append(f"{key}: headers {headers}, expected {want}")
        if key != agg_id:
            problems.append(f"{h['id']}: key {key!r}, aggregate id {agg_id!r}")
        if r["timestamp_type"] != "CreateTime" or r["timestamp"] != created_ms:
            problems.append(f"{key}: timestamp {r['timestamp_type']} {r['timestamp']}, created_at {created_ms}")
        if json.loads(b64(r["value"])) != payload:
            problems.append(f"{key}: value {b64(r['value'])!r}, payload {payload}")
        last = seqs.get(key, -1)
        if payload["seq"] <= last:
            problems.append(f"{key}: seq {payload['seq']} after {last}")
        seqs[key] = payload["seq"]
    ids = {dict((k, b64(v).decode()) for k, v in r["headers"]).get("id") for r in recs}
    assert len(recs) == 10000 and ids == set(rows), \
        f"{len(recs)} records, {len(ids & set(rows))} of {len(rows)} events"
    assert not problems, f"{len(problems)} problems:\n  " + "\n  ".join(problems[:20])
    partitions = sorted({r["partition"] for r in recs})
    report(f"OUTBOX JAVA CLIENT (kafka-clients 4.4.0): 10000 events over 1000 aggregates, "
           f"7 partitions {partitions}: 0 partition mismatches with Utils.murmur2, headers, "
           f"CreateTime timestamps and values as written, per-aggregate order kept; read in {took:.1f}s")


def test_cloudevents_sdk_parses_every_event(env, conn):
    agg_type = new_aggregate_type("ce")
    topic = new_topic(env, "ce")
    probe_topic = new_topic(env, "ceprobe")
    sysid, db = query_one(conn, "SELECT system_identifier, current_database() FROM pg_control_system()")
    source = f"/postgresql/{sysid}/{db}"
    try:
        set_format(env, conn, probe_topic, fmt="cloudevents")
        query(conn, """
            SELECT outbox.emit(%s, 'order-' || (g %% 50), 'order.updated',
                               jsonb_build_object('seq', g, 'text', 'ü€ "quoted"'), NULL, %s)
              FROM generate_series(1, 300) g""", (agg_type, topic))
        with conn.cursor() as cur:
            cur.execute("SELECT outbox.emit(%s, 'special', 'order.moved', '{\"to\": 1}', %s, %s)",
                        (agg_type, json.dumps({"ce_source": "urn:shop:legacy", "ce_type": "com.example.moved",
                                               "ce_tenant": "acme", "tenant": "acme"}), topic))
            cur.execute("SELECT outbox.emit(%s, 'special2', 'order.moved', '{\"to\": 2}', %s, %s)",
                        (agg_type, json.dumps({"ce_source": "/relative/path?q=1#frag", "ce_subject": "order/2",
                                               "ce_time": "2026-12-03T04:05:06.123456+01:00"}), topic))
            cur.execute("SELECT outbox.emit(%s, 'gone', 'order.deleted', NULL, NULL, %s)", (agg_type, topic))
            cur.execute("SELECT outbox.emit_bytes(%s, 'avro', 'order.avro', %s, NULL, %s)",
                        (agg_type, CONFLUENT_BYTES, topic))
        wait_published(conn, agg_type, 304)
        # outbox.ce_source on reload
        set_format(env, conn, probe_topic, fmt="cloudevents", ce_source="https://shop.example/orders",
                   expect_source="https://shop.example/orders")
        query(conn, "SELECT outbox.emit(%s, 'order-1', 'order.updated', '{\"seq\": 301}', NULL, %s)",
              (agg_type, topic))
        wait_published(conn, agg_type, 305)
        rows = rows_by_id(conn, agg_type)
        recs = java_read(env, topic, 305, "cloudevents")
    finally:
        set_format(env, conn, probe_topic, fmt="debezium")

    problems = [f"offset {r['offset']}: {r['error']}" for r in recs if "error" in r]
    parsed = [r for r in recs if "error" not in r]
    for r in parsed:
        row = rows.get(r["id"])
        if row is None:
            problems.append(f"unknown ce id {r['id']}")
            continue
        _, agg_id, event_type, payload, headers, created_at, _, payload_bytes = row
        headers = headers or {}
        want_source = headers.get("ce_source") or \
            ("https://shop.example/orders" if payload == {"seq": 301} else source)
        want = {"specversion": "1.0", "type": headers.get("ce_type", event_type),
                "source": want_source, "subject": headers.get("ce_subject", agg_id),
                "datacontenttype": "application/octet-stream" if payload_bytes is not None
                else None if payload is None else "application/json",
                "extensions": "tenant" if "ce_tenant" in headers else ""}
        got = {k: r[k] for k in want}
        if got != want:
            problems.append(f"{r['id']}: {got}, expected {want}")
        t = datetime.datetime.fromisoformat(r["time"].replace("Z", "+00:00"))
        if "ce_time" in headers:
            created_at = datetime.datetime.fromisoformat(headers["ce_time"])
        if t != created_at:
            problems.append(f"{r['id']}: time {r['time']}, created_at {created_at.isoformat()}")
        data = b64(r["data"])
        if payload_bytes is not None:
            if data != bytes(payload_bytes):
                problems.append(f"{r['id']}: data {data!r}, bytes {bytes(payload_bytes)!r}")
        elif (None if data is None else json.loads(data)) != payload:
            problems.append(f"{r['id']}: data {data!r}, payload {payload}")
        if b64(r["key"]).decode() != agg_id:
            problems.append(f"{r['id']}: key {b64(r['key'])!r}")
    assert {r["id"] for r in parsed} == set(rows) and len(recs) == 305, \
        f"{len(recs)} records, {len(parsed)} parsed, {len(rows)} events"
    assert not problems, f"{len(problems)} problems:\n  " + "\n  ".join(problems[:20])
    report(f"OUTBOX CLOUDEVENTS (cloudevents-kafka 4.0.1 CloudEventDeserializer): 305 of 305 events "
           f"parsed as CloudEvents 1.0 with id, type, source ({source} by default, per-event "
           f"ce_source (absolute and relative), ce_subject, ce_time overrides, and outbox.ce_source "
           f"after a reload), subject, time (µs), data; 1 tombstone "
           f"without data; 1 extension (ce_tenant); 1 emit_bytes() event as application/octet-stream")


def new_relay(conn):
    """End the relay worker and wait for the one the launcher starts instead (it connects anew,
    with the database's settings)."""
    old = relay_status(conn)[0]["pid"]
    query(conn, "SELECT pg_terminate_backend(%s)", (old,))
    wait_until(lambda: (lambda r: r and r[0]["pid"] not in (None, old) and
                        r[0]["state"] in ("idle", "publishing"))(relay_status(conn)),
               60, "a new relay worker")


def test_ce_source_per_database(env, conn):
    """outbox.ce_source set with ALTER DATABASE reaches the relay when it next connects."""
    probe_topic = new_topic(env, "ceprobe")
    db = env.pg_database
    try:
        query(conn, f'ALTER DATABASE "{db}" SET outbox.ce_source = %s', ("urn:shop:orders-db",))
        new_relay(conn)
        t0 = time.monotonic()
        set_format(env, conn, probe_topic, fmt="cloudevents", expect_source="urn:shop:orders-db")
        took = time.monotonic() - t0
    finally:
        query(conn, f'ALTER DATABASE "{db}" RESET outbox.ce_source')
        new_relay(conn)
        set_format(env, conn, probe_topic, fmt="debezium")
    report(f"OUTBOX CLOUDEVENTS per database: ALTER DATABASE ... SET outbox.ce_source applied by the "
           f"next relay worker ({took:.1f}s to the first probe with that source)")


def test_trace_context_reaches_the_consumer(env, conn):
    agg_type = new_aggregate_type("trace")
    topic = new_topic(env, "trace")
    table = f"traced_{uuid.uuid4().hex[:8]}"
    expected = {}
    sql = "SELECT outbox.emit(%s, %s, 'x', '{}', NULL, %s)"
    c2 = pg_connect(env, autocommit=False)
    try:
        with conn.cursor() as cur:
            # an instrumented application: sqlcommenter comments, the tracestate URL-encoded
            cur.execute(sql + f" /*controller='orders',traceparent='{TP1}',tracestate='congo%%3Dt61rcWkgMzE'*/",
                        (agg_type, "comment", topic))
            expected["comment"] = {"traceparent": TP1, "tracestate": "congo=t61rcWkgMzE"}
            cur.execute(sql + " /*traceparent='00-not-a-trace-01'*/", (agg_type, "bad comment", topic))
            expected["bad comment"] = {}
            cur.execute(sql, (agg_type, "no comment", topic))
            expected["no comment"] = {}
            # capture() of a commented INSERT
            cur.execute(f"CREATE TABLE {table} (id text PRIMARY KEY)")
            cur.execute(f"CREATE TRIGGER t AFTER INSERT ON {table} FOR EACH ROW "
                        f"EXECUTE FUNCTION outbox.capture(%s, 'id', %s)", (agg_type, topic))
        query(conn, f"INSERT INTO {table} VALUES ('captured-1'), ('captured-2') /*traceparent='{TP2}'*/")
        expected["captured-1"] = expected["captured-2"] = {"traceparent": TP2}
        # a middleware's SET LOCAL, which wins over the comment
        with c2.cursor() as cur:
            cur.execute("SET LOCAL outbox.traceparent = %s", (TP2,))
            cur.execute("SET LOCAL outbox.tracestate = 'vendor=v1'")
            cur.execute(sql + f" /*traceparent='{TP1}'*/", (agg_type, "set local", topic))
        c2.commit()
        expected["set local"] = {"traceparent": TP2, "tracestate": "vendor=v1"}
        with c2.cursor() as cur:
            cur.execute(sql, (agg_type, "after commit", topic))
        c2.commit()
        expected["after commit"] = {}
    finally:
        c2.close()
        query(conn, f"DROP TABLE IF EXISTS {table}")

    wait_published(conn, agg_type, len(expected))
    recs = java_read(env, topic, len(expected), "records")
    got = {}
    for r in recs:
        h = {k: b64(v).decode() for k, v in r["headers"]}
        got[b64(r["key"]).decode()] = {k: v for k, v in h.items() if k in ("traceparent", "tracestate")}
    assert got == expected
    report(f"OUTBOX TRACE CONTEXT: {len(expected)} events read by kafka-clients: sqlcommenter comment "
           f"(with URL-encoded tracestate), capture() of a commented INSERT, SET LOCAL over a comment; "
           f"a malformed comment and no context give no trace headers")


def test_bytes_arrive_unchanged(env, conn):
    agg_type = new_aggregate_type("bytes")
    topic = new_topic(env, "bytes")
    rng = random.Random(26)
    big = bytes(rng.getrandbits(8) for _ in range(BIG_VALUE_BYTES - 256)) + bytes(range(256))
    values = {"confluent": CONFLUENT_BYTES, "every byte": bytes(range(256)), "zeros": bytes(1000),
              "not utf-8": b"\xff\xfe\xc3\x28", "empty": b"", "tombstone": None, "1 MB": big}
    with conn.cursor() as cur:
        for agg_id, value in values.items():
            cur.execute("SELECT outbox.emit_bytes(%s, %s, 'blob.put', %s, %s, %s)",
                        (agg_type, agg_id, value, json.dumps({"schema": "7"}), topic))
    wait_published(conn, agg_type, len(values))
    recs = java_read(env, topic, len(values), "records")
    got = {b64(r["key"]).decode(): b64(r["value"]) for r in recs}
    assert set(got) == set(values), f"got {sorted(got)}"
    wrong = [k for k, v in values.items() if got[k] != v]
    assert not wrong, f"values changed on the way: {wrong}"
    headers = {b64(r["key"]).decode(): [k for k, _ in r["headers"]] for r in recs}
    assert all(h == ["id", "event_type", "aggregate_type", "schema"] for h in headers.values()), headers
    report(f"OUTBOX BYTES: {len(values)} emit_bytes() values read by kafka-clients byte for byte "
           f"(Confluent wire format, 0x00..0xff, 1000 zeros, invalid UTF-8, empty, a "
           f"{BIG_VALUE_BYTES}-byte value; NULL arrived as a tombstone)")


def test_bytes_dead_letter_hold_and_replay(env, conn):
    """emit_bytes() events take emit()'s paths: a value Kafka refuses (too large) records its
    failure and holds back the later events of its aggregate; replay() sends the bytes again."""
    agg_type = new_aggregate_type("bytesfail")
    topic = new_topic(env, "bytesfail")
    with conn.cursor() as cur:
        ids = {}
        for agg_id, value in (("ok", CONFLUENT_BYTES), ("big", bytes(1_100_000)), ("big", b"\x00after")):
            cur.execute("SELECT outbox.emit_bytes(%s, %s, 'blob.put', %s, NULL, %s)::text",
                        (agg_type, agg_id, value, topic))
            ids.setdefault(agg_id, []).append(cur.fetchone()[0])
    poison, held = ids["big"]
    # replay right away, long before outbox.retention (60 s) deletes the published event
    wait_until(lambda: query_one(conn, "SELECT outbox.published(e) FROM outbox.events e WHERE event_id = %s",
                                 (ids["ok"][0],))[0], 30, "the first event to be published")
    first_id = query_one(conn, "SELECT id FROM outbox.events WHERE event_id = %s", (ids["ok"][0],))[0]
    assert query_one(conn, "SELECT outbox.replay(%s, %s)", (first_id, first_id))[0] == 1
    try:
        wait_until(lambda: query_one(conn, "SELECT attempts > 0 FROM outbox.events WHERE event_id = %s",
                                     (poison,))[0], 30, "the failed delivery to be recorded")
        err, held_published = query_one(conn, """
            SELECT (SELECT last_error FROM outbox.events WHERE event_id = %s),
                   (SELECT outbox.published(e) FROM outbox.events e WHERE event_id = %s)""", (poison, held))
        assert err and "MSG_SIZE_TOO_LARGE" in err, err
        assert not held_published, "an event overtook the failed one of its aggregate"
    finally:
        query(conn, "DELETE FROM outbox.events WHERE event_id = %s", (poison,))
    wait_published(conn, agg_type, 2)
    recs = java_read(env, topic, 3, "records")
    got = [(b64(r["key"]).decode(), b64(r["value"])) for r in recs]
    assert sorted(got) == sorted([("ok", CONFLUENT_BYTES), ("ok", CONFLUENT_BYTES), ("big", b"\x00after")]), got
    report("OUTBOX BYTES dead letter: a 1,100,000-byte emit_bytes() value refused (MSG_SIZE_TOO_LARGE "
           "recorded), the next event of its aggregate held until it was removed; replay() sent the "
           "bytes of another event again unchanged")


@pytest.mark.parametrize("setting,value", [("outbox.message_format", "avro"),
                                           ("outbox.ce_source", '"quoted"')])
def test_refused_format_setting_at_server_start_stops_the_relay(env, setting, value):
    """PostgreSQL only warns about an invalid value in postgresql.conf at start and uses the
    default: consumers would get Debezium messages, or another source, than they were built for
    (found by a fresh user's try-out).  The relay says config_error and publishes nothing until a
    reload brings a valid value."""
    agg_type = new_aggregate_type("badfmt")
    topic = new_topic(env, "badfmt")
    conf = Path(env.pg_dir) / "data" / "postgresql.conf"
    original = conf.read_text()
    conn = None
    try:
        conf.write_text(original + f"\n{setting} = '{value}'\n")
        pg_sh(env, "restart")
        conn = wait_until(lambda: pg_connect(env), 30, "a connection after the restart")
        st = wait_until(lambda: (lambda r: r[0] if r and r[0]["state"] == "config_error" else None)(
            relay_status(conn)), 30, "state config_error after a start with a refused value")
        assert f"{setting} in the configuration file was refused when the server started" in st["last_error"], st
        query(conn, "SELECT outbox.emit(%s, 'a', 'e', '{}', NULL, %s)", (agg_type, topic))
        time.sleep(3)
        assert not query_one(conn, "SELECT outbox.published(e) FROM outbox.events e WHERE aggregate_type = %s",
                             (agg_type,))[0], "published with the default instead of the configured value"
        conf.write_text(original)
        query(conn, "SELECT pg_reload_conf()")
        wait_published(conn, agg_type, 1, timeout=60)
    finally:
        conf.write_text(original)
        if conn is not None:
            query(conn, "SELECT pg_reload_conf()")
            conn.close()
        wait_relay_ready(env)
    report(f"OUTBOX CONFIG REFUSED AT START: {setting} = {value!r} in postgresql.conf: the relay said "
           f"config_error and published nothing until the file was fixed and reloaded")
