"""Fixtures: a real PostgreSQL (configured or embedded), SQLite, MariaDB/MySQL,
apps and clients.

Set ``IDEMPOTENCY_TEST_POSTGRES_URL`` to test against a PostgreSQL you run;
otherwise the suite starts its own with ``pgserver`` (a PostgreSQL from PyPI).
PostgreSQL tests are never skipped: if no server can be had, they error. Every
PostgreSQL test runs twice, through each driver SQLAlchemy may pick for a
``postgresql://`` URL: psycopg2 (``postgresql+psycopg2://``, test ids
``psycopg2``) and psycopg 3 (``postgresql+psycopg://``, ids ``psycopg``),
whatever driver the configured URL names.

Through PgBouncer: the PostgreSQL tests of :data:`POOLED_MODULES` also run through
a PgBouncer in transaction pooling mode (test ids ``psycopg2-pgbouncer`` and
``psycopg-pgbouncer``), started by the suite in front of its PostgreSQL; skipped,
with the reason, where PgBouncer is not installed. ``IDEMPOTENCY_TEST_PGBOUNCER=all``
sends every PostgreSQL URL of the suite through it instead (the whole suite behind
a pooler); ``=off`` leaves the pooler out.

MariaDB/MySQL runs every engine-parametrized test too, at
``IDEMPOTENCY_TEST_MYSQL_URL`` (default: root without a password on
127.0.0.1:3306, database ``idempotency_test``, created if missing; under
pytest-xdist each worker has its own, the worker's name appended). When no
server answers there, those tests are skipped with the reason, and the report
header says so.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import tempfile
import typing as t
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from flask import Flask
from sqlalchemy import event

from flask_idempotency._storage import text_param
from flask_idempotency._storage.schema import as_utc, inbox_table, job_lock_table, record_table
from tests.support import browser, pgbouncer, testapp
from tests.support.live import LiveServer
from tests.support.tables import recreate_tables
from tests.support.tcp_proxy import TcpProxy, upstream_of

# The testing kit's fixtures (api, db, fault, downstream) for tests/kit and
# tests/example; inert for every other test (it loads no app, starts nothing).
pytest_plugins = ["flask_idempotency.testing.plugin"]

POSTGRES_ENV = "IDEMPOTENCY_TEST_POSTGRES_URL"
PGBOUNCER_ENV = "IDEMPOTENCY_TEST_PGBOUNCER"
MYSQL_ENV = "IDEMPOTENCY_TEST_MYSQL_URL"
DEFAULT_MYSQL_URL = "mysql+pymysql://root@127.0.0.1:3306/idempotency_test?charset=utf8mb4"


def _start_embedded_postgres() -> tuple[str, t.Any]:
    # pgserver asks platformdirs for a runtime dir, which warns (an error under
    # filterwarnings=error) when XDG_RUNTIME_DIR is unset or shared; give it a
    # private one.
    if not os.environ.get("XDG_RUNTIME_DIR"):
        os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="idempotency-run-")
    import pgserver

    data_dir = Path(tempfile.mkdtemp(prefix="idempotency-pg-"))
    server = pgserver.get_server(data_dir, cleanup_mode="delete")
    uri = server.get_uri()
    return uri.replace("postgresql://", "postgresql+psycopg2://", 1), server


_PG: dict[str, t.Any] = {}


def _private_schema(configured: str) -> str:
    """A schema of our own in a PostgreSQL someone else runs, dropped when the
    session ends, and the URL that puts it first on the search path."""
    url = sa.make_url(configured)
    schema = f"idempotency_test_{uuid.uuid4().hex[:12]}"
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    finally:
        engine.dispose()
    _PG["schema"], _PG["admin_url"] = schema, configured
    options = url.query.get("options", "")
    options = f"{options} -csearch_path={schema}".strip()
    return url.update_query_dict({"options": options}).render_as_string(hide_password=False)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the PgBouncer; leave nothing behind in a configured PostgreSQL."""
    bouncer = _PG.pop("pgbouncer", None)
    if bouncer is not None:
        bouncer.stop()
    schema = _PG.pop("schema", None)
    if schema is None:
        return
    engine = sa.create_engine(_PG["admin_url"])
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
    finally:
        engine.dispose()


