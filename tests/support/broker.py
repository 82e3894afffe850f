"""The broker the relay publishes to in the relay tests: RabbitMQ or kombu's
SQLAlchemy transport, and reading what reached it."""

from __future__ import annotations

import dataclasses
import typing as t

from tests.support.tcp_proxy import TcpProxy, Upstream

RABBITMQ = ("127.0.0.1", 5672)


@dataclasses.dataclass
class Broker:
    """Where the relay publishes and where the consumer reads."""

    name: str
    url: str  # for the consumer (and a relay without a proxy)
    upstream: Upstream  # what a proxy in front of it forwards to

    def through(self, proxy: TcpProxy) -> str:
        """The broker's URL by way of ``proxy``."""
        if self.url.startswith("amqp"):
            return f"amqp://guest:guest@127.0.0.1:{proxy.port}//"
        return "sqla+" + proxy.url(self.url.removeprefix("sqla+"))


def waiting(broker: Broker, exchange: str, queue: str) -> int:
    """Messages in the queue, asked of the broker itself (not through the proxy)."""
    import kombu

    with kombu.Connection(broker.url) as conn:
        _, count, _ = queue_of(exchange, queue)(conn.channel()).queue_declare(passive=True)
        return int(count)


def drain(broker: Broker, exchange: str, queue: str, count: int) -> list[dict[str, t.Any]]:
    """Take ``count`` messages off the queue (acked), then check none is left."""
    import kombu

    got = []
    with kombu.Connection(broker.url) as conn:
        simple = conn.SimpleQueue(queue_of(exchange, queue))
        try:
            for _ in range(count):
                message = simple.get(timeout=10)
                got.append(
                    {
                        "event_id": message.properties.get("message_id"),
                        "payload": message.payload,
                        "headers": message.headers,
                    }
                )
                message.ack()
        finally:
            simple.close()
    assert waiting(broker, exchange, queue) == 0
    return got


def collect(broker: Broker, exchange: str, queue: str, event_ids: set[str]) -> bool:
    """Take messages off the queue until every id in ``event_ids`` came."""
    import kombu

    seen: set[str] = set()
    with kombu.Connection(broker.url) as conn:
        simple = conn.SimpleQueue(queue_of(exchange, queue))
        try:
            while not event_ids <= seen:
                message = simple.get(timeout=10)
                seen.add(message.properties.get("message_id"))
                message.ack()
        finally:
            simple.close()
    return True


def delete_queue(broker: Broker, exchange: str, queue: str) -> None:
    import kombu

    with kombu.Connection(broker.url) as conn:
        bound = queue_of(exchange, queue)(conn.channel())
        bound.delete()
        if broker.name == "rabbitmq":  # leave nothing behind on a shared server
            bound.exchange.delete()


def text(value: t.Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def queue_of(exchange: str, queue: str) -> t.Any:
    import kombu

    return kombu.Queue(
        queue, kombu.Exchange(exchange, type="topic", durable=True), routing_key="#", durable=True
    )
