"""The settings resolved and checked: what ``init_app`` and the route options turn
the declared keys (:mod:`flask_idempotency.config`) into, and the checks that
refuse a value meaning something other than what was written."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import typing as t
from datetime import timedelta

from ._config_connection import (
    TRANSACTION_POOLERS,
    resolve_form_field,
    resolve_listen_url,
    resolve_pooler,
)
from ._contract import ALWAYS_REPLAYED, NEVER_REPLAYED, is_storable
from ._secrets import KeyPairs, resolve_encryption_keys, resolve_fingerprint_key
from .config import DEFAULTS, PREFIX
from .keys import MAX_KEY_LENGTH, KeyFormat, resolve_key_format, resolve_key_max_length

ScopeFunc = t.Callable[[], str]


#: The longest duration a setting takes (100 years): a record's expiry and the
#: jobs' and the relay's locks are "now" plus one, a date every engine must store.
MAX_DURATION = timedelta(days=36500)
#: The longest bound a setting the database enforces takes (24 days):
#: PostgreSQL holds ``lock_timeout`` and ``idle_in_transaction_session_timeout``
#: in milliseconds, at most 2**31 - 1 (24.8 days), and refuses the statement
#: that sets more, which would fail every claim (or readiness probe).
MAX_ENGINE_TIMEOUT = timedelta(days=24)
#: The largest count a setting takes: it lands in a ``LIMIT`` or beside an
#: ``INTEGER`` column, 32-bit on some engines.
MAX_COUNT = 2**31 - 1


def _human(limit: timedelta) -> str:
    return f"{limit.days} days" if limit.days and not limit.seconds else str(limit)


def as_timedelta(
    value: timedelta | float | int, name: str, *, maximum: timedelta = MAX_DURATION
) -> timedelta:
    """Accept a timedelta or a number of seconds, from 0 to ``maximum``; refuse
    anything else (a string such as ``"10s"``, a bool, NaN, infinity) with an
    error naming the setting."""
    limit = f"{name} must be at most {_human(maximum)}"
    if isinstance(value, timedelta):
        result = value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")
        if value > maximum.total_seconds():
            raise ValueError(f"{limit}, got {value!r} seconds")
        result = timedelta(seconds=value)
    else:
        raise TypeError(
            f"{name} must be a timedelta or a number of seconds (an int or float), not {value!r}"
        )
    if result < timedelta(0):
        raise ValueError(f"{name} must not be negative, got {result}")
    if result > maximum:
        raise ValueError(f"{limit}, got {result}")
    return result


def engine_timeout(value: timedelta | float | int, name: str) -> timedelta:
    """A bound the database enforces (:data:`MAX_ENGINE_TIMEOUT` at most)."""
    return as_timedelta(value, name, maximum=MAX_ENGINE_TIMEOUT)


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def as_bool(value: t.Any, name: str) -> bool:
    """``True``/``False``, 1/0, or their usual spellings as text (``"false"``,
    ``"off"``, ``"0"``, ... as read from an environment variable): text is not
    true just for being non-empty. Anything else is refused."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
    raise ValueError(
        f'{name} must be True or False (or 1/0, "true"/"false", "on"/"off", '
        f'"yes"/"no"), got {value!r}'
    )


def check_positive(ttl: timedelta, lease: timedelta, where: str) -> None:
    """Refuse a TTL or lease that is not positive."""
    if ttl <= timedelta(0):
        raise ValueError(f"{where}: the ttl must be positive, got {ttl}")
    if lease <= timedelta(0):
        raise ValueError(f"{where}: the lease must be positive, got {lease}")


def check_retention(
    ttl: timedelta, lease: timedelta, where: str, *, names: tuple[str, str] = ("ttl", "lease")
) -> None:
    """Refuse a TTL or lease that is not positive, or a TTL not longer than the lease.

    A leased record (``lease=`` on its route) whose retention ended before its
    lease would count as absent once that lease ended: the retry that should
    resume the operation from its recovery points (or the recovery job) would
    start a new one instead, running its steps again. ``names`` are how the
    message calls the two values (the route's options, or the app's settings).
    """
    check_positive(ttl, lease, where)
    if ttl <= lease:
        raise ValueError(
            f"{where}: the {names[0]} ({ttl}) must be longer than the {names[1]} ({lease}); a "
            "leased record that expired before its lease ended would make the retry that "
            "should resume it start a second operation instead"
        )


