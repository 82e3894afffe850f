"""Telemetry is a bystander: it never fails what it observes, and it never
carries what it observes' data.

* :func:`quietly` and :func:`context`: an entry point of the telemetry (a
  recording, a span around a publish or a delivery) that raises (a span
  processor, a meter provider or an instrument with a bug) is logged at DEBUG
  and otherwise ignored. A span that cannot start leaves its block to run, once,
  untraced; a span that cannot end leaves the block's result as it was.
* :func:`record_error`: what a span records of an error. Never its text: a
  database error's text is SQLAlchemy's, with the statement's parameters (the
  scope, the key, the stored response, an event id), and the extension's own
  internal errors name the scope and key they concern. A span gets an
  ``exception`` event with the error's type (``exception.type``), its frames
  (``exception.stacktrace``: code locations, no message) and a message only
  where it is public and fixed: a :class:`~flask_idempotency.errors.ProblemError`'s
  ``title``, a database error's driver class; and status ERROR described by the
  error's class name.

Nothing here imports OpenTelemetry: the spans come from modules that do.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import traceback
import typing as t

from ..errors import ProblemError

logger = logging.getLogger("flask_idempotency")

P = t.ParamSpec("P")
R = t.TypeVar("R")
F = t.TypeVar("F")
#: A function that makes a context manager of ``Y``.
Making = t.Callable[P, "contextlib.AbstractContextManager[Y]"]
Y = t.TypeVar("Y")


def quietly(
    fallback: t.Callable[P, F],
) -> t.Callable[[t.Callable[P, R]], t.Callable[P, R | F]]:
    """Decorate a telemetry function: if it raises an :class:`Exception`, log it
    at DEBUG and answer ``fallback(*args, **kwargs)`` instead."""

    def decorate(function: t.Callable[P, R]) -> t.Callable[P, R | F]:
        @functools.wraps(function)
        def guarded(*args: P.args, **kwargs: P.kwargs) -> R | F:
            try:
                return function(*args, **kwargs)
            except Exception:  # telemetry never fails what it observes
                logger.debug("telemetry: %s failed", function.__qualname__, exc_info=True)
                return fallback(*args, **kwargs)

        return guarded

    return decorate


def nothing(*args: t.Any, **kwargs: t.Any) -> None:
    """The fallback of a telemetry function that answers nothing."""


class _Guarded(t.Generic[Y]):
    """A context manager whose entry and exit failures are logged, not raised
    (see :func:`context`)."""

    __slots__ = ("_entered", "_fallback", "_make", "_name")

    def __init__(
        self,
        make: t.Callable[[], contextlib.AbstractContextManager[Y]],
        fallback: t.Callable[[], Y],
        name: str,
    ) -> None:
        self._make, self._fallback, self._name = make, fallback, name
        self._entered: contextlib.AbstractContextManager[Y] | None = None

    def __enter__(self) -> Y:
        try:
            manager = self._make()
            value = manager.__enter__()
        except Exception:  # the block still runs, once, untraced
            logger.debug("telemetry: starting %s failed", self._name, exc_info=True)
            return self._fallback()
        self._entered = manager
        return value

    def __exit__(self, kind: t.Any, error: BaseException | None, tb: t.Any) -> None:
        manager, self._entered = self._entered, None
        if manager is not None:
            try:
                manager.__exit__(kind, error, tb)
            except BaseException as exc:
                if exc is not error:
                    if not isinstance(exc, Exception):
                        raise
                    logger.debug("telemetry: ending %s failed", self._name, exc_info=True)
        # None: the block's own exception, if any, goes on unchanged.


def context(
    fallback: t.Callable[[], Y],
) -> t.Callable[[Making[P, Y]], Making[P, Y]]:
    """Decorate a function that makes a context manager (a span around a block):
    if making or entering it raises an :class:`Exception`, the block runs with
    ``fallback()`` as its value; if leaving it raises, the block's outcome
    stands (its result, or its own exception). Logged at DEBUG either way."""

    def decorate(make: Making[P, Y]) -> Making[P, Y]:
        @functools.wraps(make)
        def guarded(*args: P.args, **kwargs: P.kwargs) -> contextlib.AbstractContextManager[Y]:
            return _Guarded(lambda: make(*args, **kwargs), fallback, make.__qualname__)

        return guarded

    return decorate


# -- what a span records of an error --------------------------------------------------------


def error_type(error: BaseException) -> str:
    """The error's class, qualified by its module (``exception.type``)."""
    cls = type(error)
    module = cls.__module__
    return cls.__qualname__ if module in (None, "builtins") else f"{module}.{cls.__qualname__}"


def safe_message(error: BaseException) -> str | None:
    """The part of ``error``'s description that may go on a span: a problem's
    ``title`` (fixed per type, what a client sees), a database error's driver
    class (SQLAlchemy's ``orig``); ``None`` for anything else."""
    if isinstance(error, ProblemError):
        return error.title
    orig = getattr(error, "orig", None)
    if isinstance(orig, BaseException):
        return error_type(orig)
    return None


def _frames(error: BaseException) -> str:
    """``error``'s traceback without any message: where it was raised, not what it said."""
    lines = ["Traceback (most recent call last):\n"]
    lines.extend(traceback.format_tb(error.__traceback__))
    lines.append(error_type(error) + "\n")
    return "".join(lines)


def record_error(span: t.Any, error: BaseException, status: t.Any) -> None:
    """Record ``error`` on ``span`` (see the module) with ``status``, OpenTelemetry's
    ``Status``/``StatusCode`` module (``opentelemetry.trace``). Never raises."""
    try:
        if not span.is_recording():
            return
        attributes = {
            "exception.type": error_type(error),
            "exception.stacktrace": _frames(error),
        }
        message = safe_message(error)
        if message is not None:
            attributes["exception.message"] = message
        span.add_event("exception", attributes)
        span.set_status(status.Status(status.StatusCode.ERROR, type(error).__name__))
    except Exception:  # telemetry never fails what it observes
        logger.debug("tracing: recording an error on a span failed", exc_info=True)


@contextlib.contextmanager
def errors_recorded(span: t.Any, status: t.Any) -> t.Iterator[None]:
    """Record on ``span`` an exception that leaves the block (then re-raised)."""
    try:
        yield
    except BaseException as exc:
        record_error(span, exc, status)
        raise
