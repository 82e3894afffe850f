"""Publishers for the outbox relay (:class:`~flask_idempotency.relay.Publisher`).

* :class:`KombuPublisher`: a message broker through kombu (the ``kombu``
  extra). On AMQP it publishes with publisher confirms, so
  ``publish`` returns only once the broker has the message: "published" in the
  outbox then means the broker took it. ``memory://`` and ``filesystem://`` work
  for development and tests.
* :class:`CallablePublisher`: calls a function per event (a webhook, a log);
  :class:`ListPublisher` keeps the events in a list (tests, the README).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import typing as t

from ._confirms import UNSETTLED, ConfirmChannel, Message, Round, Unsent, amqp_message, out_of_time
from .errors import BrokerUnavailable, StalledMessage

if t.TYPE_CHECKING:
    from ._messaging.outbox import OutboxEvent


__all__ = [
    "CallablePublisher",
    "KombuPublisher",
    "ListPublisher",
]
logger = logging.getLogger("flask_idempotency")

#: AMQP reply codes with which a broker answers the message being published
#: (closing the channel or the connection): the message's failure, not the
#: broker's. 311 content too large, 406 precondition failed (a message over
#: ``max_message_size``, a bad property), 501 frame error (headers larger than
#: a frame), 502 syntax error, 503 command invalid, 505 unexpected frame.
MESSAGE_CODES = frozenset({311, 406, 501, 502, 503, 505})

#: kombu transports by the name OpenTelemetry's ``messaging.system`` gives their broker.
_SYSTEMS = {"sqs": "aws_sqs"} | dict.fromkeys(
    ("amqp", "amqps", "pyamqp", "librabbitmq"), "rabbitmq"
)

#: AMQP reply codes of a refused login or vhost (at connect): 402 invalid
#: path, 403 access refused, 530 not allowed.
_LOGIN_CODES = frozenset({402, 403, 530})


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
    rows) for ever.

    ``ssl``: kombu's ``Connection(ssl=...)``, TLS to the broker. ``amqps://``
    alone verifies the broker's certificate chain against the system's CAs but
    not its host name (py-amqp checks the name only when given one); pass
    ``ssl={"server_hostname": None}`` (the URL's host) and ``"ca_certs"``,
    ``"certfile"``/``"keyfile"`` as needed. See docs/security.md.

    ``publish`` raises :class:`~flask_idempotency.relay.BrokerUnavailable`
    (never counted toward parking; the relay ends its batch) when the broker is
    not there to take any message: connecting, logging in or declaring failed
    (refused, timed out, a login or vhost the broker refused, a permission it
    revoked: one connection attempt per run, logged), or the connection was
    lost or timed out while publishing, or the broker closed it for a reason of
    its own (a shutdown, an internal error, a missing exchange, a refused
    permission). It raises an ordinary error, the event's failure (backed off,
    parked after ``IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS``, the events after it go
    out in the same batch), when the message itself is what failed: a nack
    (py-amqp's ``MessageNacked``: a full queue with ``x-overflow:
    reject-publish``; the connection is kept), a message the client cannot
    encode (a routing key or header over AMQP's limits), or a broker that
    answered this message by closing the connection or channel (AMQP codes
    311, 406, 501, 502, 503, 505: headers larger than a frame, a message
    over the broker's ``max_message_size``).

    A publish that is cut off or times out after the connection was up counts as
    the broker's failure, but not for ever: when the same event fails that way
    :attr:`STALLS` times in a row, with no connect failing in between
    (so the broker kept accepting connections; other events going out in
    between only confirm it), and the broker had not told the connection it was blocked
    (a RabbitMQ memory or disk alarm), the next such failure is raised as
    :class:`StalledMessage`, the event's failure: a message whose confirm
    always outlasts ``timeout`` (a very large one) is backed off and parked
    rather than heading every run for ever. A real outage makes the connect
    fail, which starts the count again.
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
        ssl: bool | dict[str, t.Any] | None = None,
    ) -> None:
        try:
            import kombu
        except ImportError as exc:  # pragma: no cover - depends on the extra
            raise ImportError(
                "KombuPublisher needs kombu: install the package's kombu extra (pip install "
                "'path/to/flask-idempotency[kombu]', see docs/installation.md), or pip "
                "install kombu"
            ) from exc
        self._kombu: t.Any = kombu
        options = dict(transport_options or {})
        scheme = url.split("://", 1)[0].split("+", 1)[0]
        if url.split("://", 1)[0] in ("amqp", "pyamqp", "amqps"):
            options.setdefault("confirm_publish", True)
        self.url = url
        self.transport_options = options
        #: The metrics' ``messaging.system``: ``rabbitmq`` on AMQP, else kombu's transport.
        self.messaging_system = _SYSTEMS.get(scheme, scheme)
        self.exchange: t.Any = self._kombu.Exchange(exchange, type=exchange_type, durable=True)
        self.queues: list[t.Any] = [
            q
            if isinstance(q, self._kombu.Queue)
            else self._kombu.Queue(q, self.exchange, routing_key="#", durable=True)
            for q in queues
        ]
        self.declare = declare
        self.timeout = timeout
        self.ssl = ssl
        self._connection: t.Any = None
        self._producer: t.Any = None
        self._confirms: ConfirmChannel | None = None  # publish_many's channel
        self._lock = threading.Lock()
        self._blocked = False  # the broker said the connection is blocked (an alarm)
        self._stalled: tuple[str, int] = ("", 0)  # (event id, cut-offs in a row)

    #: Cut-offs and timeouts of one event's publish in a row (the connection up,
    #: connects not failing) that count as the broker's; the next is the event's.
    STALLS = 3

    def _connection_options(self) -> dict[str, t.Any]:
        options = dict(self.transport_options)
        if self.url.split("://", 1)[0] in ("amqp", "pyamqp", "amqps"):
            # Every wait for the broker bounded, the ones kombu gives no timeout
            # too (the confirm.select a channel's first publish waits for).
            options.setdefault("read_timeout", self.timeout)
            options.setdefault("write_timeout", self.timeout)
            # py-amqp tells a blocked connection (a memory or disk alarm): a
            # confirm that times out then is the broker's, however often.
            options.setdefault("on_blocked", self._on_blocked)
            options.setdefault("on_unblocked", self._on_unblocked)
        return options

    def _on_blocked(self, reason: object = None) -> None:
        self._blocked = True

    def _on_unblocked(self) -> None:
        self._blocked = False

    def _ensure(self) -> t.Any:
        if self._producer is None:
            self._blocked = False
            # Without ssl= the URL decides (amqps:// is TLS); a copy of a dict, as
            # kombu fills in the server_hostname None stands for on the one it is given.
            tls = {} if self.ssl is None else {"ssl": copy.copy(self.ssl)}
            self._connection = self._kombu.Connection(
                self.url,
                transport_options=self._connection_options(),
                connect_timeout=self.timeout,
                **tls,
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
        with self._lock:
            self._publish_one(event)

    def publish_many(self, events: t.Sequence[OutboxEvent]) -> list[BaseException | None]:
        """Publish ``events`` together; each one's outcome, in order: ``None``
        once the broker confirmed it, else what :meth:`publish` would have
        raised for it (a :class:`~flask_idempotency.relay.BrokerUnavailable`
        for every event not confirmed when the broker went away).

        On AMQP every message is sent first and the confirms are collected
        together (pipelined publisher confirms, over py-amqp, the client
        kombu's AMQP transport uses), one broker round trip for the lot
        instead of one each. ``timeout`` bounds each send and the wait for all
        the confirms. A nack is that message's failure, and the connection is
        kept. A round cut short (the connection lost, a timeout, the broker
        closing the connection over a message) re-publishes its unconfirmed
        events one at a time as :meth:`publish` does (which tells the broker's
        failures from a message's; they may reach the broker twice) while the
        relay's batch has time. Other transports publish one event at a time."""
        with self._lock:
            if not self._pipelines():
                return self._one_by_one(events, [None] * len(events), range(len(events)))
            messages: list[Message] = []
            outcomes: list[BaseException | None] = [None] * len(events)
            sendable: list[int] = []
            try:
                self._ensure()
            except Exception as exc:
                unavailable = self._cannot_connect(exc)
                return [unavailable] * len(events)
            for i, event in enumerate(events):
                try:
                    messages.append(amqp_message(event, self.exchange.name))
                except Exception as exc:  # it cannot be encoded: its own failure
                    outcomes[i] = exc
                    self._forget_stall(event)
                else:
                    sendable.append(i)
            if not sendable:
                return outcomes
            try:
                done = self._confirming().send(messages, self.timeout)
            except Exception as exc:  # opening its channel failed: as a cut-short round
                done = Round([UNSETTLED] * len(messages), exc)
            except BaseException:
                self._drop()  # interrupted mid-round: the channel's numbering is lost
                raise
            for i, outcome in zip(sendable, done.outcomes, strict=True):
                if outcome is not UNSETTLED:
                    outcomes[i] = t.cast("BaseException | None", outcome)
                    self._forget_stall(events[i])
            if done.error is None:
                return outcomes
            logger.debug("outbox publisher: pipelined round cut short: %r", done.error)
            self._drop()  # its numbering of deliveries is no longer known
            return self._one_by_one(events, outcomes, [sendable[i] for i in done.unsettled])

    def _one_by_one(
        self,
        events: t.Sequence[OutboxEvent],
        outcomes: list[BaseException | None],
        indexes: t.Iterable[int],
    ) -> list[BaseException | None]:
        """Publish ``events[i]`` for each of ``indexes`` as :meth:`publish`
        does, into ``outcomes``; the first :class:`BrokerUnavailable` (or
        :class:`Unsent`, once the relay's batch is out of time) is the outcome
        of every one not yet tried."""
        pending, late = list(indexes), out_of_time.get()
        for n, i in enumerate(pending):
            try:
                if late is not None and late():
                    raise Unsent("not tried: the relay's batch ran out of time")
                self._publish_one(events[i])
            except BrokerUnavailable as exc:
                for j in pending[n:]:
                    outcomes[j] = exc
                break
            except Exception as exc:
                outcomes[i] = exc
        return outcomes

    def _pipelines(self) -> bool:
        """Whether this transport confirms through py-amqp (``amqp``, ``pyamqp``,
        ``amqps`` with ``confirm_publish``)."""
        scheme = self.url.split("://", 1)[0]
        return scheme in ("amqp", "pyamqp", "amqps") and bool(
            self.transport_options.get("confirm_publish")
        )

    def _confirming(self) -> ConfirmChannel:
        """The connection's channel in confirm mode, opened on first use."""
        if self._confirms is None:
            self._confirms = ConfirmChannel(self._connection.connection, self.timeout)
        return self._confirms

    def _cannot_connect(self, exc: Exception) -> BrokerUnavailable:
        """Connecting, logging in or declaring failed, which no event can cause:
        one attempt per run (the relay ends the batch), never counted toward
        parking."""
        self._drop()
        self._stalled = ("", 0)  # the broker is away: not a stall
        code = getattr(exc, "reply_code", None)
        if code in _LOGIN_CODES:
            logger.error(
                "outbox publisher: the broker refused the connection (%s: %s); "
                "check the URL's credentials, vhost and permissions. The events "
                "wait, none counts it as a failure",
                type(exc).__name__,
                exc,
            )
        unavailable = BrokerUnavailable(
            f"cannot connect to the broker: {type(exc).__name__}: {exc}"
        )
        unavailable.__cause__ = exc
        return unavailable

    def _publish_one(self, event: OutboxEvent) -> None:
        try:
            producer = self._ensure()
        except Exception as exc:
            raise self._cannot_connect(exc) from exc
        try:
            producer.publish(
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
                self._forget_stall(event)
                raise
            unavailable = self._unreachable(exc)
            blocked = self._blocked
            self._drop()
            if not unavailable:
                self._forget_stall(event)
                raise
            stalls = self._stalled[1] + 1 if self._stalled[0] == event.event_id else 1
            if blocked:
                stalls = 0  # the broker said why: an alarm, not this message
            self._stalled = (event.event_id, stalls)
            if stalls > self.STALLS:
                raise StalledMessage(
                    f"not confirmed {stalls} times in a row while the broker accepted "
                    f"connections (counted as the event's failure): "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            raise BrokerUnavailable(f"{type(exc).__name__}: {exc}") from exc
        except BaseException:  # a frame may be half sent, a confirm left unread
            self._drop()
            raise
        self._forget_stall(event)

    def _forget_stall(self, event: OutboxEvent) -> None:
        """``event``'s publish got an answer: its count of cut-offs starts again.
        (Other events going out meanwhile do not reset it: they say the broker
        is up, and so that this one's trouble is its own.)"""
        if self._stalled[0] == event.event_id:
            self._stalled = ("", 0)

    def _unreachable(self, exc: Exception) -> bool:
        """Whether ``exc``, raised while publishing on a connection that was up,
        is the broker's failure (the connection lost, timed out, or closed for
        a reason of the broker's own) rather than this message's."""
        if _refused(exc):
            return False
        code = getattr(exc, "reply_code", None)
        amqp_error = _amqp_error()
        if amqp_error is not None and isinstance(exc, amqp_error):
            # The broker closed the channel or the connection, and said why.
            return code not in MESSAGE_CODES
        if isinstance(exc, (OSError, TimeoutError)):
            return True
        if isinstance(exc, self._kombu.exceptions.OperationalError):
            return True  # kombu's wrapping of a failed connect
        connection = self._connection
        if connection is None:
            return False
        try:
            errors = (*connection.recoverable_connection_errors, *connection.connection_errors)
        except Exception:  # the transport could not even be loaded
            return False
        return isinstance(exc, errors)

    def _drop(self) -> None:
        """Forget a failed connection without talking to the broker: a graceful
        close would wait for an answer from a broker that may not give one."""
        connection, self._connection, self._producer = self._connection, None, None
        self._confirms = None
        if connection is not None:
            with contextlib.suppress(Exception):  # already broken
                connection.collect(socket_timeout=0.1)

    def close(self) -> None:
        """Close the connection (the next publish opens a new one)."""
        connection, self._connection, self._producer = self._connection, None, None
        self._confirms = None
        if connection is not None:
            with contextlib.suppress(Exception):  # already broken
                connection.release()


def _amqp_error() -> type[Exception] | None:
    try:
        from amqp.exceptions import AMQPError  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - kombu without py-amqp
        return None
    return t.cast("type[Exception]", AMQPError)


def _refused(exc: BaseException) -> bool:
    """Whether ``exc`` is the broker refusing the message (a nack): py-amqp lists
    ``MessageNacked`` among its recoverable connection errors, but the
    connection is fine and the failure is the message's."""
    try:
        from amqp.exceptions import MessageNacked
    except ImportError:  # pragma: no cover - kombu without py-amqp
        return False
    return isinstance(exc, MessageNacked)
