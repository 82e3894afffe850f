"""Columns a release added to the record table, and a table from before them.

A record table created by an earlier release lacks ``rules_version`` and
``request_digest``. It works as before without them: records are written
without either, and every retry is judged by its fingerprint (a deploy that
changes a route's fingerprint rules then answers an in-flight retry 422
``key-reused``). Which columns are absent is read once per engine, with one
WARNING per engine and column naming the statement that adds it, as the
outbox does for its own added columns (:func:`.outbox.absent_columns`).
"""

from __future__ import annotations

import logging
import typing as t

import sqlalchemy as sa

from .schema import REQUEST_DIGEST, RULES_VERSION
from .sql import AddedColumns

logger = logging.getLogger("flask_idempotency")

#: The columns a release added to the record table, in the order they came.
ADDED_COLUMNS = (RULES_VERSION, REQUEST_DIGEST)

_COLUMNS = AddedColumns(
    ADDED_COLUMNS,
    lambda _: (
        "retries after a deploy that changes a route's fingerprint rules are judged by "
        "their fingerprint only (422 key-reused)"
    ),
)


def lacking_columns(conn: sa.Connection, table: sa.Table) -> tuple[str, ...]:
    """Of :data:`ADDED_COLUMNS`, those ``table`` lacks on ``conn``, read now;
    none without the table (it is created whole)."""
    return _COLUMNS.lacking(conn, table)


def absent_columns(conn: sa.Connection, table: sa.Table) -> frozenset[str]:
    """The added columns the record table behind ``conn`` lacks: read once per
    engine (a column added later is used by processes started after), with
    one WARNING per engine and column naming the statement to run."""
    return _COLUMNS.absent(conn, table)


def forget(engine: sa.Engine) -> None:
    """Read the table's columns again at the next use on ``engine`` (tests)."""
    _COLUMNS.forget(engine)


def without(values: t.Mapping[str, t.Any], absent: frozenset[str]) -> dict[str, t.Any]:
    """``values`` without the columns in ``absent``."""
    if not absent:
        return dict(values)
    return {name: value for name, value in values.items() if name not in absent}
