"""The driver fast paths, one module per driver, chosen by (dialect, driver).

Where the app's engine runs on a driver listed here, the store sends its
statements compiled once, and the claim as one batch of statements in one round
trip (setting the bounds, the insert, restoring the wait's bound, reading the
record; on MariaDB without multi-statement strings, two for a taken key:
:mod:`.pymysql`). On pysqlite (:mod:`.pysqlite`) each statement is compiled once and
run on the driver's connection with SQLAlchemy's conversions. Elsewhere each
statement goes through SQLAlchemy, one by one. Every
path reads the same outcome the same way: the claim's from the fencing token
of the row read back.
"""

from __future__ import annotations

import typing as t

import sqlalchemy as sa

from . import pysqlite
from .base import FastPath, quiet, unobserved
from .compiled import Compiled, claim_params
from .psycopg import Psycopg
from .psycopg2 import Psycopg2
from .pymysql import PyMySQL

__all__ = [
    "Compiled",
    "FastPath",
    "claim_params",
    "direct",
    "fast_path",
    "prepares",
    "pysqlite",
    "quiet",
    "register",
    "unobserved",
]

_PATHS: dict[tuple[str, str], FastPath] = {
    ("postgresql", "psycopg2"): Psycopg2(),
    ("postgresql", "psycopg"): Psycopg(),
}
#: Fast paths for the claim's batch alone: the engine's other statements keep
#: SQLAlchemy's path (its bind and result processing, which PyMySQL's own
#: quoting of the claim's values does not need).
_CLAIM_PATHS: dict[tuple[str, str], FastPath] = {
    ("mysql", "pymysql"): PyMySQL(),
    ("mariadb", "pymysql"): PyMySQL(),
}


def fast_path(connection: sa.Connection, *, claim: bool = False) -> FastPath | None:
    """The fast path for ``connection``'s (dialect, driver), or ``None``: no fast
    path for it, or none that :meth:`~FastPath.applies` to this connection.
    ``claim``: for the claim's batch, which more drivers send themselves."""
    dialect = connection.dialect
    name = (dialect.name, dialect.driver)
    path = _PATHS.get(name) or (_CLAIM_PATHS.get(name) if claim else None)
    if path is None or not path.applies(connection):
        return None
    return path


def prepares(dialect: sa.Dialect, dbapi_connection: t.Any) -> bool:
    """Whether ``dbapi_connection`` (of ``dialect``'s driver) prepares statements
    on the server by itself (psycopg 3 unless ``prepare_threshold=None``)."""
    path = _PATHS.get((dialect.name, dialect.driver))
    return path is not None and path.prepares(dbapi_connection)


def register(dialect: str, driver: str, path: FastPath) -> FastPath | None:
    """Make ``path`` the fast path of (``dialect``, ``driver``); the one it
    replaces, if any. (The benchmark puts its variants of the claim in place
    this way.) The batch a path is given is the engine's SQL, bound ``%(name)s``."""
    previous = _PATHS.get((dialect, driver))
    _PATHS[(dialect, driver)] = path
    return previous


def direct(
    connection: sa.Connection, stmt: t.Any, params: dict[str, t.Any]
) -> tuple[list[dict[str, t.Any]], int] | None:
    """Run ``stmt`` with ``params`` on ``connection``'s driver directly, where
    :func:`.pysqlite.applies`: the rows it returns (column values by name) and
    its row count. ``None``: not run (the caller runs it through SQLAlchemy)."""
    if not pysqlite.applies(connection):
        return None
    prepared = pysqlite.prepare(connection.dialect, stmt, tuple(params))
    if prepared is None:
        return None
    return pysqlite.run(connection, prepared, params)
