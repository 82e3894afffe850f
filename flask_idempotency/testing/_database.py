"""The ``db`` fixture's object: a database of the test's own on the app's real
engine, and the counts a test asserts on."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import socket
import typing as t
import uuid
from pathlib import Path

import sqlalchemy as sa
from flask import Flask

from .. import models
from ._app import create_tables, dispose, load_app
from ._control import Control, TraceEntry


def _without_search_path(url: sa.URL) -> sa.URL:
    """``url`` without a ``-c search_path=...`` option: a schema named there does
    not exist in the new database (and would leave no schema to create in)."""
    options = url.query.get("options")
    if not options:
        return url
    text = options if isinstance(options, str) else " ".join(options)
    kept = re.sub(r"-c\s*search_path=\S+", "", text).strip()
    if kept:
        return url.update_query_dict({"options": kept})
    return url.difference_update_query(["options"])


def _host_tag() -> str:
    """This host, in six hex digits (a database name has room for little)."""
    return hashlib.sha1(socket.gethostname().encode("utf-8")).hexdigest()[:6]


#: A kit database's name: ``kit_<host>_<pid>_<hex>``, the host and the process
#: that made it, so that a later run on the same host can tell one whose maker
#: is gone (killed before its teardown) and drop it.
_NAME = re.compile(r"^kit_([0-9a-f]{6})_([0-9]+)_[0-9a-f]+$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def _admin_engine(admin: sa.URL) -> sa.Engine:
    return sa.create_engine(
        _without_search_path(admin), isolation_level="AUTOCOMMIT", poolclass=sa.NullPool
    )


def _drop(conn: sa.Connection, backend: str, name: str) -> None:
    if backend == "postgresql":
        # Connections a killed server left open still count; end them.
        conn.execute(
            sa.text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = :name AND pid <> pg_backend_pid()"
            ),
            {"name": name},
        )
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
    else:
        conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))


def sweep_stale(admin_url: str) -> list[str]:
    """Drop the kit databases on ``admin_url``'s server that a process of this
    host made and that process is gone (a test run killed by SIGTERM or SIGKILL
    never reached its teardown); the names dropped. Others' are left alone:
    another host's, a live process's, names not of the kit's pattern."""
    admin = sa.make_url(admin_url)
    backend = admin.get_backend_name()
    if backend == "sqlite":
        return []
    engine = _admin_engine(admin)
    dropped = []
    try:
        with engine.connect() as conn:
            if backend == "postgresql":
                names = conn.execute(
                    sa.text("SELECT datname FROM pg_database WHERE datname LIKE 'kit\\_%'")
                ).scalars()
            else:
                names = conn.execute(sa.text("SHOW DATABASES LIKE 'kit\\_%'")).scalars()
            host = _host_tag()
            for name in list(names):
                found = _NAME.match(name)
                if found is None or found.group(1) != host or _alive(int(found.group(2))):
                    continue
                # Another run sweeping at the same time may drop it first.
                with contextlib.suppress(sa.exc.DBAPIError):
                    _drop(conn, backend, name)
                    dropped.append(name)
    finally:
        engine.dispose()
    return dropped


class Provisioned:
    """A database of its own, next to the one ``admin_url`` names: created by
    :meth:`create`, dropped (with whatever is connected to it) by :meth:`drop`.
    PostgreSQL and MySQL/MariaDB get ``kit_<host>_<pid>_<hex>`` (PostgreSQL's
    also says so in its comment); SQLite a file in ``folder``."""

    def __init__(self, admin_url: str, folder: Path) -> None:
        self.admin = sa.make_url(admin_url)
        self.folder = folder
        self.name = f"kit_{_host_tag()}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.backend = self.admin.get_backend_name()
        self.url = ""

    def create(self) -> str:
        if self.backend == "sqlite":
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / f"{self.name}.sqlite3"
            self.url = self.admin.set(database=str(path)).render_as_string(hide_password=False)
            return self.url
        admin = _without_search_path(self.admin)
        engine = _admin_engine(admin)
        try:
            with engine.connect() as conn:
                if self.backend == "postgresql":
                    conn.execute(sa.text(f'CREATE DATABASE "{self.name}"'))
                    # Who made it, for whoever lists databases (the sweep reads the
                    # name). A literal: a utility statement takes no parameters.
                    maker = f"flask-idempotency testing kit: pid {os.getpid()} on "
                    maker += socket.gethostname().replace("'", "''")
                    conn.execute(sa.text(f"COMMENT ON DATABASE \"{self.name}\" IS '{maker}'"))
                else:
                    conn.execute(sa.text(f"CREATE DATABASE `{self.name}` CHARACTER SET utf8mb4"))
        finally:
            engine.dispose()
        self.url = admin.set(database=self.name).render_as_string(hide_password=False)
        return self.url

    def drop(self) -> None:
        if not self.url or self.backend == "sqlite":
            return  # the file goes with the test's tmp_path
        engine = _admin_engine(self.admin)
        try:
            with engine.connect() as conn:
                _drop(conn, self.backend, self.name)
        finally:
            engine.dispose()


