"""Pipelined publisher confirms on py-amqp: send a run of messages on a channel
in confirm mode, then collect the broker's answers to all of them.

The client is py-amqp, the one kombu's AMQP transport already speaks (no new
dependency, the same connection options, TLS and timeouts as
:class:`~flask_idempotency.publishers.KombuPublisher`). kombu's
``confirm_publish`` waits for each message's confirm before it sends the next:
one broker round trip per message. But a channel in confirm mode numbers its
messages 1, 2, 3, ... (the delivery tag) and the broker acks or nacks them by
that number, alone or together with every lower one (``multiple``); so the
messages of a run can all be sent first and their confirms counted as they come
back. (pika's blocking connection waits per message too; aio-pika or a Rust
client would take an event loop or a compiled dependency for what this module
does in some 150 lines.)

What a caller may rely on: an outcome of ``None`` is that message's own ack, a
:class:`MessageNacked` its own nack; a message without either (the round was
cut short) may or may not have reached the broker. Anything unexpected while
sending or waiting ends the round at once, and the channel is not to be used
again (the numbering may no longer be known).
"""

from __future__ import annotations

import contextvars
import dataclasses
import struct
import time
import typing as t

from ._failures import BrokerUnavailable

if t.TYPE_CHECKING:
    from ._messaging.outbox import OutboxEvent

#: The outcome of a message the round sent or meant to send but got no answer for.
UNSETTLED: t.Final = object()

#: ``None`` (acked), a :class:`MessageNacked` (nacked) or :data:`UNSETTLED`.
Outcome = BaseException | object | None


#: Set by the relay around ``publish_many``: whether its batch is out of time
#: (half its lease has passed). A round cut short then re-publishes its
#: unconfirmed events one at a time only while it is not: that fallback takes a
#: publish each, and a batch must not publish past its lease.
out_of_time: contextvars.ContextVar[t.Callable[[], bool] | None] = contextvars.ContextVar(
    "out_of_time", default=None
)


class Unsent(BrokerUnavailable):
    """The outcome of an event not tried because its batch ran out of time: not
    the event's failure and not an outage; the relay gives it back, due at once."""


class Message(t.NamedTuple):
    """A message ready to be framed: its body, its encoded basic properties."""

    body: bytes
    properties: bytes
    exchange: str
    routing_key: str


@dataclasses.dataclass
class Round:
    """What a round of messages got: ``outcomes[i]`` is message ``i``'s, and
    ``error`` what cut the round short (``None`` when every message was answered)."""

    outcomes: list[Outcome]
    error: BaseException | None = None

    @property
    def unsettled(self) -> list[int]:
        """The indexes of the messages without an answer, in order."""
        return [i for i, outcome in enumerate(self.outcomes) if outcome is UNSETTLED]


class ConfirmChannel:
    """A new channel of the py-amqp ``connection`` (a ``kombu.Connection``'s
    ``connection``), put in confirm mode; its deliveries counted from 1."""

    def __init__(self, connection: t.Any, timeout: float) -> None:
        from amqp.exceptions import MessageNacked  # type: ignore[import-untyped]

        self._nacked: type[BaseException] = MessageNacked
        self.connection = connection
        self.channel = connection.channel()
        # An explicit wait bounded by ``timeout`` (the connection's read timeout
        # bounds it too): confirm.select answers at once on a live broker.
        with connection.transport.having_timeout(timeout):
            self.channel.confirm_select()
        self.channel.events["basic_ack"].add(self._on_ack)
        self.channel.events["basic_nack"].add(self._on_nack)
        self._sent = 0  # the delivery tag of the last message sent
        self._first = 1  # the delivery tag of the current round's first message
        self._outcomes: list[Outcome] = []
        self._left = 0  # messages of the round without an answer
        self._low = 0  # every outcome below this index is settled

    def send(self, messages: t.Sequence[Message], timeout: float) -> Round:
        """Publish ``messages`` and
        wait for their confirms: every send bounded by ``timeout``, and the wait
        for the confirms after the last send by ``timeout`` in all."""
        self._outcomes = [UNSETTLED] * len(messages)
        self._first, self._left, self._low = self._sent + 1, len(messages), 0
        round_ = Round(self._outcomes)
        channel, connection = self.channel, self.connection
        try:
            # The frames of every message in one write: py-amqp's own
            # basic_publish writes each message's frames apart (a system call
            # each) and polls the socket before each (for a blocked-connection
            # notice, which the wait below reads as well).
            # At most WRITE bytes a write, each bounded by ``timeout`` (a socket's
            # timeout bounds a whole sendall): a round of large messages is not
            # held to one timeout for all of them.
            for data in _frames(channel.channel_id, connection.frame_max, messages):
                with connection.transport.having_timeout(timeout):
                    connection.transport.write(data)
            self._sent += len(messages)
            deadline = time.monotonic() + timeout
            while self._left:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"{self._left} of {len(messages)} confirms did not come within {timeout} s"
                    )
                try:
                    connection.drain_events(timeout=remaining)
                except TimeoutError:
                    continue  # the deadline decides
        except BaseException as exc:
            round_.error = exc
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt, SystemExit: the caller unwinds
        return round_

    def _settle(self, tag: int, multiple: bool, outcome: Outcome) -> None:
        index = tag - self._first
        outcomes = self._outcomes
        if not 0 <= index < len(outcomes):
            return  # not this round's (there is no other on this channel)
        for i in range(self._low if multiple else index, index + 1):
            if outcomes[i] is UNSETTLED:
                outcomes[i] = outcome
                self._left -= 1
        while self._low < len(outcomes) and outcomes[self._low] is not UNSETTLED:
            self._low += 1

    def _on_ack(self, tag: int, multiple: bool) -> None:
        self._settle(tag, multiple, None)

    def _on_nack(self, tag: int, multiple: bool) -> None:
        self._settle(tag, multiple, self._nacked("the broker refused the message (basic.nack)"))


