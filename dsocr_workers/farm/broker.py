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

from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport.virtual.base import QoS as VirtualQoS

TRANSPORT = "dsocr_workers.farm.broker:Transport"


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
