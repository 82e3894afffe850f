"""The instruments, on OpenTelemetry's metrics API: imported only when
``opentelemetry-api`` is installed (the ``otel`` extra), through
:mod:`flask_idempotency._telemetry`, which the rest of the package calls.

Every instrument comes from one meter, ``flask_idempotency``, of the meter
provider in force when it is first needed: the API's global one (a proxy until
the app sets an SDK's, even after ``init_app``: gunicorn's ``post_fork``), or
one a test hands in. Attribute sets are built once per (route, method,
outcome) and reused: recording costs a dictionary lookup and the API's call.
"""

from __future__ import annotations

import threading
import typing as t

from opentelemetry import metrics

from .figures import GAUGES, observe

#: Seconds: a claim or a replay takes milliseconds, a duplicate's wait up to
#: ``IDEMPOTENCY_WAIT``, a publish up to the publisher's timeout.
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Bytes of a stored response, up to ``IDEMPOTENCY_MAX_BODY``'s default (1 MiB) and beyond.
BYTES = (0, 128, 512, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)
#: Events in one relay batch (at most its ``batch``, 100 by default).
EVENTS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)

Attributes = t.Mapping[str, str]


class Instruments:
    """Every instrument of the package, made once per meter provider."""

    def __init__(self, meter: metrics.Meter) -> None:
        self.requests = meter.create_counter(
            "idempotency.requests",
            unit="{request}",
            description="Requests to protected routes, by outcome.",
        )
        self.claim_duration = meter.create_histogram(
            "idempotency.claim.duration",
            unit="s",
            description="Time to claim the key, or to find the record that holds it.",
            explicit_bucket_boundaries_advisory=SECONDS,
        )
        self.wait_duration = meter.create_histogram(
            "idempotency.wait.duration",
            unit="s",
            description="Time a concurrent duplicate waited for the first request.",
            explicit_bucket_boundaries_advisory=SECONDS,
        )
        self.replay_duration = meter.create_histogram(
            "idempotency.replay.duration",
            unit="s",
            description="Time to answer a retry with the stored response.",
            explicit_bucket_boundaries_advisory=SECONDS,
        )
        self.response_size = meter.create_histogram(
            "idempotency.response.size",
            unit="By",
            description="Size of the response bodies stored for replay.",
            explicit_bucket_boundaries_advisory=BYTES,
        )
        self.sent_messages = meter.create_counter(
            "messaging.client.sent.messages",
            unit="{message}",
            description="Outbox events the relay tried to publish (error.type on failure).",
        )
        self.operation_duration = meter.create_histogram(
            "messaging.client.operation.duration",
            unit="s",
            description="Time from publish to the broker's confirm, per event.",
            explicit_bucket_boundaries_advisory=SECONDS,
        )
        self.batch_size = meter.create_histogram(
            "idempotency.relay.batch.size",
            unit="{event}",
            description="Events the relay took in one batch (batches that found none left out).",
            explicit_bucket_boundaries_advisory=EVENTS,
        )
        self.inbox_duplicates = meter.create_counter(
            "idempotency.inbox.duplicates",
            unit="{event}",
            description="Deliveries the inbox skipped: the event was processed already.",
        )
        self.job_runs = meter.create_counter(
            "idempotency.job.runs",
            unit="{run}",
            description="Maintenance job ticks, by job and result (skipped: run elsewhere).",
        )
        self.job_rows = meter.create_counter(
            "idempotency.job.rows",
            unit="{row}",
            description="Rows the maintenance jobs deleted or changed.",
        )
        self.job_duration = meter.create_histogram(
            "idempotency.job.duration",
            unit="s",
            description="Time a job run took, by job and result.",
            explicit_bucket_boundaries_advisory=SECONDS,
        )
        for gauge in GAUGES:
            meter.create_observable_gauge(
                gauge.name,
                callbacks=[_callback(gauge.name)],
                unit=gauge.unit,
                description=gauge.description,
            )
        # Attribute sets, built once each (bounded: routes x methods x outcomes).
        self._request_attributes: dict[tuple[str, str, str, str | None], Attributes] = {}
        self._route_attributes: dict[tuple[str, str], Attributes] = {}
        self._other: dict[tuple[str, ...], Attributes] = {}

    def request_attributes(
        self, route: str, method: str, outcome: str, refusal: str | None
    ) -> Attributes:
        key = (route, method, outcome, refusal)
        found = self._request_attributes.get(key)
        if found is None:
            built = {
                "idempotency.outcome": outcome,
                "http.route": route,
                "http.request.method": method,
            }
            if refusal is not None:
                built["idempotency.key_refusal"] = refusal
            found = self._request_attributes[key] = built
        return found

    def route_attributes(self, route: str, method: str) -> Attributes:
        key = (route, method)
        found = self._route_attributes.get(key)
        if found is None:
            found = self._route_attributes[key] = {
                "http.route": route,
                "http.request.method": method,
            }
        return found

    def attributes(self, *pairs: str) -> Attributes:
        """``attributes("a", "1", "b", "2")`` is ``{"a": "1", "b": "2"}``, built once."""
        found = self._other.get(pairs)
        if found is None:
            found = self._other[pairs] = dict(zip(pairs[::2], pairs[1::2], strict=True))
        return found


def _callback(name: str) -> t.Callable[[metrics.CallbackOptions], t.Iterable[metrics.Observation]]:
    def read(options: metrics.CallbackOptions) -> t.Iterable[metrics.Observation]:
        # Never raises: a failed read yields nothing (see figures.observe).
        return [metrics.Observation(value, attributes) for value, attributes in observe(name)]

    return read


_lock = threading.Lock()
_made: Instruments | None = None
#: A provider handed in (tests); ``None``: the API's global one.
_provider: metrics.MeterProvider | None = None


def instruments() -> Instruments:
    """The instruments, made on first use from the meter provider in force."""
    global _made
    made = _made
    if made is None:
        with _lock:
            if _made is None:
                provider = _provider or metrics.get_meter_provider()
                _made = Instruments(provider.get_meter("flask_idempotency", _version()))
            made = _made
    return made


def _stand_ins() -> tuple[type[t.Any], ...]:
    """The API's stand-ins before (and instead of) an app's provider: what is
    recorded on them goes nowhere. Named by class, not by what the global
    provider is at import: a process that sets its SDK provider before importing
    the extension (gunicorn's config, a telemetry bootstrap) must not have its
    own provider taken for a stand-in. The proxy's class is private to the API;
    without it the proxy counts as recording (slower, never wrong)."""
    try:
        from opentelemetry.metrics._internal import _ProxyMeterProvider
    except ImportError:  # pragma: no cover - depends on the API's layout
        return (metrics.NoOpMeterProvider,)
    return (_ProxyMeterProvider, metrics.NoOpMeterProvider)


_STAND_INS = _stand_ins()


def recording() -> bool:
    """Whether a meter provider is in force whose instruments record: one handed
    in, or an SDK's set as the global one (not the API's proxy or no-op)."""
    return _provider is not None or not isinstance(metrics.get_meter_provider(), _STAND_INS)


def use_provider(provider: metrics.MeterProvider | None) -> None:
    """Record through ``provider`` from now on (``None``: the global one again).
    For tests: the SDK lets a process set its global provider only once."""
    global _made, _provider
    with _lock:
        _provider, _made = provider, None


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flask-idempotency")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return None
