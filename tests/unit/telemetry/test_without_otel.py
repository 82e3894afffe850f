"""Without the ``otel`` extra the extension works as before, imports nothing
of OpenTelemetry, and still writes the request's log line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent(
    """
    import importlib.abc
    import json
    import logging
    import sys

    class NoOpenTelemetry(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "opentelemetry" or name.startswith("opentelemetry."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoOpenTelemetry())

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__()
            self.lines = []

        def emit(self, record):
            if record.msg == "idempotency request":
                self.lines.append([record.idempotency_outcome, record.trace_id])

    lines = Lines()
    logger = logging.getLogger("flask_idempotency")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)

    from flask_idempotency import _telemetry
    from tests.support import testapp

    app = testapp.create_app(sys.argv[1])
    with app.app_context():
        testapp.db.create_all()
    client = app.test_client()
    body = {"amount": 5, "currency": "EUR"}
    answers = [
        client.post("/charges", json=body, headers={"Idempotency-Key": "k"}) for _ in range(2)
    ]
    loaded = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")
    print(json.dumps({
        "available": _telemetry.AVAILABLE,
        "codes": [a.status_code for a in answers],
        "replayed": answers[1].headers.get("Idempotent-Replayed"),
        "loaded": loaded,
        "lines": lines.lines,
    }))
    """
)


def test_the_extension_works_and_imports_no_opentelemetry_without_the_extra(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'app.sqlite3'}"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {
        "available": False,
        "codes": [201, 201],
        "replayed": "true",
        "loaded": [],
        "lines": [["executed", None], ["replayed", None]],
    }


LATE_SDK = textwrap.dedent(
    """
    import json
    import sys

    from tests.support import testapp

    # The app first (gunicorn's master, --preload), the SDK after (post_fork).
    # A generous ready timeout: a busy machine's slow first read is not the point here.
    app = testapp.create_app(
        sys.argv[1], IDEMPOTENCY_SCOPE=lambda: "s", IDEMPOTENCY_READY_TIMEOUT=30
    )
    with app.app_context():
        testapp.db.create_all()

    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    exporter = InMemorySpanExporter()
    tracers = TracerProvider()
    tracers.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(tracers)

    client = app.test_client()
    for _ in range(2):
        client.post("/raw", json={}, headers={"Idempotency-Key": "k"})
    found = {}
    for resource in reader.get_metrics_data().resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    if metric.name == "idempotency.requests":
                        found[point.attributes["idempotency.outcome"]] = point.value
                    elif metric.name == "idempotency.records.live":
                        found["live"] = point.value
    found["spans"] = sorted({s.name for s in exporter.get_finished_spans()})
    print(json.dumps(found))
    """
)


def test_an_sdk_set_up_after_init_app_receives_everything(tmp_path: Path) -> None:
    """The global providers are looked up through the API's proxies: an SDK set
    after ``init_app`` (gunicorn's ``post_fork``) gets the requests, the gauges
    registered at ``init_app`` and the spans."""
    url = f"sqlite:///{tmp_path / 'app.sqlite3'}"
    done = subprocess.run(
        [sys.executable, "-c", LATE_SDK, url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {
        "executed": 1,
        "replayed": 1,
        "live": 1,
        "spans": [
            "idempotency claim",
            "idempotency complete",
            "idempotency replay",
        ],
    }
