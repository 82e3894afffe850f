"""One module per database engine, behind one interface (:class:`Dialect`).

Every difference between engines that the record's statements meet sits in
the engine's module: the conflict-tolerant insert, the bound on lock waits, the
idle bound, the clock, locking reads, the purge's batch, statement size
limits, a transaction's commit judged after its answer was lost. The store
asks :func:`dialect_of` for the engine's object and calls it; it never branches
on an engine's name. An engine without a module here gets :class:`Dialect`
itself, served with what SQLAlchemy gives every engine.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import Session

from .base import READY, Deleted, Dialect, Executor, Verdict, millis
from .mysql import MySQL
from .postgresql import PostgreSQL, idle_bound
from .sqlite import SQLite

__all__ = [
    "DIALECTS",
    "READY",
    "Deleted",
    "Dialect",
    "Executor",
    "MySQL",
    "PostgreSQL",
    "SQLite",
    "Verdict",
    "dialect_for",
    "dialect_of",
    "idle_bound",
    "millis",
]

#: The engines with a module of their own, by SQLAlchemy's dialect name.
DIALECTS: dict[str, Dialect] = {
    dialect.name: dialect for dialect in (PostgreSQL(), MySQL("mysql"), MySQL("mariadb"), SQLite())
}
_GENERIC = Dialect()


def dialect_for(name: str) -> Dialect:
    """The object for SQLAlchemy's dialect ``name`` (``postgresql``, ``sqlite``...)."""
    return DIALECTS.get(name, _GENERIC)


def dialect_of(executor: Executor | sa.Engine) -> Dialect:
    """The object for the engine behind a session, a connection or an engine."""
    if isinstance(executor, Session):
        return dialect_for(executor.get_bind().dialect.name)
    return dialect_for(executor.dialect.name)
