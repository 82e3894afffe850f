"""Errors a client sees, as RFC 9457 ``application/problem+json`` responses.

Each is a :class:`werkzeug.exceptions.HTTPException`, so an app can register its
own error handler for any of them. The ``type`` member is a stable URI a client
may switch on; ``title`` is fixed per type; ``detail`` is for humans.

Every error of the extension is an :class:`IdempotencyError`::

    IdempotencyError
    +-- ProblemError (HTTP, problem+json): what a client sees
    |   +-- MissingKeyError, InvalidKeyError, MalformedBodyError,
    |   |   UnsupportedMediaTypeError, PayloadTooLargeError, LengthRequiredError,
    |   |   ValidationProblem, KeyReusedError, NothingToRecoverError,
    |   |   ReplayRefusedError, KeyErasedError (4xx)
    |   |   +-- FormKeyError (an InvalidKeyError), FormKeyExpiredError (400)
    |   |   +-- RulesChangedError (a KeyReusedError, 422)
    |   +-- ConflictError (409)
    |   |   +-- TransactionConflictError, LeaseLostError
    |   +-- FailedAfterCommitError, StepNotStoredError, RecordUnreadableError,
    |       DatabaseUnavailableError, ServerMisconfiguredError (5xx)
    +-- EventIdConflictError: an outbox event id already names another event
    +-- BrokerUnavailable: a publisher cannot reach the broker (the relay retries)
    +-- StalledMessage: one event's publish stalled again and again (its failure)
    +-- ClaimWaitExceeded, TooLargeToStore, RecordGone: raised and handled inside
        the extension (each becomes one of the answers above); never seen by a view
"""

from __future__ import annotations

import json
import math
import typing as t
from datetime import timedelta

from werkzeug.exceptions import HTTPException
from werkzeug.sansio.response import Response as SansIOResponse
from werkzeug.wrappers import Response

from . import _pages
from ._failures import BrokerUnavailable, EventIdConflictError, IdempotencyError, StalledMessage
from ._failures import ClaimWaitExceeded as ClaimWaitExceeded
from ._failures import RecordGone as RecordGone
from ._failures import TooLargeToStore as TooLargeToStore

__all__ = [
    "PROBLEM_JSON",
    "PROBLEM_TYPE_BASE",
    "BrokerUnavailable",
    "ConflictError",
    "DatabaseUnavailableError",
    "EventIdConflictError",
    "FailedAfterCommitError",
    "FormKeyError",
    "FormKeyExpiredError",
    "IdempotencyError",
    "InvalidKeyError",
    "KeyErasedError",
    "KeyReusedError",
    "LeaseLostError",
    "LengthRequiredError",
    "MalformedBodyError",
    "MissingKeyError",
    "NothingToRecoverError",
    "OperationInProgressError",
    "PayloadTooLargeError",
    "ProblemError",
    "RecordUnreadableError",
    "ReplayRefusedError",
    "RulesChangedError",
    "ServerMisconfiguredError",
    "StalledMessage",
    "StepNotStoredError",
    "TransactionConflictError",
    "UnsupportedMediaTypeError",
    "ValidationProblem",
]

#: What every problem type URI starts with; the slug after it names the type
#: (``tag:flask-idempotency,2026:problem/key-reused``), stable across releases.
PROBLEM_TYPE_BASE = "tag:flask-idempotency,2026:problem/"
#: The media type of every error the extension answers (RFC 9457).
PROBLEM_JSON = "application/problem+json"