#: The basic properties a message has (flags bit 15 down): content type,
#: content encoding, headers, delivery mode, priority, and message id (bit 7).
_FLAGS = struct.pack(">H", 0x8000 | 0x4000 | 0x2000 | 0x1000 | 0x0800 | 0x0080)


def amqp_message(event: OutboxEvent, exchange: str) -> Message:
    """``event`` as the AMQP message kombu's producer makes of it: the body
    JSON by kombu's serializer, the event's headers, its id as
    ``message_id``, persistent, priority 0 (the same properties, encoded as
    py-amqp encodes them); with its exchange and routing key."""
    from amqp import serialization  # type: ignore[import-untyped]
    from kombu.utils import json

    dumps: t.Callable[[str, tuple[t.Any, ...]], bytes] = serialization.dumps
    to_json: t.Callable[[t.Any], str] = json.dumps
    body = to_json(event.payload).encode("utf-8")
    properties = _FLAGS + dumps(
        "ssFoos",
        ("application/json", "utf-8", dict(event.headers), 2, 0, event.event_id),
    )
    return Message(body, properties, exchange, event.topic)


#: A method frame's start: type 1 (method); a content header's payload start:
#: class 60 (basic), weight 0; basic.publish is class 60, method 40.
_PUBLISH = struct.pack(">HH", 60, 40)
_END = b"\xce"


#: The most bytes of frames sent in one write (more when one message is larger).
WRITE = 256 * 1024


def _frames(channel: int, frame_max: int, messages: t.Sequence[Message]) -> t.Iterator[bytes]:
    """The AMQP 0-9-1 frames that publish ``messages`` on ``channel``, about
    :data:`WRITE` bytes at a time: for each message, a basic.publish method
    frame, a content header frame and the body in frames of at most
    ``frame_max`` bytes (8 of them the frame's own)."""
    from amqp import serialization

    dumps: t.Callable[[str, tuple[t.Any, ...]], bytes] = serialization.dumps
    pack, chunk = struct.pack, frame_max - 8
    arguments: dict[tuple[str, str], bytes] = {}  # a batch's few topics, encoded once
    parts: list[bytes] = []
    size = 0
    for body, properties, exchange, routing_key in messages:
        args = arguments.get((exchange, routing_key))
        if args is None:
            args = arguments[(exchange, routing_key)] = _PUBLISH + dumps(
                "Bssbb", (0, exchange, routing_key, False, False)
            )
        header = pack(">HHQ", 60, 0, len(body)) + properties
        parts += (pack(">BHI", 1, channel, len(args)), args, _END)
        parts += (pack(">BHI", 2, channel, len(header)), header, _END)
        for start in range(0, len(body), chunk):
            piece = body[start : start + chunk]
            parts += (pack(">BHI", 3, channel, len(piece)), piece, _END)
        size += len(args) + len(header) + len(body) + 24
        if size >= WRITE:
            yield b"".join(parts)
            parts, size = [], 0
    if parts:
        yield b"".join(parts)
