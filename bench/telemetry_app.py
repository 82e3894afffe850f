"""The app of ``python -m bench.telemetry``: ``bench/app.py``'s app with one
OpenTelemetry set-up per variant, made in each gunicorn worker (each worker is a
process of its own; gunicorn loads the app after the fork) before the extension
is imported.

``gunicorn 'bench.telemetry_app:create_app()'`` serves it; ``BENCH_TELEMETRY``
names the variant (:data:`VARIANTS`), ``BENCH_DATABASE_URL`` the database and
``BENCH_TELEMETRY_DIR`` a folder where each worker writes what it recorded
(``<variant>-<pid>.json``, once a second: the extension's instruments and
spans seen by the SDK) and, with Prometheus, the port of its ``/metrics``
(``port-<pid>``).

This module imports neither ``flask_idempotency`` nor ``opentelemetry`` at
import time: what each variant sets up must come first.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
import time
import types
import typing as t
from pathlib import Path

from flask import Flask, jsonify

VARIANT_ENV = "BENCH_TELEMETRY"
DIR_ENV = "BENCH_TELEMETRY_DIR"

NO_API = "no-api"
API = "api"
SDK = "sdk"
SDK_FLASK = "sdk-flask"
FLASK_ONLY = "flask-only"
PROMETHEUS = "prometheus"
#: The variants, and what each sets up in the worker.
VARIANTS = {
    NO_API: "`opentelemetry` cannot be imported in the workers (an import blocker first on "
    "`sys.meta_path`, installed before `flask_idempotency` is imported): as without the "
    "`otel` extra",
    API: "opentelemetry-api importable, nothing configured (the API's default no-op "
    "providers): the `otel` extra and nothing else. **The baseline**",
    SDK: "the SDK in each worker: a `MeterProvider` with an `InMemoryMetricReader` "
    "(collected once a second, as a periodic exporter would) and a `TracerProvider` with a "
    "`BatchSpanProcessor` to an exporter that counts and drops; nothing else instrumented, "
    "so everything it records is the extension's",
    SDK_FLASK: "`sdk` plus `opentelemetry-instrumentation-flask` (a server span and the "
    "`http.server` metrics per request; the extension's spans are its children)",
    FLASK_ONLY: "`sdk-flask` with the extension's meter and tracer replaced by no-op ones "
    "(the same SDK and Flask instrumentation, without the extension's figures): the "
    "baseline of `sdk-flask`",
    PROMETHEUS: "a `MeterProvider` with the OTel `PrometheusMetricReader`, `/metrics` on "
    "a port of each worker's own (prometheus_client's HTTP server), scraped once a second "
    "by the benchmark during the variant's rounds, as a Prometheus would",
}
#: The extension's instrumentation scope (meter and tracer name).
OUR_SCOPE = "flask_idempotency"
#: The packages each variant needs beyond opentelemetry-api.
NEEDS = {
    SDK: ("opentelemetry.sdk",),
    SDK_FLASK: ("opentelemetry.sdk", "opentelemetry.instrumentation.flask"),
    FLASK_ONLY: ("opentelemetry.sdk", "opentelemetry.instrumentation.flask"),
    PROMETHEUS: ("opentelemetry.sdk", "opentelemetry.exporter.prometheus", "prometheus_client"),
}
#: How often the SDK variants collect their in-memory figures (s).
COLLECT_EVERY = 1.0


class _Missing(importlib.abc.MetaPathFinder):
    """Every ``opentelemetry`` module is missing, as when it is not installed."""

    def find_spec(
        self,
        fullname: str,
        path: t.Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] == "opentelemetry":
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def _otel_modules() -> list[str]:
    return sorted(name for name in sys.modules if name.split(".")[0] == "opentelemetry")


def block_opentelemetry() -> None:
    """Make ``opentelemetry`` unimportable in this process from now on."""
    if loaded := _otel_modules():
        raise RuntimeError(f"opentelemetry is already imported: {loaded[:3]}")
    sys.meta_path.insert(0, _Missing())


def _without_ours(meters: t.Any, tracers: t.Any) -> tuple[t.Any, t.Any]:
    """``meters`` and ``tracers`` (SDK providers), except that the extension's
    meter and tracer are no-op ones."""
    from opentelemetry import metrics, trace

    class Meters(metrics.MeterProvider):
        def get_meter(self, name: str, *args: t.Any, **kwargs: t.Any) -> metrics.Meter:
            if name.split(".")[0] == OUR_SCOPE:
                return metrics.NoOpMeter(name)
            return t.cast(metrics.Meter, meters.get_meter(name, *args, **kwargs))

    class Tracers(trace.TracerProvider):
        def get_tracer(self, name: str, *args: t.Any, **kwargs: t.Any) -> trace.Tracer:
            if name.split(".")[0] == OUR_SCOPE:
                return trace.NoOpTracer()
            return t.cast(trace.Tracer, tracers.get_tracer(name, *args, **kwargs))

    return Meters(), Tracers()


class _Recorded:
    """What the SDK saw in this worker: the extension's instruments (points per
    name; ``idempotency.requests`` summed by outcome) and spans by scope and name."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: dict[str, int] = {}

    def count_spans(self, spans: t.Sequence[t.Any]) -> None:
        with self.lock:
            for span in spans:
                scope = span.instrumentation_scope.name if span.instrumentation_scope else "?"
                name = f"{scope}: {span.name}"
                self.spans[name] = self.spans.get(name, 0) + 1

    def figures(self, data: t.Any) -> dict[str, t.Any]:
        instruments: dict[str, int] = {}
        outcomes: dict[str, float] = {}
        for resource_metrics in data.resource_metrics if data is not None else ():
            for scope_metrics in resource_metrics.scope_metrics:
                if scope_metrics.scope.name.split(".")[0] != OUR_SCOPE:
                    continue
                for metric in scope_metrics.metrics:
                    points = list(metric.data.data_points)
                    instruments[metric.name] = len(points)
                    if metric.name == "idempotency.requests":
                        for point in points:
                            outcome = str(point.attributes.get("idempotency.outcome", "?"))
                            outcomes[outcome] = outcomes.get(outcome, 0) + point.value
        with self.lock:
            spans = dict(self.spans)
        return {
            "pid": os.getpid(),
            "instruments": instruments,
            "requests": outcomes,
            "spans": spans,
        }