class ProblemError(HTTPException, IdempotencyError):
    """An HTTP error answered with an ``application/problem+json`` body."""

    slug = "error"
    title = "Idempotency error"
    #: ``None`` on this base class alone, so that Flask files a handler for it
    #: (``@app.errorhandler(ProblemError)``) for every status: each subclass
    #: has its own, and an instance of this class answers 400.
    code: int | None = None
    #: What a person who sent a form reads on the default page (the ``detail``
    #: is written for API clients); ``None``: the detail.
    visitor: str | None = None

    def __init__(
        self,
        detail: str,
        *,
        extra: t.Mapping[str, t.Any] | None = None,
        headers: t.Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(description=detail)
        if self.code is None:
            self.code = 400
        self.detail = detail
        self.extra = dict(extra or {})
        self.extra_headers = dict(headers or {})

    @property
    def type_uri(self) -> str:
        return PROBLEM_TYPE_BASE + self.slug

    def problem(self) -> dict[str, t.Any]:
        """The problem document, as a dict."""
        return {
            "type": self.type_uri,
            "title": self.title,
            "status": self.code,
            "detail": self.detail,
            **self.extra,
        }

    def get_response(  # type: ignore[override]
        self,
        environ: t.Any = None,
        scope: t.Any = None,
    ) -> SansIOResponse:
        """``application/problem+json``; a short HTML page instead for a browser
        (``Accept`` prefers ``text/html``) that sent a form (its key came from a
        rendered form, or its body is a form), worded for the person who sent it
        (:attr:`visitor`)."""
        if self._page_wanted(environ):
            response = Response(self.html_page(), status=self.code, content_type="text/html")
        else:
            body = json.dumps(self.problem(), separators=(",", ":"), sort_keys=True)
            response = Response(body, status=self.code, content_type=PROBLEM_JSON)
        for name, value in self.extra_headers.items():
            response.headers[name] = value
        return response

    def _page_wanted(self, environ: t.Any) -> bool:
        return _pages.wanted(environ, PROBLEM_JSON, from_form=isinstance(self, FormKeyError))

    def html_page(self) -> str:
        """The default page a browser gets: the title and :attr:`visitor` (else
        the detail), escaped."""
        return _pages.render(self.title, self.visitor if self.visitor is not None else self.detail)


class InvalidKeyError(ProblemError):
    """The ``Idempotency-Key`` header is malformed (400).

    ``reason`` is ``"too_long"`` for a key over the length limit, else
    ``"malformed"`` (the metrics' ``idempotency.key_refusal``)."""

    slug = "invalid-key"
    title = "Invalid idempotency key"
    code = 400
    default_reason = "malformed"

    def __init__(
        self,
        detail: str,
        *,
        reason: str | None = None,
        extra: t.Mapping[str, t.Any] | None = None,
        headers: t.Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(detail, extra=extra, headers=headers)
        self.reason = reason or self.default_reason


class FormKeyError(InvalidKeyError):
    """A form's key (the hidden field ``idempotency_field()`` renders, or the
    rendered token sent as the header) is refused (400); nothing ran or was stored.

    ``reason`` says why: ``"forged"`` (not signed by this app, altered, or
    unreadable), ``"expired"`` (older than ``IDEMPOTENCY_FORM_KEY_MAX_AGE``),
    ``"other_caller"`` (rendered for another user or session) or ``"other_form"``
    (rendered for another endpoint). The problem's type is ``form-key-expired``
    (:class:`FormKeyExpiredError`) for the one a user fixes by reloading the page,
    ``form-key-invalid`` for the rest. A browser gets a plain HTML page; register
    ``@app.errorhandler(FormKeyError)`` to render your own.
    """

    slug = "form-key-invalid"
    title = "This form cannot be submitted"
    code = 400
    default_reason = "forged"


class FormKeyExpiredError(FormKeyError):
    """A :class:`FormKeyError` whose form is older than ``IDEMPOTENCY_FORM_KEY_MAX_AGE``
    (``reason`` ``"expired"``): reloading the page fixes it."""

    slug = "form-key-expired"
    title = "This form has expired"

    def __init__(self, detail: str) -> None:
        super().__init__(detail, reason="expired")


class MissingKeyError(ProblemError):
    """The route requires an ``Idempotency-Key`` and the request has none (400)."""

    slug = "missing-key"
    title = "Idempotency key required"
    visitor = (
        "This form cannot be sent as it is (it carries no key: the page may be older "
        "than the site). Reload the page and send it again."
    )
    code = 400


class MalformedBodyError(ProblemError):
    """The body is not the JSON the route needs (400)."""

    slug = "malformed-body"
    title = "Malformed request body"
    code = 400


class UnsupportedMediaTypeError(ProblemError):
    """The route needs a JSON body and got another content type (415)."""

    slug = "unsupported-media-type"
    title = "Unsupported media type"
    code = 415


class PayloadTooLargeError(ProblemError):
    """The request body is larger than the app accepts (413)."""

    slug = "payload-too-large"
    title = "Request body too large"
    code = 413


class LengthRequiredError(ProblemError):
    """A chunked body the WSGI server cannot deliver; send Content-Length (411)."""

    slug = "length-required"
    title = "Content-Length required"
    code = 411


class ValidationProblem(ProblemError):
    """The body failed the route's marshmallow schema (422); ``errors`` lists why."""

    slug = "validation-failed"
    title = "Request body failed validation"
    code = 422


class KeyReusedError(ProblemError):
    """The key was used before with a different payload (422)."""

    slug = "key-reused"
    title = "Idempotency key reused with a different payload"
    visitor = (
        "This form was already sent with other values, and that first submission "
        "stands. To send new values, reload the page and fill it in again."
    )
    code = 422


class RulesChangedError(KeyReusedError):
    """The key was used under other fingerprint rules, with other bytes (422)."""

    slug = "fingerprint-rules-changed"
    title = "Idempotency key used before the route's fingerprint rules changed"
    visitor = "This form changed since it was sent. Reload the page and fill it in again."


class ConflictError(ProblemError):
    """A request with this key is still in progress (409, with ``Retry-After``)."""

    slug = "request-in-progress"
    title = "A request with this idempotency key is in progress"
    visitor = (
        "This form is still being processed. Wait a moment, then reload this page to "
        "see the result: it will not be done twice."
    )
    code = 409

    def __init__(self, detail: str, *, retry_after: timedelta) -> None:
        seconds = max(1, math.ceil(retry_after.total_seconds()))
        super().__init__(detail, headers={"Retry-After": str(seconds)})
        self.retry_after = seconds


class TransactionConflictError(ConflictError):
    """The database aborted the request's transaction for a concurrent one: a lock
    timeout, a deadlock or a serialization failure (409, ``Retry-After``). Its
    writes were rolled back; a retry with the same key runs again."""

    slug = "transaction-conflict"
    title = "The request conflicted with a concurrent transaction"
    visitor = "The site is busy. Send the form again in a moment: it will not be done twice."


class LeaseLostError(ConflictError):
    """This request's lease was taken over by another; its work was rolled back (409)."""

    slug = "lease-lost"
    title = "The lease on this idempotency key was lost"


class OperationInProgressError(ConflictError):
    """An idempotent function's call with this key is still running (``idem.function``):
    the caller waited its ``wait`` for it, or it runs under a lease. ``retry_after``: seconds."""

    slug = "operation-in-progress"
    title = "An operation with this idempotency key is in progress"


class FailedAfterCommitError(ProblemError):
    """The view failed after committing work of its own (500): recorded, so retries
    get this answer instead of running the operation a second time."""

    slug = "failed-after-commit"
    title = "The request failed after committing part of its work"
    visitor = (
        "Something went wrong after your submission was recorded. Do not send it again: "
        "check its result first (your orders, your account), or contact the site."
    )
    code = 500

    def __init__(
        self,
        detail: str = (
            "This request failed after it had committed part of its work, so it will not "
            "run again with this idempotency key. Check the resource's state before "
            "sending a new operation with a new key."
        ),
    ) -> None:
        super().__init__(detail)


class StepNotStoredError(ProblemError):
    """A step (``idem.step``) ran but its result, not JSON or larger than the database
    takes, could not be saved: the view's bug (500). The step is marked done, so every
    retry gets this answer until the record expires or an operator releases it
    (``flask idempotency release --override recovery-points``: the step runs again)."""

    slug = "step-not-stored"
    title = "A step of the operation ran but its result could not be saved"
    code = 500


class ReplayRefusedError(ProblemError):
    """The replay guard refused to give this caller the stored answer (403);
    nothing changed, and the record stays for a retry the guard allows."""

    slug = "replay-refused"
    title = "The stored response is not replayed to this caller"
    code = 403


class KeyErasedError(ProblemError):
    """The operation's stored data was erased (``idem.erase``, ``flask idempotency
    erase``) and its record kept as a tombstone until it expires (410): the
    operation ran once and will not run again with this key, and its answer is
    gone."""

    slug = "key-erased"
    title = "The data of this idempotency key was erased"
    visitor = (
        "This form was already sent, and what it did was since erased at someone's "
        "request. It will not be done again: reload the page to start anew."
    )
    code = 410


class RecordUnreadableError(ProblemError):
    """The stored record exists but cannot be opened (500): it was sealed with an
    encryption key that is no longer configured, or its sealed data does not
    belong to it (copied from another record, altered). Nothing ran and nothing
    changed; the log names the key id. A retry gets the same answer until an
    operator configures the key again."""

    slug = "record-unreadable"
    title = "The stored record cannot be opened"
    code = 500


class NothingToRecoverError(ProblemError):
    """A recovery run found the record finished or gone (409); only the recovery job sees it."""

    slug = "nothing-to-recover"
    title = "Nothing to recover"
    code = 409


class DatabaseUnavailableError(ProblemError):
    """The database could not be reached or dropped the connection (503, ``Retry-After``).

    The request's transaction was rolled back, unless the connection broke
    during its ``COMMIT``: then the outcome is unknown. Either way a retry with
    the same key is safe: the record commits with the business rows, so the
    retry runs the request or replays it.
    """

    slug = "database-unavailable"
    title = "The database is unavailable"
    visitor = (
        "The site cannot take this form right now. Send it again in a minute: it will "
        "not be done twice."
    )
    code = 503

    def __init__(
        self,
        detail: str,
        *,
        retry_after: timedelta = timedelta(seconds=1),
        extra: t.Mapping[str, t.Any] | None = None,
        headers: t.Mapping[str, str] | None = None,
    ) -> None:
        seconds = max(1, math.ceil(retry_after.total_seconds()))
        super().__init__(
            detail, extra=extra, headers={**(headers or {}), "Retry-After": str(seconds)}
        )
        self.retry_after = seconds


class ServerMisconfiguredError(ProblemError):
    """A table of the extension's is missing (503, ``Retry-After``: :attr:`RETRY_AFTER`,
    so retrying clients do not hammer a host readiness reports not ready). The
    transaction rolled back: no record was stored, nothing written to the database
    kept (work the view did outside it is not undone). Once an operator has created
    the table (``flask idempotency create-tables``), a retry with the key runs it."""

    slug = "server-misconfigured"
    title = "The server is misconfigured"
    visitor = (
        "The site cannot take this form right now. Send it again later: it will not be done twice."
    )
    code = 503
    #: Seconds a client should wait before it retries.
    RETRY_AFTER = 30

    def __init__(self, detail: str) -> None:
        super().__init__(detail, headers={"Retry-After": str(self.RETRY_AFTER)})
        self.retry_after = self.RETRY_AFTER
