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
    (``amqp://guest:guest@localhost:5672//``, ``memory://``,
    ``sqla+postgresql://...``); on ``amqp``/``pyamqp`` the connection is opened
    with ``confirm_publish=True`` unless ``transport_options`` says otherwise.

    ``queues``: the consumers' queues (:class:`kombu.Queue`, or names bound to
    the exchange with the routing key ``#``), declared and bound on every
    connection. A broker drops a message that no queue is bound for, and the
    relay would mark it published: declare them here unless they are sure to
    exist before the first event. On kombu's embedded transports (``memory``,
    ``filesystem``, ``sqla``) bindings live in the process's memory, so a relay
    in a process of its own must declare them.

    One connection is kept and reopened after a failure. Connecting is tried
    once (no sleeping retry loop: the relay retries the event later), and
    ``timeout`` (seconds) bounds connecting, sending and waiting for the
    confirm, so a broker that stopped answering cannot hold the relay (and its
    rows) for ever. ``publish`` raises
    :class:`~flask_idempotency.relay.BrokerUnavailable` when the broker cannot
    be reached or does not answer within ``timeout`` (never counted toward
    parking), and the transport's own error otherwise: a message the broker
    refused (a nack, py-amqp's ``MessageNacked``: a full queue with
    ``x-overflow: reject-publish``, an internal error) is the event's failure,
    backed off and parked after ``IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS``, and keeps
    the connection, so the events after it go out in the same batch.
    """

    def __init__(
        self,
        url: str,
        *,
        exchange: str = "idempotency",
        exchange_type: str = "topic",
        queues: t.Iterable[t.Any] = (),
        transport_options: dict[str, t.Any] | None = None,
        declare: bool = True,
        timeout: float = 10.0,
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
        self.queues: list[t.Any] = [
            q
            if isinstance(q, self._kombu.Queue)
            else self._kombu.Queue(q, self.exchange, routing_key="#", durable=True)
            for q in queues
        ]
        self.declare = declare
        self.timeout = timeout
        self._connection: t.Any = None
        self._producer: t.Any = None
        self._lock = threading.Lock()

    def _ensure(self) -> t.Any:
        if self._producer is None:
            self._connection = self._kombu.Connection(
                self.url, transport_options=self.transport_options, connect_timeout=self.timeout
            )
            self._connection.ensure_connection(max_retries=0)  # one try, no sleeping
            self._producer = self._connection.Producer()
            channel = self._producer.channel
            if self.declare:
                self.exchange(channel).declare()
            for queue in self.queues:
                queue(channel).declare()
        return self._producer

    def publish(self, event: OutboxEvent) -> None:
        from .relay import BrokerUnavailable

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
                    timeout=self.timeout,
                    confirm_timeout=self.timeout,
                )
            except Exception as exc:
                if _refused(exc):
                    # The broker answered: the connection and channel are fine.
                    raise
                unreachable = self._unreachable(exc)
                self._drop()
                if unreachable:
                    raise BrokerUnavailable(f"{type(exc).__name__}: {exc}") from exc
                raise

    def _unreachable(self, exc: Exception) -> bool:
        """Whether ``exc`` says the broker could not be reached (rather than that
        it refused this message)."""
        if _refused(exc):
            return False
        if isinstance(exc, (OSError, TimeoutError)):
            return True
        if isinstance(exc, self._kombu.exceptions.OperationalError):
            return True  # kombu's wrapping of a failed connect
        connection = self._connection
        if connection is None:
            return False
        try:
            errors = tuple(connection.recoverable_connection_errors) + tuple(
                connection.connection_errors
            )
        except Exception:  # the transport could not even be loaded
            return False
        return isinstance(exc, errors)

    def _drop(self) -> None:
        """Forget a failed connection without talking to the broker: a graceful
        close would wait for an answer from a broker that may not give one."""
        connection, self._connection, self._producer = self._connection, None, None
        if connection is not None:
            with contextlib.suppress(Exception):  # already broken
                connection.collect(socket_timeout=0.1)

    def close(self) -> None:
        """Close the connection (the next publish opens a new one)."""
        connection, self._connection, self._producer = self._connection, None, None
        if connection is not None:
            with contextlib.suppress(Exception):  # already broken
                connection.release()


def _refused(exc: BaseException) -> bool:
    """Whether ``exc`` is the broker refusing the message (a nack): py-amqp lists
    ``MessageNacked`` among its recoverable connection errors, but the
    connection is fine and the failure is the message's."""
    try:
        from amqp.exceptions import MessageNacked  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - kombu without py-amqp
        return False
    return isinstance(exc, MessageNacked)