def _sdk(variant: str, folder: Path) -> None:
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    recorded = _Recorded()

    class Dropping(SpanExporter):
        def export(self, spans: t.Sequence[t.Any]) -> SpanExportResult:
            recorded.count_spans(spans)
            return SpanExportResult.SUCCESS

    resource = Resource.create({"service.name": "bench", "service.instance.id": str(os.getpid())})
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader], resource=resource)
    tracers = TracerProvider(resource=resource)
    tracers.add_span_processor(BatchSpanProcessor(Dropping()))
    if variant == FLASK_ONLY:
        meters, tracers = _without_ours(meters, tracers)
    metrics.set_meter_provider(meters)
    trace.set_tracer_provider(tracers)
    out = folder / f"{variant}-{os.getpid()}.json"

    def collect() -> None:
        while True:
            time.sleep(COLLECT_EVERY)
            figures = recorded.figures(reader.get_metrics_data())
            partial = out.with_suffix(".part")
            partial.write_text(json.dumps(figures))
            partial.replace(out)

    threading.Thread(target=collect, name="bench-collect", daemon=True).start()


def _prometheus(folder: Path) -> None:
    import prometheus_client
    from opentelemetry import metrics
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource

    resource = Resource.create({"service.name": "bench", "service.instance.id": str(os.getpid())})
    metrics.set_meter_provider(
        MeterProvider(metric_readers=[PrometheusMetricReader()], resource=resource)
    )
    server, _ = prometheus_client.start_http_server(0, addr="127.0.0.1")
    (folder / f"port-{os.getpid()}").write_text(str(server.server_port))


def create_app() -> Flask:
    """``bench.app``'s app, after the set-up ``$BENCH_TELEMETRY`` names; plus
    ``GET /telemetry-state``: what this worker loaded and set up."""
    variant = os.environ[VARIANT_ENV]
    if variant not in VARIANTS:
        raise RuntimeError(f"{VARIANT_ENV}={variant!r}: not one of {', '.join(VARIANTS)}")
    folder = Path(os.environ[DIR_ENV])
    if variant == NO_API:
        block_opentelemetry()
    elif variant in (SDK, SDK_FLASK, FLASK_ONLY):
        _sdk(variant, folder)
    elif variant == PROMETHEUS:
        _prometheus(folder)

    from bench import app as bench_app  # the extension is imported here, not before

    app = bench_app.create_app()
    if variant in (SDK_FLASK, FLASK_ONLY):
        from opentelemetry.instrumentation.flask import FlaskInstrumentor

        FlaskInstrumentor().instrument_app(app)

    @app.get("/telemetry-state")
    def telemetry_state() -> t.Any:
        providers = {}
        if "opentelemetry.metrics" in sys.modules:
            from opentelemetry import metrics, trace

            providers = {
                "meter_provider": type(metrics.get_meter_provider()).__name__,
                "tracer_provider": type(trace.get_tracer_provider()).__name__,
            }
        ours = sys.modules.get("flask_idempotency._telemetry")
        return jsonify(
            variant=variant,
            pid=os.getpid(),
            opentelemetry_modules=len(_otel_modules()),
            extension_telemetry=ours is not None,
            # The extension's own word on whether it found the API.
            extension_sees_api=getattr(ours, "AVAILABLE", None),
            **providers,
        )

    return app
