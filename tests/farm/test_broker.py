"""Where the farm's messages go back to (farm/celery/broker.py), on the real Redis: a message given back —
its child was killed (`reject_on_worker_lost`), or its worker died holding it and a sweep takes it back
(`take_back_messages`) — goes to the head of its queue, where it was taken from, and no copy of it stays
in Redis's unacknowledged set for the visibility timeout."""

from __future__ import annotations

import uuid

import pytest
import redis

from dsocr_workers.farm.celery.app import create_app
from dsocr_workers.farm.celery.broker import take_back_messages
from dsocr_workers.farm.celery.messages import send_job_messages
from dsocr_workers.settings import Settings

pytestmark = pytest.mark.redis


def test_a_message_given_back_goes_to_the_head_of_its_queue(broker_env):
    tag = uuid.uuid4().hex[:8]  # the session's prefix is shared: keys of this test's own
    queue, prefix = f"{broker_env['DSOCR_QUEUE']}-{tag}", f"{broker_env['DSOCR_BROKER_KEY_PREFIX']}{tag}:"
    app = create_app(Settings(broker_url=broker_env["DSOCR_BROKER_URL"], broker_key_prefix=prefix, queue=queue))
    send_job_messages(app, [(job_id, queue) for job_id in ("a", "b", "c", "d")], [], {})
    client = redis.Redis.from_url(broker_env["DSOCR_BROKER_URL"])
    try:
        with app.connection_for_write() as worker:  # as a worker's consumer: each message unacknowledged
            channel = worker.default_channel

            def fetch() -> str:
                message = channel.basic_get(queue, no_ack=False)
                assert message is not None
                return message.headers["id"]

            held = channel.basic_get(queue, no_ack=False)
            assert held.headers["id"] == "a"
            held.reject(requeue=True)  # its child was killed: back where it came from, before b
            assert fetch() == "a" and fetch() == "b"
            # The worker dies holding both (nothing acknowledges them): a sweep takes them back, once.
            assert client.hlen(prefix + "unacked") == 2
            assert take_back_messages(app, ["a", "b", "not-held"]) == {"a", "b"}
            assert take_back_messages(app, ["a", "b"]) == set()
            assert client.hlen(prefix + "unacked") == 0
            assert {fetch(), fetch()} == {"a", "b"} and fetch() == "c"  # ahead of what was queued after them
    finally:
        client.delete(*client.keys(prefix + "*"))
        client.close()
