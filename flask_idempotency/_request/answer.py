"""What every answer to a protected request carries, however the app renders it.

- The key, echoed in the key's own header on every answer to a request whose
  header key was accepted: the view's response, a replay, a problem (an SDK reads
  it back, as Stripe's does from ``last_response.idempotency_key``).
- A problem's own headers (``Retry-After``), put back where an app's error
  handler answered it in the app's own envelope and did not copy them.
- A default error handler for :class:`~flask_idempotency.errors.ProblemError`,
  so that a handler for every ``HTTPException`` or ``Exception`` (flask-smorest's,
  APIFlask's, an app's or a blueprint's catch-all) leaves the extension's problems
  in problem+json, as its OpenAPI documents them. An app's own handler for
  ``ProblemError`` (before or after ``init_app``), for one of its subclasses, or
  for ``IdempotencyError`` still wins.
- A stored ``failed-after-commit``, replayed as the app answers its problems.

Both additions are made by a function of the request's own (Flask's
``after_this_request``), which runs before every ``after_request`` function of
the app and its blueprints: those see the answer as the client will.
"""

from __future__ import annotations

import typing as t
import weakref

from flask import Flask, Response, after_this_request, current_app, request
from werkzeug.exceptions import HTTPException
from werkzeug.sansio.response import Response as SansIOResponse

from .._context import answer_notes
from ..errors import IdempotencyError, ProblemError

__all__ = ["cover_blueprints", "install", "keyed", "raised", "render_stored", "stored"]

_ECHO = "echo"
_BODY_HEADERS = frozenset({"content-type", "content-length"})
_PROBLEM = "problem"

Handler = t.Callable[[t.Any], t.Any]

# The replays that are a problem the extension stored: each is rendered by the
# wrapper of the request that replays it (weak: a response not rendered is gone
# with its request; a manual view's own answer is never in here).
_STORED: weakref.WeakKeyDictionary[Response, ProblemError] = weakref.WeakKeyDictionary()


def _notes() -> dict[str, t.Any]:
    notes = answer_notes()
    if not notes:  # the first note of this request: its answer gets them
        after_this_request(_finish)
    return notes


def keyed(header: str, value: str) -> None:
    """The request's ``header`` held ``value``, accepted as its key: echo it."""
    _notes()[_ECHO] = (header, value)


def raised(problem: ProblemError) -> None:
    """``problem`` is this request's answer, whoever renders it."""
    _notes()[_PROBLEM] = problem


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


def stored(response: Response, problem: ProblemError) -> Response:
    """``response`` replays ``problem``, which the extension itself stored (a
    ``failed-after-commit``): :func:`render_stored` answers it as the app answers
    its problems, not as the bytes of the first request's default rendering."""
    _STORED[response] = problem
    return response


def render_stored(response: Response) -> Response:
    """``response``, or, where it replays a stored problem, that problem rendered
    by the app's handler (by the default: a browser's page, or the same
    problem+json), marked replayed like any replay."""
    problem = _STORED.pop(response, None)
    if problem is None:
        return response
    answer = current_app.make_response(_answer_problem(problem))
    # The replay's other headers (Idempotent-Replayed, and any a manual view
    # added to idem.replay()'s answer) stay; the body's own are the rendering's.
    for name, value in response.headers.items():
        if name.lower() not in _BODY_HEADERS and name not in answer.headers:
            answer.headers[name] = value
    return answer


def _app_handler(problem: ProblemError) -> Handler | None:
    """The app's own handler for ``problem``, or ``None`` where only the default
    would answer it. Flask finds the default before a handler for HTTPException
    or Exception (it walks the problem's classes in order), and also before a
    handler for IdempotencyError, which comes after ProblemError: one of the
    request's blueprints or the app's, then."""
    handler = current_app._find_error_handler(problem, request.blueprints)
    if handler is not None and handler is not _answer_problem:
        return t.cast(Handler, handler)
    # The default answered in Flask's stead: the first handler of the app's or
    # the request's blueprints for one of the problem's own classes (the app's
    # ProblemError handler where a blueprint's catch-all got the default).
    ours = [cls for cls in type(problem).__mro__ if issubclass(cls, IdempotencyError)]
    spec = current_app.error_handler_spec
    for name in (*request.blueprints, None):
        handlers = spec[name].get(None, {}) if name in spec else {}
        for cls in ours:
            found = handlers.get(cls)
            if found is not None and found is not _answer_problem:
                return t.cast(Handler, found)
    return None


def _answer_problem(problem: ProblemError) -> t.Any:
    handler = _app_handler(problem)
    if handler is not None:
        return current_app.ensure_sync(handler)(problem)
    return problem.get_response(request.environ)


def install(app: Flask) -> None:
    """Answer ``app``'s problems in problem+json unless it has its own handler."""
    handlers = app.error_handler_spec[None][None]
    if ProblemError not in handlers:
        handlers[ProblemError] = _answer_problem


def cover_blueprints(app: Flask) -> None:
    """Give each blueprint with a catch-all handler (``HTTPException`` or
    ``Exception``) and none for ``ProblemError`` the default too: Flask looks in
    the request's blueprints before the app, so their catch-all would otherwise
    answer the problems. Run at the app's first request, once its blueprints
    are registered."""
    for name, by_code in list(app.error_handler_spec.items()):
        if name is None or None not in by_code:
            continue
        handlers = by_code[None]
        if ProblemError in handlers:
            continue
        if HTTPException in handlers or Exception in handlers:
            handlers[ProblemError] = _answer_problem
