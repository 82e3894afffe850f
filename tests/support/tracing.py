"""OpenTelemetry's SDK for a test: a tracer provider with an in-memory exporter,
installed as the global provider for the test and taken away after it, so the
rest of the suite runs with the API alone (no SDK), as an app without one does."""

from __future__ import annotations

import contextlib
import json
import typing as t

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once


@contextlib.contextmanager
def _global_provider(provider: TracerProvider | None) -> t.Iterator[None]:
    """``provider`` as the API's global tracer provider for the block (``None``:
    none set, the API's proxy to its no-op one), and then the one before put
    back. The API lets the global provider be set once per process; this
    resets its guard, as OpenTelemetry's own test utilities do."""
    before = (trace._TRACER_PROVIDER_SET_ONCE, trace._TRACER_PROVIDER)
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None
    if provider is not None:
        trace.set_tracer_provider(provider)
    try:
        yield
    finally:
        trace._TRACER_PROVIDER_SET_ONCE, trace._TRACER_PROVIDER = before


@contextlib.contextmanager
def sdk_tracing(
    *processors: SpanProcessor,
) -> t.Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    """The SDK as the global tracer provider, every span exported to memory
    (then given to ``processors`` too)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    for processor in processors:
        provider.add_span_processor(processor)
    try:
        with _global_provider(provider):
            yield provider, exporter
    finally:
        provider.shutdown()


@contextlib.contextmanager
def without_sdk() -> t.Iterator[None]:
    """The API with no SDK for the block, whatever provider the process has."""
    with _global_provider(None):
        yield


def traceparent(trace_id: int, span_id: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-01"


def parse_traceparent(value: str) -> tuple[int, int]:
    """(trace id, parent span id) of a W3C ``traceparent``."""
    version, trace_id, span_id, flags = value.split("-")
    assert (version, len(trace_id), len(span_id), len(flags)) == ("00", 32, 16, 2), value
    return int(trace_id, 16), int(span_id, 16)


def stored_context(text: t.Any) -> dict[str, str] | None:
    """An outbox row's ``trace_context``, decoded."""
    if text is None:
        return None
    return t.cast(dict[str, str], json.loads(text))


def named(spans: t.Iterable[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def parent_id(span: ReadableSpan) -> int | None:
    """The span id of ``span``'s parent (``None``: a root span)."""
    return span.parent.span_id if span.parent is not None else None
