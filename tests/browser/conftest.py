"""The browser tests' fixtures: Chromium (tests/support/browser.py) and the example
shop served on 127.0.0.1 in a thread of the test process, on a database of its own."""

from __future__ import annotations

import dataclasses
import io
import threading
import time
import typing as t
import uuid
from pathlib import Path
from urllib.parse import parse_qs

import pytest
import sqlalchemy as sa
from flask import Flask
from werkzeug.serving import make_server

from tests.conftest import Clock, postgres_url
from tests.support.browser import browser, browsers  # noqa: F401 (fixtures)

FORM_FIELD = "idempotency_key"


@dataclasses.dataclass
class Post:
    """A POST the server received: its path, its key (header or form field), and
    the status it answered (``None`` while it runs)."""

    path: str
    key: str | None
    status: int | None = None


class PostLog:
    """WSGI middleware: every POST that reaches the server, whatever the app does
    with it, so a test sees what the browser sent and not only what it shows."""

    def __init__(self, app: t.Any) -> None:
        self.app = app
        self.posts: list[Post] = []
        self.running = 0
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, t.Any], start_response: t.Any) -> t.Any:
        if environ["REQUEST_METHOD"] != "POST":
            return self.app(environ, start_response)
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        environ["wsgi.input"] = io.BytesIO(body)
        key = environ.get("HTTP_IDEMPOTENCY_KEY")
        if key is None and environ.get("CONTENT_TYPE", "").startswith(
            "application/x-www-form-urlencoded"
        ):
            key = parse_qs(body.decode("utf-8")).get(FORM_FIELD, [None])[0]
        post = Post(environ["PATH_INFO"], key)
        with self.lock:
            self.posts.append(post)
            self.running += 1

        def starting(status: str, headers: t.Any, *rest: t.Any) -> t.Any:
            post.status = int(status.split()[0])
            return start_response(status, headers, *rest)

        try:
            answer = self.app(environ, starting)
            try:
                return list(answer)  # the whole answer, then done
            finally:
                if hasattr(answer, "close"):
                    answer.close()
        finally:
            with self.lock:
                self.running -= 1


@dataclasses.dataclass
class Shop:
    """The example shop served for a test module, and what its database holds."""

    app: Flask
    url: str
    clock: Clock
    log: PostLog
    database: str
    flavour: str

    def page(self, path: str) -> str:
        return self.url + path

    def reset(self) -> None:
        """Before each test: no orders, no events, no POSTs seen, default settings."""
        self.settle()
        self.app.config.update(EXAMPLE_CHECKOUT_DELAY=0, EXAMPLE_CHECKOUT_REDIRECT=True)
        engine = sa.create_engine(self.database)
        try:
            with engine.begin() as conn:
                conn.execute(sa.text("DELETE FROM orders"))
                conn.execute(sa.text("DELETE FROM idempotency_outbox"))
        finally:
            engine.dispose()
        with self.log.lock:
            self.log.posts.clear()

    def settle(self, timeout: float = 15) -> None:
        """Wait until no request runs (a browser that cancelled a navigation does
        not wait for the server to finish it)."""
        deadline = time.monotonic() + timeout
        while self.log.running and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not self.log.running, "a request still runs"

    @property
    def posts(self) -> list[Post]:
        self.settle()
        with self.log.lock:
            return list(self.log.posts)

    def count(self, table: str) -> int:
        """Rows of ``table`` (the shop's orders, the outbox's events), read on a
        connection of the test's own."""
        self.settle()
        engine = sa.create_engine(self.database)
        try:
            with engine.connect() as conn:
                return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())
        finally:
            engine.dispose()


def _own_database(engine: str, tmp: Path) -> t.Iterator[str]:
    if engine == "sqlite":
        yield f"sqlite:///{tmp / 'shop.sqlite3'}"
        return
    base = sa.make_url(postgres_url(engine)).difference_update_query(["options"])
    name = f"browser_{uuid.uuid4().hex[:10]}"
    server = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    try:
        with server.connect() as conn:
            conn.execute(sa.text(f"CREATE DATABASE {name}"))
        yield base.set(database=name).render_as_string(hide_password=False)
    finally:
        with server.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        server.dispose()


@pytest.fixture(scope="module", params=["sqlite", "psycopg2"])
def shop_database(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> t.Iterator[str]:
    """A database of the shop's own on each engine (SQLite and PostgreSQL)."""
    yield from _own_database(request.param, tmp_path_factory.mktemp("shop"))


@pytest.fixture(scope="module", params=["plain", "flask-wtf"])
def served_shop(
    request: pytest.FixtureRequest, shop_database: str, tmp_path_factory: pytest.TempPathFactory
) -> t.Iterator[Shop]:
    """The example shop (example_app/shop.py) on 127.0.0.1, in threads of this
    process: ``plain`` (the template helper) or ``flask-wtf`` (a FlaskForm, with
    CSRFProtect on)."""
    from example_app import orders, shop

    clock = Clock()
    app = shop.create_app(
        {
            "SQLALCHEMY_DATABASE_URI": shop_database,
            "SECRET_KEY": "browser-tests",
            "EXAMPLE_BROKER_FOLDER": str(tmp_path_factory.mktemp("broker")),
        },
        flask_wtf=request.param == "flask-wtf",
        clock=clock,
    )
    log = PostLog(app.wsgi_app)
    app.wsgi_app = log  # type: ignore[method-assign]
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Shop(
            app=app,
            url=f"http://127.0.0.1:{server.server_port}",
            clock=clock,
            log=log,
            database=shop_database,
            flavour=request.param,
        )
    finally:
        server.shutdown()
        thread.join(10)
        server.server_close()
        app.config["IDEMPOTENCY_PUBLISHER"].close()
        with app.app_context():
            orders.db.engine.dispose()


@pytest.fixture
def shop(served_shop: Shop) -> Shop:
    """The served shop, emptied for this test."""
    served_shop.reset()
    return served_shop
