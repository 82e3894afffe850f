"""The pytest plugin of the testing kit: the ``api``, ``db``, ``fault`` and
``downstream`` fixtures (and ``idempotency_config``), documented in
``docs/testing-kit.md``.

Registered through the ``pytest11`` entry point (``pip install
flask-idempotency[testing]``), or by ``-p flask_idempotency.testing.plugin`` or
``pytest_plugins = ["flask_idempotency.testing.plugin"]``. It is inert until a
test requests one of its fixtures: loading it imports no app, starts no server
and touches no database. A fixture of the same name in a ``conftest.py`` wins.

Settings, each a command-line option, else an ini setting (``pytest.ini``,
``[tool.pytest.ini_options]``):

* ``--idempotency-app`` / ``idempotency_app``: the app's factory, as
  ``"myshop.app:create_app"`` (called with a config dict), or an app;
* ``--idempotency-database`` / ``IDEMPOTENCY_KIT_DATABASE_URL`` /
  ``idempotency_database``: an admin URL of the database server each test gets
  a database of its own on;
* ``--idempotency-downstream-config`` / ``idempotency_downstream_config``: the
  config key the fake downstream's URL is given in (default ``DOWNSTREAM_URL``);
* ``idempotency_server`` (``auto``, ``gunicorn``, ``werkzeug``),
  ``idempotency_workers`` (2) and ``idempotency_threads`` (8).
"""

from __future__ import annotations

import os
import typing as t
from pathlib import Path

import pytest

from ._app import dispose, load_app
from ._config import DATABASE_ENV, DEFAULT_DOWNSTREAM_CONFIG, KitConfig
from ._control import Control
from ._database import Database, Provisioned
from ._downstream import Downstream
from ._fault import Fault, proxy_for
from ._server import ServedApp, gunicorn_available

__all__ = [
    "api",
    "db",
    "downstream",
    "fault",
    "idempotency_config",
]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("idempotency", "Flask-Idempotency testing kit")
    group.addoption(
        "--idempotency-app",
        dest="idempotency_app",
        default=None,
        help="the app's factory for the kit's fixtures, as 'myshop.app:create_app'",
    )
    group.addoption(
        "--idempotency-database",
        dest="idempotency_database",
        default=None,
        help=f"admin URL of the database server the kit creates test databases on "
        f"(also {DATABASE_ENV})",
    )
    group.addoption(
        "--idempotency-downstream-config",
        dest="idempotency_downstream_config",
        default=None,
        help=f"config key the fake downstream's URL goes in (default {DEFAULT_DOWNSTREAM_CONFIG})",
    )
    parser.addini("idempotency_app", "the app's factory for the kit, as 'module:create_app'")
    parser.addini("idempotency_database", "admin URL of the kit's database server")
    parser.addini(
        "idempotency_downstream_config",
        "config key the fake downstream's URL goes in",
        default=DEFAULT_DOWNSTREAM_CONFIG,
    )
    parser.addini("idempotency_server", "auto, gunicorn or werkzeug", default="auto")
    parser.addini("idempotency_workers", "gunicorn workers of the served app", default="2")
    parser.addini("idempotency_threads", "threads per gunicorn worker", default="8")


def _setting(config: pytest.Config, name: str, env: str | None = None) -> str | None:
    value = config.getoption(name, default=None)
    if not value and env:
        value = os.environ.get(env)
    if not value:
        value = config.getini(name)
    return str(value) if value else None


@pytest.fixture
def idempotency_config(request: pytest.FixtureRequest) -> KitConfig:
    """The kit's settings (:class:`~flask_idempotency.testing.KitConfig`), from the
    options. Override this fixture to run the kit on another app or database, or
    to give the app more config."""
    config = request.config
    return KitConfig(
        app=_setting(config, "idempotency_app"),
        database=_setting(config, "idempotency_database", DATABASE_ENV),
        downstream_config=_setting(config, "idempotency_downstream_config")
        or DEFAULT_DOWNSTREAM_CONFIG,
        server=_setting(config, "idempotency_server") or "auto",
        workers=int(_setting(config, "idempotency_workers") or 2),
        threads=int(_setting(config, "idempotency_threads") or 8),
    )


@pytest.fixture
def _idempotency_control(tmp_path: Path) -> Control:
    return Control(tmp_path / "idempotency-kit")


