"""W3C trace context across the chain: the client's attempts, the outbox, the
relay and the inbox, so that one trace runs from the caller to the last consumer.

Everything goes through OpenTelemetry's API: the global propagator
(``opentelemetry.propagate``; W3C ``traceparent`` and ``tracestate``, and
whatever else the app configured, baggage by default) and the global tracer
provider, looked up at each use, so an SDK set up after ``init_app`` (in
gunicorn's ``post_fork``) is still the one used. Nothing here configures an SDK.

Without ``opentelemetry-api`` (the ``otel`` extra) nothing of it is imported,
every span is ``None`` and every carrier empty; with the API and no SDK the
spans are OpenTelemetry's non-recording ones and a carrier holds only a context
that came in (an extracted parent), so nothing is written either.

A carrier is a ``dict[str, str]`` of header names (lower case, as the
propagators write them) and values; the outbox keeps it as compact JSON text.

What the outbox stores and the relay forwards is bounded (:func:`carried`):
W3C ``traceparent`` and ``tracestate`` (cut to the size W3C advises), and
``baggage`` only when the app opts in (``IDEMPOTENCY_TRACE_BAGGAGE``), since
a request's context may come from its client: a client's baggage is not
written into every event and sent to every consumer unless the app wants it.
"""

from __future__ import annotations

import contextlib
import json
import typing as t
from importlib import metadata

from . import safety

#: The tracer's (instrumentation scope's) name.
TRACER_NAME = "flask_idempotency"

#: The client's span for one attempt (kind CLIENT).
CLIENT_ATTEMPT = "idempotency.client attempt"
#: The relay's span for one publish (kind PRODUCER).
OUTBOX_PUBLISH = "idempotency.outbox publish"
#: The inbox's span around one delivery (kind CONSUMER).
INBOX_PROCESS = "idempotency.inbox process"

_api: t.Any = None  # None: not looked for yet; False: absent; else the modules


class _Api:
    __slots__ = ("context", "propagate", "stand_in", "trace", "version")

    def __init__(self) -> None:
        from opentelemetry import context, propagate, trace

        # Whether the global tracer provider is an API stand-in (no SDK set): its
        # span under a parent is that parent (API 1.40+; earlier, an invalid
        # span), so a publish carries the parent's context as injected, without
        # the span's set-up (most of the relay's CPU per event otherwise).
        from .spans import stand_in  # imports the API too: only once it is there

        self.context, self.propagate, self.trace = context, propagate, trace
        self.stand_in: t.Callable[[], bool] = stand_in
        # The distribution's version (the package root would import everything).
        try:
            self.version: str | None = metadata.version("Flask-Idempotency")
        except metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
            self.version = None


def _otel() -> _Api | None:
    """OpenTelemetry's API, imported at the first call; ``None`` without it."""
    global _api
    if _api is None:
        try:
            _api = _Api()
        except ImportError:
            _api = False
    return _api or None


def _tracer(api: _Api) -> t.Any:
    # Not cached: the global provider may be set (or, in tests, replaced) later.
    return api.trace.get_tracer(TRACER_NAME, api.version)


def _parent(api: _Api, carrier: t.Mapping[str, str] | None) -> t.Any:
    """The context ``carrier`` holds, or ``None`` (the current context) when it
    holds no valid span: an event or a message without a trace is not made
    the root of a trace of its own when a span is current (a job's)."""
    if not carrier:
        return None
    context = api.propagate.extract(dict(carrier))
    if not api.trace.get_current_span(context).get_span_context().is_valid:
        return None
    return context


@contextlib.contextmanager
def _attached(api: _Api, context: t.Any) -> t.Iterator[None]:
    """``context`` current for the block (``None``: the current one stays).
    Attached whole, not only passed as a span's parent, so that what else it
    holds (baggage) is current in the block and propagated from it."""
    if context is None:
        yield
        return
    token = api.context.attach(context)
    try:
        yield
    finally:
        api.context.detach(token)


#: The spans' errors are recorded by :func:`.safety.record_error`, never by the
#: SDK (whose record holds the error's text: SQLAlchemy's has the parameters).
_RECORDED_HERE = {"record_exception": False, "set_status_on_exception": False}


