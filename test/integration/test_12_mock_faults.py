"""
Broker faults injected with librdkafka's mock cluster (test/mock) while a steady stream of events
over many aggregates flows through the relay: Produce errors (NOT_ENOUGH_REPLICAS,
REQUEST_TIMED_OUT, NOT_LEADER_FOR_PARTITION), round-trip delays, one broker and then all brokers
down for a few seconds, partition leaders moving, and an idempotent-producer FATAL error (the
relay must rebuild its producer).  For each: nothing lost, per-aggregate order kept (first
occurrences strictly increasing), every row marked published, and no transient error counted
as permanent (permanent_failures 0, failed_at NULL, status.failed unchanged).

The mock does not de-duplicate retried batches of an idempotent (non-transactional) producer, so
duplicates are counted and reported here, not forbidden.  Nor does it check their sequence
numbers, so the relay keeps one Produce request in flight here (see MOCK_KAFKA_PROPERTIES and
test/mock/implicit_ack_probe.py): otherwise librdkafka may report a refused batch delivered.
"""
import time

import pytest

from conftest import LogWatcher, new_aggregate_type, pg_connect, report
from helpers_faults import (check_delivery, max_latency, mock_probe, mock_reader, mock_topic,
                            read_all, relay_on_mock, run_stream, status, wait_all_published)

N_AGGREGATES = 20
BEFORE_S = 1.5          # stream this long before the fault
AFTER_S = 3.0           # and this long after it was injected (or lifted)
FATAL_LINE = "Kafka producer failed fatally, creating a new one"


@pytest.fixture(scope="module")
def mock(env):
    """One mock cluster (3 brokers) for the module, the relay pointed at it."""
    conn = pg_connect(env)
    try:
        with relay_on_mock(env, conn) as mc:
            yield mc
    finally:
        conn.close()


def produce_errors(err, count=5):
    def fault(mc, topic):
        mc.push_errors("Produce", *([err] * count))
        return f"next {count} Produce requests fail with {err}"
    return fault


def rtt(mc, topic):
    mc.rtt("all", 400)
    time.sleep(2)
    mc.rtt("all", 0)
    return "400 ms round trip on every broker for 2 s"


def one_broker_down(mc, topic):
    mc.down(2)
    time.sleep(3)
    mc.up(2)
    return "broker 2 down for 3 s"


def all_brokers_down(mc, topic):
    mc.down("all")
    time.sleep(4)
    mc.up("all")
    return "all 3 brokers down for 4 s"


def leaders_move(mc, topic):
    for broker in (1, 2, 3):              # every partition moves at least twice
        for p in range(4):
            mc.leader(topic, p, (p + broker) % 3 + 1)
        time.sleep(0.7)
    return "leaders of all 4 partitions moved 3 times, 0.7 s apart"


SCENARIOS = {
    "not_enough_replicas": (produce_errors("NOT_ENOUGH_REPLICAS"), 0.0),
    "request_timed_out": (produce_errors("REQUEST_TIMED_OUT"), 0.0),
    "not_leader": (produce_errors("NOT_LEADER_FOR_PARTITION"), 0.0),
    "rtt": (rtt, 0.4),                    # lower bound of the slowest event's latency (s)
    "one_broker_down": (one_broker_down, 1.5),
    "all_brokers_down": (all_brokers_down, 2.5),
    "leader_move": (leaders_move, 0.0),
}


def run_scenario(env, mock, prefix, name, fault):
    conn = pg_connect(env)
    try:
        agg_type = new_aggregate_type(f"mock_{name}")
        topic = prefix + agg_type
        mock_topic(mock, topic)
        reader = mock_reader(env, mock, [topic])
        before = status(conn)
        watcher = LogWatcher(env)
        t0 = time.monotonic()
        try:
            stream, what = run_stream(env, agg_type, N_AGGREGATES, name, BEFORE_S, AFTER_S,
                                      fault=lambda: fault(mock, topic), reader=reader)
            emitted = stream.emitted
            rows = wait_all_published(conn, agg_type, emitted, timeout=90)
            msgs = read_all(reader, emitted, timeout=30)
            leftover = mock_probe(mock)     # before clear_errors: were the injections used up?
        finally:
            reader.close()
            mock.clear_errors("Produce")
            mock.rtt("all", 0)
            mock.up("all")
        elapsed = time.monotonic() - t0
        check = check_delivery(msgs, emitted)
        after = status(conn)
        return dict(emitted=emitted, stream=stream, rows=rows, msgs=msgs, check=check,
                    before=before, after=after, what=what, lines=watcher.new_lines(),
                    elapsed=elapsed, agg_type=agg_type, leftover=leftover)
    finally:
        conn.close()


