"""The driver fast paths, one module per driver, chosen by (dialect, driver).

Where the app's engine runs on a driver listed here, the store sends its
statements compiled once, and the claim as one batch of statements in one round
trip (setting the bounds, the insert, restoring the wait's bound, reading the
record); elsewhere each statement goes through SQLAlchemy, one by one. Every
path reads the same outcome the same way: the claim's from the fencing token
of the row read back.
"""

from __future__ import annotations

import typing as t

import sqlalchemy as sa

from .base import FastPath
from .compiled import Compiled, claim_params
from .psycopg import Psycopg
from .psycopg2 import Psycopg2

__all__ = ["Compiled", "FastPath", "claim_params", "fast_path", "prepares", "register"]

_PATHS: dict[tuple[str, str], FastPath] = {
    ("postgresql", "psycopg2"): Psycopg2(),
    ("postgresql", "psycopg"): Psycopg(),
}


def fast_path(connection: sa.Connection) -> FastPath | None:
    """The fast path for ``connection``'s (dialect, driver), or ``None``: no fast
    path for it, or none that :meth:`~FastPath.applies` to this connection."""
    dialect = connection.dialect
    path = _PATHS.get((dialect.name, dialect.driver))
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
    this way.) The batch a path is given is PostgreSQL's SQL, bound ``%(name)s``."""
    previous = _PATHS.get((dialect, driver))
    _PATHS[(dialect, driver)] = path
    return previous
