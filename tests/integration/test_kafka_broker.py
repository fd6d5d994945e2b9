"""The test broker does what the pipeline relies on: multi-partition topics and exactly-once transactions.

The pipeline's sink commits results and input offsets in one Kafka transaction and every reader uses
read_committed, so a broker that cannot run transactions on a single node (internal topics with the
default replication factor 3) would make every other integration test hang instead of fail clearly.
"""

from __future__ import annotations

import time

from confluent_kafka import Consumer, KafkaError, Producer
from confluent_kafka.admin import AdminClient, NewTopic

PARTITIONS = 4
MESSAGES = 1000


def test_transactional_messages_are_all_read_committed(kafka_bootstrap: str, topic_prefix: str) -> None:
    topic = f"{topic_prefix}.broker-check"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    new_topic = NewTopic(topic, num_partitions=PARTITIONS, replication_factor=1)
    for future in admin.create_topics([new_topic]).values():
        future.result(timeout=30)
    assert len(admin.list_topics(topic, timeout=10).topics[topic].partitions) == PARTITIONS

    producer = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"{topic}.tx"})
    producer.init_transactions(30)
    producer.begin_transaction()
    for i in range(MESSAGES):
        producer.produce(topic, key=str(i).encode(), value=f"v{i}".encode(), partition=i % PARTITIONS)
    producer.commit_transaction(30)

    consumer = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": f"{topic}.reader",
            "isolation.level": "read_committed",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    seen: dict[int, str] = {}
    partitions: set[int] = set()
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + 60
        while len(seen) < MESSAGES and time.monotonic() < deadline:
            for msg in consumer.consume(num_messages=500, timeout=1.0):
                error = msg.error()
                if error is not None:
                    assert error.code() == KafkaError._PARTITION_EOF, error
                    continue
                key, value, partition = msg.key(), msg.value(), msg.partition()
                assert key is not None and value is not None and partition is not None
                seen[int(key)] = value.decode()
                partitions.add(partition)
    finally:
        consumer.close()

    assert seen == {i: f"v{i}" for i in range(MESSAGES)}
    assert partitions == set(range(PARTITIONS))
