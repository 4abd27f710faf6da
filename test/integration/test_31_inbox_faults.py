"""
Faults injected with librdkafka's mock cluster (test/mock), in addition to the real broker of the
other inbox tests (issue 30): while records stream into a 3-broker mock cluster, its Fetch and
Metadata requests fail (leader moved, transport errors, timeouts), partition leaders move, and
every broker goes down for a while.  The inbox applies every record exactly once per offset, in
offset order, and none twice.
"""
import json
import threading
import time
import uuid

import pytest
from confluent_kafka import Producer

from conftest import query, query_one, set_conf, wait_until
from helpers_faults import MockCluster
from helpers_inbox import mail_handler, relay_headers, setup_app_role, status, subscribe, unsubscribe_all

PARTITIONS = 3
RECORDS = 3000


@pytest.fixture
def app(env, conn):
    setup_app_role(conn)
    yield conn
    unsubscribe_all(conn)
    set_conf(conn, inbox_bootstrap_servers=None)


def test_fetch_errors_leader_moves_and_an_outage_lose_and_double_nothing(env, app):
    conn = app
    topic = f"it_inbox_mock_{uuid.uuid4().hex[:8]}"
    with MockCluster(brokers=3, topics={topic: PARTITIONS}) as mc:
        set_conf(conn, inbox_bootstrap_servers=mc.bootstrap)
        mail_handler(conn, "it_mail_mock", "it_handle_mock")
        subscribe(conn, "it_mock", [topic], "it_handle_mock")
        wait_until(lambda: len([r for r in status(conn, "it_mock") if r["state"] == "running"]) == PARTITIONS,
                   60, "the partitions assigned")
        acked = []
        errors = []
        p = Producer({"bootstrap.servers": mc.bootstrap, "enable.idempotence": True,
                      "reconnect.backoff.max.ms": 500})

        def report(err, msg):
            (errors if err else acked).append(err or (msg.partition(), msg.offset()))

        # the second half waits for the faults: an inbox that keeps up with the producer had
        # applied all 3,000 before they came, and none was left to apply after them (CI, PG15)
        faults_in = threading.Event()

        def produce_all():
            for i in range(RECORDS):
                if i == RECORDS // 2:
                    faults_in.wait(120)
                p.produce(topic, key=f"k{i % 30}", value=json.dumps({"n": i}).encode(),
                          headers=relay_headers(str(uuid.uuid4())), on_delivery=report)
                p.poll(0)
                if i % 100 == 0:
                    time.sleep(0.05)
            p.flush(120)
        t = threading.Thread(target=produce_all)
        t.start()
        wait_until(lambda: query_one(conn, "SELECT count(*) FROM it_mail_mock")[0] > 200, 60, "records applied")
        mc.push_errors("Fetch", "NOT_LEADER_FOR_PARTITION", "_TRANSPORT", "REQUEST_TIMED_OUT", "_TRANSPORT")
        mc.push_errors("Metadata", "_TRANSPORT", "REQUEST_TIMED_OUT")
        for part in range(PARTITIONS):
            mc.leader(topic, part, (part + 1) % 3 + 1)
        n = query_one(conn, "SELECT count(*) FROM it_mail_mock")[0]
        faults_in.set()
        wait_until(lambda: query_one(conn, "SELECT count(*) FROM it_mail_mock")[0] > n + 200, 60,
                   "records applied after the errors")
        mc.down("all")
        wait_until(lambda: query(conn, "SELECT 1 FROM outbox.cluster_status() WHERE kind = 'inbox'"
                                       " AND state = 'broker_down'"), 60, "broker_down")
        mc.up("all")
        t.join(180)
        assert not errors, errors[:3]
        assert len(acked) == RECORDS
        wait_until(lambda: query_one(conn, "SELECT count(*) FROM it_mail_mock")[0] >= RECORDS, 120,
                   "every record applied")
        rows = query(conn, "SELECT kafka_partition, kafka_offset, (payload->>'n')::int, key FROM it_mail_mock ORDER BY id")
        positions = [(r[0], r[1]) for r in rows]
        assert len(positions) == len(set(positions)) == RECORDS, "each offset applied once"
        assert sorted(positions) == sorted(acked)
        for part in range(PARTITIONS):
            offs = [r[1] for r in rows if r[0] == part]
            assert offs == sorted(offs), f"partition {part} applied out of order"
        st = status(conn, "it_mock")
        assert sum(r["applied"] for r in st) == RECORDS and sum(r["duplicates"] for r in st) == 0, st
        wait_until(lambda: query(conn, "SELECT 1 FROM outbox.cluster_status() WHERE kind = 'inbox'"
                                       " AND state = 'running'"), 60, "running again")