def _admin_url(kit: KitConfig) -> str:
    if kit.database:
        return kit.database
    # No server named: the app's own, for a database next to its own one.
    assert kit.app is not None
    app = load_app(kit.app, kit.app_config)
    try:
        url = app.config.get("SQLALCHEMY_DATABASE_URI")
    finally:
        dispose(app)
    if not url:
        raise pytest.UsageError(
            "the kit found no database: set --idempotency-database (or "
            f"{DATABASE_ENV}, or idempotency_database in the ini file)"
        )
    return str(url)


@pytest.fixture
def db(
    idempotency_config: KitConfig, _idempotency_control: Control, tmp_path: Path
) -> t.Iterator[Database]:
    """The app's real database, a database of this test's own (PostgreSQL and
    MySQL: ``kit_<hex>`` on the admin URL's server, dropped after; SQLite: a file
    in ``tmp_path``), with the app's tables and the extension's created.
    See :class:`~flask_idempotency.testing.Database`."""
    kit = idempotency_config
    if not kit.app:
        raise pytest.UsageError(
            "the kit needs your app: set --idempotency-app or idempotency_app in the "
            "ini file (as 'myshop.app:create_app'), or override idempotency_config"
        )
    provisioned = Provisioned(_admin_url(kit), tmp_path / "idempotency-db")
    url = provisioned.create()
    try:
        database = Database.build(kit.app, url, kit.app_config, _idempotency_control)
    except BaseException:
        provisioned.drop()
        raise
    try:
        yield database
    finally:
        database.close()
        provisioned.drop()


@pytest.fixture
def fault(db: Database, _idempotency_control: Control) -> t.Iterator[Fault]:
    """One-shot faults in the served app, and its database cut on command.
    See :class:`~flask_idempotency.testing.Fault`."""
    injector = Fault(_idempotency_control, proxy_for(db.url))
    try:
        yield injector
    finally:
        injector.close()


@pytest.fixture
def downstream() -> t.Iterator[Downstream]:
    """A fake HTTP service that records calls, on 127.0.0.1; its URL is given to
    the served app in the ``idempotency_downstream_config`` config key.
    See :class:`~flask_idempotency.testing.Downstream`."""
    service = Downstream()
    try:
        yield service
    finally:
        service.close()


@pytest.fixture
def api(
    request: pytest.FixtureRequest,
    idempotency_config: KitConfig,
    db: Database,
    fault: Fault,
    downstream: Downstream,
    _idempotency_control: Control,
) -> t.Iterator[ServedApp]:
    """The app served by a real WSGI server in a subprocess (gunicorn where
    importable, else werkzeug's), on ``db`` (through the kit's proxy on a server
    database) and the fake ``downstream``. Killed after the test; its logs are
    shown when the test fails. See :class:`~flask_idempotency.testing.ServedApp`."""
    kit = idempotency_config
    assert kit.app is not None  # db checked it
    url = fault.proxy.url(db.url) if fault.proxy is not None else db.url
    config = {
        **kit.app_config,
        "SQLALCHEMY_DATABASE_URI": url,
        kit.downstream_config: downstream.url,
    }
    server = kit.server
    if server == "auto":
        server = "gunicorn" if gunicorn_available() else "werkzeug"
    served = ServedApp(
        app=kit.app,
        config=config,
        control=_idempotency_control,
        downstream=downstream.address,
        key_header=db.app.config.get("IDEMPOTENCY_HEADER") or "Idempotency-Key",
        server=server,
        workers=kit.workers,
        threads=kit.threads,
        cwd=request.config.invocation_params.dir,
    )
    try:
        yield served.start()
    finally:
        served.kill()


# An old-style wrapper: this module is loaded by every pytest run where the
# package is installed (the entry point does not depend on the [testing] extra),
# and ``wrapper=True`` needs pluggy 1.2, which pytest 7 does not require: with
# it, pytest 7 on pluggy 1.0 could not start at all, in any project.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> t.Generator[None, t.Any, None]:
    """A failed test that used ``api`` gets the server's logs in its report."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.failed:
        served = getattr(item, "funcargs", {}).get("api")
        if isinstance(served, ServedApp):
            report.sections.append(
                (f"idempotency kit: {served.server} logs ({served.url})", served.logs(tail=200))
            )
