"""Response capture (what is stored, and whether it may be) and replay."""

from __future__ import annotations

import dataclasses
import json

from flask import Response

from .._contract import NEVER_REPLAYED, REPLAYED_HEADER
from .._storage.schema import ERASED, Record
from ..errors import PROBLEM_JSON, PROBLEM_TYPE_BASE, FailedAfterCommitError, KeyErasedError
from . import answer


@dataclasses.dataclass(frozen=True)
class Captured:
    """What is stored of a response."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes | None
    body_omitted: bool


def capture(response: Response, header_names: frozenset[str] | None, max_body: int) -> Captured:
    """Take the status, the replayable headers and (if small and not streamed) the body.

    ``header_names`` are the lower-cased headers kept; ``None`` keeps every
    header but :data:`NEVER_REPLAYED` and those the ``Connection`` header names.

    A streamed response is never read here: the client still gets it whole, and
    the record keeps only status and headers.
    """
    never = NEVER_REPLAYED | {
        name.strip().lower() for name in response.headers.get("Connection", "").split(",")
    }
    if header_names is None:
        headers = [(k, v) for k, v in response.headers.items() if k.lower() not in never]
    else:
        headers = [
            (k, v)
            for k, v in response.headers.items()
            if k.lower() in header_names and k.lower() not in never
        ]
    body: bytes | None = None
    if not response.is_streamed and not response.direct_passthrough:
        data = response.get_data()
        if len(data) <= max_body:
            body = data
    return Captured(response.status_code, headers, body, body_omitted=body is None)


def erased_error() -> KeyErasedError:
    """The answer to a request that finds its key's record erased (a tombstone)."""
    return KeyErasedError(
        "The data of the operation with this idempotency key was erased: it ran once, "
        "it does not run again with this key, and its answer is no longer kept. Do not "
        "retry it; ask the service for the state of what it did."
    )


def replay(record: Record) -> Response:
    """The stored response: same status, byte-identical body, stored safe headers.

    When the body was not kept, the answer keeps the original status (the
    operation did succeed) and explains in a problem+json body, with the original
    ``Location`` if there was one. An erased record (a tombstone) has no
    response: :class:`~flask_idempotency.errors.KeyErasedError`.
    """
    if record.status == ERASED:
        raise erased_error()
    assert record.response_code is not None
    if record.body_omitted or record.response_body is None:
        response = Response(
            json.dumps(
                {
                    "type": PROBLEM_TYPE_BASE + "response-not-stored",
                    "title": "The original response body was not kept",
                    "status": record.response_code,
                    "detail": (
                        "This request was already processed with this idempotency key; "
                        "its response body was too large or streamed, so it cannot be "
                        "replayed. Fetch the resource (see Location, if present)."
                    ),
                },
                sort_keys=True,
                separators=(",", ":"),
            ),
            status=record.response_code,
            content_type=PROBLEM_JSON,
        )
        for name, value in record.response_headers:
            if name.lower() == "location":
                response.headers[name] = value
    else:
        response = Response(record.response_body, status=record.response_code)
        # The stored headers replace the defaults, Content-Type included, so a
        # replay is what the client would have seen the first time.
        response.headers.remove("Content-Type")
        for name, value in record.response_headers:
            response.headers.add(name, value)
    response.headers[REPLAYED_HEADER] = "true"
    return response


def replay_answer(record: Record, *, reconciled: bool | None = None) -> Response:
    """:func:`replay`, for the answer to a retry: a ``failed-after-commit`` the
    extension stored is rendered as the app answers its problems (``answer``).
    ``reconciled=False``: the app's reconcile hook was asked and rebuilt no
    answer, which the problem says (member ``"reconciled": false``)."""
    response = replay(record)
    problem = _stored_problem(record)
    if problem is not None and reconciled is False:
        problem = FailedAfterCommitError(
            f"{problem.detail} The service could not rebuild its answer from what was committed."
        )
        problem.extra["reconciled"] = False
    return response if problem is None else answer.stored(response, problem)


def stored_failure(record: Record) -> bool:
    """Whether ``record``'s answer is the ``failed-after-commit`` the extension
    stored (not an answer of the view's that looks alike)."""
    return _stored_problem(record) is not None


def _stored_problem(record: Record) -> FailedAfterCommitError | None:
    """The ``failed-after-commit`` the extension stored on ``record`` in its
    default rendering, or ``None`` for any answer of the view's."""
    if record.response_code != FailedAfterCommitError.code or record.response_body is None:
        return None
    if not any(
        name.lower() == "content-type" and value == PROBLEM_JSON
        for name, value in record.response_headers
    ):
        return None
    try:
        document = json.loads(record.response_body)
    except ValueError:
        return None
    if not isinstance(document, dict) or document.get("type") != _FAILED_AFTER_COMMIT:
        return None
    detail = document.get("detail")
    return FailedAfterCommitError(detail) if isinstance(detail, str) else FailedAfterCommitError()


_FAILED_AFTER_COMMIT = PROBLEM_TYPE_BASE + FailedAfterCommitError.slug
