"""Erasure's statements: one batch of a scope's (or one key's) records made
tombstones, one batch of their outbox events emptied.

A tombstone keeps the record's scope, key, fencing token, times and status
(``erased``): the fence that answers a retry 410 instead of running the
operation again. Everything the operation stored goes: the response (code,
headers, body), the recovery points, the kept request, and the fingerprint
(``request_hash`` becomes :data:`.schema.ERASED_HASH`) with the digest of
the request and the version of the rules that made it. Each batch is read,
then changed by conditional ``UPDATE`` statements that re-check, on the row
as it is when the statement runs, what the read saw (the fencing token, and
that no live lease holds it), in the caller's transaction: a batch holds its
rows' locks only until that transaction (one batch) commits.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import typing as t

import sqlalchemy as sa

from .added import absent_columns, without
from .dialects import dialect_for
from .holds import Hold
from .schema import (
    ERASED,
    ERASED_HASH,
    ERASED_PAYLOAD,
    IN_PROGRESS,
    OWNER_KEY,
    OWNER_SCOPE,
    REQUEST_DIGEST,
    RULES_VERSION,
    _text,
    as_utc,
)
from .sql import text_param

#: The columns a tombstone clears (the response, the steps, the kept request).
_CLEARED = {
    "response_code": None,
    "response_headers": None,
    "response_body": None,
    "body_omitted": False,
    "locked_until": None,
    "recovery_points": None,
    "request_method": None,
    "request_path": None,
    "request_content_type": None,
    "request_body": None,
    # Derived from the request: a digest of it could confirm a guess of it.
    RULES_VERSION: None,
    REQUEST_DIGEST: None,
}


class Batch(t.NamedTuple):
    """What one batch did: rows erased, rows read but left (skipped), and the
    position the next batch starts after (``None``: nothing was read, done)."""

    erased: int
    skipped: int
    last: t.Any


def _count(conn: sa.Connection, stmt: t.Any, column: t.Any) -> int:
    """Run an ``UPDATE`` of several rows; how many it changed: the rows it
    returned where the engine returns rows from it, else the matched-row
    count (see :func:`.sql.changed_one`)."""
    if dialect_for(conn.dialect.name).returns_rows(conn.dialect, stmt):
        return len(conn.execute(stmt.returning(column)).all())
    result = conn.execute(stmt, execution_options={"preserve_rowcount": True})
    return int(t.cast("sa.CursorResult[t.Any]", result).rowcount)


#: The most rows one erasing ``UPDATE`` names (a key and a token each): SQLite
#: before 3.32 binds at most 999 variables in a statement. A batch larger than
#: this runs as several statements in its one transaction, on every engine.
MAX_IN_LIST = 400


def _chunks(rows: list[t.Any]) -> t.Iterator[list[t.Any]]:
    for start in range(0, len(rows), MAX_IN_LIST):
        yield rows[start : start + MAX_IN_LIST]


def already_erased(conn: sa.Connection, table: sa.Table, scope: str, key: str | None) -> int:
    """How many tombstones ``scope`` (only ``key``, when given) holds now."""
    c = table.c
    where = [c.scope == text_param("w_scope", scope), c.status == ERASED]
    if key is not None:
        where.append(c.key == text_param("w_key", key))
    return int(conn.execute(sa.select(sa.func.count()).where(*where)).scalar_one())


@contextlib.contextmanager
def overwriting(conn: sa.Connection) -> t.Iterator[None]:
    """While it is open, the erasure's writes on ``conn`` overwrite the space they
    free where the engine can (SQLite's ``secure_delete``); the connection's own
    setting is put back after (it returns to the app's pool)."""
    dialect = dialect_for(conn.dialect.name)
    previous = dialect.erase_securely(conn)
    try:
        yield
    finally:
        dialect.restore_erasing(conn, previous)


def after_erasure(engine: sa.Engine) -> None:
    """Drop the engine's own copies of the old rows where an ordinary connection
    can (SQLite: checkpoint and truncate its write-ahead log)."""
    with engine.connect() as conn:
        dialect_for(conn.dialect.name).after_erasure(conn)


def rewrite_tables(engine: sa.Engine, tables: list[sa.Table]) -> None:
    """Rewrite ``tables`` so no old row version stays in the files (outside a
    transaction, as ``VACUUM`` must run)."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        dialect_for(conn.dialect.name).reclaim(conn, tables)


def _keys(name: str, values: list[str]) -> t.Any:
    # Bound as strings on every engine (MySQL's VARBINARY columns, text_param).
    return sa.bindparam(name, values, expanding=True, type_=sa.String())


def erase_records(
    conn: sa.Connection,
    table: sa.Table,
    scope: str,
    key: str | None,
    now: dt.datetime,
    limit: int,
    after: str | None,
    *,
    created_before: dt.datetime | None = None,
) -> Batch:
    """Make tombstones of up to ``limit`` records of ``scope`` (only ``key``,
    when given), in key order after ``after``, that are not tombstones yet;
    in ``conn``'s transaction.

    Skipped (counted, left as they are): a record in progress under a live
    lease (its operation is running: erasing it would cut off its holder), and
    one that changed between the read and the ``UPDATE`` (a new token, a lease
    taken). A completion that commits meanwhile is not lost: the ``UPDATE``
    sees the completed row, and makes it a tombstone. The expiry stays, except
    for a record whose view committed work of its own and never finished (it
    never expires while in progress): its tombstone is kept a retention from
    now, as settling it would have kept its answer.
    """
    c = table.c
    # SQLite: its one write lock first, so that the batch waits here for a
    # writer rather than failing at its update after reading.
    dialect_for(conn.dialect.name).lock_writers(conn, table, "status")
    where = [c.scope == text_param("w_scope", scope), c.status != ERASED]
    if key is not None:
        where.append(c.key == text_param("w_key", key))
    if after is not None:
        where.append(c.key > text_param("w_after", after))
    if created_before is not None:
        where.append(c.created_at <= created_before)
    read = sa.select(
        c.key,
        c.fencing_token,
        c.status,
        c.response_code,
        c.locked_until,
        c.created_at,
        c.expires_at,
    )
    rows = conn.execute(read.where(*where).order_by(c.key).limit(limit)).all()
    if not rows:
        return Batch(0, 0, None)
    live = Hold.LIVE_LEASE.condition(c, now)
    committed = Hold.VIEW_COMMITTED.condition(c, now)
    this_scope = c.scope == text_param("w_scope", scope)
    cleared = without(_CLEARED, absent_columns(conn, table))  # a table from an earlier release
    tombstone = {**cleared, "status": ERASED, "request_hash": ERASED_HASH}
    plain: list[t.Any] = []
    settled: list[t.Any] = []
    for row in rows:
        leased = as_utc(row.locked_until)
        if row.status == IN_PROGRESS and leased is not None and leased > now:
            continue  # running now: skipped
        committed_view = row.status == IN_PROGRESS and row.response_code is not None
        (settled if committed_view else plain).append(row)
    erased = 0
    for chunk in _chunks(plain):
        keys = [_key(row) for row in chunk]
        stmt = (
            sa.update(table)
            .where(
                this_scope,
                c.key.in_(_keys("w_keys", keys)),
                # Fenced by the tokens read: a key taken by a new operation since
                # keeps it (a token is 63 random bits, never reused for a key).
                c.fencing_token.in_([row.fencing_token for row in chunk]),
                c.status != ERASED,
                sa.not_(live),
                sa.not_(committed),
            )
            .values(**tombstone)
        )
        erased += _count(conn, stmt, c.key)
    for row in settled:
        created, expires = as_utc(row.created_at), as_utc(row.expires_at)
        assert created is not None
        assert expires is not None
        stmt = (
            sa.update(table)
            .where(
                this_scope,
                c.key == text_param("w_key1", _key(row)),
                c.fencing_token == row.fencing_token,
                committed,
                sa.not_(live),
            )
            .values(**tombstone, expires_at=max(expires, now + (expires - created)))
        )
        erased += _count(conn, stmt, c.key)
    return Batch(erased, len(rows) - erased, _key(rows[-1]))


def _key(row: t.Any) -> str:
    """A row's key as text (VARBINARY on MySQL gives bytes)."""
    return t.cast(str, _text(row.key))


def erase_events(
    conn: sa.Connection,
    table: sa.Table,
    scope: str,
    key: str | None,
    limit: int,
    after: int | None,
    *,
    trace_context: bool = True,
) -> Batch:
    """Empty up to ``limit`` outbox events owned by ``scope``'s operations (only
    ``key``'s, when given), in id order after ``after``, not emptied yet; in
    ``conn``'s transaction. Payload becomes :data:`ERASED_PAYLOAD`; headers,
    trace context and last error NULL. Only a published or parked event: a
    pending one is skipped and counted (the relay must publish it first).
    ``trace_context=False``: the table has no such column (an earlier release's)."""
    c = table.c
    dialect_for(conn.dialect.name).lock_writers(conn, table, "attempts")
    owned = [c[OWNER_SCOPE] == text_param("w_scope", scope)]
    if key is not None:
        owned.append(c[OWNER_KEY] == text_param("w_key", key))
    if after is not None:
        owned.append(c.id > after)
    not_erased = c.payload != ERASED_PAYLOAD
    read = sa.select(c.id).where(*owned, not_erased).order_by(c.id).limit(limit)
    ids = [int(i) for i in conn.execute(read).scalars()]
    if not ids:
        return Batch(0, 0, None)
    done = sa.or_(c.published_at.is_not(None), c.failed_at.is_not(None))
    values: dict[str, t.Any] = {"payload": ERASED_PAYLOAD, "headers": None, "last_error": None}
    if trace_context:
        values["trace_context"] = None
    erased = 0
    for chunk in _chunks(ids):
        stmt = sa.update(table).where(c.id.in_(chunk), not_erased, done).values(**values)
        erased += _count(conn, stmt, c.id)
    return Batch(erased, len(ids) - erased, ids[-1])