def pg_options(url: str, extra: str) -> str:
    """The libpq ``options`` of ``url`` (the suite's ``search_path``, when it runs in
    a schema of its own) with ``extra`` added: for ``connect_args={"options": ...}``,
    which replaces the URL's instead of adding to it."""
    given = sa.make_url(url).query.get("options", "")
    assert isinstance(given, str)
    return f"{given} {extra}".strip()


#: The PostgreSQL drivers every PostgreSQL test runs on, by test id.
PG_DRIVERS = {"psycopg2": "postgresql+psycopg2", "psycopg": "postgresql+psycopg"}


#: The same drivers through PgBouncer in transaction pooling mode, by test id.
POOLED = {f"{driver}-pgbouncer": driver for driver in PG_DRIVERS}

#: The modules whose PostgreSQL tests also run through PgBouncer on every run:
#: the request path (claims, replays, concurrent duplicates, bounds) and the
#: leases (live servers killed mid-request, reclaims, recovery points).
POOLED_MODULES = frozenset(
    {
        "tests/unit/request/test_flow.py",
        "tests/unit/request/test_fencing.py",
        "tests/live/test_leases.py",
        "tests/live/test_pooler.py",
    }
)


def pgbouncer_mode() -> str:
    """``IDEMPOTENCY_TEST_PGBOUNCER``: ``"some"`` (default), ``"all"`` or ``"off"``."""
    mode = os.environ.get(PGBOUNCER_ENV, "some").strip().lower() or "some"
    if mode not in ("some", "all", "off"):
        raise pytest.UsageError(f"{PGBOUNCER_ENV} must be some, all or off, got {mode!r}")
    return mode


def postgres_url(driver: str = "psycopg2") -> str:
    """The PostgreSQL the suite uses, started on first use, spelled for ``driver``
    (a key of :data:`PG_DRIVERS`, or of :data:`POOLED`: through PgBouncer).

    A configured one (``IDEMPOTENCY_TEST_POSTGRES_URL``) is used through a
    schema of the suite's own, created for the run and dropped at its end: the
    tables already in that database are never touched.
    ``IDEMPOTENCY_TEST_PGBOUNCER=all`` sends every driver through PgBouncer.
    """
    if driver in POOLED or (driver in PG_DRIVERS and pgbouncer_mode() == "all"):
        return pooled_url(POOLED.get(driver, driver))
    return direct_postgres_url(driver)


def direct_postgres_url(driver: str = "psycopg2") -> str:
    """The suite's PostgreSQL for ``driver`` (a key of :data:`PG_DRIVERS`), never
    through PgBouncer."""
    url = sa.make_url(_postgres_url()).set(drivername=PG_DRIVERS[driver])
    return url.render_as_string(hide_password=False)


def pooled_url(driver: str) -> str:
    """The suite's PostgreSQL through its PgBouncer (started on first use), for
    ``driver``; skips the test, with the reason, where PgBouncer is missing (or
    ``IDEMPOTENCY_TEST_PGBOUNCER=off``)."""
    reason = pgbouncer.missing()
    if pgbouncer_mode() == "off":
        reason = f"{PGBOUNCER_ENV}=off"
    if reason is not None:
        pytest.skip(reason)
    if "pgbouncer" not in _PG:
        _PG["pgbouncer"] = pgbouncer.run(_postgres_url())
        # Where an app behind it LISTENs (pgbouncer.user_config), in subprocesses too.
        os.environ[pgbouncer.DIRECT_ENV] = _postgres_url()
    return t.cast(str, _PG["pgbouncer"].url(PG_DRIVERS[driver]))


def _postgres_url() -> str:
    if "url" not in _PG:
        configured = os.environ.get(POSTGRES_ENV)
        if configured:
            _PG["url"], _PG["source"] = _private_schema(configured), f"{POSTGRES_ENV}"
        else:
            _PG["url"], _PG["server"] = _start_embedded_postgres()
            _PG["source"] = "embedded pgserver"
    return t.cast(str, _PG["url"])


