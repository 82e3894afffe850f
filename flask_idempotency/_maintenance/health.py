"""Readiness: can this process use the record's database right now?

A load balancer should stop sending requests to a host that is cut off from its
database: every request there would hang or fail. A liveness check that does
not touch the database cannot tell; this probe can. It runs a trivial query on
the record's table (``SELECT 1 FROM idempotency_keys LIMIT 1``) through the
app's own engine and pool, then checks that the database accepts writes, so it
fails exactly when a claim would:

* PostgreSQL: ``pg_is_in_recovery()`` (a standby) and ``transaction_read_only``
  (``default_transaction_read_only``, for the server, database or role), read
  without taking a lock, so a migration's table lock does not take every host
  out of rotation; and ``has_any_column_privilege`` for the claim's INSERT and UPDATE
  (``"forbidden"`` when a GRANT is missing, as the claim would be refused);
* MySQL/MariaDB and SQLite: a write that touches no row (``UPDATE ... WHERE
  scope IS NULL``, rolled back; the claim completes with an UPDATE, so it needs
  no privilege the claim does not), which the server refuses exactly as it would refuse
  the claim: ``read_only`` (unless the app's user may write anyway, READ_ONLY
  ADMIN or SUPER), ``innodb_read_only``, a read-only transaction default, a
  SQLite file opened read-only or ``PRAGMA query_only``.

The query runs in a background thread, so the answer comes within the timeout
even when the database hangs (a network partition does not fail a query, it
never answers it). At most one probe per app and process is in flight: while a
hung probe is running, every check answers "not ready" at once instead of
piling up threads and connections, until the probe returns.

The answers over HTTP, and the server that gives them on a port of its own,
are in :mod:`.readiness_http`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import logging
import os
import threading
import time
import typing as t
import weakref

import sqlalchemy as sa

from .._storage import dberrors
from .._storage import readiness as readiness_sql

# The answers over HTTP, which the extension's readiness view and
# serve_readiness reach through here.
from .readiness_http import Details

logger = logging.getLogger("flask_idempotency")


@dataclasses.dataclass
class _Probe:
    number: int
    started: float  # time.monotonic()
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    ok: bool = False
    # "ok", a dberrors.Failure value, "read_only", "forbidden", "missing_table" or "error"
    outcome: str = "running"
    error: str | None = None
    reason: str | None = None  # why a read-only database refuses writes
    duration: float = 0.0


class ReadinessProbe:
    """The probe state of one app in one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._current: _Probe | None = None
        self._numbers = itertools.count(1)

    def check(
        self,
        engine: sa.Engine,
        table: sa.Table,
        timeout: dt.timedelta,
        also: t.Sequence[sa.Table] = (),
    ) -> tuple[bool, Details]:
        """Probe (or join the probe in flight) and wait for it at most ``timeout``
        from the probe's start. ``also``: tables that must exist too (the
        outbox: a missing one fails every request that emits)."""
        seconds = timeout.total_seconds()
        with self._lock:
            if self._pid != os.getpid():
                # A forked child inherits the parent's probe, but not its thread.
                self._pid, self._current = os.getpid(), None
            probe = self._current
            if probe is None or probe.done.is_set():
                probe = _Probe(number=next(self._numbers), started=time.monotonic())
                self._current = probe
                threading.Thread(
                    target=_run,
                    args=(probe, engine, table, timeout, tuple(also)),
                    name="flask-idempotency-readiness",
                    daemon=True,
                ).start()
        remaining = probe.started + seconds - time.monotonic()
        finished = probe.done.wait(max(0.0, remaining))
        details: Details = {
            "ready": finished and probe.ok,
            "table": table.name,
            "timeout_ms": round(seconds * 1000),
            "probe_id": probe.number,
        }
        if finished:
            details["database"] = probe.outcome
            details["duration_ms"] = round(probe.duration * 1000, 1)
            if probe.error is not None:
                details["error"] = probe.error
            if probe.reason is not None:
                details["reason"] = probe.reason
        else:
            details["database"] = "timeout"
            details["running_ms"] = round((time.monotonic() - probe.started) * 1000, 1)
        return bool(details["ready"]), details


def _run(
    probe: _Probe,
    engine: sa.Engine,
    table: sa.Table,
    timeout: dt.timedelta,
    also: tuple[sa.Table, ...] = (),
) -> None:
    try:
        verdict = readiness_sql.probe(engine, table, timeout)
        # The other tables only once the database could take a claim: a standby
        # or a refused privilege is the reason to give first.
        healthy = verdict.forbidden is None and verdict.read_only is None
        missing = _missing(engine, also) if healthy else None
        if missing is not None:
            probe.outcome, probe.reason = "missing_table", f"the table {missing} does not exist"
            logger.warning("readiness probe: the table %s is missing", missing)
        elif verdict.forbidden is not None:
            probe.outcome, probe.reason = "forbidden", verdict.forbidden
            probe.error = "InsufficientPrivilege"
            logger.warning("readiness probe of %s: %s", table.name, verdict.forbidden)
        elif verdict.read_only is None:
            probe.ok, probe.outcome = True, "ok"
        else:
            probe.outcome, probe.reason = "read_only", verdict.read_only
            logger.warning(
                "readiness probe of %s: read-only database: %s", table.name, verdict.read_only
            )
    except Exception as exc:  # any failure means "not ready"; say which kind
        reason = dberrors.read_only_reason(exc)
        if reason is not None:
            probe.outcome, probe.reason = "read_only", reason
        elif dberrors.privilege_refused(exc):  # the write check, as a claim would be
            probe.outcome = "forbidden"
        elif dberrors.missing_table(exc, (table.name,)) is not None:
            probe.outcome = "missing_table"  # create-tables or the migrations never ran
        else:
            failure = dberrors.classify(exc)
            probe.outcome = failure.value if failure is not None else "error"
        # The class name only: driver messages can name hosts and users, and a
        # readiness endpoint is often reachable by more people than the logs.
        probe.error = type(exc).__name__
        logger.warning(
            "readiness probe of %s failed%s: %s",
            table.name,
            ": read-only database" if reason is not None else "",
            dberrors.summary(exc),
        )
    finally:
        probe.duration = time.monotonic() - probe.started
        probe.done.set()


def _missing(engine: sa.Engine, tables: tuple[sa.Table, ...]) -> str | None:
    """The name of the first of ``tables`` that does not exist, or ``None``."""
    if not tables:
        return None
    with engine.connect() as conn:
        inspector = sa.inspect(conn)
        for table in tables:
            if not inspector.has_table(table.name, schema=table.schema):
                return table.name
    return None


_probes: weakref.WeakKeyDictionary[t.Any, ReadinessProbe] = weakref.WeakKeyDictionary()
_probes_lock = threading.Lock()


def probe_for(app: t.Any) -> ReadinessProbe:
    """The readiness probe of ``app`` (a Flask app), made on first use."""
    with _probes_lock:
        probe = _probes.get(app)
        if probe is None:
            probe = _probes[app] = ReadinessProbe()
        return probe
