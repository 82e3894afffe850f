"""Exceptions every module may raise: the base of the extension's errors, and
those raised and handled inside the extension (each becomes one of the answers
of :mod:`flask_idempotency.errors`, which exports them)."""

from __future__ import annotations


class IdempotencyError(Exception):
    """Base class of every error this extension raises."""


class ClaimWaitExceeded(IdempotencyError):
    """The database gave up on this transaction while the claim waited (lock
    timeout, deadlock victim, serialization failure): on another request with
    the same key, or on an unrelated writer (``on_record``)."""

    def __init__(self, message: str, *, on_record: bool | None = None) -> None:
        super().__init__(message)
        #: The wait was on the key's own record (``True``), not on it
        #: (``False``), or the database's error does not say (``None``).
        self.on_record = on_record


class TooLargeToStore(IdempotencyError):
    """The request to keep for the recovery job is larger than the database takes
    in one statement (MySQL's ``max_allowed_packet``)."""


class RecordGone(IdempotencyError):
    """A recovery run found no abandoned record to resume (someone else finished it)."""


class EventIdConflictError(IdempotencyError):
    """An outbox event id already names another event (another topic or payload).

    Raised by ``idem.emit`` and ``add_event`` in the caller's transaction, which
    stays usable; nothing was added. Not an HTTP error: it is a bug in the
    caller (two events given one name, or a named event whose payload differs
    between attempts), and a view that lets it through fails as for any error.
    """


class BrokerUnavailable(IdempotencyError):
    """Raised by a publisher when the broker cannot be reached (connection
    refused, lost, timed out): the failure is not the event's.

    The relay then stops the batch (the next events would only wait on the same
    broker) and gives the event back as it was, its attempts unchanged and
    ``last_error`` set: an outage never counts toward parking, and the events
    flow again, in order, without an operator. A message the broker refused
    (a nack) is the event's failure: raise something else for it.
    """


class StalledMessage(IdempotencyError):
    """The same event's publish was cut off or timed out
    :attr:`KombuPublisher.STALLS` times in a row while the broker kept
    accepting connections: counted as the event's failure (see
    :class:`KombuPublisher`)."""


class SealBroken(IdempotencyError):
    """A sealed value (encryption at rest) cannot be opened: its key id is not
    configured, or it does not open for its place (altered, or copied from
    another record). Answered as ``RecordUnreadableError`` (500)."""

    def __init__(self, where: str, key_id: str, why: str) -> None:
        super().__init__(f"{where}: sealed with key id {key_id!r}, and {why}")
        #: The column and record (or event) whose value did not open.
        self.where = where
        #: The key id the value names.
        self.key_id = key_id
        #: Why it did not open.
        self.why = why


# Exported by flask_idempotency.errors (the first four documented there): named
# by it, so that a span's or log's exception type reads as before the split.
for _public in (
    IdempotencyError,
    EventIdConflictError,
    BrokerUnavailable,
    StalledMessage,
    ClaimWaitExceeded,
    TooLargeToStore,
    RecordGone,
):
    _public.__module__ = "flask_idempotency.errors"
