"""OpenTelemetry's SDK for a test: a tracer provider with an in-memory exporter,
installed as the global provider for the test and taken away after it, so the
rest of the suite runs with the API alone (no SDK), as an app without one does."""

from __future__ import annotations

import contextlib
import json
import typing as t

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once


def _reset_global_provider() -> None:
    # The API lets the global provider be set once per process; a test that
    # sets its own puts the API back as it found it (as OpenTelemetry's own
    # test utilities do).
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None


@contextlib.contextmanager
def sdk_tracing() -> t.Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    """The SDK as the global tracer provider, every span exported to memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _reset_global_provider()
    trace.set_tracer_provider(provider)
    try:
        yield provider, exporter
    finally:
        _reset_global_provider()
        provider.shutdown()


def no_sdk() -> None:
    """The API with no SDK (the global provider a proxy to the no-op one)."""
    _reset_global_provider()


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