_MYSQL: dict[str, t.Any] = {}


def mysql_url() -> str | None:
    """The MariaDB/MySQL the suite uses, or ``None`` (with the reason kept) when
    none answers. The database is created if missing."""
    if "url" not in _MYSQL:
        url = sa.make_url(os.environ.get(MYSQL_ENV) or DEFAULT_MYSQL_URL)
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        if worker:  # a database per pytest-xdist worker: tests reset their tables
            url = url.set(database=f"{url.database}_{worker}")
        _MYSQL["shown"] = url.render_as_string(hide_password=True)
        server = sa.create_engine(url.set(database=""), connect_args={"connect_timeout": 3})
        try:
            with server.begin() as conn:
                conn.execute(
                    sa.text(f"CREATE DATABASE IF NOT EXISTS `{url.database}` CHARACTER SET utf8mb4")
                )
                _MYSQL["version"] = conn.execute(sa.text("SELECT VERSION()")).scalar_one()
            _MYSQL["url"] = url.render_as_string(hide_password=False)
        except Exception as exc:  # any failure to reach it means "not here"
            _MYSQL["url"], _MYSQL["reason"] = None, f"{type(exc).__name__}: {exc}"
        finally:
            server.dispose()
    return t.cast("str | None", _MYSQL["url"])


def pytest_report_header(config: pytest.Config) -> list[str]:
    source = os.environ.get(POSTGRES_ENV)
    where = (
        f"{POSTGRES_ENV}={source} (in a schema of the run's own, dropped at the end)"
        if source
        else "embedded (pgserver), started on first use"
    )
    lines = [f"PostgreSQL for tests: {where}"]
    reason = pgbouncer.missing()
    mode = pgbouncer_mode()
    if mode == "off":
        lines.append(f"PgBouncer: off ({PGBOUNCER_ENV}=off)")
    elif reason is not None:
        lines.append(f"PgBouncer: NOT AVAILABLE, its tests are skipped: {reason}")
    elif mode == "all":
        lines.append("PgBouncer (transaction pooling): every PostgreSQL URL goes through it")
    else:
        lines.append(
            "PgBouncer (transaction pooling): the PostgreSQL tests of "
            f"{', '.join(sorted(POOLED_MODULES))} also run through it"
        )
    no_browser = browser.missing()
    lines.append(
        "Chromium for the browser tests (tests/browser): "
        + (f"NOT AVAILABLE, they are skipped: {no_browser}" if no_browser else browser.found())
    )
    if mysql_url() is not None:
        lines.append(f"MariaDB/MySQL for tests: {_MYSQL['shown']} (server {_MYSQL['version']})")
    else:
        lines.append(
            f"MariaDB/MySQL for tests: NOT REACHABLE at {_MYSQL['shown']} "
            f"({_MYSQL['reason']}); its tests are skipped. Set {MYSQL_ENV} to run them."
        )
    return lines


@pytest.fixture(scope="session", params=[*PG_DRIVERS, *POOLED])
def pg_url(request: pytest.FixtureRequest) -> str:
    """The suite's PostgreSQL, through psycopg2 and through psycopg 3 (and, for
    :data:`POOLED_MODULES`, both through PgBouncer)."""
    return postgres_url(request.param)


