"""Every ``IDEMPOTENCY_*`` configuration key, with its default and meaning.

This module is the one place the keys are documented. Each key can be set in
``app.config`` or passed to :class:`~flask_idempotency.Idempotency` (lower-case,
without the prefix: ``Idempotency(app, db, ttl=timedelta(hours=48))``); the
constructor value becomes the app's default, and ``app.config`` wins over it.
Route options of :meth:`~flask_idempotency.Idempotency.idempotent` win over both.

=============================  ======================  ============================================
key                            default                 meaning
=============================  ======================  ============================================
``IDEMPOTENCY_HEADER``         ``"Idempotency-Key"``   request header that carries the key
``IDEMPOTENCY_REQUIRED``       ``False``               a protected route without a key answers 400
                                                       (otherwise the request runs unprotected)
``IDEMPOTENCY_TTL``            24 hours                how long a record is kept (retention window);
                                                       a retry after that runs again
``IDEMPOTENCY_LEASE``          60 seconds              how long an in-progress record that has been
                                                       committed blocks duplicates (409) before a
                                                       retry may reclaim it after a crash
``IDEMPOTENCY_WAIT``           10 seconds              how long a duplicate waits for the first
                                                       request's transaction before answering 409;
                                                       ``None``: as long as it takes (saves two
                                                       statements per request on PostgreSQL)
``IDEMPOTENCY_MAX_BODY``       1 MiB (1048576)         largest response body stored for replay;
                                                       larger or streamed bodies are not kept
``IDEMPOTENCY_REPLAY_HEADERS`` ``()``                  response headers replayed in addition to
                                                       ``Content-Type`` and ``Location``
``IDEMPOTENCY_SCOPE``          ``None``                callable returning the scope string; ``None``
                                                       means the endpoint plus a digest of the
                                                       ``Authorization`` header when present
``IDEMPOTENCY_PURGE_BATCH``    1000                    expired records deleted per transaction
``IDEMPOTENCY_SCHEDULER``      ``False``               run the jobs in each serving process
                                                       (started on its first request)
``IDEMPOTENCY_PURGE_EVERY``    5 minutes               interval of the cleanup job
``IDEMPOTENCY_RECOVER_EVERY``  30 seconds              interval of the lease recovery job
``IDEMPOTENCY_JOB_LOCK``       2 minutes               how long a job run holds its lock before
                                                       renewing; a dead runner's lock frees after
``IDEMPOTENCY_READY_TIMEOUT``  2 seconds               how long ``idem.readiness()`` (and
                                                       ``idem.readiness_view``) waits for its probe
                                                       of the record's table before answering
                                                       "not ready"; must be positive
=============================  ======================  ============================================

Durations accept a :class:`~datetime.timedelta` or a number of seconds.
"""

from __future__ import annotations

import dataclasses
import typing as t
from datetime import timedelta

PREFIX = "IDEMPOTENCY_"

DEFAULTS: dict[str, t.Any] = {
    "HEADER": "Idempotency-Key",
    "REQUIRED": False,
    "TTL": timedelta(hours=24),
    "LEASE": timedelta(seconds=60),
    "WAIT": timedelta(seconds=10),
    "MAX_BODY": 1024 * 1024,
    "REPLAY_HEADERS": (),
    "SCOPE": None,
    "PURGE_BATCH": 1000,
    "SCHEDULER": False,
    "PURGE_EVERY": timedelta(minutes=5),
    "RECOVER_EVERY": timedelta(seconds=30),
    "JOB_LOCK": timedelta(minutes=2),
    "READY_TIMEOUT": timedelta(seconds=2),
}

#: Response headers that are never stored or replayed, whatever the configuration
#: says: they carry credentials or per-client state that must not leak to another
#: request.
NEVER_REPLAYED = frozenset(
    {
        "set-cookie",
        "authorization",
        "proxy-authorization",
        "www-authenticate",
        "proxy-authenticate",
        "cookie",
        "content-length",
        "transfer-encoding",
        "connection",
        "idempotent-replayed",
    }
)

ALWAYS_REPLAYED = ("Content-Type", "Location")

ScopeFunc = t.Callable[[], str]


def as_timedelta(value: timedelta | float | int, name: str) -> timedelta:
    """Accept a timedelta or a number of seconds; reject negative durations."""
    if isinstance(value, timedelta):
        result = value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        result = timedelta(seconds=value)
    else:
        raise TypeError(f"{name} must be a timedelta or a number of seconds, not {value!r}")
    if result < timedelta(0):
        raise ValueError(f"{name} must not be negative, got {result}")
    return result


def positive_duration(value: timedelta | float | int, name: str) -> timedelta:
    """A duration longer than zero."""
    result = as_timedelta(value, name)
    if result <= timedelta(0):
        raise ValueError(f"{name} must be longer than zero, got {result}")
    return result


def positive_int(value: t.Any, name: str) -> int:
    """An int of at least 1 (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Settings:
    """The resolved settings for one app (or one route, after its overrides)."""

    header: str
    required: bool
    ttl: timedelta
    lease: timedelta
    wait: timedelta | None
    max_body: int
    replay_headers: tuple[str, ...]
    scope: ScopeFunc | None
    purge_batch: int = 1000
    scheduler: bool = False
    purge_every: timedelta = timedelta(minutes=5)
    recover_every: timedelta = timedelta(seconds=30)
    job_lock: timedelta = timedelta(minutes=2)
    ready_timeout: timedelta = timedelta(seconds=2)

    @classmethod
    def from_mapping(cls, values: t.Mapping[str, t.Any]) -> Settings:
        """Build settings from un-prefixed, upper-case keys (``"TTL"``, ...)."""
        header = str(values["HEADER"]).strip()
        if not header:
            raise ValueError("IDEMPOTENCY_HEADER must not be empty")
        max_body = int(values["MAX_BODY"])
        if max_body < 0:
            raise ValueError("IDEMPOTENCY_MAX_BODY must not be negative")
        extra = tuple(str(h) for h in values["REPLAY_HEADERS"])
        scope = values["SCOPE"]
        if scope is not None and not callable(scope):
            raise TypeError("IDEMPOTENCY_SCOPE must be a callable returning a string")
        return cls(
            header=header,
            required=bool(values["REQUIRED"]),
            ttl=as_timedelta(values["TTL"], "IDEMPOTENCY_TTL"),
            lease=as_timedelta(values["LEASE"], "IDEMPOTENCY_LEASE"),
            wait=None
            if values["WAIT"] is None
            else as_timedelta(values["WAIT"], "IDEMPOTENCY_WAIT"),
            max_body=max_body,
            replay_headers=extra,
            scope=scope,
            purge_batch=positive_int(values["PURGE_BATCH"], "IDEMPOTENCY_PURGE_BATCH"),
            scheduler=bool(values["SCHEDULER"]),
            purge_every=as_timedelta(values["PURGE_EVERY"], "IDEMPOTENCY_PURGE_EVERY"),
            recover_every=as_timedelta(values["RECOVER_EVERY"], "IDEMPOTENCY_RECOVER_EVERY"),
            job_lock=as_timedelta(values["JOB_LOCK"], "IDEMPOTENCY_JOB_LOCK"),
            ready_timeout=positive_duration(values["READY_TIMEOUT"], "IDEMPOTENCY_READY_TIMEOUT"),
        )

    def replayed_header_names(self) -> frozenset[str]:
        """Lower-cased names of the headers stored and replayed."""
        names = {h.lower() for h in (*ALWAYS_REPLAYED, *self.replay_headers)}
        return frozenset(names - NEVER_REPLAYED)
