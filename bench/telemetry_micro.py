"""The extension's own per-request telemetry cost, in one process:
``python -m bench.telemetry_micro``.

Two measures, each per OpenTelemetry set-up, interleaved in rounds so that
every set-up sees the same machine:

* ``calls``: the telemetry calls a protected request makes and nothing else
  (``flask_idempotency._telemetry``: the request's observation, its claim,
  complete or replay phases, the outcome), new key and replay, in a loop: the
  fastest of 20 blocks (on a busy machine the least disturbed one);
* ``request``: a whole protected request on SQLite (in memory) through
  Flask's test client, new key and replay: the fastest of 10 blocks.

Set-ups: ``none`` (the calls with no OpenTelemetry module behind them, as
without the ``otel`` extra: ``calls`` only), ``api`` (the API's no-op
providers: the baseline), ``metrics`` (an SDK ``MeterProvider`` with an
``InMemoryMetricReader``), ``traces`` (an SDK ``TracerProvider`` with a
``BatchSpanProcessor`` to an exporter that drops) and ``sdk`` (both). A
figure is the median over the rounds of microseconds per request; ``+µs`` is
the set-up's figure minus ``api``'s in the same round (median); ``ratio`` the
``api`` request time over the set-up's (below 1 costs more). No assertions:
it reports. The gunicorn benchmark of the same set-ups is ``bench.telemetry``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import statistics
import time
import typing as t
import uuid

from flask import Flask, jsonify
from flask_sqlalchemy import SQLAlchemy
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from flask_idempotency import Idempotency, _telemetry
from flask_idempotency._telemetry.request import RequestTelemetry

SETUPS = ("none", "api", "metrics", "traces", "sdk")


class Dropping(SpanExporter):
    """Counts the spans and drops them."""

    def __init__(self) -> None:
        self.count = 0

    def export(self, spans: t.Sequence[t.Any]) -> SpanExportResult:
        self.count += len(spans)
        return SpanExportResult.SUCCESS


def providers(setup: str) -> tuple[t.Any, t.Any, t.Callable[[], None]]:
    """(meter provider, tracer provider, shutdown) for ``setup``."""
    meters = tracers = None
    closing: list[t.Callable[[], t.Any]] = []
    if setup in ("metrics", "sdk"):
        meters = MeterProvider(metric_readers=[InMemoryMetricReader()])
        closing.append(meters.shutdown)
    if setup in ("traces", "sdk"):
        tracers = TracerProvider()
        # A queue that holds a whole loop's spans: none dropped, each one exported.
        tracers.add_span_processor(BatchSpanProcessor(Dropping(), max_queue_size=1_000_000))
        closing.append(tracers.shutdown)
    return meters, tracers, lambda: [close() for close in closing] and None


def use(setup: str, meters: t.Any, tracers: t.Any) -> t.Callable[[str, str], RequestTelemetry]:
    """Point the extension at ``setup``'s providers; the observation factory."""
    _telemetry._use_providers(meters, tracers)
    if setup == "none":
        return lambda route, method: RequestTelemetry(route, method, None, None)
    return _telemetry.request


def calls(
    make: t.Callable[[str, str], RequestTelemetry], n: int, blocks: int = 20
) -> tuple[float, float]:
    """µs per new key and per replay: the telemetry calls alone, the fastest of
    ``blocks`` blocks of ``n // blocks`` (the least disturbed by other work)."""
    earlier = dt.datetime(2026, 1, 1)
    now = dt.datetime(2026, 1, 2)
    size = max(1, n // blocks)
    new = replay = float("inf")
    for _ in range(blocks):
        started = time.perf_counter()
        for _ in range(size):
            observed = make("/ext", "POST")
            with observed.claim():
                observed.began(now)
            with observed.complete():
                observed.stored(17)
            observed.finish()
        new = min(new, time.perf_counter() - started)
        started = time.perf_counter()
        for _ in range(size):
            observed = make("/ext", "POST")
            with observed.claim():
                observed.began(now)
                observed.found_completed(earlier)
                with observed.replay():
                    pass
            observed.finish()
        replay = min(replay, time.perf_counter() - started)
    return new / size * 1e6, replay / size * 1e6


def app() -> Flask:
    flask_app = Flask(__name__)
    flask_app.config["SQLALCHEMY_DATABASE_URI"] = "sqlite://"
    db = SQLAlchemy(flask_app)
    idem = Idempotency(flask_app, db)

    @flask_app.post("/ext")
    @idem.idempotent()
    def ext() -> t.Any:
        return jsonify(ok=True), 201

    with flask_app.app_context():
        db.create_all()
    return flask_app


def requests(flask_app: Flask, n: int, blocks: int = 10) -> tuple[float, float]:
    """µs per new-key and per replay request through the test client, the
    fastest of ``blocks`` blocks of ``n // blocks``."""
    client = flask_app.test_client()
    size = max(1, n // blocks)
    body = {"amount": 1}
    new = replay = float("inf")
    for _ in range(blocks):
        keys = [str(uuid.uuid4()) for _ in range(size)]
        started = time.perf_counter()
        for key in keys:
            client.post("/ext", json=body, headers={"Idempotency-Key": key})
        new = min(new, time.perf_counter() - started)
        started = time.perf_counter()
        for key in keys:
            client.post("/ext", json=body, headers={"Idempotency-Key": key})
        replay = min(replay, time.perf_counter() - started)
    return new / size * 1e6, replay / size * 1e6


def main(argv: t.Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20000, help="loop length of `calls`")
    parser.add_argument(
        "--requests", type=int, default=400, help="requests per round (0: calls only)"
    )
    args = parser.parse_args(argv)

    flask_app = app()
    figures: dict[tuple[str, str], list[float]] = {}
    for round_ in range(args.rounds):
        order = SETUPS if round_ % 2 == 0 else SETUPS[::-1]
        for setup in order:
            meters, tracers, shutdown = providers(setup)
            make = use(setup, meters, tracers)
            gc.collect()
            new, replay = calls(make, args.calls)
            figures.setdefault((setup, "calls new"), []).append(new)
            figures.setdefault((setup, "calls replay"), []).append(replay)
            if setup != "none" and args.requests > 0:
                new, replay = requests(flask_app, args.requests)
                figures.setdefault((setup, "request new"), []).append(new)
                figures.setdefault((setup, "request replay"), []).append(replay)
            shutdown()
    _telemetry._use_providers(None, None)

    print(f"{args.rounds} rounds; µs per request, median; +µs and ratio against `api`")
    print(f"{'set-up':8} {'measure':15} {'µs':>9} {'+µs':>8} {'ratio':>7}")
    for measure in ("calls new", "calls replay", "request new", "request replay"):
        for setup in SETUPS:
            values = figures.get((setup, measure))
            if not values:
                continue
            base = figures[("api", measure)]
            added = statistics.median(v - b for v, b in zip(values, base, strict=True))
            ratio = statistics.median(b / v for v, b in zip(values, base, strict=True))
            print(
                f"{setup:8} {measure:15} {statistics.median(values):9.1f} "
                f"{added:+8.1f} {ratio:7.3f}"
            )


if __name__ == "__main__":
    main()