#: The engines (and drivers) every engine-parametrized test runs on.
ENGINES = [*PG_DRIVERS, *POOLED, "sqlite", "mysql"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the PgBouncer variants of :data:`POOLED_MODULES` only (none with
    ``IDEMPOTENCY_TEST_PGBOUNCER=off``, nor with ``=all``, where every
    PostgreSQL URL goes through it already); the others are deselected."""
    mode = pgbouncer_mode()
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        callspec = getattr(item, "callspec", None)
        pooled = callspec is not None and any(
            isinstance(value, str) and value in POOLED for value in callspec.params.values()
        )
        path = item.nodeid.split("::", 1)[0]
        if pooled and (mode != "some" or path not in POOLED_MODULES):
            dropped.append(item)
        else:
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(params=ENGINES)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param in PG_DRIVERS or request.param in POOLED:
        return postgres_url(request.param)
    if request.param == "mysql":
        url = mysql_url()
        if url is None:
            pytest.skip(f"no MariaDB/MySQL at {_MYSQL['shown']}: {_MYSQL['reason']}")
        return url
    return f"sqlite:///{tmp_path / 'test.sqlite3'}"


@pytest.fixture(params=ENGINES)
def fresh_database(request: pytest.FixtureRequest, tmp_path: Path) -> t.Iterator[str]:
    """An empty database of its own on each engine, dropped afterwards (for code that
    creates its own tables: migrations, the README's examples)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'shop.sqlite3'}"
        return
    postgres = request.param in PG_DRIVERS or request.param in POOLED
    base = postgres_url(request.param) if postgres else mysql_url()
    if base is None:
        pytest.skip("no MariaDB/MySQL reachable (see the report header)")
    name = f"shop_{uuid.uuid4().hex[:10]}"
    url = sa.make_url(base).difference_update_query(["options"])  # a whole database of its own
    server = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with server.connect() as conn:
            conn.execute(sa.text(f"CREATE DATABASE {name}"))
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        with server.connect() as conn:
            if postgres:
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            else:
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name}"))
        server.dispose()


def reset_tables(url: str) -> None:
    """Drop and recreate the test app's tables (ledger and idempotency_keys)."""
    # The extension puts its tables on the metadata at init_app; a test that
    # resets before creating its first app still gets them.
    recreate_tables(testapp.db.metadata, url, (record_table, job_lock_table, inbox_table))


#: Engines that opened a connection during the current test, kept alive until
#: its end: an engine a test made and dropped (``table.create(create_engine(url))``)
#: would otherwise leave its pooled connection to the garbage collector mid-test.
_engines_used: set[sa.Engine] = set()


@event.listens_for(sa.Engine, "engine_connect")
def _engine_used(connection: sa.Connection) -> None:
    _engines_used.add(connection.engine)


@event.listens_for(sa.pool.Pool, "connect")
def _no_prepares_through_the_pooler(dbapi_connection: t.Any, record: t.Any) -> None:
    """With ``IDEMPOTENCY_TEST_PGBOUNCER=all``, the tests' own engines (readers,
    ``run_sql``) go through PgBouncer too, and are no subject of the test: their
    psycopg 3 connections prepare nothing, as a user's would be set up. (The apps
    under test get it from their config, ``pgbouncer.user_config``.)"""
    if pgbouncer_mode() != "all" or getattr(dbapi_connection, "prepare_threshold", None) is None:
        return
    if pgbouncer.POOLED_APP in dbapi_connection.info.dsn:  # psycopg 3, through the pooler
        dbapi_connection.prepare_threshold = None


@pytest.fixture(autouse=True)
def _close_pooled_connections() -> t.Iterator[None]:
    """Close the pooled connections of every engine a test used, when it ends.

    Tests make apps (and so engines) freely; an engine dropped with connections
    in its pool leaves them to the garbage collector, which psycopg 3 reports as
    a ResourceWarning (an error here) in whichever test runs then. Each engine
    is held until the test ends, then disposed. Disposing only empties the pool:
    an engine a later test uses again reconnects.
    """
    yield
    for engine in list(_engines_used):
        engine.dispose()
    _engines_used.clear()


class Clock:
    """A controllable clock: starts at the real time, moves only when told."""

    def __init__(self) -> None:
        self.now = dt.datetime.now(dt.timezone.utc)

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, **delta: float) -> None:
        self.now += dt.timedelta(**delta)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def app(database_url: str, clock: Clock) -> t.Iterator[Flask]:
    app = testapp.create_app(
        database_url,
        clock=clock,
        IDEMPOTENCY_MAX_BODY=1000,
        IDEMPOTENCY_REPLAY_HEADERS=["X-Request-Cost", "Set-Cookie"],
    )
    reset_tables(database_url)
    # No app context stays pushed: each test-client request gets its own, as in
    # production, so nothing (g, the session) leaks from one request to the next.
    yield app
    with app.app_context():
        testapp.db.engine.dispose()


