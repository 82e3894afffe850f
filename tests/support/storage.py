"""The storage implementations the conformance tests run on, and their helpers
(``tests/unit/storage/test_conformance.py``)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import typing as t
import uuid

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import Session

from flask_idempotency._storage import (
    IN_PROGRESS,
    Store,
    as_utc,
    drivers,
    new_fencing_token,
    operation_values,
)
from flask_idempotency._storage.dialects import Dialect, MySQL, PostgreSQL, SQLite
from flask_idempotency._storage.drivers.psycopg import Psycopg
from flask_idempotency._storage.drivers.psycopg2 import Psycopg2

HOUR = dt.timedelta(hours=1)
SCOPE = "conformance"

#: Implementation: (database, its dialect object's class, its fast path's class).
IMPLEMENTATIONS: dict[str, tuple[str, type[Dialect], type[drivers.FastPath] | None]] = {
    "psycopg2": ("psycopg2", PostgreSQL, Psycopg2),
    "psycopg": ("psycopg", PostgreSQL, Psycopg),
    "postgresql-one-by-one": ("psycopg2", PostgreSQL, None),
    "sqlite": ("sqlite", SQLite, None),
    "mysql": ("mysql", MySQL, None),
    # The same server through connections that take multi-statement strings: the
    # claim is one batch (drivers/pymysql.py); every other statement as above.
    "mysql-multi": ("mysql", MySQL, None),
    "generic": ("sqlite", Dialect, None),
}


@dataclasses.dataclass
class Impl:
    name: str
    url: str
    engine: sa.Engine
    store: Store
    dialect: type[Dialect]
    fast_path: type[drivers.FastPath] | None

    def engine_like(self, **kwargs: t.Any) -> sa.Engine:
        """Another engine on the same database, set up as :attr:`engine` is."""
        return engine_for(self.name, self.url, **kwargs)

    def rows(self) -> dict[str, dict[str, t.Any]]:
        """The table's rows by key, read on a connection of their own, as
        PostgreSQL returns them (aware UTC times, ``str`` scope and key)."""
        found = {}
        with self.engine.connect() as conn:
            for row in conn.execute(sa.select(self.store.table)):
                values = {k: portable(v) for k, v in row._mapping.items()}
                for name in ("scope", "key"):  # VARBINARY on MySQL
                    if isinstance(values[name], bytes):
                        values[name] = values[name].decode()
                found[values["key"]] = values
        return found


def portable(value: t.Any) -> t.Any:
    if isinstance(value, dt.datetime):
        return as_utc(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    return value


#: PyMySQL's ``CLIENT.MULTI_STATEMENTS`` (``;``-joined statements in one query)
#: with ``CLIENT.FOUND_ROWS``, as docs/performance.md says to ask for it: a
#: ``client_flag`` in ``connect_args`` replaces SQLAlchemy's, which has FOUND_ROWS.
MULTI_STATEMENTS = 1 << 16 | 1 << 1
#: PyMySQL's ``CLIENT.MULTI_STATEMENTS`` alone, as an engine may wrongly ask for it.
MULTI_STATEMENTS_ONLY = 1 << 16


def engine_for(name: str, url: str, **kwargs: t.Any) -> sa.Engine:
    if name == "mysql-multi":
        return sa.create_engine(url, connect_args={"client_flag": MULTI_STATEMENTS}, **kwargs)
    if name != "generic":
        return sa.create_engine(url, **kwargs)
    # SQLAlchemy's recipe for pysqlite savepoints: the driver's own transaction
    # handling off, BEGIN sent when SQLAlchemy begins.
    engine = sa.create_engine(url, connect_args={"isolation_level": None}, **kwargs)
    event.listen(engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN"))
    return engine


def now_ms() -> dt.datetime:
    # Milliseconds: the finest time SQLite's own clock gives.
    now = dt.datetime.now(dt.UTC)
    return now.replace(microsecond=now.microsecond // 1000 * 1000)


def record_values(
    key: str, now: dt.datetime, *, lease: dt.timedelta = HOUR, **columns: t.Any
) -> dict[str, t.Any]:
    return {
        "scope": SCOPE,
        "key": key,
        "fencing_token": new_fencing_token(),
        **operation_values(
            request_hash="h",
            status=IN_PROGRESS,
            locked_until=now + lease,
            created_at=now,
            expires_at=now + 24 * HOUR,
            **columns,
        ),
    }


def claimed(impl: Impl, values: dict[str, t.Any]) -> None:
    """Claim ``values`` and commit."""
    with Session(impl.engine) as session:
        assert impl.store.claim(session, values, dt.timedelta(seconds=5)) == (True, None)
        session.commit()


def new_key() -> str:
    return f"k-{uuid.uuid4()}"
