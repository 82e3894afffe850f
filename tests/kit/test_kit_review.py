"""Regressions found by an outside review of the testing kit: the kit refuses an
app that does not use the database it was given (before it creates a table
anywhere), and its plugin loads on every pluggy pytest 7 may bring."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import sqlalchemy as sa

import flask_idempotency_pytest as kit_plugin
from flask_idempotency.testing import Database
from flask_idempotency.testing._control import Control

APP = """
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import orm

from flask_idempotency import Idempotency

db = SQLAlchemy()
idem = Idempotency()
OWN_DATABASE = "@OWN@"


class Order(db.Model):
    __tablename__ = "orders"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)


class Config:
    SQLALCHEMY_DATABASE_URI = OWN_DATABASE


def ignores_its_argument(env=None):
    # The config-class pattern: a dict passed here is not config.
    app = Flask(__name__)
    app.config.from_object(Config)
    if env == "testing":
        app.config["SQLALCHEMY_DATABASE_URI"] = "sqlite://"
    db.init_app(app)
    idem.init_app(app, db)
    return app


def applies_it_too_late(config=None):
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = OWN_DATABASE
    db.init_app(app)  # the engine is made here, on the app's own database
    app.config.update(config or {})
    idem.init_app(app, db)
    return app


def applies_it(config=None):
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = OWN_DATABASE
    app.config.update(config or {})
    db.init_app(app)
    idem.init_app(app, db)
    return app
"""


@pytest.fixture
def user_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """A user's module (a name of its own per test), whose own database is a
    SQLite file that must stay untouched."""
    own = tmp_path / "own.sqlite3"
    name = f"kit_review_app_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(APP.replace("@OWN@", f"sqlite:///{own}")))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name, own


@pytest.mark.parametrize("factory", ["ignores_its_argument", "applies_it_too_late"])
def test_an_app_on_another_database_is_refused_before_any_table_is_made(
    user_app: tuple[str, Path], tmp_path: Path, factory: str
) -> None:
    module, own = user_app
    test_db = f"sqlite:///{tmp_path / 'kit_test.sqlite3'}"
    with pytest.raises(RuntimeError, match="not the test database the kit gave it") as refused:
        Database.build(f"{module}:{factory}", test_db, {}, Control(tmp_path / "control"))
    assert str(own) in str(refused.value)
    # Nothing was created on the app's own database.
    engine = sa.create_engine(f"sqlite:///{own}")
    try:
        assert sa.inspect(engine).get_table_names() == []
    finally:
        engine.dispose()


def test_an_app_that_applies_the_config_is_built_on_the_test_database(
    user_app: tuple[str, Path], tmp_path: Path
) -> None:
    module, own = user_app
    test_db = f"sqlite:///{tmp_path / 'kit_test.sqlite3'}"
    database = Database.build(f"{module}:applies_it", test_db, {}, Control(tmp_path / "control"))
    try:
        assert database.has_table("orders")
        assert database.has_table("idempotency_keys")
    finally:
        database.close()
    assert not own.exists()


def test_the_plugin_uses_no_hook_wrapper_older_pluggy_refuses() -> None:
    """The entry point loads the plugin in every pytest run where the package is
    installed, [testing] extra or not; ``wrapper=True`` needs pluggy 1.2, and
    pytest 7 runs on pluggy 1.0, where it stops pytest from starting at all."""
    hooks = {
        name: opts
        for name in dir(kit_plugin)
        if (opts := getattr(getattr(kit_plugin, name), "pytest_impl", None)) is not None
    }
    assert "pytest_runtest_makereport" in hooks
    for name, opts in hooks.items():
        assert not opts.get("wrapper"), name
