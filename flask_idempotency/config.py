"""Every ``IDEMPOTENCY_*`` configuration key, with its default and meaning.

Each key is declared once, in :data:`SETTINGS`; :data:`DEFAULTS` is derived from
it, and so is the documentation's configuration reference, so neither can drift.
A key can be set in ``app.config`` or passed to :class:`~flask_idempotency.Idempotency`
(lower-case, without the prefix: ``Idempotency(app, db, ttl=timedelta(hours=48))``);
the constructor value becomes the app's default, and ``app.config`` wins over it.
Route options of :meth:`~flask_idempotency.Idempotency.idempotent` win over both.
``init_app`` checks every value: an unknown ``IDEMPOTENCY_*`` key or a bad value
stops the app with an error naming the setting; nothing is clamped.
"""

from __future__ import annotations

import dataclasses
import typing as t
from datetime import timedelta

from .keys import MAX_KEY_LENGTH

__all__ = [
    "DEFAULTS",
    "PREFIX",
    "SETTINGS",
    "Setting",
]

PREFIX = "IDEMPOTENCY_"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One key: its name without :data:`PREFIX`, its default, its meaning (Markdown)."""

    name: str
    default: t.Any
    doc: str

    @property
    def key(self) -> str:
        """The ``app.config`` key, such as ``IDEMPOTENCY_TTL``."""
        return PREFIX + self.name


_ENGINE_MAX = " At most 24 days (PostgreSQL's limit for the timeout it sets)."

#: Every setting, in the order the documentation lists them: add a key here, and nowhere else.
SETTINGS: tuple[Setting, ...] = (
    Setting("HEADER", "Idempotency-Key", "The request header that carries the key."),
    Setting(
        "METHODS",
        None,
        "The methods a decorated view protects. `None`: every method it serves but GET, HEAD,"
        " OPTIONS and TRACE; a collection: only those (the safe four cannot be listed). A view"
        " serving an unsafe method left out is refused at the app's first request; a route's own"
        " `methods=` is followed.",
    ),
    Setting(
        "REQUIRED",
        False,
        "A protected route answers 400 `missing-key` without a key (else it runs unprotected).",
    ),
    Setting("SKIP", None, "A callable; true runs the request unprotected, as without a key."),
    Setting(
        "REPLAY_GUARD",
        None,
        "A callable run before each replay of a completed operation with a"
        " `flask_idempotency.scope.ReplayAttempt` (no body): a false"
        " value refuses the replay with 403 `replay-refused`, an `HTTPException` it raises"
        " (`abort(403)`) answers instead; nothing changes either way. Not run in manual mode.",
    ),
    Setting(
        "RECONCILE",
        None,
        "A callable that rebuilds the answer of an operation whose view committed and whose"
        " request never finished, from the committed state (`reconcile=` on a route wins):"
        " given a `flask_idempotency.scope.ReconcileAttempt`, it returns what a view returns,"
        " or `None` when it cannot tell. The answer replaces the stored 500"
        " `failed-after-commit`. See the reconcile guide.",
    ),
    Setting(
        "KEY_FORMAT",
        None,
        'What a key must look like, else 400 `invalid-key`: `None` any printable ASCII; `"uuid"`'
        ' a canonical UUID of any version; `"uuid4"` or `"uuid7"` one of that version; or a'
        " regular expression the *whole* key must match (a compiled `re.Pattern`, or a string"
        " with a character other than letters, digits, `-` and `_`). A pattern that does not"
        ' compile, or an unknown name (`"ulid"`), stops `init_app`.',
    ),
    Setting(
        "KEY_MAX_LENGTH",
        MAX_KEY_LENGTH,
        "The longest key accepted, 1 to 255 (the key column's size); checked before the format.",
    ),
    Setting(
        "TTL",
        timedelta(hours=24),
        (
            "The retention window, counted from the answer's completion: a retry later than"
            " this runs again. Must exceed the lease."
        ),
    ),
    Setting(
        "LEASE",
        timedelta(seconds=60),
        "How long a committed in-progress record blocks duplicates (409) before a retry may"
        " reclaim it after a crash.",
    ),
    Setting(
        "WAIT",
        timedelta(seconds=10),
        "How long a duplicate waits for the first request's transaction before 409: PostgreSQL"
        " `lock_timeout`, MySQL/MariaDB `innodb_lock_wait_timeout` (whole seconds), SQLite's busy"
        " timeout, set around the claim only. `None`: the engine's own timeout (still a 409)."
        + _ENGINE_MAX,
    ),
    Setting(
        "MAX_BODY",
        1024 * 1024,
        "The largest response body (bytes) stored for replay; a larger or streamed one is not"
        " kept, and a retry gets `response-not-stored`. On MySQL/MariaDB keep it under"
        " `max_allowed_packet`.",
    ),
    Setting(
        "REPLAY_HEADERS",
        (),
        'Headers replayed besides `Content-Type` and `Location`; `"*"`: every header but the'
        " never-replayed ones.",
    ),
    Setting(
        "STORED_STATUSES",
        None,
        "The statuses stored and replayed. `None`: 2xx, 3xx and deterministic 4xx (not 408, 409,"
        " 423, 425, 429); a collection of codes from 200 to 499 stores only those. An answer not"
        " stored keeps no record (a retry runs again); its work commits with a 2xx or 3xx and"
        " rolls back otherwise.",
    ),
    Setting(
        "SCOPE",
        None,
        "A callable returning the scope string. `None`: the endpoint plus the caller's identity;"
        " see [Scope](scope.md).",
    ),
    Setting(
        "FINGERPRINT_KEY",
        None,
        "The secret that keys the request fingerprint: with it the stored `request_hash` is"
        " HMAC-SHA256 instead of SHA-256, so whoever reads the table cannot confirm a guess of"
        ' a small body (`{"amount": 100}`). Text or bytes, at least 32 characters (bytes); make'
        ' one with `python -c "import secrets; print(secrets.token_urlsafe(32))"`. Required'
        " with `IDEMPOTENCY_ENCRYPTION_KEYS` and on any route with `redact=`. A list names the"
        " current key first, then older ones still accepted: a retry of an operation recorded"
        " under another key is judged by its bytes. See"
        " [Redaction](scope.md#redaction-and-the-keyed-fingerprint) and"
        " [Deploys](deploys.md#rotating-the-fingerprint-key).",
    ),
    Setting("PURGE_BATCH", 1000, "Expired rows deleted per transaction by cleanup."),
    Setting("SCHEDULER", False, "Run the jobs in each serving process, from its first request."),
    Setting("PURGE_EVERY", timedelta(minutes=5), "The interval of the cleanup job."),
    Setting("RECOVER_EVERY", timedelta(seconds=30), "The interval of the lease recovery job."),
    Setting(
        "JOB_LOCK",
        timedelta(minutes=2),
        "How long a job run holds its lock between renewals (a runner that dies blocks the job"
        " this long).",
    ),
    Setting(
        "CLAIM_IDLE_TIMEOUT",
        None,
        "PostgreSQL: how long a transaction holding a claim may sit idle before the server ends"
        " it (`SET LOCAL idle_in_transaction_session_timeout` with the claim), so a host cut off"
        " mid-request does not keep the key from its retries. Above the longest pause a view"
        " makes between two statements; `None`: no bound of ours." + _ENGINE_MAX,
    ),
    Setting(
        "READY_TIMEOUT",
        timedelta(seconds=2),
        'How long `idem.readiness()` waits for its probe before answering "not ready".'
        + _ENGINE_MAX,
    ),
    Setting(
        "PUBLISHER",
        None,
        "The outbox relay's publisher: an object with `publish(event)`, an import string"
        ' (`"myapp.events:publisher"`), or a class or factory called once without arguments.',
    ),
    Setting(
        "OUTBOX_MAX_ATTEMPTS",
        10,
        "Failed publishes of an event before the relay parks it; an unreachable broker never"
        " counts.",
    ),
    Setting(
        "OUTBOX_LEASE",
        timedelta(minutes=1),
        "How long the relay holds the events it took while it publishes them; a batch publishes"
        " for at most half of it. Above twice the publisher's longest publish.",
    ),
    Setting(
        "RELAY_EVERY",
        timedelta(seconds=1),
        "The interval of the relay job (scheduled when a publisher is set): the fallback poll.",
    ),
    Setting(
        "OUTBOX_RETENTION",
        timedelta(days=7),
        "How long a published event is kept before cleanup deletes it (pending and parked ones"
        " stay).",
    ),
    Setting(
        "RELAY_WAKE",
        True,
        "Wake the relay right after a commit that carried events (in-process; on PostgreSQL also"
        " LISTEN/NOTIFY across processes). `False`: polling alone.",
    ),
    Setting(
        "DATABASE_POOLER",
        None,
        "The connection pooler between the app and PostgreSQL, if any: `None` (none, or one in"
        ' session pooling), `"session"`, `"transaction"` (PgBouncer\'s `pool_mode = transaction`,'
        ' RDS Proxy, PgCat\'s transaction mode), or `"transaction+prepared"` (transaction pooling'
        " that tracks protocol-level prepared statements: PgBouncer 1.21+ with"
        " `max_prepared_statements` above 0). With either transaction mode the relay LISTENs only"
        " through `IDEMPOTENCY_RELAY_LISTEN_URL` (else it polls, and says so when it starts);"
        ' with `"transaction"`, a psycopg 3 connection that would prepare statements'
        " (`prepare_threshold` not `None`) is logged as a misconfiguration. See"
        " [Poolers](poolers.md).",
    ),
    Setting(
        "RELAY_LISTEN_URL",
        None,
        "A PostgreSQL URL the relay LISTENs on instead of the app's engine: a direct connection"
        " (or one through a pooler in session mode) when the app's goes through transaction"
        " pooling, where LISTEN cannot work. Used for LISTEN only, on a connection of its own.",
    ),
    Setting(
        "INBOX_TTL",
        timedelta(days=7),
        "How long the inbox keeps a processed event id; a redelivery after that runs again.",
    ),
    Setting(
        "METRICS_INTERVAL",
        timedelta(seconds=30),
        "With the `otel` extra: how often, at most, each process reads the figures its"
        " observable gauges report (records live, in flight, past their lease; the outbox; the"
        " inbox) from the database, whatever the number of collections; a read that fails, or"
        " does not answer within `IDEMPOTENCY_READY_TIMEOUT`, reports nothing for that"
        " interval. See [Observability](observability.md).",
    ),
    Setting(
        "TRACE_BAGGAGE",
        False,
        "With the `otel` extra: also store the request's W3C `baggage` with each outbox event"
        " and send it on the event's message to every consumer. Off, only `traceparent` and"
        " `tracestate` (cut to 32 members, 512 characters) travel: a request's baggage may be"
        " its client's, and is not passed on unless the app trusts it. See"
        " [Traces](tracing.md#what-travels-and-whom-to-trust).",
    ),
    Setting(
        "FORM_FIELD",
        "idempotency_key",
        "The form field that carries a rendered form's key (`idempotency_field()` writes it),"
        " read when a form is posted without the key header; the header wins when both are"
        " sent. The field (and Flask-WTF's `WTF_CSRF_FIELD_NAME`) never counts in the"
        ' fingerprint. `None` or `""`: forms carry no key. See [Forms](forms.md).',
    ),
    Setting(
        "FORM_KEY_MAX_AGE",
        None,
        "How long a rendered form may be submitted, by the app's clock; an older form key is"
        " refused with a page asking to reload. `None`: the route's `ttl`. Never longer than"
        " the route's `ttl`, whatever is set: a form submitted after its record expired would"
        " run again.",
    ),
    Setting(
        "ENCRYPTION_KEYS",
        None,
        "Encryption at rest (the `crypto` extra): the keys that seal stored bodies, headers,"
        " stored requests and recovery points, each with an id; the first seals, every one"
        ' opens. A list of `"id:base64key"` strings, a list of `(id, key)` pairs, a dict'
        ' `{id: key}` (in its order), or one string `"id:key,id:key"` (from an environment'
        " variable); a key is 32 random bytes in base64 (`flask idempotency generate-key`)."
        " `None`: stored in clear. A bad id or key, an id twice, or an empty list stops"
        " `init_app`. See [Encryption at rest](encryption.md).",
    ),
    Setting(
        "ENCRYPTION_ALLOW_CLEAR",
        False,
        "With `IDEMPOTENCY_ENCRYPTION_KEYS`: read a value in clear in a sealed column as it is"
        " (records stored before encryption was turned on). `False`: such a value is unreadable"
        " (500 `record-unreadable`), so a writer of the database cannot put an answer of its"
        " choosing in clear. Set it for the window after turning encryption on, until those"
        " records expire or `flask idempotency reseal` seals them. See"
        " [Encryption at rest](encryption.md#turning-it-on).",
    ),
)

#: Each setting's default, by its name without the prefix (``"TTL"``, ...).
DEFAULTS: dict[str, t.Any] = {setting.name: setting.default for setting in SETTINGS}