def _portable(row: t.Any) -> dict[str, t.Any]:
    # MySQL's key columns are VARBINARY: bytes there, text everywhere else.
    return {
        k: v.decode("utf-8") if isinstance(v, bytes) and k in ("scope", "key") else v
        for k, v in row.items()
    }


class Database:
    """The app's real database, a database of this test's own.

    ``url`` is its URL (the served app reaches it through the kit's proxy on
    server databases); ``engine`` an engine of the test process; ``app`` the app
    as built in the test process (its tables created), for its models and
    metadata.
    """

    def __init__(self, app: Flask, url: str, control: Control) -> None:
        self.app = app
        self.url = url
        self.engine = sa.create_engine(url, poolclass=sa.NullPool)
        self._control = control

    @classmethod
    def build(
        cls, app_spec: str, url: str, config: t.Mapping[str, t.Any], control: Control
    ) -> Database:
        app = load_app(app_spec, {**config, "SQLALCHEMY_DATABASE_URI": url})
        create_tables(app)
        return cls(app, url, control)

    def close(self) -> None:
        self.engine.dispose()
        dispose(self.app)

    # -- counting --------------------------------------------------------------

    def scalar(self, sql: str, /, **params: t.Any) -> t.Any:
        """The first column of the first row of ``sql`` (bound ``:params``)."""
        with self.engine.connect() as conn:
            return conn.execute(sa.text(sql), params).scalar()

    def rows(self, sql: str, /, **params: t.Any) -> list[dict[str, t.Any]]:
        """Every row of ``sql`` (bound ``:params``), as dicts."""
        with self.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(sa.text(sql), params)]

    def count(self, what: t.Any, /, **filters: t.Any) -> int:
        """How many rows: ``count(Model, column=value, ...)`` (a mapped class or a
        :class:`~sqlalchemy.Table`, equality filters), or ``count("SELECT count(*)
        ... WHERE x = :x", x=...)`` (SQL that counts)."""
        if isinstance(what, str):
            return int(self.scalar(what, **filters) or 0)
        table = what if isinstance(what, sa.Table) else getattr(what, "__table__", None)
        if table is None:
            raise TypeError(f"count() takes a model, a Table or SQL, not {what!r}")
        stmt = sa.select(sa.func.count()).select_from(table)
        for name, value in filters.items():
            column = getattr(what, name) if not isinstance(what, sa.Table) else table.c[name]
            stmt = stmt.where(column == value)
        with self.engine.connect() as conn:
            return int(conn.execute(stmt).scalar_one())

    def records(self, key: str | None = None) -> list[dict[str, t.Any]]:
        """The idempotency records (``idempotency_keys`` rows) as dicts, of every
        scope; only those of ``key`` if given."""
        table = models.record_table(sa.MetaData())
        stmt = sa.select(table).order_by(table.c.created_at)
        if key is not None:
            stmt = stmt.where(table.c.key == sa.bindparam("key", key, type_=sa.String()))
        with self.engine.connect() as conn:
            return [_portable(r._mapping) for r in conn.execute(stmt)]

    def has_table(self, name: str) -> bool:
        return sa.inspect(self.engine).has_table(name)

    # -- the trace -------------------------------------------------------------

    def traced(self, key: str, kind: str = "row") -> list[TraceEntry]:
        """What requests with ``key`` committed in the served app (``kind``:
        ``"row"``, ``"write"`` or ``"event"``)."""
        return [e for e in self._control.read_trace() if e.key == key and e.kind == kind]

    def unattributed(self) -> list[TraceEntry]:
        """Writes the served app committed outside any request while requests
        were in flight: no key can be told for them."""
        return [e for e in self._control.read_trace() if e.key is None]

    def exists(self, entry: TraceEntry) -> bool:
        """Whether the row ``entry`` names is in the database now. The row's
        table is looked up in the app's metadata, so each key value is bound
        with its column's type (a UUID, a timestamp); a table the app's models
        do not know is read with untyped columns."""
        schema, _, name = entry.table.rpartition(".")
        table = self._table(entry.table)
        if table is None or not all(c in table.c for c in entry.columns):
            columns: list[sa.Column[t.Any]] = [sa.Column(c) for c in entry.columns]
            table = sa.Table(name, sa.MetaData(), *columns, schema=schema or None)
        stmt = sa.select(sa.func.count()).select_from(table)
        for column, value in zip(entry.columns, entry.pk, strict=True):
            if entry.kind == "event":  # VARBINARY on MySQL: bound as text
                stmt = stmt.where(table.c[column] == sa.bindparam(None, value, type_=sa.String()))
            else:
                stmt = stmt.where(table.c[column] == value)
        with self.engine.connect() as conn:
            return bool(conn.execute(stmt).scalar_one())

    def _table(self, fullname: str) -> sa.Table | None:
        """The app's table of that name (in any of its Flask-SQLAlchemy metadatas)."""
        ext = self.app.extensions.get("sqlalchemy")
        metadatas = list(getattr(ext, "metadatas", {}).values()) if ext is not None else []
        for metadata in metadatas:
            table = metadata.tables.get(fullname)
            if isinstance(table, sa.Table):
                return table
        return None

    def __repr__(self) -> str:
        return f"<Database {sa.make_url(self.url).render_as_string(hide_password=True)}>"
