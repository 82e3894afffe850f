"""The telemetry tests' fixture: an SDK meter provider with an in-memory reader
and a tracer provider with an in-memory exporter, handed to the extension for
one test (the SDK's global providers can be set only once per process)."""

from __future__ import annotations

import dataclasses
import typing as t

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from flask_idempotency import _telemetry
from flask_idempotency._telemetry import figures


@dataclasses.dataclass
class Point:
    """One time series' value as last collected."""

    metric: str
    attributes: dict[str, t.Any]
    value: float  # a sum's value, a gauge's value, a histogram's count
    total: float  # a histogram's sum (else the value)


@dataclasses.dataclass
class Otel:
    reader: InMemoryMetricReader
    meters: MeterProvider
    exporter: InMemorySpanExporter
    tracers: TracerProvider

    def collect(self) -> list[Point]:
        """Every time series, collected now."""
        data = self.reader.get_metrics_data()
        points: list[Point] = []
        if data is None:
            return points
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        value = getattr(point, "value", None)
                        if value is None:
                            value, total = point.count, point.sum  # type: ignore[attr-defined]
                        else:
                            total = value
                        points.append(
                            Point(metric.name, dict(point.attributes or {}), value, total)
                        )
        return points

    def series(self, metric: str, points: list[Point] | None = None) -> list[Point]:
        return [p for p in (self.collect() if points is None else points) if p.metric == metric]

    def outcomes(self, points: list[Point] | None = None) -> dict[tuple[str, ...], float]:
        """``idempotency.requests`` by (outcome, route, method[, key refusal])."""
        found: dict[tuple[str, ...], float] = {}
        for p in self.series("idempotency.requests", points):
            a = p.attributes
            key = (a["idempotency.outcome"], a["http.route"], a["http.request.method"])
            if "idempotency.key_refusal" in a:
                key += (a["idempotency.key_refusal"],)
            found[key] = p.value
        return found

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())


@pytest.fixture
def otel() -> t.Iterator[Otel]:
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    exporter = InMemorySpanExporter()
    tracers = TracerProvider()
    tracers.add_span_processor(SimpleSpanProcessor(exporter))
    figures.forget_all()  # apps of earlier tests: only the apps made from here on count
    _telemetry._use_providers(meters, tracers)
    try:
        yield Otel(reader, meters, exporter, tracers)
    finally:
        _telemetry._use_providers(None, None)
        meters.shutdown()
        tracers.shutdown()
        # The gauges' sources of this test's apps (each app registers at init_app).
        figures.forget_all()
