"""The record table, ``idempotency_keys``, defined on the app's own metadata.

One row per (scope, key). It lives in the app's database, next to the business
tables, because the point of the record is to commit in the same transaction as
the side effect it guards.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import typing as t

import sqlalchemy as sa

TABLE_NAME = "idempotency_keys"

#: The request is running (or its worker died); see ``locked_until``.
IN_PROGRESS = "in_progress"
#: The response is stored and will be replayed.
COMPLETED = "completed"


class UTCDateTime(sa.types.TypeDecorator[dt.datetime]):
    """A timestamp stored in UTC and always read back timezone-aware.

    SQLite keeps no zone; storing UTC everywhere keeps comparisons in SQL right
    on every engine.
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(
        self, value: dt.datetime | None, dialect: sa.Dialect
    ) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("flask_idempotency timestamps must be timezone-aware")
        value = value.astimezone(dt.timezone.utc)
        if dialect.name == "sqlite":
            return value.replace(tzinfo=None)
        return value

    def process_result_value(
        self, value: dt.datetime | None, dialect: sa.Dialect
    ) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=dt.timezone.utc)
        return value.astimezone(dt.timezone.utc)


def record_table(metadata: sa.MetaData) -> sa.Table:
    """The ``idempotency_keys`` table on ``metadata``, defined once per metadata."""
    existing = metadata.tables.get(TABLE_NAME)
    if existing is not None:
        return existing
    return sa.Table(
        TABLE_NAME,
        metadata,
        # scope first: it is the natural distribution column (Citus) and every
        # lookup names it.
        sa.Column("scope", sa.String(512), nullable=False),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("request_hash", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("fencing_token", sa.Integer, nullable=False),
        sa.Column("response_code", sa.Integer, nullable=True),
        sa.Column("response_headers", sa.Text, nullable=True),
        sa.Column("response_body", sa.LargeBinary, nullable=True),
        sa.Column("body_omitted", sa.Boolean, nullable=False, default=False),
        sa.Column("locked_until", UTCDateTime, nullable=True),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("completed_at", UTCDateTime, nullable=True),
        sa.Column("expires_at", UTCDateTime, nullable=False),
        # Recovery points: {step name: JSON result}, saved as steps finish.
        sa.Column("recovery_points", sa.Text, nullable=True),
        # The request itself, kept only for routes that let the recovery job
        # finish an abandoned request without the client (recover=True).
        sa.Column("request_method", sa.String(16), nullable=True),
        sa.Column("request_path", sa.Text, nullable=True),
        sa.Column("request_content_type", sa.String(255), nullable=True),
        sa.Column("request_body", sa.LargeBinary, nullable=True),
        sa.PrimaryKeyConstraint("scope", "key", name="idempotency_keys_scope_key"),
        sa.Index("idempotency_keys_expires_at", "expires_at"),
        # The recovery job looks for in-progress records whose lease ended.
        sa.Index("idempotency_keys_locked_until", "locked_until"),
    )


JOB_LOCK_TABLE_NAME = "idempotency_job_locks"


def job_lock_table(metadata: sa.MetaData) -> sa.Table:
    """The ``idempotency_job_locks`` table: one row per scheduled job.

    A plain row with a holder and an expiry, claimed with a conditional UPDATE,
    so the "one runner at a time" rule works on every engine, with or without
    advisory locks.
    """
    existing = metadata.tables.get(JOB_LOCK_TABLE_NAME)
    if existing is not None:
        return existing
    return sa.Table(
        JOB_LOCK_TABLE_NAME,
        metadata,
        sa.Column("name", sa.String(100), primary_key=True),
        sa.Column("holder", sa.String(255), nullable=True),
        sa.Column("locked_until", UTCDateTime, nullable=True),
        sa.Column("last_started_at", UTCDateTime, nullable=True),
        sa.Column("last_finished_at", UTCDateTime, nullable=True),
    )


@dataclasses.dataclass(frozen=True)
class Record:
    """One row of ``idempotency_keys``, as read."""

    scope: str
    key: str
    request_hash: str
    status: str
    fencing_token: int
    response_code: int | None
    response_headers: list[tuple[str, str]]
    response_body: bytes | None
    body_omitted: bool
    locked_until: dt.datetime | None
    created_at: dt.datetime
    completed_at: dt.datetime | None
    expires_at: dt.datetime
    recovery_points: dict[str, t.Any] = dataclasses.field(default_factory=dict)
    request_method: str | None = None
    request_path: str | None = None
    request_content_type: str | None = None
    request_body: bytes | None = None

    @property
    def recoverable(self) -> bool:
        """The request was stored, so the recovery job can run it without the client."""
        return self.request_method is not None and self.request_path is not None

    @classmethod
    def from_row(cls, row: t.Any) -> Record:
        m = row._mapping
        headers = json.loads(m["response_headers"]) if m["response_headers"] else []
        body = m["response_body"]
        return cls(
            scope=m["scope"],
            key=m["key"],
            request_hash=m["request_hash"],
            status=m["status"],
            fencing_token=m["fencing_token"],
            response_code=m["response_code"],
            response_headers=[(str(k), str(v)) for k, v in headers],
            response_body=bytes(body) if body is not None else None,
            body_omitted=bool(m["body_omitted"]),
            locked_until=m["locked_until"],
            created_at=m["created_at"],
            completed_at=m["completed_at"],
            expires_at=m["expires_at"],
            recovery_points=json.loads(m["recovery_points"]) if m["recovery_points"] else {},
            request_method=m["request_method"],
            request_path=m["request_path"],
            request_content_type=m["request_content_type"],
            request_body=bytes(m["request_body"]) if m["request_body"] is not None else None,
        )

    def is_expired(self, now: dt.datetime) -> bool:
        """Past its retention: counts as absent even before cleanup deletes it."""
        return self.expires_at <= now

    def lease_live(self, now: dt.datetime) -> bool:
        """In progress under a lease that has not ended."""
        return (
            self.status == IN_PROGRESS and self.locked_until is not None and self.locked_until > now
        )
