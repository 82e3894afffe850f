"""Telemetry: the one small interface the request flow, the relay, the inbox
and the jobs record through, and the only place that imports OpenTelemetry.

With ``opentelemetry-api`` absent (no ``otel`` extra) nothing of it is
imported and every call here costs a check of one module-level flag; the
request's structured log line is still written. With the API but no SDK,
the API's no-op meter and tracer take the calls. The package never
configures an SDK: the app's own set-up, global or made later (gunicorn's
``post_fork``), receives everything.

* :mod:`.request`: a protected request's outcome, phases and log line;
* :mod:`.metrics`: the instruments; :mod:`.figures`: the gauges' database reads;
* :mod:`.spans`: the request flow's spans; :mod:`.propagation`: W3C trace context
  across the chain (the client's attempts, outbox events, the relay, the inbox);
* :mod:`.safety`: telemetry never fails what it observes (every entry point
  here that records is guarded: a failure is logged at DEBUG) and a span never
  records an error's text.
"""

from __future__ import annotations

import importlib
import logging
import typing as t

from .figures import GAUGES as GAUGES
from .figures import Reader, Source, watch
from .request import OUTCOMES as OUTCOMES
from .request import RequestTelemetry as RequestTelemetry
from .safety import nothing, quietly

if t.TYPE_CHECKING:
    from types import ModuleType

logger = logging.getLogger("flask_idempotency")


def _load(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ImportError as exc:
        if not (exc.name or "").startswith("opentelemetry"):
            raise
        return None


_metrics = _load("metrics")
_spans = _load("spans") if _metrics is not None else None

#: Whether OpenTelemetry's API is installed (the ``otel`` extra).
AVAILABLE = _metrics is not None


def request(route: str, method: str) -> RequestTelemetry:
    """The observation of one request to a protected route (``http.route`` is
    the URL rule, never the path)."""
    return RequestTelemetry(route, method, _metrics, _spans)


def watch_database(
    identity: str,
    namespace: str | None,
    read: Reader,
    interval: float,
    alive: t.Callable[[], bool],
    timeout: float,
) -> None:
    """Report the gauges from ``read()``'s snapshots, read at most once per
    ``interval`` seconds per process, while ``alive()``; a collection waits at
    most ``timeout`` seconds for a read. ``identity`` names the database and
    tables: apps sharing them share the read."""
    if _metrics is None:
        return
    watch(Source(identity, namespace, read, interval, alive, timeout))
    _make_instruments()  # the gauges exist from now on, requests or not


@quietly(nothing)
def _make_instruments() -> None:
    if _metrics is not None:
        _metrics.instruments()


@quietly(nothing)
def published(system: str, seconds: float, error: str | None) -> None:
    """One publish by the relay: to the broker's confirm, or failed for ``error``
    (``broker_unavailable``, ``rejected``, ``timeout``, ``serialization``, ``other``)."""
    if _metrics is None or not _metrics.recording():  # the API's stand-ins record nothing
        return
    instruments = _metrics.instruments()
    if error is None:
        attributes = instruments.attributes(
            "messaging.system", system, "messaging.operation.name", "publish"
        )
    else:
        attributes = instruments.attributes(
            "messaging.system", system, "messaging.operation.name", "publish", "error.type", error
        )
    instruments.sent_messages.add(1, attributes)
    instruments.operation_duration.record(seconds, attributes)


@quietly(nothing)
def batch_taken(size: int) -> None:
    """A relay batch took ``size`` events (empty batches are not recorded)."""
    if _metrics is None or size <= 0 or not _metrics.recording():
        return
    _metrics.instruments().batch_size.record(size)


@quietly(nothing)
def inbox_duplicate(consumer: str) -> None:
    """The inbox skipped a delivery for ``consumer``: processed already."""
    if _metrics is None:
        return
    instruments = _metrics.instruments()
    instruments.inbox_duplicates.add(1, instruments.attributes("idempotency.consumer", consumer))


@quietly(nothing)
def job_ran(job: str, result: str, seconds: float | None) -> None:
    """A tick of ``job`` ended with ``result`` (``ok``, ``error``, ``skipped``);
    ``seconds`` it took when it ran."""
    if _metrics is None:
        return
    instruments = _metrics.instruments()
    attributes = instruments.attributes("idempotency.job", job, "idempotency.job.result", result)
    instruments.job_runs.add(1, attributes)
    if seconds is not None:
        instruments.job_duration.record(seconds, attributes)


@quietly(nothing)
def job_rows(job: str, rows: int) -> None:
    """``job`` deleted or changed ``rows`` rows."""
    if _metrics is None or rows <= 0:
        return
    instruments = _metrics.instruments()
    instruments.job_rows.add(rows, instruments.attributes("idempotency.job", job))


def tracer() -> t.Any:
    """The ``flask_idempotency`` tracer (``None`` without the API): for the
    client's and the inbox's spans."""
    return None if _spans is None else _spans.tracer()


def _use_providers(meter_provider: t.Any = None, tracer_provider: t.Any = None) -> None:
    """Record through these providers instead of the global ones (``None``: the
    global ones again). For tests only: an SDK's global providers can be set
    once per process."""
    if _metrics is not None:
        _metrics.use_provider(meter_provider)
    if _spans is not None:
        _spans.use_provider(tracer_provider)