#: Safe methods never need a key: they change nothing.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})


def resolve_methods(value: t.Any, name: str) -> frozenset[str] | None:
    """Upper-case method names; safe methods refused. ``None``: every unsafe method."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, t.Iterable):
        raise TypeError(f"{name} must be a collection of HTTP method names, not {value!r}")
    methods = frozenset(str(m).upper() for m in value)
    if not methods:
        raise ValueError(f"{name} must name at least one method")
    safe = sorted(methods & SAFE_METHODS)
    if safe:
        raise ValueError(f"{name}: {', '.join(safe)} change nothing and need no idempotency key")
    return methods


def resolve_stored_statuses(value: t.Any, name: str) -> frozenset[int] | None:
    """``None`` (the default rule), or a set of status codes between 200 and 499."""
    if value is None:
        return None
    if isinstance(value, (str, int)) or not isinstance(value, t.Iterable):
        raise TypeError(f"{name} must be None or a collection of status codes, not {value!r}")
    codes = frozenset(value)
    bad = sorted(
        repr(c)
        for c in codes
        if isinstance(c, bool) or not isinstance(c, int) or not 200 <= c < 500
    )
    if bad:
        raise ValueError(
            f"{name}: only 2xx, 3xx and 4xx answers can be stored (a 5xx is rolled back so "
            f"the retry runs again); got {', '.join(bad)}"
        )
    if not codes:
        raise ValueError(f"{name} must name at least one status (or be None)")
    return codes


def resolve_replay_headers(value: t.Any, name: str) -> tuple[str, ...] | t.Literal["*"]:
    """Header names to replay, or ``"*"`` for every header but the never-replayed ones."""
    if value == "*":
        return "*"
    if isinstance(value, str) or not isinstance(value, t.Iterable):
        raise TypeError(f'{name} must be "*" or a collection of header names, not {value!r}')
    return tuple(str(h) for h in value)


def optional_callable(value: t.Any, name: str) -> t.Any:
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be a callable or None, not {value!r}")
    return value


def check_known(config: t.Mapping[str, t.Any]) -> None:
    """Refuse ``IDEMPOTENCY_*`` keys this extension does not know.

    A typo (``IDEMPOTENCY_TLL``) would otherwise leave the default in force,
    unseen.
    """
    known = {PREFIX + name for name in DEFAULTS}
    unknown = sorted(k for k in config if k.startswith(PREFIX) and k not in known)
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, known, n=1)
            hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
        raise ValueError(
            f"unknown Flask-Idempotency setting(s): {'; '.join(hints)}. "
            "Every setting is listed in flask_idempotency.config."
        )


def positive_duration(
    value: timedelta | float | int, name: str, *, maximum: timedelta = MAX_DURATION
) -> timedelta:
    """A duration longer than zero, and at most ``maximum``."""
    result = as_timedelta(value, name, maximum=maximum)
    if result <= timedelta(0):
        raise ValueError(f"{name} must be longer than zero, got {result}")
    return result


def positive_int(value: t.Any, name: str, *, maximum: int = MAX_COUNT) -> int:
    """An int from 1 to ``maximum`` (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise ValueError(f"{name} must be an integer from 1 to {maximum}, got {value!r}")
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
    replay_headers: tuple[str, ...] | t.Literal["*"]
    scope: ScopeFunc | None
    #: ``None``: every method but :data:`SAFE_METHODS`.
    methods: frozenset[str] | None = None
    skip: t.Callable[[], bool] | None = None
    #: Called with a ``scope.ReplayAttempt`` before a replay; false refuses it.
    replay_guard: t.Callable[[t.Any], t.Any] | None = None
    #: Called with a ``scope.ReconcileAttempt``; rebuilds a failed-after-commit answer.
    reconcile: t.Callable[[t.Any], t.Any] | None = None
    stored_statuses: frozenset[int] | None = None
    purge_batch: int = 1000
    scheduler: bool = False
    purge_every: timedelta = timedelta(minutes=5)
    recover_every: timedelta = timedelta(seconds=30)
    job_lock: timedelta = timedelta(minutes=2)
    key_format: KeyFormat | None = None
    key_max_length: int = MAX_KEY_LENGTH

    claim_idle_timeout: timedelta | None = None
    ready_timeout: timedelta = timedelta(seconds=2)
    outbox_max_attempts: int = 10
    outbox_lease: timedelta = timedelta(minutes=1)
    relay_every: timedelta = timedelta(seconds=1)
    outbox_retention: timedelta = timedelta(days=7)
    relay_wake: bool = True
    inbox_ttl: timedelta = timedelta(days=7)
    metrics_interval: timedelta = timedelta(seconds=30)
    trace_baggage: bool = False
    #: ``None``, ``"session"``, ``"transaction"`` or ``"transaction+prepared"``.
    database_pooler: str | None = None
    relay_listen_url: str | None = None
    #: The form field of a rendered form's key; ``None``: forms carry none.
    form_field: str | None = "idempotency_key"
    #: ``None``: the ttl.
    form_key_max_age: timedelta | None = None
    #: The keyed fingerprint's secret; ``None``: plain SHA-256. Never in a repr.
    fingerprint_key: bytes | None = dataclasses.field(default=None, repr=False)
    #: ``None``: encryption at rest off; else (id, key) pairs, the first seals.
    encryption_keys: KeyPairs | None = dataclasses.field(default=None, repr=False)

    @property
    def transaction_pooled(self) -> bool:
        """Whether the app's connections go through transaction pooling: no
        session state (LISTEN) outlives a transaction."""
        return self.database_pooler in TRANSACTION_POOLERS

    def __post_init__(self) -> None:
        # Also runs for dataclasses.replace(), so route overrides are checked too.
        # The TTL against the lease is checked where a lease applies: the app's
        # settings (from_mapping) and each leased route (RouteOptions.settings_for).
        check_positive(self.ttl, self.lease, "IDEMPOTENCY_TTL/IDEMPOTENCY_LEASE")

    @classmethod
    def from_mapping(cls, values: t.Mapping[str, t.Any]) -> Settings:
        """Build settings from un-prefixed, upper-case keys (``"TTL"``, ...)."""
        header = str(values["HEADER"]).strip()
        if not header:
            raise ValueError("IDEMPOTENCY_HEADER must not be empty")
        max_body = values["MAX_BODY"]
        if isinstance(max_body, bool) or not isinstance(max_body, int) or max_body < 0:
            raise ValueError(
                f"IDEMPOTENCY_MAX_BODY must be a number of bytes (an int, 0 or more), "
                f"got {max_body!r}"
            )
        extra = resolve_replay_headers(values["REPLAY_HEADERS"], "IDEMPOTENCY_REPLAY_HEADERS")
        scope = optional_callable(values["SCOPE"], "IDEMPOTENCY_SCOPE")
        settings = cls(
            header=header,
            required=as_bool(values["REQUIRED"], "IDEMPOTENCY_REQUIRED"),
            ttl=as_timedelta(values["TTL"], "IDEMPOTENCY_TTL"),
            lease=as_timedelta(values["LEASE"], "IDEMPOTENCY_LEASE"),
            wait=None
            if values["WAIT"] is None
            else engine_timeout(values["WAIT"], "IDEMPOTENCY_WAIT"),
            max_body=max_body,
            replay_headers=extra,
            scope=scope,
            methods=resolve_methods(values["METHODS"], "IDEMPOTENCY_METHODS"),
            skip=optional_callable(values["SKIP"], "IDEMPOTENCY_SKIP"),
            replay_guard=optional_callable(values["REPLAY_GUARD"], "IDEMPOTENCY_REPLAY_GUARD"),
            reconcile=optional_callable(values.get("RECONCILE"), "IDEMPOTENCY_RECONCILE"),
            stored_statuses=resolve_stored_statuses(
                values["STORED_STATUSES"], "IDEMPOTENCY_STORED_STATUSES"
            ),
            purge_batch=positive_int(values["PURGE_BATCH"], "IDEMPOTENCY_PURGE_BATCH"),
            scheduler=as_bool(values["SCHEDULER"], "IDEMPOTENCY_SCHEDULER"),
            purge_every=positive_duration(values["PURGE_EVERY"], "IDEMPOTENCY_PURGE_EVERY"),
            recover_every=positive_duration(values["RECOVER_EVERY"], "IDEMPOTENCY_RECOVER_EVERY"),
            job_lock=positive_duration(values["JOB_LOCK"], "IDEMPOTENCY_JOB_LOCK"),
            key_format=resolve_key_format(values["KEY_FORMAT"], "IDEMPOTENCY_KEY_FORMAT"),
            key_max_length=resolve_key_max_length(
                values["KEY_MAX_LENGTH"], "IDEMPOTENCY_KEY_MAX_LENGTH"
            ),
            claim_idle_timeout=None
            if values.get("CLAIM_IDLE_TIMEOUT") is None
            else positive_duration(
                values["CLAIM_IDLE_TIMEOUT"],
                "IDEMPOTENCY_CLAIM_IDLE_TIMEOUT",
                maximum=MAX_ENGINE_TIMEOUT,
            ),
            ready_timeout=positive_duration(
                values["READY_TIMEOUT"], "IDEMPOTENCY_READY_TIMEOUT", maximum=MAX_ENGINE_TIMEOUT
            ),
            outbox_max_attempts=positive_int(
                values.get("OUTBOX_MAX_ATTEMPTS", 10), "IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS"
            ),
            outbox_lease=positive_duration(
                values.get("OUTBOX_LEASE", timedelta(minutes=1)), "IDEMPOTENCY_OUTBOX_LEASE"
            ),
            relay_every=positive_duration(
                values.get("RELAY_EVERY", timedelta(seconds=1)), "IDEMPOTENCY_RELAY_EVERY"
            ),
            outbox_retention=positive_duration(
                values.get("OUTBOX_RETENTION", timedelta(days=7)), "IDEMPOTENCY_OUTBOX_RETENTION"
            ),
            relay_wake=as_bool(values.get("RELAY_WAKE", True), "IDEMPOTENCY_RELAY_WAKE"),
            inbox_ttl=positive_duration(values["INBOX_TTL"], "IDEMPOTENCY_INBOX_TTL"),
            metrics_interval=positive_duration(
                values.get("METRICS_INTERVAL", timedelta(seconds=30)),
                "IDEMPOTENCY_METRICS_INTERVAL",
            ),
            trace_baggage=as_bool(values.get("TRACE_BAGGAGE", False), "IDEMPOTENCY_TRACE_BAGGAGE"),
            database_pooler=resolve_pooler(
                values.get("DATABASE_POOLER"), "IDEMPOTENCY_DATABASE_POOLER"
            ),
            relay_listen_url=resolve_listen_url(
                values.get("RELAY_LISTEN_URL"), "IDEMPOTENCY_RELAY_LISTEN_URL"
            ),
            form_field=resolve_form_field(values.get("FORM_FIELD", "idempotency_key")),
            form_key_max_age=None
            if values.get("FORM_KEY_MAX_AGE") is None
            else positive_duration(values["FORM_KEY_MAX_AGE"], "IDEMPOTENCY_FORM_KEY_MAX_AGE"),
            fingerprint_key=resolve_fingerprint_key(
                values.get("FINGERPRINT_KEY"), values.get("ENCRYPTION_KEYS")
            ),
            encryption_keys=resolve_encryption_keys(values.get("ENCRYPTION_KEYS")),
        )
        # The app's lease is every ``lease=True`` route's: its records must
        # outlive it. (A route's own ttl or lease is checked on that route.)
        check_retention(
            settings.ttl,
            settings.lease,
            "IDEMPOTENCY_TTL/IDEMPOTENCY_LEASE",
            names=("IDEMPOTENCY_TTL", "IDEMPOTENCY_LEASE"),
        )
        return settings

    @functools.cached_property
    def replayed_header_names(self) -> frozenset[str] | None:
        """Lower-cased names of the headers stored and replayed; ``None``: every
        header but :data:`NEVER_REPLAYED`."""
        if self.replay_headers == "*":
            return None
        names = {h.lower() for h in (*ALWAYS_REPLAYED, *self.replay_headers)}
        return frozenset(names - NEVER_REPLAYED)

    def protects(self, method: str) -> bool:
        """Whether a decorated view protects a request with ``method``."""
        if self.methods is None:
            return method not in SAFE_METHODS
        return method in self.methods

    def storable(self, status: int) -> bool:
        """Whether an answer with ``status`` is stored (and its writes committed)."""
        if self.stored_statuses is not None:
            return status in self.stored_statuses
        return is_storable(status)

    def commits(self, status: int) -> bool:
        """Whether the view's writes commit with an answer of ``status``: when it is
        stored, and for any success or redirect (2xx, 3xx), so that an answer left
        out of ``IDEMPOTENCY_STORED_STATUSES`` is never a success whose work was
        rolled back. A 4xx or 5xx not stored rolls back."""
        return self.storable(status) or 200 <= status < 400
