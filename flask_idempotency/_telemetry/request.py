"""One protected request, observed: its outcome, counted once, with the
durations of its phases, its spans (:mod:`.spans`) and one structured log line.

The request flow marks what only it knows (a replay, a duplicate that waited,
a failure recorded after the view committed) and times its phases; the
wrapper around it calls :meth:`RequestTelemetry.finish` or
:meth:`RequestTelemetry.fail` exactly once, and the outcome is decided there:
from the flow's marks, else from the answer or the exception. Nothing here
needs OpenTelemetry: without it the log line is all that is written.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
import typing as t

from ..errors import (
    ConflictError,
    DatabaseUnavailableError,
    FailedAfterCommitError,
    InvalidKeyError,
    KeyErasedError,
    KeyReusedError,
    LeaseLostError,
    LengthRequiredError,
    MalformedBodyError,
    MissingKeyError,
    PayloadTooLargeError,
    ServerMisconfiguredError,
    TransactionConflictError,
    UnsupportedMediaTypeError,
    ValidationProblem,
)

if t.TYPE_CHECKING:
    from types import ModuleType

logger = logging.getLogger("flask_idempotency")

# -- the outcomes (``idempotency.outcome``) -----------------------------------------

#: The view ran and its answer was given (stored or not).
EXECUTED = "executed"
#: A retry of a completed operation got the stored response.
REPLAYED = "replayed"
#: A duplicate that arrived while the first request ran waited for it, then got its response.
WAITED_REPLAYED = "waited_replayed"
#: 409 ``request-in-progress``: another request holds the key.
IN_FLIGHT = "in_flight"
#: 422 ``key-reused``: the key was used with another payload.
MISMATCH = "mismatch"
#: 400 ``missing-key`` or ``invalid-key`` (``idempotency.key_refusal`` says which).
KEY_REFUSED = "key_refused"
#: 400, 411, 413, 415 or 422 for the body (malformed, too large, failed the schema).
INVALID_PAYLOAD = "invalid_payload"
#: 503 ``database-unavailable``.
UNAVAILABLE = "unavailable"
#: 409 ``transaction-conflict``: the database was busy (a lock timeout, a deadlock).
BUSY = "busy"
#: 409 ``lease-lost``: the request outlived its lease and another took the key over.
LEASE_LOST = "lease_lost"
#: The view (or the flow) raised: its work was rolled back, a retry runs again.
FAILED = "failed"
#: The view committed work of its own, then failed: recorded, never run again.
FAILED_AFTER_COMMIT = "failed_after_commit"
#: No key on a route that does not require one (or ``skip`` said so): run unprotected.
PASSED_THROUGH = "passed_through"
#: 500 ``server-misconfigured``: a table of the extension's is missing. Nothing stored.
MISCONFIGURED = "misconfigured"
#: The replay guard refused a retry its stored answer (403, or the app's own error).
REPLAY_REFUSED = "replay_refused"
#: 410 ``key-erased``: the key's record is a tombstone (its data erased).
ERASED = "erased"
#: A retry found an operation whose answer was lost (``failed-after-commit``, or a
#: leased holder gone) and the app's reconcile hook rebuilt it: stored and replayed.
RECONCILED = "reconciled"

OUTCOMES = (
    EXECUTED,
    REPLAYED,
    WAITED_REPLAYED,
    IN_FLIGHT,
    MISMATCH,
    KEY_REFUSED,
    INVALID_PAYLOAD,
    UNAVAILABLE,
    BUSY,
    LEASE_LOST,
    FAILED,
    FAILED_AFTER_COMMIT,
    PASSED_THROUGH,
    MISCONFIGURED,
    REPLAY_REFUSED,
    ERASED,
    RECONCILED,
)
#: ``idempotency.key_refusal``, with ``key_refused`` only.
KEY_REFUSALS = ("missing", "malformed", "too_long")

_REPLAYS = frozenset({REPLAYED, WAITED_REPLAYED, RECONCILED})
#: Outcomes logged at WARNING: this side failed. The rest (the client's
#: mistakes and duplicates included) at INFO.
_WARNINGS = frozenset({UNAVAILABLE, BUSY, LEASE_LOST, FAILED, FAILED_AFTER_COMMIT, MISCONFIGURED})

_INVALID_PAYLOAD = (
    MalformedBodyError,
    ValidationProblem,
    UnsupportedMediaTypeError,
    PayloadTooLargeError,
    LengthRequiredError,
)


def outcome_of(error: BaseException) -> tuple[str, str | None]:
    """The outcome of a request that ended with ``error``, and the key refusal."""
    if isinstance(error, MissingKeyError):
        return KEY_REFUSED, "missing"
    if isinstance(error, InvalidKeyError):
        return KEY_REFUSED, error.reason
    if isinstance(error, _INVALID_PAYLOAD):
        return INVALID_PAYLOAD, None
    if isinstance(error, KeyReusedError):
        return MISMATCH, None
    if isinstance(error, KeyErasedError):
        return ERASED, None
    if isinstance(error, TransactionConflictError):
        return BUSY, None
    if isinstance(error, LeaseLostError):
        return LEASE_LOST, None
    if isinstance(error, ConflictError):
        return IN_FLIGHT, None
    if isinstance(error, DatabaseUnavailableError):
        return UNAVAILABLE, None
    if isinstance(error, FailedAfterCommitError):
        return FAILED_AFTER_COMMIT, None
    if isinstance(error, ServerMisconfiguredError):
        return MISCONFIGURED, None
    return FAILED, None


class _NoPhase:
    """A phase when there is nothing to trace."""

    __slots__ = ()

    def end(self, outcome: str | None, error: BaseException | None) -> None:
        pass

    def child(self, name: str, route: str, outcome: str | None) -> None:
        pass


_NO_PHASE = _NoPhase()


class Timed:
    """A phase of the request (``with telemetry.claim(): ...``): timed, and
    traced as a span when OpenTelemetry is there."""

    __slots__ = ("_phase", "_request", "_started", "kind")

    def __init__(self, request: RequestTelemetry, kind: str) -> None:
        self._request = request
        self.kind = kind
        self._started = 0
        self._phase: t.Any = _NO_PHASE

    def __enter__(self) -> Timed:
        request = self._request
        spans = request.spans
        if request.tracing and spans is not None:
            try:
                if request.parent is None:
                    request.parent = spans.parent()
                replay = self.kind == "replay"
                self._phase = spans.Phase(
                    _NAMES[self.kind],
                    request.parent,
                    request.route,
                    # A replay's outcome is marked before it starts and stays.
                    request.marked if replay else None,
                    not replay,  # a replay runs no statement: no child spans
                )
            except Exception:  # telemetry never fails a request
                logger.debug("tracing: starting a span failed", exc_info=True)
        self._started = time.perf_counter_ns()
        return self

    def __exit__(self, kind: t.Any, error: BaseException | None, tb: t.Any) -> None:
        took = time.perf_counter_ns() - self._started
        request = self._request
        if self.kind == "claim":
            request.claim_ns += took
            if request.waited:
                request.wait_ns += took
        outcome = request.marked
        if error is not None and outcome is None:
            outcome = outcome_of(error)[0] if isinstance(error, _KNOWN) else None
        elif outcome is None and self.kind == "complete":
            outcome = EXECUTED  # the view's answer is stored: the request executed
        try:
            if self.kind == "claim" and request.waited:
                self._phase.child("idempotency wait", request.route, outcome)
            self._phase.end(outcome, error)
        except Exception:  # telemetry never fails a request
            logger.debug("tracing: ending a span failed", exc_info=True)


_NAMES = {kind: "idempotency " + kind for kind in ("claim", "replay", "complete")}

_KNOWN = (
    MissingKeyError,
    InvalidKeyError,
    *_INVALID_PAYLOAD,
    KeyReusedError,
    ConflictError,
    DatabaseUnavailableError,
    FailedAfterCommitError,
)


class RequestTelemetry:
    """The observation of one request to a protected route (see the module)."""

    __slots__ = (
        "_metrics",
        "_started",
        "claim_began",
        "claim_ns",
        "counted",
        "marked",
        "method",
        "parent",
        "route",
        "spans",
        "stored_size",
        "tracing",
        "wait_ns",
        "waited",
    )

    def __init__(
        self, route: str, method: str, metrics: ModuleType | None, spans: ModuleType | None
    ) -> None:
        self.route = route
        self.method = method
        # Only where a provider records: the API's stand-ins would take the
        # calls and keep nothing, at the cost of making them (:func:`.spans.recording`).
        self._metrics = metrics if metrics is not None and metrics.recording() else None
        self.spans = spans
        #: Whether the request's phases are traced as spans.
        self.tracing = spans is not None and bool(spans.recording())
        self.parent: t.Any = None
        self._started = time.perf_counter_ns()
        #: The app's clock when the request first tried to claim (or, on an
        #: optimistic route, ran the view): a record completed after it was
        #: completed by a request that ran at the same time.
        self.claim_began: dt.datetime | None = None
        self.claim_ns = 0
        self.wait_ns = 0
        self.waited = False
        self.marked: str | None = None
        self.stored_size: int | None = None
        self.counted = True

    # -- what the flow marks ---------------------------------------------------------

    def claim(self) -> Timed:
        """The claim phase: ``with telemetry.claim(): ...``."""
        return Timed(self, "claim")

    def replay(self) -> Timed:
        """Building the stored answer for a retry."""
        return Timed(self, "replay")

    def complete(self) -> Timed:
        """Storing the answer on the record and committing it."""
        return Timed(self, "complete")

    def began(self, now: dt.datetime) -> None:
        """The request is about to claim (or run an optimistic view) at ``now``."""
        if self.claim_began is None:
            self.claim_began = now

    def found_completed(self, completed_at: dt.datetime | None) -> None:
        """The key's record is completed: a replay, or a duplicate's wait's end
        when the record was completed after this request began (unless its
        answer was just rebuilt: :meth:`reconciled`)."""
        if self.marked == RECONCILED:
            return
        began = self.claim_began
        waited = completed_at is not None and began is not None and completed_at > began
        self.waited = self.waited or waited
        self.marked = WAITED_REPLAYED if self.waited else REPLAYED

    def reconciled(self) -> None:
        """The reconcile hook rebuilt the answer this retry gets."""
        self.marked = RECONCILED

    def wait_exceeded(self) -> None:
        """The database gave up on the claim's wait for another request."""
        self.waited = True

    def passed_through(self) -> None:
        self.marked = PASSED_THROUGH

    def failed_after_commit(self) -> None:
        self.marked = FAILED_AFTER_COMMIT

    def replay_refused(self) -> None:
        """The replay guard runs: whatever it raises ends the request as ``replay_refused``."""
        self.marked = REPLAY_REFUSED

    def stored(self, size: int) -> None:
        """The answer was stored, its body ``size`` bytes (0: not kept)."""
        self.stored_size = size

    def ignore(self) -> None:
        """Not a protected request (a safe method, a recovery re-run): not counted."""
        self.counted = False

    # -- the end, once ---------------------------------------------------------------

    def finish(self) -> None:
        """The flow answered."""
        self._end(self.marked or EXECUTED, None, None)

    def fail(self, error: BaseException) -> None:
        """The flow ended with ``error`` (after the database problem it maps to, if any)."""
        if self.marked in (FAILED_AFTER_COMMIT, REPLAY_REFUSED):
            self._end(self.marked, None, error)
            return
        outcome, refusal = outcome_of(error)
        self._end(outcome, refusal, error)

    def _end(self, outcome: str, refusal: str | None, error: BaseException | None) -> None:
        if not self.counted:
            return
        try:
            self._emit(outcome, refusal, error)
        except Exception:  # telemetry never fails a request
            logger.debug("telemetry: recording the request failed", exc_info=True)

    def _emit(self, outcome: str, refusal: str | None, error: BaseException | None) -> None:
        took = time.perf_counter_ns() - self._started
        metrics = self._metrics
        if metrics is not None:
            try:
                self._record(metrics.instruments(), outcome, refusal, took)
            except Exception:  # the log line still goes out
                logger.debug("metrics: recording the request failed", exc_info=True)
        trace_id = span_id = None
        if self.spans is not None:
            trace_id, span_id = self.spans.mark_current(outcome)
        level = logging.WARNING if outcome in _WARNINGS else logging.INFO
        if logger.isEnabledFor(level):
            extra: dict[str, t.Any] = {
                "idempotency_outcome": outcome,
                "http_route": self.route,
                "http_request_method": self.method,
                "duration_ms": round(took / 1e6, 3),
                "trace_id": trace_id,
                "span_id": span_id,
            }
            if refusal is not None:
                extra["idempotency_key_refusal"] = refusal
            if error is not None:
                extra["error_type"] = type(error).__name__
            logger.log(level, "idempotency request", extra=extra)

    def _record(self, instruments: t.Any, outcome: str, refusal: str | None, took: int) -> None:
        attributes = instruments.request_attributes(self.route, self.method, outcome, refusal)
        instruments.requests.add(1, attributes)
        if self.claim_ns:
            instruments.claim_duration.record(self.claim_ns / 1e9, attributes)
        if self.waited:
            instruments.wait_duration.record(self.wait_ns / 1e9, attributes)
        if outcome in _REPLAYS:
            instruments.replay_duration.record(took / 1e9, attributes)
        if self.stored_size is not None:
            route = instruments.route_attributes(self.route, self.method)
            instruments.response_size.record(self.stored_size, route)
