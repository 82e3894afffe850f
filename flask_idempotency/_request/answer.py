"""What every answer to a protected request carries, however the app renders it.

- The key, echoed in the key's own header on every answer to a request whose
  header key was accepted: the view's response, a replay, a problem (an SDK reads
  it back, as Stripe's does from ``last_response.idempotency_key``).
- A problem's own headers (``Retry-After``), put back where an app's error
  handler answered it in the app's own envelope and did not copy them.
- A default error handler for :class:`~flask_idempotency.errors.ProblemError`,
  so that frameworks that answer every ``HTTPException`` in their own envelope
  (flask-smorest, APIFlask) leave the extension's problems in problem+json, as
  its OpenAPI documents them. An app's own handler for ``ProblemError`` (before
  or after ``init_app``), for one of its subclasses, or for ``IdempotencyError``
  still wins.
"""

from __future__ import annotations

import typing as t

from flask import Flask, Response, current_app, request
from werkzeug.sansio.response import Response as SansIOResponse

from .._context import answer_notes
from .._contract import REPLAYED_HEADER
from ..errors import IdempotencyError, ProblemError

__all__ = ["install", "keyed", "raised", "render_stored", "stored"]

_ECHO = "echo"
_PROBLEM = "problem"
_STORED = "stored"


def keyed(header: str, value: str) -> None:
    """The request's ``header`` held ``value``, accepted as its key: echo it."""
    answer_notes()[_ECHO] = (header, value)


def raised(problem: ProblemError) -> None:
    """``problem`` is this request's answer, whoever renders it."""
    answer_notes()[_PROBLEM] = problem


def _finish(response: SansIOResponse) -> SansIOResponse:
    notes = answer_notes(take=True)
    problem: ProblemError | None = notes.get(_PROBLEM)
    if problem is not None:
        for name, value in problem.extra_headers.items():
            if name not in response.headers:
                response.headers[name] = value
    echo: tuple[str, str] | None = notes.get(_ECHO)
    if echo is not None:
        response.headers[echo[0]] = echo[1]
    return response


def stored(problem: ProblemError) -> None:
    """A replay is ``problem``, which the extension itself stored (a
    ``failed-after-commit``): :func:`render_stored` answers it as the app answers
    its problems, not as the bytes of the first request's default rendering."""
    answer_notes()[_STORED] = problem


def render_stored(response: Response) -> Response:
    """``response`` (a replay), or the stored problem it holds rendered by the
    app's handler (by the default, a browser's page or the same problem+json),
    marked replayed like any replay."""
    problem: ProblemError | None = answer_notes().pop(_STORED, None)
    if problem is None:
        return response
    handler = _app_handler(problem)
    rendered = (
        problem.get_response(request.environ)
        if handler is None
        else current_app.ensure_sync(handler)(problem)
    )
    answer = current_app.make_response(rendered)
    answer.headers[REPLAYED_HEADER] = response.headers.get(REPLAYED_HEADER, "true")
    return answer


def _app_handler(problem: ProblemError) -> t.Callable[[t.Any], t.Any] | None:
    """The app's own handler for ``problem``, or ``None`` where only the default
    would answer it. Flask finds the default before a handler for HTTPException
    or Exception (it walks the problem's classes in order), and also before an
    app's handler for IdempotencyError, which comes after ProblemError: that
    one is the app's, then."""
    handler = current_app._find_error_handler(problem, request.blueprints)
    if handler is None or handler is _answer_problem:
        handler = current_app.error_handler_spec[None][None].get(IdempotencyError)
    return t.cast("t.Callable[[t.Any], t.Any] | None", handler)


def _answer_problem(problem: ProblemError) -> t.Any:
    handler = _app_handler(problem)
    if handler is not None:
        return handler(problem)
    return problem.get_response(request.environ)


def install(app: Flask) -> None:
    """Echo keys and keep problems' headers on ``app``'s answers, and answer its
    problems in problem+json unless it has its own handler for them."""
    app.after_request(_finish)
    if ProblemError not in app.error_handler_spec[None][None]:
        app.register_error_handler(ProblemError, _answer_problem)
