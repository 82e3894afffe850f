"""Gunicorn configuration: each worker exports its own metrics for Prometheus.

    METRICS_PORTS=9464-9471 gunicorn -c gunicorn_otel.conf.py -w 4 "myapp:create_app()"

Flask-Idempotency records through the OpenTelemetry API and never configures an
SDK: this file is the app's SDK set-up, for gunicorn with several workers.

Why one endpoint per worker: gunicorn's workers are separate processes, each with
its own counters. One shared /metrics port would answer each scrape from whichever
worker accepted it, and the totals would jump about. prometheus_client's
multiprocess mode (PROMETHEUS_MULTIPROC_DIR) does not help: it merges only the
metrics prometheus_client itself created, and the OpenTelemetry exporter is a
custom collector, which that mode does not support (opentelemetry-python issue
3747; the exporter's documentation says so under "Limitations"). So each worker,
right after the fork, sets up its own MeterProvider with a PrometheusMetricReader
and serves /metrics on a port of its own: the first free port of METRICS_PORTS.
Prometheus scrapes every port of the range; each worker is a target (its own
``instance`` label), and ``sum without (instance) (...)`` gives the totals.

A worker that is replaced (a crash, ``max_requests``, a timeout) starts its
counters at zero on the port its predecessor freed: Prometheus' rate() and
increase() treat that as a counter reset, and the ``instance`` label takes no more
values than the range has ports, however often workers restart. During a
graceful reload (SIGHUP) gunicorn starts the new workers before the old ones
exit, so give the range twice as many ports as workers; a worker that finds no
free port keeps serving requests and takes the first port that frees up.

Environment:
    METRICS_PORTS  the port range, ``FIRST-LAST`` (default ``9464-9471``)
    METRICS_HOST   the address to listen on (default ``127.0.0.1``; the address
                   Prometheus reaches, or ``0.0.0.0``, in production)
    OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES  read by the SDK as usual

Needs ``opentelemetry-sdk`` and ``opentelemetry-exporter-prometheus`` (which
brings ``prometheus_client``). Flask-Idempotency's tests start gunicorn with this
very file.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import typing as t

_RETRY_SECONDS = 1.0


def _ports() -> range:
    first, _, last = os.environ.get("METRICS_PORTS", "9464-9471").partition("-")
    return range(int(first), int(last or first) + 1)


def _serve_metrics(host: str) -> int | None:
    """Serve the default prometheus_client registry on the first free port of the
    range; the port, or ``None`` when every port is taken."""
    from prometheus_client import start_http_server

    for port in _ports():
        try:
            start_http_server(port, addr=host)
        except OSError:  # taken by another worker (or anything else): try the next
            continue
        return port
    return None


def post_fork(server: t.Any, worker: t.Any) -> None:
    # Imported here, in the worker: nothing of the SDK runs in gunicorn's master.
    from opentelemetry import metrics
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, Resource

    host = os.environ.get("METRICS_HOST", "127.0.0.1")
    port = _serve_metrics(host)
    # The identity follows the port, not the pid: a replaced worker takes its
    # predecessor's place, and target_info keeps as few label values as the range.
    instance = f"{socket.gethostname()}:{port if port is not None else worker.pid}"
    reader = PrometheusMetricReader()
    provider = MeterProvider(
        metric_readers=[reader], resource=Resource.create({SERVICE_INSTANCE_ID: instance})
    )
    metrics.set_meter_provider(provider)
    if port is not None:
        server.log.info("Worker %s serves /metrics on %s:%s", worker.pid, host, port)
        return
    server.log.warning(
        "Worker %s: no free port in METRICS_PORTS for /metrics; retrying every %ss",
        worker.pid,
        _RETRY_SECONDS,
    )

    def retry() -> None:
        while (found := _serve_metrics(host)) is None:
            time.sleep(_RETRY_SECONDS)
        server.log.info("Worker %s serves /metrics on %s:%s", worker.pid, host, found)

    threading.Thread(target=retry, name="metrics-port", daemon=True).start()
