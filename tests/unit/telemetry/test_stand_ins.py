"""With OpenTelemetry's API but no provider of the app's, a request makes no
spans and records no instrument (the API's stand-ins would keep nothing); a
provider handed in later is used from the next request on."""

from __future__ import annotations

import subprocess
import sys
import typing as t
from pathlib import Path

import pytest

from flask_idempotency import _telemetry
from flask_idempotency._telemetry import spans as spans_module
from tests.support.tracing import without_sdk

from .conftest import Otel


def _made_phases(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    made: list[str] = []
    real = spans_module.Phase

    def phase(name: str, *args: t.Any) -> t.Any:
        made.append(name)
        return real(name, *args)

    monkeypatch.setattr(spans_module, "Phase", phase)
    return made


def test_no_provider_no_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    made = _made_phases(monkeypatch)
    with without_sdk():
        assert not spans_module.recording()
        telemetry = _telemetry.request("/x", "POST")
        assert telemetry.tracing is False
        with telemetry.claim():
            pass
        telemetry.finish()
    assert made == []


def test_a_provider_in_force_traces_the_phases(otel: Otel, monkeypatch: pytest.MonkeyPatch) -> None:
    made = _made_phases(monkeypatch)
    telemetry = _telemetry.request("/x", "POST")
    assert telemetry.tracing is True
    assert telemetry._metrics is not None
    with telemetry.claim():
        pass
    telemetry.finish()
    assert made == ["idempotency claim"]
    assert [span.name for span in otel.spans()] == ["idempotency claim"]


_SET_FIRST = """
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

reader = InMemoryMetricReader()
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))

from flask import Flask  # the extension is imported after the provider is set
from flask_sqlalchemy import SQLAlchemy
from flask_idempotency import Idempotency

app = Flask(__name__)
app.config["SQLALCHEMY_DATABASE_URI"] = "sqlite://"
app.config["IDEMPOTENCY_SCOPE"] = lambda: "tenant"
db = SQLAlchemy(app)
idem = Idempotency(app, db)

@app.post("/x")
@idem.idempotent()
def x():
    return {"ok": True}, 201

with app.app_context():
    db.create_all()
client = app.test_client()
for _ in range(2):
    assert client.post("/x", json={}, headers={"Idempotency-Key": "k1"}).status_code == 201
total = 0
for rm in reader.get_metrics_data().resource_metrics:
    for sm in rm.scope_metrics:
        for metric in sm.metrics:
            if metric.name == "idempotency.requests":
                total += sum(point.value for point in metric.data.data_points)
print("requests", total)
"""


def test_a_provider_set_before_the_import_records() -> None:
    """An SDK provider set before the extension is imported (gunicorn's config
    does so) is the app's, not a stand-in: its requests are counted."""
    done = subprocess.run(
        [sys.executable, "-c", _SET_FIRST],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2:] == ["requests", "2"], done.stdout + done.stderr
