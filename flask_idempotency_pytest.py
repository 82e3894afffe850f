"""The pytest plugin of Flask-Idempotency's testing kit: the ``api``, ``db``,
``fault`` and ``downstream`` fixtures (and ``idempotency_config``), documented in
``docs/testing-kit.md``.

Registered through the ``pytest11`` entry point (installing the
``testing`` extra), or by ``-p flask_idempotency_pytest`` (or its
older name ``-p flask_idempotency.testing.plugin``, the same plugin) or
``pytest_plugins = [...]`` of either name. ``-p no:flask_idempotency_pytest``
turns it off.

It is a module of its own, outside the package, because the entry point loads it
in every pytest run where the package is installed: at load time it imports
pytest and the standard library only, never ``flask_idempotency`` (which brings
Flask, SQLAlchemy and its dialects). The fixtures import the kit when a test
requests one; a run whose tests use none imports no app, starts no server and
touches no database. A fixture of the same name in a ``conftest.py`` wins.

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
import sys
import typing as t
from pathlib import Path

import pytest

if t.TYPE_CHECKING:  # names for annotations only: nothing of the kit at load time
    from flask_idempotency.testing import Database, Downstream, Fault, KitConfig, ServedApp
    from flask_idempotency.testing._control import Control

__all__ = [
    "api",
    "db",
    "downstream",
    "fault",
    "idempotency_config",
]

#: The environment variable that names the admin database URL (the kit's
#: ``_config.DATABASE_ENV``, spelled here so that loading the plugin imports
#: nothing of the package).
DATABASE_ENV = "IDEMPOTENCY_KIT_DATABASE_URL"
DEFAULT_DOWNSTREAM_CONFIG = "DOWNSTREAM_URL"
#: The module that holds the served app's object: loaded only once a test used ``api``.
_SERVER_MODULE = "flask_idempotency.testing._server"


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
    from flask_idempotency.testing import KitConfig

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
    from flask_idempotency.testing._control import Control

    return Control(tmp_path / "idempotency-kit")


@pytest.fixture
def db(
    idempotency_config: KitConfig, _idempotency_control: Control, tmp_path: Path
) -> t.Iterator[Database]:
    """The app's real database, a database of this test's own (PostgreSQL and
    MySQL: ``kit_...`` on the admin URL's server, dropped after; SQLite: a file
    in ``tmp_path``), with the app's tables and the extension's created.
    See :class:`~flask_idempotency.testing.Database`."""
    from flask_idempotency.testing._plugin import database

    yield from database(idempotency_config, _idempotency_control, tmp_path)


@pytest.fixture
def fault(db: Database, _idempotency_control: Control) -> t.Iterator[Fault]:
    """One-shot faults in the served app, and its database cut on command.
    See :class:`~flask_idempotency.testing.Fault`."""
    from flask_idempotency.testing._fault import Fault, proxy_for

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
    from flask_idempotency.testing import Downstream

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
    database) and the fake ``downstream``. Killed after the test, and when the
    test process dies; its logs are shown when the test fails.
    See :class:`~flask_idempotency.testing.ServedApp`."""
    from flask_idempotency.testing._plugin import served

    yield from served(
        idempotency_config,
        db,
        fault,
        downstream,
        _idempotency_control,
        cwd=request.config.invocation_params.dir,
    )


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
    server_module = sys.modules.get(_SERVER_MODULE)
    if report.failed and server_module is not None:  # no api ever served: nothing to show
        served = getattr(item, "funcargs", {}).get("api")
        if isinstance(served, server_module.ServedApp):
            report.sections.append(
                (f"idempotency kit: {served.server} logs ({served.url})", served.logs(tail=200))
            )