def _injected(api: _Api, context: t.Any, baggage: bool) -> dict[str, str]:
    """What the propagators write for ``context`` (``None``: the current one),
    bounded by :func:`carried`."""
    headers: dict[str, str] = {}
    api.propagate.inject(headers, context=context)
    return carried(headers, baggage=baggage)


def _clean(carrier: t.Mapping[str, t.Any]) -> dict[str, str]:
    return {str(k): v for k, v in carrier.items() if isinstance(v, str) and v}


# -- what the outbox stores and the relay forwards --------------------------------------------

#: W3C trace context: at most 32 list-members in ``tracestate``; above 512
#: characters a propagator may cut it, members over 128 characters first,
#: then from the end (the specification's advice).
TRACESTATE_MAX_MEMBERS = 32
TRACESTATE_MAX_CHARS = 512
_TRACESTATE_LONG_MEMBER = 128
#: W3C baggage: a propagator must carry at least 8192 bytes; more is cut from the end.
BAGGAGE_MAX_CHARS = 8192


def _cut(members: list[str], limit: int) -> str | None:
    while members and len(",".join(members)) > limit:
        members.pop()
    return ",".join(members) or None


def bounded_tracestate(value: str) -> str | None:
    """``value`` cut to W3C's advice: 32 members, 512 characters (members over
    128 characters dropped first, then members from the end); ``None`` when
    nothing is left."""
    members = [m.strip() for m in value.split(",") if m.strip()][:TRACESTATE_MAX_MEMBERS]
    if len(",".join(members)) > TRACESTATE_MAX_CHARS:
        members = [m for m in members if len(m) <= _TRACESTATE_LONG_MEMBER]
    return _cut(members, TRACESTATE_MAX_CHARS)


def carried(carrier: t.Mapping[str, t.Any], *, baggage: bool) -> dict[str, str]:
    """What of ``carrier`` the outbox stores and the relay forwards: its
    ``traceparent``, its ``tracestate`` bounded (:func:`bounded_tracestate`)
    and, when ``baggage`` is true, its ``baggage`` (at most 8192 characters,
    members cut from the end); nothing else a propagator wrote."""
    kept: dict[str, str] = {}
    for name, value in _clean(carrier).items():
        key = name.lower()
        cut: str | None = value
        if key == "tracestate":
            cut = bounded_tracestate(value)
        elif key == "baggage":
            if not baggage:
                continue
            cut = _cut([m.strip() for m in value.split(",") if m.strip()], BAGGAGE_MAX_CHARS)
        elif key != "traceparent":
            continue
        if cut:
            kept[key] = cut
    return kept


# -- the outbox: the emitting request's context, stored with the event ------------------------


@safety.quietly(safety.nothing)
def current_carrier_text(*, baggage: bool = False) -> str | None:
    """The current context (the request's span) as compact JSON text for the
    outbox's ``trace_context`` column, bounded by :func:`carried` (``baggage``:
    the app's ``IDEMPOTENCY_TRACE_BAGGAGE``); ``None`` when there is none to
    carry (no API, no SDK and no incoming context, or an invalid span)."""
    api = _otel()
    if api is None:
        return None
    carrier: dict[str, str] = {}
    api.propagate.inject(carrier)
    carrier = carried(carrier, baggage=baggage)
    if not carrier:
        return None
    return json.dumps(carrier, separators=(",", ":"), sort_keys=True)