def assert_transient_only(r, name):
    rows, before, after = r["rows"], r["before"], r["after"]
    assert rows["failed"] == 0, f"{name}: {rows['failed']} event(s) dead-lettered by a transient fault: {rows}"
    assert rows["permanent_failures"] == 0, f"{name}: transient fault counted as permanent: {rows}"
    assert after["failed"] == before["failed"], f"{name}: status.failed went {before['failed']} -> {after['failed']}"
    dead = [ln for ln in r["lines"] if "marked" in ln and "event(s) failed" in ln]
    assert not dead, f"{name}: " + "\n".join(dead)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_transient_fault_loses_and_reorders_nothing(env, prefix, mock, name):
    fault, min_latency = SCENARIOS[name]
    r = run_scenario(env, mock, prefix, name, fault)
    check = r["check"]
    lat = max_latency(r["msgs"], r["stream"].committed_at)
    report(f"OUTBOX MOCK FAULT {name} ({r['what']}): {check.expected} events over {N_AGGREGATES}"
           f" aggregates, {check.received} messages, {len(check.missing)} lost,"
           f" {check.duplicates} duplicate(s), order problems {len(check.order_problems)};"
           f" rows retried {r['rows']['rows_retried']} (max attempts {r['rows']['max_attempts']}),"
           f" delivery_errors +{r['after']['delivery_errors'] - r['before']['delivery_errors']};"
           f" slowest event {lat:.2f}s; {r['elapsed']:.1f}s")
    check.assert_ok(f"scenario {name}")
    assert_transient_only(r, name)
    assert r["leftover"] is None, \
        f"{name}: injected Produce error {r['leftover']} was still pending after the stream: the relay never hit it"
    assert min_latency == 0 or lat >= min_latency, \
        f"{name}: slowest event took {lat:.2f}s, so the fault ({r['what']}) did not hit the relay"
    assert not any(FATAL_LINE in ln for ln in r["lines"]), f"{name}: unexpected fatal producer error"


def test_idempotent_producer_fatal_error_rebuilds_producer(env, prefix, mock):
    """OUT_OF_ORDER_SEQUENCE_NUMBER on the head-of-line ProduceRequest of a partition makes
    librdkafka 2.0.2 raise a fatal error for an idempotent producer (rdkafka_request.c,
    rd_kafka_handle_idempotent_Produce_error: "sequence desynchronization",
    rd_kafka_idemp_set_fatal_error).  The relay must log it, rebuild the producer and resend
    what was not acknowledged."""
    injected = []

    def fatal(mc, topic):
        # A request that is not head-of-line only bumps the epoch; inject again until the
        # producer failed fatally (normally the first one does it).
        for _ in range(5):
            mc.push_errors("Produce", "OUT_OF_ORDER_SEQUENCE_NUMBER")
            injected.append(time.monotonic())
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                if any(FATAL_LINE in ln for ln in watcher.new_lines()):
                    return f"{len(injected)} OUT_OF_ORDER_SEQUENCE_NUMBER Produce error(s) pushed"
                time.sleep(0.1)
        return f"{len(injected)} OUT_OF_ORDER_SEQUENCE_NUMBER Produce error(s) pushed, no fatal error"

    watcher = LogWatcher(env)
    r = run_scenario(env, mock, prefix, "fatal", fatal)
    check = r["check"]
    fatal_lines = [ln for ln in r["lines"] if FATAL_LINE in ln]
    details = [ln for ln in r["lines"] if "DETAIL:" in ln and "OUT_OF_ORDER_SEQUENCE_NUMBER" in ln]
    report(f"OUTBOX MOCK FAULT fatal ({r['what']}): {len(fatal_lines)} '{FATAL_LINE}' warning(s);"
           f" {check.expected} events, {check.received} messages, {len(check.missing)} lost,"
           f" {check.duplicates} duplicate(s), order problems {len(check.order_problems)};"
           f" rows retried {r['rows']['rows_retried']}; {r['elapsed']:.1f}s")
    assert fatal_lines, f"no '{FATAL_LINE}' WARNING after {r['what']}"
    assert all("WARNING:" in ln for ln in fatal_lines), fatal_lines
    assert len(fatal_lines) <= len(injected), f"{len(fatal_lines)} fatal warnings for {len(injected)} injections"
    assert details, "the fatal warning does not name the librdkafka error"
    check.assert_ok("fatal producer error")
    assert_transient_only(r, "fatal")
    # the rebuilt producer is a new idempotent producer and kept publishing
    assert r["after"]["state"] in ("idle", "publishing"), r["after"]
    assert r["after"]["published"] - r["before"]["published"] >= check.expected, (r["before"], r["after"])
