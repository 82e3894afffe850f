"""The request flow's spans, on OpenTelemetry's trace API: imported only when
``opentelemetry-api`` is installed, through :mod:`flask_idempotency._telemetry`.

``idempotency claim``, ``idempotency wait`` (a duplicate that waited for the
first request: a child of its claim), ``idempotency replay`` and
``idempotency complete``, each a child of the span current when the request
reached the view (the Flask server span, as ``opentelemetry-instrumentation-flask``
makes it), with ``http.route`` and, where known, ``idempotency.outcome``; an
error is recorded on the span it went through, with status ERROR, as
:func:`.safety.record_error` says (its type, never its text). The claim and
the completion are the current span while they run (a database
instrumentation's statement spans are their children); the replay, which runs
no statement, is not. A span the SDK does not record (none configured, or
sampled out) is never made current.
"""

from __future__ import annotations

import threading
import time
import typing as t

from opentelemetry import context, trace
from opentelemetry.trace import Span

from .safety import record_error

_lock = threading.Lock()
_tracer: trace.Tracer | None = None
#: A provider handed in (tests); ``None``: the API's global one.
_provider: trace.TracerProvider | None = None


def tracer() -> trace.Tracer:
    """The ``flask_idempotency`` tracer of the provider in force: the global one
    is a proxy until the app sets an SDK's, so one made early still follows it."""
    global _tracer
    found = _tracer
    if found is None:
        with _lock:
            if _tracer is None:
                provider = _provider or trace.get_tracer_provider()
                _tracer = provider.get_tracer("flask_idempotency")
            found = _tracer
    return found


# The API's stand-ins before (and instead of) an app's provider: their spans
# record nothing. A provider set later is seen at the next request.
_STAND_INS = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)


def stand_in() -> bool:
    """Whether the global tracer provider is one of the API's stand-ins."""
    return isinstance(trace.get_tracer_provider(), _STAND_INS)


def recording() -> bool:
    """Whether a tracer provider is in force whose spans record: one handed in,
    or an SDK's set as the global one (not the API's proxy or no-op)."""
    return _provider is not None or not stand_in()


def use_provider(provider: trace.TracerProvider | None) -> None:
    """Trace through ``provider`` from now on (``None``: the global one). Tests."""
    global _tracer, _provider
    with _lock:
        _provider, _tracer = provider, None


def parent() -> context.Context:
    """The context the request's spans are children of: the current one."""
    return context.get_current()


#: Span attribute sets, built once each (bounded: routes x outcomes); the SDK
#: copies what it is handed, so one dictionary serves every span.
_attributes: dict[tuple[str, str | None], dict[str, str]] = {}


def attributes(route: str, outcome: str | None) -> dict[str, str]:
    """``http.route`` and, if known, ``idempotency.outcome``."""
    key = (route, outcome)
    found = _attributes.get(key)
    if found is None:
        found = {"http.route": route}
        if outcome is not None:
            found["idempotency.outcome"] = outcome
        _attributes[key] = found
    return found


class Phase:
    """One span of the request flow. ``current``: made the current span while
    it runs, for the spans of what runs inside (a database instrumentation's
    statements); a phase that runs nothing traced (the replay) is not, which
    spares the context's attach and detach. ``outcome``: known at its start,
    set then (one attribute pass in the SDK instead of two)."""

    __slots__ = ("_outcome", "_token", "span", "started_ns")

    def __init__(
        self, name: str, parent: context.Context, route: str, outcome: str | None, current: bool
    ) -> None:
        self.started_ns = time.time_ns()
        self._outcome = outcome
        self.span: Span = tracer().start_span(
            name,
            context=parent,
            attributes=attributes(route, outcome),
            start_time=self.started_ns,
        )
        self._token: object | None = None
        if current and self.span.is_recording():
            self._token = context.attach(trace.set_span_in_context(self.span, parent))

    def end(self, outcome: str | None, error: BaseException | None) -> None:
        if self._token is not None:
            context.detach(t.cast(t.Any, self._token))
            self._token = None
        span = self.span
        said = outcome is None or outcome == self._outcome
        if not (said and error is None) and span.is_recording():
            if not said:
                span.set_attribute("idempotency.outcome", t.cast(str, outcome))
            if error is not None:
                record_error(span, error, trace)
        span.end()

    def child(self, name: str, route: str, outcome: str | None) -> None:
        """A span under this one, from its start to now (the wait, known only
        once it is over)."""
        if not self.span.is_recording():
            return
        tracer().start_span(
            name,
            context=trace.set_span_in_context(self.span),
            attributes=attributes(route, outcome),
            start_time=self.started_ns,
        ).end()


def mark_current(outcome: str) -> tuple[str, str] | tuple[None, None]:
    """Put the outcome on the current span (the Flask server span); its trace
    and span ids, in hex, if a span is active."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute("idempotency.outcome", outcome)
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None, None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")