def carrier_from_text(text: str | bytes | None) -> dict[str, str]:
    """The carrier stored as ``text``, bounded by :func:`carried` (``baggage``
    kept when stored: it was stored only when the emitting app opted in);
    empty for ``None`` or anything unreadable (a column written by other means
    never stops the relay)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return carried(value, baggage=True) if isinstance(value, dict) else {}


# -- the relay: publish under the stored context ---------------------------------------------


def _no_headers() -> dict[str, str]:
    return {}


@safety.context(_no_headers)
@contextlib.contextmanager
def publishing(
    stored: t.Mapping[str, str] | None, *, destination: str
) -> t.Iterator[dict[str, str]]:
    """A PRODUCER span whose parent is ``stored`` (the emitting request's
    context), around one publish; yields the headers the message carries: the
    context of that span (so the consumer's span is its child), or, without
    the API, ``stored`` as it is. Only what :func:`carried` keeps, ``baggage``
    only when ``stored`` has it; empty when there is nothing to carry.
    An exception is recorded on the span and propagates."""
    stored = carried(stored or {}, baggage=True)
    api = _otel()
    if api is None:
        yield stored
        return
    parent = _parent(api, stored)
    if api.stand_in():
        # No span, but the publisher still runs under the stored context (its
        # own instrumentation or logs may read or inject it).
        with _attached(api, parent):
            yield _injected(api, parent, "baggage" in stored)
        return
    attributes = {
        "messaging.operation.name": "publish",
        "messaging.operation.type": "send",
        "messaging.destination.name": destination,
    }
    span_kind = api.trace.SpanKind.PRODUCER
    with (
        _attached(api, parent),
        _tracer(api).start_as_current_span(
            OUTBOX_PUBLISH, kind=span_kind, attributes=attributes, **_RECORDED_HERE
        ) as span,
    ):
        headers: dict[str, str] = {}
        api.propagate.inject(headers)
        with safety.errors_recorded(span, api.trace):
            yield carried(headers, baggage="baggage" in stored)


def _no_spans(
    stored: t.Sequence[t.Mapping[str, str] | None], destinations: t.Sequence[str]
) -> tuple[list[dict[str, str]], t.Callable[[t.Sequence[BaseException | None]], None]]:
    return [carried(one or {}, baggage=True) for one in stored], safety.nothing


@safety.quietly(_no_spans)
def publishing_together(
    stored: t.Sequence[t.Mapping[str, str] | None], destinations: t.Sequence[str]
) -> tuple[list[dict[str, str]], t.Callable[[t.Sequence[BaseException | None]], None]]:
    """:func:`publishing` for messages published together (pipelined): a
    PRODUCER span each, all started now, each the child of its own stored
    context (or of the current one) and none of another's; the headers each
    message carries; and ``end(outcomes)``, which records ``outcomes[i]``
    (``None``: published) on span ``i`` and ends them all. Nothing here raises:
    spans that cannot start leave the messages untraced."""
    api = _otel()
    if api is None:
        return _no_spans(stored, destinations)
    if api.stand_in():
        carriers = []
        for one, _ in zip(stored, destinations, strict=True):
            one = carried(one or {}, baggage=True)
            carriers.append(_injected(api, _parent(api, one), "baggage" in one))
        return carriers, safety.nothing
    tracer, kind = _tracer(api), api.trace.SpanKind.PRODUCER
    spans, headers_of = [], []
    for one, destination in zip(stored, destinations, strict=True):
        one = carried(one or {}, baggage=True)
        parent = _parent(api, one) or api.context.get_current()
        attributes = {
            "messaging.operation.name": "publish",
            "messaging.operation.type": "send",
            "messaging.destination.name": destination,
        }
        span = tracer.start_span(
            OUTBOX_PUBLISH, context=parent, kind=kind, attributes=attributes, **_RECORDED_HERE
        )
        spans.append(span)
        headers: dict[str, str] = {}
        api.propagate.inject(headers, context=api.trace.set_span_in_context(span, parent))
        headers_of.append(carried(headers, baggage="baggage" in one))

    @safety.quietly(safety.nothing)
    def end(outcomes: t.Sequence[BaseException | None]) -> None:
        for span, outcome in zip(spans, outcomes, strict=True):
            if outcome is not None:
                safety.record_error(span, outcome, api.trace)
            span.end()

    return headers_of, end


# -- the inbox: continue the trace the message carries ----------------------------------------


@safety.context(safety.nothing)
@contextlib.contextmanager
def consuming(headers: t.Mapping[str, t.Any] | None, *, consumer: str) -> t.Iterator[t.Any]:
    """A CONSUMER span around one delivery, its parent the context in the
    message's ``headers`` (or the current one when they carry none); yields
    the span (``None`` without the API). An exception is recorded on it."""
    api = _otel()
    if api is None:
        yield None
        return
    parent = _parent(api, _text_headers(headers))
    attributes = {
        "messaging.operation.name": "process",
        "messaging.operation.type": "process",
        "idempotency.consumer": consumer,
    }
    span_kind = api.trace.SpanKind.CONSUMER
    with (
        _attached(api, parent),
        _tracer(api).start_as_current_span(
            INBOX_PROCESS, kind=span_kind, attributes=attributes, **_RECORDED_HERE
        ) as span,
        safety.errors_recorded(span, api.trace),
    ):
        yield span


@safety.quietly(safety.nothing)
def set_attribute(span: t.Any, name: str, value: t.Any) -> None:
    """``span.set_attribute`` on a span of this module's (``None``: nothing)."""
    if span is not None:
        span.set_attribute(name, value)


# -- the client: one span per attempt ---------------------------------------------------------


class Attempt:
    """One attempt's CLIENT span, started without being made current (attempts
    are siblings under the caller's span). :meth:`end` is idempotent."""

    __slots__ = ("_api", "_span")

    def __init__(self, api: _Api, span: t.Any) -> None:
        self._api, self._span = api, span

    @safety.quietly(safety.nothing)
    def end(self, *, status: int | None = None, error: BaseException | None = None) -> None:
        span, self._span = self._span, None
        if span is None:
            return
        trace = self._api.trace
        if status is not None:
            span.set_attribute("http.response.status_code", status)
            if status >= 400:
                span.set_attribute("error.type", str(status))
                span.set_status(trace.Status(trace.StatusCode.ERROR))
        if error is not None:
            span.set_attribute("error.type", type(error).__qualname__)
            safety.record_error(span, error, trace)
        span.end()


def _untraced(
    method: str,
    attempt: int,
    headers: t.Mapping[str, t.Any] | None,
    *,
    host: str | None = None,
    port: int | None = None,
) -> tuple[None, t.Mapping[str, t.Any] | None]:
    """An attempt sent as it is: its span could not be started."""
    return None, headers


@safety.quietly(_untraced)
def start_attempt(
    method: str,
    attempt: int,
    headers: t.Mapping[str, t.Any] | None,
    *,
    host: str | None = None,
    port: int | None = None,
) -> tuple[Attempt | None, t.Mapping[str, t.Any] | None]:
    """Start the CLIENT span of one attempt under the current context and give
    the headers to send: a copy of ``headers`` with this span's context
    injected (any ``traceparent``, ``tracestate`` already there replaced).
    With no current span, a context the caller put in ``headers`` itself (a
    ``traceparent`` it continues) is the span's parent instead, so every
    attempt stays in the caller's trace. Without the API: ``(None, headers)``
    unchanged. Never the key in an attribute: only the attempt's number,
    method, status and server."""
    api = _otel()
    if api is None:
        return None, headers
    parent = None
    if headers and not api.trace.get_current_span().get_span_context().is_valid:
        parent = _parent(api, _text_headers(headers))
    attributes: dict[str, t.Any] = {"http.request.method": method, "idempotency.attempt": attempt}
    if attempt > 1:
        attributes["http.request.resend_count"] = attempt - 1
    if host:
        attributes["server.address"] = host
    if port:
        attributes["server.port"] = port
    span = _tracer(api).start_span(
        CLIENT_ATTEMPT, context=parent, kind=api.trace.SpanKind.CLIENT, attributes=attributes
    )
    carrier: dict[str, str] = {}
    api.propagate.inject(carrier, context=api.trace.set_span_in_context(span, parent))
    if not carrier:
        return Attempt(api, span), headers
    names = {k.lower() for k in carrier}
    sent: dict[t.Any, t.Any] = {
        k: v for k, v in (headers or {}).items() if _name(k).lower() not in names
    }
    sent.update(carrier)
    return Attempt(api, span), sent


def _text_headers(headers: t.Mapping[t.Any, t.Any] | None) -> dict[str, str]:
    """``headers`` as a carrier: names lower-cased, ``bytes`` decoded, other values left out."""
    return {
        _name(k).lower(): v.decode("latin-1") if isinstance(v, bytes) else v
        for k, v in (headers or {}).items()
        if isinstance(v, str | bytes)
    }


def _name(key: t.Any) -> str:
    return bytes(key).decode("latin-1") if isinstance(key, bytes | bytearray) else str(key)
