"""
Extreme and awkward data through outbox.emit() and the relay to the real broker: a payload just
under Kafka's 1 MiB limit, 4-byte UTF-8 (emoji, CJK extension B) in the key, the headers, the
event/aggregate type and the payload, a 1 KB aggregate id, an empty header object, a NULL payload
(tombstone), JSON null and other scalar payloads.  Each message is checked byte for byte: key,
header names/values in order, value (= PostgreSQL's jsonb text of the row), partition (the Java
client's murmur2 choice) and timestamp.  The text \\u0000 (jsonb refuses the escape itself, 22P05,
before emit() runs) arrives as it was sent, never as a NUL byte.
"""
import collections
import json
import time

import pytest

from conftest import (LogWatcher, create_topics, emit, java_partition, message_problems,
                      new_aggregate_type, query, query_one, relay_status, report, unique_messages,
                      wait_until)

# 4-byte UTF-8: U+1F600 (emoji), U+2000B (CJK extension B), U+1D11E (musical symbol)
EMOJI, CJK_B, CLEF = "\U0001F600", "\U0002000B", "\U0001D11E"
UTF8_ID = f"客户-{EMOJI}-{CJK_B}-漢字"
BIG_VALUE_BYTES = 1_048_000          # value size; the limit is 1048588 for the whole record batch


def big_payload():
    """A payload whose jsonb text is exactly BIG_VALUE_BYTES bytes, with multi-byte characters
    and escapes so that byte-exactness means something."""
    head = {"kind": "big", "text": f"ä\"\\\t{EMOJI}{CJK_B}", "n": 1.50}
    base = len(json.dumps({**head, "blob": ""}, ensure_ascii=False, separators=(", ", ": ")).encode())
    return {**head, "blob": "z" * (BIG_VALUE_BYTES - base)}


CASES = [
    # name, aggregate_id, event_type, payload (python; None = SQL NULL), headers, sql payload override
    ("big_1mb", "big-1", "it.big", big_payload(), None, None),
    ("utf8", UTF8_ID, f"it.utf8.{EMOJI}", {"emoji": EMOJI, "cjk": f"{CJK_B}漢字", "clef": CLEF,
                                            f"key-{EMOJI}": [EMOJI, {"x": CJK_B}]},
     {"trace": f"{EMOJI}{EMOJI}", f"名前-{CJK_B}": f"値-{CLEF}", "plain": "ascii"}, None),
    ("long_id", "k" * 1000 + EMOJI * 6, "it.long", {"n": 1}, {"h": "v"}, None),   # 1024 bytes
    ("empty_headers", "eh-1", "it.empty", {"n": 2}, {}, None),
    ("null_headers", "eh-2", "it.nullh", {"n": 3}, None, None),
    ("tombstone", "ts-1", "it.tombstone", None, None, None),
    ("json_null", "jn-1", "it.jsonnull", None, None, "null"),
    ("json_string", "js-1", "it.scalar", None, None, json.dumps(f"text {EMOJI}", ensure_ascii=False)),
    ("json_number", "jn-2", "it.scalar", None, None, "12.50"),
    ("json_array", "ja-1", "it.scalar", None, None, '[true, false, null, "\\u00e9"]'),
]


def emit_raw(cur, agg_type, agg_id, event_type, payload_sql, headers):
    cur.execute("SELECT outbox.emit(%s, %s, %s, %s::jsonb, %s::jsonb)",
                (agg_type, agg_id, event_type, payload_sql,
                 None if headers is None else json.dumps(headers, ensure_ascii=False)))
    return str(cur.fetchone()[0])


def wait_acknowledged(conn, event_ids, timeout):
    """Wait until the relay recorded Kafka's acknowledgement of every event; False on timeout."""
    try:
        wait_until(lambda: query_one(conn, """SELECT count(*) FROM outbox.events
                                               WHERE event_id = ANY(%s::uuid[])
                                                 AND outbox.published(events)""",
                                     (event_ids,))[0] == len(event_ids),
                   timeout, "Kafka's acknowledgement of every event")
        return True
    except AssertionError:
        return False


