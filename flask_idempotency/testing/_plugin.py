"""What the plugin's fixtures do, imported by them when a test requests one (the
plugin module itself, ``flask_idempotency_pytest``, imports nothing of the
package at load time). This module needs pytest; nothing else of the kit does."""

from __future__ import annotations

import typing as t
from pathlib import Path

import pytest

from ._app import dispose, key_header, load_app
from ._config import DATABASE_ENV, KitConfig
from ._control import Control
from ._database import Database, Provisioned, sweep_stale
from ._downstream import Downstream
from ._fault import Fault
from ._server import ServedApp, gunicorn_available


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


def database(kit: KitConfig, control: Control, tmp_path: Path) -> t.Iterator[Database]:
    """The ``db`` fixture: a database of the test's own, dropped after."""
    if not kit.app:
        raise pytest.UsageError(
            "the kit needs your app: set --idempotency-app or idempotency_app in the "
            "ini file (as 'myshop.app:create_app'), or override idempotency_config"
        )
    admin = _admin_url(kit)
    sweep_stale(admin)  # what runs killed before their teardown left behind
    provisioned = Provisioned(admin, tmp_path / "idempotency-db")
    url = provisioned.create()
    try:
        built = Database.build(kit.app, url, kit.app_config, control)
    except BaseException:
        provisioned.drop()
        raise
    try:
        yield built
    finally:
        built.close()
        provisioned.drop()


def served(
    kit: KitConfig,
    db: Database,
    fault: Fault,
    downstream: Downstream,
    control: Control,
    *,
    cwd: Path,
) -> t.Iterator[ServedApp]:
    """The ``api`` fixture: the app in a subprocess, killed after."""
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
    header = key_header(db.app)
    # The app forwards its key downstream in its own header (idem.forward_headers()).
    downstream.key_header = header
    app = ServedApp(
        app=kit.app,
        config=config,
        control=control,
        downstream=downstream.address,
        key_header=header,
        server=server,
        workers=kit.workers,
        threads=kit.threads,
        cwd=cwd,
    )
    try:
        yield app.start()
    finally:
        app.kill()
