"""Publishers for the outbox relay (:class:`~flask_idempotency.relay.Publisher`).

* :class:`KombuPublisher`: a message broker through kombu (``pip install
  flask-idempotency[kombu]``). On AMQP it publishes with publisher confirms, so
  ``publish`` returns only once the broker has the message: "published" in the
  outbox then means the broker took it. ``memory://`` and ``filesystem://`` work
  for development and tests.
* :class:`CallablePublisher`: calls a function per event (a webhook, a log);
  :class:`ListPublisher` keeps the events in a list (tests, the README).
"""

from __future__ import annotations

import contextlib
import threading
import typing as t

if t.TYPE_CHECKING:
    from .outbox import OutboxEvent


class CallablePublisher:
    """Publishes by calling ``fn(event)``; an exception from it is a failed publish."""

    def __init__(self, fn: t.Callable[[OutboxEvent], object]) -> None:
        self.fn = fn

    def publish(self, event: OutboxEvent) -> None:
        self.fn(event)


class ListPublisher:
    """Appends every event to ``events`` (thread-safe): for tests and examples."""

    def __init__(self) -> None:
        self.events: list[OutboxEvent] = []
        self._lock = threading.Lock()

    def publish(self, event: OutboxEvent) -> None:
        with self._lock:
            self.events.append(event)


class KombuPublisher:
    """Publishes each event to ``exchange`` with the topic as routing key.

    The message body is the payload (JSON), its ``message_id`` the event id
    (consumers deduplicate on it: delivery is at least once), its headers the
    event's headers, persistent (delivery mode 2). ``url`` is a kombu URL
    (``amqp://guest:guest@localhost:5672//``, ``memory://``...); on
    ``amqp``/``pyamqp`` the connection is opened with ``confirm_publish=True``
    unless ``transport_options`` says otherwise. One connection is kept and
    reopened after a failure; ``publish`` raises on any failure, and the relay
    retries the event later.
    """

    def __init__(
        self,
        url: str,
        *,
        exchange: str = "idempotency",
        exchange_type: str = "topic",
        transport_options: dict[str, t.Any] | None = None,
        declare: bool = True,
    ) -> None:
        try:
            import kombu
        except ImportError as exc:  # pragma: no cover - depends on the extra
            raise ImportError(
                "KombuPublisher needs kombu: pip install 'flask-idempotency[kombu]'"
            ) from exc
        self._kombu: t.Any = kombu
        options = dict(transport_options or {})
        if url.split("://", 1)[0] in ("amqp", "pyamqp", "amqps"):
            options.setdefault("confirm_publish", True)
        self.url = url
        self.transport_options = options
        self.exchange: t.Any = self._kombu.Exchange(exchange, type=exchange_type, durable=True)
        self.declare = declare
        self._connection: t.Any = None
        self._producer: t.Any = None
        self._lock = threading.Lock()

    def _ensure(self) -> t.Any:
        if self._producer is None:
            self._connection = self._kombu.Connection(
                self.url, transport_options=self.transport_options
            )
            self._connection.ensure_connection(max_retries=1)
            self._producer = self._connection.Producer()
            if self.declare:
                self.exchange(self._producer.channel).declare()
        return self._producer

    def publish(self, event: OutboxEvent) -> None:
        with self._lock:
            try:
                self._ensure().publish(
                    event.payload,
                    exchange=self.exchange,
                    routing_key=event.topic,
                    serializer="json",
                    headers=dict(event.headers),
                    message_id=event.event_id,
                    delivery_mode=2,
                    retry=False,
                )
            except Exception:
                self.close()
                raise

    def close(self) -> None:
        """Close the connection (the next publish opens a new one)."""
        connection, self._connection, self._producer = self._connection, None, None
        if connection is not None:
            with contextlib.suppress(Exception):  # already broken
                connection.release()
