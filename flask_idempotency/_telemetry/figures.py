"""The database figures behind the observable gauges: one snapshot per
database, read at most once per ``IDEMPOTENCY_METRICS_INTERVAL`` per process
(never per request), whatever the number of gauges, readers and collections.

A read that fails (the database is away) gives no figures for that interval:
the gauges report nothing rather than stale or made-up numbers, and the
collection goes on. It is logged when it starts failing and when it works
again, not at every collection. Nothing here imports OpenTelemetry.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import typing as t

logger = logging.getLogger("flask_idempotency")


@dataclasses.dataclass(frozen=True)
class Gauge:
    """One observable gauge: its name, unit and meaning."""

    name: str
    unit: str
    description: str


RECORDS_LIVE = "idempotency.records.live"
RECORDS_IN_FLIGHT = "idempotency.records.in_flight"
RECORDS_PAST_LEASE = "idempotency.records.past_lease"
OUTBOX_UNPUBLISHED = "idempotency.outbox.unpublished"
OUTBOX_PARKED = "idempotency.outbox.parked"
OUTBOX_OLDEST_AGE = "idempotency.outbox.oldest_age"
INBOX_ROWS = "idempotency.inbox.rows"

GAUGES = (
    Gauge(RECORDS_LIVE, "{record}", "Records within their retention window."),
    Gauge(RECORDS_IN_FLIGHT, "{record}", "Live records still in progress."),
    Gauge(
        RECORDS_PAST_LEASE,
        "{record}",
        "In-progress records whose lease has ended: abandoned, awaiting a retry or recovery.",
    ),
    Gauge(OUTBOX_UNPUBLISHED, "{event}", "Outbox events not yet published (parked ones aside)."),
    Gauge(OUTBOX_PARKED, "{event}", "Outbox events the relay gave up on."),
    Gauge(OUTBOX_OLDEST_AGE, "s", "Age of the oldest unpublished outbox event (0: none)."),
    Gauge(INBOX_ROWS, "{event}", "Processed event ids the inbox keeps."),
)

#: Reads one snapshot: gauge name -> value (a gauge left out reports nothing),
#: or ``None`` when its app is gone. May raise: the failure is handled here.
Reader = t.Callable[[], "t.Mapping[str, float] | None"]


class Source:
    """The figures of one app's database, cached per process."""

    def __init__(
        self,
        identity: str,
        namespace: str | None,
        read: Reader,
        interval: float,
        alive: t.Callable[[], bool] = lambda: True,
        timeout: float = 2.0,
    ) -> None:
        #: Apps on the same database and tables share one read.
        self.identity = identity
        #: Whether its app still exists (a process may make and drop apps: tests).
        self.alive = alive
        self.namespace = namespace
        self.interval = interval
        #: How long a collection waits for the read: a database that hangs must
        #: not hold the app's whole metrics export.
        self.timeout = timeout
        self._read = read
        self._lock = threading.Lock()
        self._pid = 0
        self._read_at = 0.0
        self._figures: t.Mapping[str, float] | None = {}
        self._failing = False
        self._reading: threading.Thread | None = None

    def figures(self) -> t.Mapping[str, float] | None:
        """The snapshot, read again when older than the interval (or read by the
        process this one was forked from); ``None``: the app is gone. A read
        that does not end within the timeout gives nothing (it goes on in the
        background, and no other read starts while it lasts)."""
        with self._lock:
            now, pid = time.monotonic(), os.getpid()
            if pid == self._pid and now - self._read_at < self.interval:
                return self._figures
            reading = self._reading
            if pid == self._pid and reading is not None and reading.is_alive():
                return {}  # the last read still hangs: nothing, and no second one
            # Stamped before the read: a failing read is not tried again before
            # the interval has passed either.
            self._pid, self._read_at = pid, now
            self._figures = {}
            reading = self._reading = threading.Thread(
                target=self._refresh, name="idempotency-metrics-read", daemon=True
            )
            reading.start()
        reading.join(self.timeout)
        with self._lock:
            if reading.is_alive():
                self._failed(f"no answer within {self.timeout:g} s")
                return {}
            return self._figures

    def _refresh(self) -> None:
        try:
            figures = self._read()
        except Exception as exc:
            with self._lock:
                self._failed(_summary(exc))
            return
        with self._lock:
            if self._failing:
                self._failing = False
                logger.info("metrics: reading the database's figures works again")
            self._figures = figures

    def _failed(self, why: str) -> None:
        level = logging.DEBUG if self._failing else logging.WARNING
        self._failing = True
        logger.log(
            level,
            "metrics: reading the database's figures failed, the gauges report "
            "nothing until it works: %s",
            why,
        )


def _summary(exc: BaseException) -> str:
    """The error's class and first line (never the statement SQLAlchemy appends)."""
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


_lock = threading.Lock()
_sources: list[Source] = []


def watch(source: Source) -> None:
    """Report ``source``'s figures from now on (``init_app``, once per app).
    The sources of apps that are gone are forgotten here too."""
    with _lock:
        _sources[:] = [known for known in _sources if known.alive()]
        _sources.append(source)


def observe(name: str) -> list[tuple[float, t.Mapping[str, str]]]:
    """The values of the gauge ``name``: one per database (the first live app's
    read), with ``db.namespace`` when this process watches several. Never raises."""
    try:
        with _lock:
            sources = list(_sources)
        seen: dict[str, Source] = {}
        values: dict[str, float] = {}
        for source in sources:
            if source.identity in seen:
                continue
            figures = source.figures()
            if figures is None:  # its app is gone: forget it
                with _lock:
                    if source in _sources:
                        _sources.remove(source)
                continue
            seen[source.identity] = source
            if name in figures:
                values[source.identity] = figures[name]
        several = len(seen) > 1
        return [
            (
                value,
                {"db.namespace": seen[identity].namespace or "default"} if several else {},
            )
            for identity, value in values.items()
        ]
    except Exception:  # a bug here must not break the app's other metrics
        logger.debug("metrics: gauge %s failed", name, exc_info=True)
        return []


def forget_all() -> None:
    """Stop reporting every source (tests)."""
    with _lock:
        _sources.clear()
