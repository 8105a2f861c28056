"""kombu's Redis transport with two changes, and the farm's reads of what Redis holds.

A message given back goes to the head of its queue, where it was taken from: stock kombu puts a message
rejected with `requeue` (Celery's `reject_on_worker_lost`) at the back, behind every job queued since.
`take_back_messages` does the same for the messages of a dead worker, found by the ledger's sweep.

An acknowledgement that fails because Redis is gone still releases the message in the worker: stock
kombu then keeps it in the channel's delivered set, and once that fills the prefetch the worker never
polls Redis again, idle for good after Redis comes back. Releasing it is safe: a copy Redis kept is
redelivered after the visibility timeout and refused by the ledger's claim. The error is still raised.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.transport.virtual.base import QoS as VirtualQoS

TRANSPORT = "dsocr_workers.farm.celery.broker:Transport"


class QoS(kombu_redis.QoS):
    # kombu has no option for where a requeued message goes, nor a hook after a failed ack; it loads a
    # transport class by its path (TRANSPORT), so the change lives in this subclass of its Redis QoS.
    def ack(self, delivery_tag: Any) -> None:
        try:
            super().ack(delivery_tag)
        except Exception:
            VirtualQoS.ack(self, delivery_tag)  # what super() does after its Redis call
            raise

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        try:
            if requeue:  # stock kombu: restore_by_tag(leftmost=True), the back of the queue
                self.restore_by_tag(delivery_tag, leftmost=False)
                VirtualQoS.ack(self, delivery_tag)
            else:
                super().reject(delivery_tag, requeue=False)
        except Exception:
            VirtualQoS.ack(self, delivery_tag)
            raise

    def take_back(self, delivery_tag: str) -> bool:
        """Move the unacknowledged message `delivery_tag` (another consumer's) to the head of its queue,
        as kombu's visibility timeout would, in one Redis transaction; False when it is no longer
        unacknowledged (its consumer acknowledged it, or another restore took it first)."""
        # kombu's public `restore_by_tag` runs this same transaction but does not say whether the message
        # was still there, which decides whether the caller sends a new one; `_do_restore_message` is the
        # step it calls, with the same arguments.
        taken = False

        def transaction(pipe: Any) -> None:
            nonlocal taken
            raw = pipe.hget(self.unacked_key, delivery_tag)
            pipe.multi()
            self._remove_from_indices(delivery_tag, pipe)
            taken = bool(raw)
            if raw:
                payload, exchange, routing_key = json.loads(raw)
                self.channel._do_restore_message(payload, exchange, routing_key, pipe, False)

        with self.channel.conn_or_acquire() as client:
            client.transaction(transaction, self.unacked_key)
        return taken


class Channel(kombu_redis.Channel):
    QoS = QoS


class Transport(kombu_redis.Transport):
    Channel = Channel


def _unacknowledged(channel: Any) -> dict[Any, Any]:
    """Every message Redis holds as delivered and unacknowledged: delivery tag → (payload, exchange,
    routing key) as JSON."""
    client = channel.client  # kombu prefixes the keys of the commands it uses itself, not HGETALL's
    return client.hgetall(getattr(client, "global_keyprefix", "") + channel.unacked_key)


def take_back_messages(app: Any, job_ids: Iterable[str]) -> set[str]:
    """Put the unacknowledged messages of these jobs (held by a worker the ledger found dead: its lease or
    reservation ran out) back at the head of their queues, instead of leaving them to the visibility
    timeout (an hour by default); returns the job ids whose message was taken back. Task ids are job ids."""
    wanted = set(job_ids)
    if not wanted:
        return set()
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        tags = {tag: json.loads(raw)[0]["headers"]["id"] for tag, raw in _unacknowledged(channel).items()}
        return {job_id for tag, job_id in tags.items() if job_id in wanted and channel.qos.take_back(tag)}


def delivered_messages(app: Any, queues: Iterable[str]) -> dict[str, float]:
    """The job ids of the unacknowledged messages of these queues (delivered to a worker: prefetched,
    running, or held for a retry's countdown), each with the time (epoch seconds, the consumer's clock)
    since which it is due: its delivery, or its ETA when that is later. Task ids are job ids."""
    wanted = set(queues)
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        held = _unacknowledged(channel)
        delivered_at = dict(channel.client.zrange(channel.unacked_index_key, 0, -1, withscores=True))
    due: dict[str, float] = {}
    for tag, raw in held.items():
        payload, _exchange, routing_key = json.loads(raw)
        if routing_key not in wanted or tag not in delivered_at:
            continue
        headers = payload.get("headers") or {}
        eta = headers.get("eta")
        since = delivered_at[tag]
        if eta:
            since = max(since, datetime.fromisoformat(eta).timestamp())
        due[headers["id"]] = since
    return due


def job_ids_in_broker(broker_url: str, key_prefix: str, queues: Iterable[str]) -> tuple[set[str], set[str]]:
    """The job ids of the messages Redis holds for these queues: (waiting in a queue's list, delivered to
    a worker and not yet acknowledged — kombu's `unacked` index: prefetched, running, or held for a
    retry's countdown). Task ids are job ids (farm/submit.py)."""
    client = redis.Redis.from_url(broker_url)
    try:
        waiting = {
            json.loads(raw)["headers"]["id"]
            for queue in set(queues)
            for raw in client.lrange(key_prefix + queue, 0, -1)
        }
        delivered = {json.loads(raw)[0]["headers"]["id"] for raw in client.hvals(key_prefix + "unacked")}
        return waiting, delivered
    finally:
        client.close()


def job_ids_held(broker_url: str, key_prefix: str, queues: Iterable[str]) -> set[str]:
    """The job ids of every message Redis holds for these queues, waiting or delivered."""
    waiting, delivered = job_ids_in_broker(broker_url, key_prefix, queues)
    return waiting | delivered
