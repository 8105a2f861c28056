"""kombu's Redis transport with one fix: an acknowledgement that fails because Redis is gone still
releases the message in the worker.

Stock kombu (5.7) acknowledges in two steps: remove the message from Redis's `unacked` index, then from
the channel's own delivered set. When Redis is down the first step raises and the second never runs; with
prefetch 1 the channel then believes it still holds a message, never polls Redis again, never notices the
dead connection, and the worker sits idle for good after Redis comes back (found by the reliability
suite, scenario R4). Releasing the message locally is safe: if Redis lost it there is nothing left to
remove; if Redis kept it (a blip), it is redelivered after the visibility timeout and the ledger's claim
refuses the copy. The error is still raised, so Celery logs it as before.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.transport.virtual.base import QoS as VirtualQoS

TRANSPORT = "dsocr_workers.farm.celery.broker:Transport"


class QoS(kombu_redis.QoS):
    def ack(self, delivery_tag: Any) -> None:
        try:
            super().ack(delivery_tag)
        except Exception:
            VirtualQoS.ack(self, delivery_tag)  # what super() does after its Redis call
            raise

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        try:
            super().reject(delivery_tag, requeue=requeue)
        except Exception:
            VirtualQoS.ack(self, delivery_tag)
            raise


class Channel(kombu_redis.Channel):
    QoS = QoS


class Transport(kombu_redis.Transport):
    Channel = Channel


def job_ids_in_broker(broker_url: str, key_prefix: str, queues: Iterable[str]) -> tuple[set[str], set[str]]:
    """The job ids of the messages Redis holds for these queues: (waiting in a queue's list, delivered to
    a worker and not yet acknowledged — kombu's `unacked` index: prefetched, running, or held for a
    retry's countdown). Task ids are job ids (farm/submit.py)."""
    client = redis.Redis.from_url(broker_url)
    try:
        waiting = {json.loads(raw)["headers"]["id"] for queue in set(queues)
                   for raw in client.lrange(key_prefix + queue, 0, -1)}  # fmt: skip
        delivered = {json.loads(raw)[0]["headers"]["id"] for raw in client.hvals(key_prefix + "unacked")}
        return waiting, delivered
    finally:
        client.close()
