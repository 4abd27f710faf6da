#!/usr/bin/python3
"""
Why the mock tests keep one Produce request in flight (helpers_faults.MOCK_KAFKA_PROPERTIES).

librdkafka's mock cluster (2.0.2) checks the sequence numbers of transactional producers only.
This script sends two messages to one partition with an idempotent producer.  The first Produce
request (R1) is refused with NOT_ENOUGH_REPLICAS after 300 ms.  The second (R2) is sent while
R1 is still in flight, and the mock appends it.  On R2's success librdkafka implicitly acks
R1: a real broker would have refused R2 with OUT_OF_ORDER_SEQUENCE_NUMBER, so R2's success
would prove R1 was stored.  R1 is reported delivered but is not in the mock's log.  With
max.in.flight.requests.per.connection=1 both are stored.

Usage: /usr/bin/python3 test/mock/implicit_ack_probe.py    (build test/mock first: make -C test/mock)
Prints one line per setting; exit status 0 either way (this shows a property of the mock).
"""
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition  # noqa: E402
from mockcluster import MockCluster  # noqa: E402


def probe(in_flight: int) -> str:
    with MockCluster(brokers=1) as mc:
        mc.create_topic("t", 1)
        p = Producer({"bootstrap.servers": mc.bootstrap, "enable.idempotence": True,
                      "linger.ms": 0, "max.in.flight.requests.per.connection": in_flight,
                      "log_level": 3})
        p.produce("t", b"warm-up", partition=0)
        p.flush(10)                              # producer id acquired, connection up
        mc.broker_errors(1, "Produce", [("NOT_ENOUGH_REPLICAS", 300)])
        reports = {}

        def report(err, msg):
            reports[msg.value().decode()] = "delivered" if err is None else err.name()

        p.produce("t", b"R1", partition=0, on_delivery=report)
        p.poll(0.05)                             # R1 on the wire, its answer 300 ms away
        p.produce("t", b"R2", partition=0, on_delivery=report)
        p.flush(10)
        c = Consumer({"bootstrap.servers": mc.bootstrap, "group.id": "probe",
                      "enable.auto.commit": False, "log_level": 3})
        c.assign([TopicPartition("t", 0, OFFSET_BEGINNING)])
        stored, deadline = [], time.monotonic() + 3
        while time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is not None and not m.error() and m.value() != b"warm-up":
                stored.append(m.value().decode())
        c.close()
        lost = [v for v, r in reports.items() if r == "delivered" and v not in stored]
        return (f"max.in.flight.requests.per.connection={in_flight}: reports {reports}, "
                f"log holds {stored}, reported delivered but not stored: {lost or 'none'}")


if __name__ == "__main__":
    for n in (5, 1):
        print(probe(n))