def read_event_ids(reader, event_ids, timeout):
    """Poll until every event id arrived (or timeout), then 2 s more for duplicates; the
    distinct messages (by partition and offset)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and \
            not event_ids <= {m.event_id for m in reader.snapshot()}:
        reader.poll(0.2)
    return unique_messages(reader.read_until(0, timeout=0, extra=2))


def missing_report(conn, reader, log, ids, missing, msgs):
    """Everything that tells whether a missing message was never acknowledged by Kafka (the row
    says so, with its attempts and last error) or was acknowledged and not read back (then the
    consumer's errors and the partition offsets matter)."""
    rows = query(conn, """SELECT event_id::text, id, outbox.published(events), attempts, last_error,
                                 octet_length(payload::text)
                            FROM outbox.events WHERE event_id = ANY(%s::uuid[])""",
                 ([ids[n] for n in missing],))
    relay_lines = [ln for ln in log.new_lines() if "outbox" in ln][-15:]
    return (f"missing {missing}, got {len(msgs)} messages "
            f"(partition/offset seen: {sorted((m.partition, m.offset) for m in msgs)}); "
            f"rows (event_id, id, published, attempts, last_error, payload bytes): {rows}; "
            f"consumer errors: {reader.errors[:5]}; relay status: {relay_status(conn)}; "
            f"server log: {relay_lines}")


def test_extreme_data_arrives_byte_exact(env, conn, prefix, reader_factory):
    agg_type = new_aggregate_type("baddata")
    topic = prefix + agg_type
    create_topics(env, [topic])
    reader = reader_factory([topic])
    assert len(("k" * 1000 + EMOJI * 6).encode()) == 1024

    log = LogWatcher(env)
    ids = {}
    conn.autocommit = False
    with conn.cursor() as cur:
        for name, agg_id, event_type, payload, headers, raw in CASES:
            if raw is not None:
                ids[name] = emit_raw(cur, agg_type, agg_id, event_type, raw, headers)
            else:
                ids[name] = emit(cur, agg_type, agg_id, event_type, payload, headers)
        # an aggregate_type with 4-byte UTF-8 needs an explicit (ASCII) topic
        utf8_type = f"{agg_type}-{EMOJI}{CJK_B}"
        ids["utf8_type"] = emit(cur, utf8_type, "ut-1", "it.type", {"n": 4}, topic=topic)
    conn.commit()
    conn.autocommit = True

    # Kafka's acknowledgements first (the rows say so), then the consumer: a failure below then
    # tells a relay that did not deliver from a consumer that did not read back.
    acked = wait_acknowledged(conn, list(ids.values()), timeout=60)
    msgs = read_event_ids(reader, set(ids.values()), timeout=30)
    missing = sorted(name for name, eid in ids.items() if eid not in {m.event_id for m in msgs})
    if missing and acked:
        # Kafka acknowledged every event, yet this consumer did not return some (seen once in CI
        # for the 1 MB message): read the topic again from the start with a fresh consumer.  The
        # messages must be in the topic; the second reading decides.
        report(f"OUTBOX BAD DATA: the first consumer did not return {missing} within 30 s after"
               f" Kafka acknowledged them (consumer errors {reader.errors[:3]}); reading again")
        reader = reader_factory([topic])
        msgs = read_event_ids(reader, set(ids.values()), timeout=30)
        missing = sorted(name for name, eid in ids.items() if eid not in {m.event_id for m in msgs})
    assert not missing, missing_report(conn, reader, log, ids, missing, msgs)
    by_id = collections.defaultdict(list)
    for m in msgs:
        by_id[m.event_id].append(m)
    dups = {k: len(by_id[v]) for k, v in ids.items() if len(by_id[v]) != 1}
    assert not dups, f"duplicates: {dups}"

    # what PostgreSQL stored: the relay must send exactly this text
    with conn.cursor() as cur:
        cur.execute("""SELECT event_id::text, aggregate_type, aggregate_id, event_type,
                              convert_to(payload::text, 'UTF8'), headers,
                              floor(extract(epoch FROM created_at) * 1000)::bigint,
                              outbox.published(events)
                         FROM outbox.events WHERE event_id = ANY(%s::uuid[])""", (list(ids.values()),))
        stored = {r[0]: r[1:] for r in cur.fetchall()}
    problems = []
    sizes = {}
    spec = {c[0]: c for c in CASES}
    for name, eid in ids.items():
        m = by_id[eid][0]
        a_type, agg_id, event_type, value, headers, created_ms, published = stored[eid]
        value = None if value is None else bytes(value)
        if not published:
            problems.append(f"{name}: row not marked published")
        found = message_problems(
            m, event_id=eid, aggregate_type=a_type, aggregate_id=agg_id, event_type=event_type,
            payload=None if value is None else json.loads(value), headers=headers, topic=topic,
            created_ms=created_ms)
        if value == b"null":        # JSON null: message_problems would want a tombstone
            found = [p for p in found if "expected a tombstone" not in p]
        problems += [f"{name}: {p}" for p in found]
        if m.value != value:
            problems.append(f"{name}: value bytes differ ({len(m.value or b'')} received,"
                            f" {len(value or b'')} stored)")
        # bytes on the wire, not only decoded strings
        want_headers = [("id", eid.encode()), ("event_type", event_type.encode()),
                        ("aggregate_type", a_type.encode())] + \
            [(k, v.encode()) for k, v in (headers or {}).items()]
        got_headers = [(k, bytes(v)) for k, v in m.headers]
        if sorted(got_headers[3:]) != sorted(want_headers[3:]) or got_headers[:3] != want_headers[:3]:
            problems.append(f"{name}: headers {got_headers!r}, expected {want_headers!r}")
        if m.partition != java_partition(agg_id):
            problems.append(f"{name}: partition {m.partition}, murmur2 says {java_partition(agg_id)}")
        sizes[name] = len(m.value) if m.value is not None else None
        if name in spec and spec[name][5] is None and spec[name][3] is not None:
            if json.loads(m.value) != spec[name][3]:
                problems.append(f"{name}: payload differs from what the test emitted")
    assert not problems, "\n".join(problems)

    # the specific expectations, spelled out
    assert by_id[ids["tombstone"]][0].value is None
    assert by_id[ids["json_null"]][0].value == b"null"
    assert by_id[ids["json_number"]][0].value == b"12.50"
    assert by_id[ids["json_array"]][0].value == '[true, false, null, "é"]'.encode()
    assert by_id[ids["json_string"]][0].value == json.dumps(f"text {EMOJI}", ensure_ascii=False).encode()
    for name in ("empty_headers", "null_headers", "tombstone"):
        assert [h[0] for h in by_id[ids[name]][0].headers] == ["id", "event_type", "aggregate_type"], name
    assert sizes["big_1mb"] == BIG_VALUE_BYTES
    u = by_id[ids["utf8"]][0]
    assert u.key == UTF8_ID and len(UTF8_ID.encode()) > len(UTF8_ID)
    assert dict(u.headers)["trace"] == (EMOJI * 2).encode()
    assert by_id[ids["long_id"]][0].key.encode() == ("k" * 1000 + EMOJI * 6).encode()
    assert by_id[ids["utf8_type"]][0].header_dict["aggregate_type"] == utf8_type
    report(f"OUTBOX BAD DATA: {len(ids)} events byte-exact (key, headers, value, partition, timestamp):"
           f" {sizes['big_1mb']}-byte payload, 4-byte UTF-8 in key/headers/types/payload, 1024-byte key"
           f" (partition {by_id[ids['long_id']][0].partition}), '{{}}' and NULL headers -> 3 headers,"
           f" NULL payload -> tombstone, JSON null -> b'null', scalars and arrays as jsonb text")


@pytest.mark.parametrize("where", ["payload", "nested payload key", "header value"])
def test_escaped_nul_text_arrives_unchanged(env, conn, prefix, reader_factory, where):
    """A NUL cannot reach outbox.emit(): jsonb refuses \\u0000 (22P05) and libpq a NUL byte,
    before emit() runs, so there is nothing of ours to test there.  What does reach it is the
    text \\u0000 (an escaped backslash): the relay must send it as it is, the value byte for byte
    jsonb's text of the payload, a header value as the header's text, and never a NUL byte."""
    agg_type = new_aggregate_type("nul")
    topic = prefix + agg_type
    create_topics(env, [topic])
    reader = reader_factory([topic])
    payload, headers = {"a": 1}, None
    if where == "payload":
        payload = {"a": "x\\u0000y"}
    elif where == "nested payload key":
        payload = {"a": {"k\\u0000": 1}}
    else:
        headers = {"h": "x\\u0000"}
    with conn.cursor() as cur:
        eid = emit(cur, agg_type, "nul-1", "it.nul", payload, headers)
    msgs = [m for m in unique_messages(reader.read_until(1, timeout=30, extra=0)) if m.event_id == eid]
    assert len(msgs) == 1, f"{len(msgs)} messages of event {eid}"
    m = msgs[0]
    stored, stored_headers = query_one(conn, "SELECT convert_to(payload::text, 'UTF8'), headers"
                                             " FROM outbox.events WHERE event_id = %s", (eid,))
    assert m.value == bytes(stored), (m.value, bytes(stored))
    assert b"\\u0000" in m.value or where == "header value", m.value
    assert b"\x00" not in m.value, m.value
    assert json.loads(m.value) == payload
    got_headers = dict(m.headers)
    assert all(b"\x00" not in (v or b"") for v in got_headers.values()), m.headers
    if headers:
        assert stored_headers == headers
        assert got_headers["h"] == b"x\\u0000", got_headers
    report(f"OUTBOX BAD DATA \\u0000 as text in {where}: arrived as sent"
           f" ({len(m.value)}-byte value, no NUL byte)")