@pytest.fixture
def make_app(database_url: str, clock: Clock) -> t.Iterator[t.Callable[..., Flask]]:
    """Apps of the test app with extra config, on clean tables, disposed afterwards."""
    made: list[Flask] = []

    def make(**config: t.Any) -> Flask:
        app = testapp.create_app(database_url, clock=clock, **config)
        made.append(app)
        return app

    reset_tables(database_url)
    yield make
    for app in made:
        with app.app_context():
            testapp.db.engine.dispose()


@pytest.fixture
def proxy(pg_url: str) -> t.Iterator[TcpProxy]:
    with TcpProxy(upstream_of(pg_url)) as proxy:
        yield proxy


@pytest.fixture
def example_behind_proxy(pg_url: str, proxy: TcpProxy) -> t.Iterator[LiveServer]:
    """The example app in a subprocess, on PostgreSQL through the proxy."""
    from example_app import app as example

    scratch = example.create_app({"SQLALCHEMY_DATABASE_URI": pg_url, **pgbouncer.declared(pg_url)})
    with scratch.app_context():
        example.db.drop_all()
        example.db.create_all()
        example.db.engine.dispose()
    server = LiveServer("example", proxy.url(pg_url)).start()
    yield server
    proxy.heal()
    server.stop()


@pytest.fixture
def client(app: Flask) -> t.Any:
    return app.test_client()


def run_sql(url: str, sql: str, **params: t.Any) -> list[t.Any]:
    """Run one statement on a fresh connection and commit; the rows, if any.

    For tests that look at the database from outside the app under test (a live
    server in a subprocess, several processes).
    """
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            result = conn.execute(sa.text(sql), params)
            return list(result) if result.returns_rows else []
    finally:
        engine.dispose()


def ledger_count(app: Flask, route: str | None = None) -> int:
    """Ledger rows (side effects) committed, read on a fresh connection."""
    with app.app_context():
        stmt = sa.select(sa.func.count()).select_from(testapp.Ledger)
        if route is not None:
            stmt = stmt.where(testapp.Ledger.route == route)
        with testapp.db.engine.connect() as conn:
            return int(conn.execute(stmt).scalar_one())


def insert_records(conn: sa.Connection, rows: list[dict[str, t.Any]]) -> None:
    """Insert raw idempotency_keys rows as the store does: scope and key bound as
    strings (MySQL's columns are VARBINARY, whose own type wants bytes)."""
    table = testapp.db.metadata.tables["idempotency_keys"]
    stmt = sa.insert(table).values(scope=text_param("scope"), key=text_param("key"))
    conn.execute(stmt, rows)


def _portable(value: t.Any) -> t.Any:
    """A column value as PostgreSQL returns it, whatever the engine: aware UTC
    timestamps, ``str`` scope and key (MySQL's VARBINARY gives bytes)."""
    if isinstance(value, dt.datetime):
        return as_utc(value)
    return value


def record_rows(app: Flask) -> list[dict[str, t.Any]]:
    """Rows of idempotency_keys, read on a fresh connection."""
    with app.app_context(), testapp.db.engine.connect() as conn:
        table = testapp.db.metadata.tables["idempotency_keys"]
        rows = [
            {k: _portable(v) for k, v in r._mapping.items()} for r in conn.execute(sa.select(table))
        ]
        for row in rows:
            for name in ("scope", "key"):
                if isinstance(row[name], bytes):
                    row[name] = row[name].decode("utf-8")
        return rows


@pytest.fixture
def pooled_role() -> t.Iterator[t.Callable[..., str]]:
    """``pooled_role(url, lock_timeout="300ms")``: ``url`` as a role of its own whose
    sessions start with those settings (``ALTER ROLE ... SET``), dropped when the
    test ends: the settings a direct connection passes in ``options=``, which a
    transaction pooler refuses (:func:`tests.support.pgbouncer.role_with_settings`)."""
    with contextlib.ExitStack() as roles:

        def make(url: str, **settings: str) -> str:
            return roles.enter_context(pgbouncer.role_with_settings(url, **settings))

        yield make
