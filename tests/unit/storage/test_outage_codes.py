"""Failures of the database that a retry outlives, beyond a lost connection: the
server out of disk or memory, a statement killed by an operator. Each answers
503 problem+json with ``Retry-After`` and stores nothing (no record, no
business row), never Flask's HTML 500.

Real where the machine allows it: MariaDB's ``KILL QUERY`` on the view's
statement, SQLite's "database or disk is full" from ``max_page_count``.
PostgreSQL's resource errors are raised by a trigger with the exact SQLSTATE
the server sends (filling a shared machine's disk is not a test).
"""

from __future__ import annotations

import threading
import time
import typing as t
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import orm

from flask_idempotency import Idempotency
from flask_idempotency.errors import PROBLEM_JSON
from tests.conftest import PG_DRIVERS, mysql_url, postgres_url

db = SQLAlchemy()
idem = Idempotency()


class Charge(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "outage_code_charges"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    note: orm.Mapped[str] = orm.mapped_column(db.Text)


#: Connection ids the view ran on (MariaDB), for the killer.
_running: list[int] = []


def create_app(url: str) -> Flask:
    app = Flask(__name__)
    app.config.update(SQLALCHEMY_DATABASE_URI=url, IDEMPOTENCY_SCOPE=lambda: "t")
    db.init_app(app)
    idem.init_app(app, db)

    @app.post("/charge")
    @idem.idempotent()
    def charge() -> tuple[dict[str, t.Any], int]:
        db.session.add(Charge(note="x"))
        db.session.flush()
        return {"ok": True}, 201

    @app.post("/charge-big")
    @idem.idempotent()
    def charge_big() -> tuple[dict[str, t.Any], int]:
        db.session.add(Charge(note="x" * 200_000))  # pages beyond any free room
        db.session.flush()
        return {"ok": True}, 201

    @app.post("/waits")
    @idem.idempotent()
    def waits() -> tuple[dict[str, t.Any], int]:
        _running.append(db.session.execute(sa.text("SELECT CONNECTION_ID()")).scalar_one())
        db.session.execute(sa.text("SELECT * FROM outage_code_charges WHERE id = 1 FOR UPDATE"))
        db.session.add(Charge(note="x"))
        return {"ok": True}, 201

    with app.app_context():
        db.drop_all()
        db.create_all()
    return app


def records(app: Flask) -> int:
    with app.app_context():
        count = db.session.execute(sa.text("SELECT COUNT(*) FROM idempotency_keys"))
        return int(count.scalar_one())


def dispose(app: Flask) -> None:
    with app.app_context():
        db.session.remove()
        db.engine.dispose()


def assert_unavailable_and_nothing_stored(app: Flask, path: str, key: str) -> None:
    response = app.test_client().post(path, json={"n": 1}, headers={"Idempotency-Key": key})
    assert response.status_code == 503, response.get_data(as_text=True)[:300]
    assert response.mimetype == PROBLEM_JSON
    assert response.headers.get("Retry-After")
    with app.app_context():
        assert db.session.query(Charge).count() == 0
    assert records(app) == 0


@pytest.mark.parametrize(
    "condition", ["disk_full", "out_of_memory", "configuration_limit_exceeded", "io_error"]
)
@pytest.mark.parametrize("driver", list(PG_DRIVERS))
def test_postgres_resource_errors_answer_503(driver: str, condition: str) -> None:
    app = create_app(postgres_url(driver))
    try:
        with app.app_context(), db.engine.begin() as conn:
            conn.execute(
                sa.text(
                    "CREATE OR REPLACE FUNCTION outage_code_fail() RETURNS trigger AS $$ "
                    f"BEGIN RAISE EXCEPTION 'emulated {condition}' USING ERRCODE = '{condition}'; "
                    "END $$ LANGUAGE plpgsql"
                )
            )
            conn.execute(
                sa.text(
                    "CREATE TRIGGER outage_code_fail BEFORE INSERT ON outage_code_charges "
                    "FOR EACH ROW EXECUTE FUNCTION outage_code_fail()"
                )
            )
        assert_unavailable_and_nothing_stored(app, "/charge", str(uuid.uuid4()))
    finally:
        with app.app_context(), db.engine.begin() as conn:
            conn.execute(sa.text("DROP TABLE outage_code_charges"))
            conn.execute(sa.text("DROP FUNCTION IF EXISTS outage_code_fail()"))
        dispose(app)


def test_sqlite_database_or_disk_full_answers_503(tmp_path: Path) -> None:
    app = create_app(f"sqlite:///{tmp_path / 'full.sqlite3'}")
    try:
        with app.app_context():
            pages = db.session.execute(sa.text("PRAGMA page_count")).scalar_one()

        @sa.event.listens_for(_engine(app), "connect")
        def cap(dbapi_connection: t.Any, _record: t.Any) -> None:
            # No page beyond what the empty tables use: the next write is
            # SQLITE_FULL, as on a full disk.
            dbapi_connection.execute(f"PRAGMA max_page_count = {pages}")

        _engine(app).dispose()
        assert_unavailable_and_nothing_stored(app, "/charge-big", "full")
    finally:
        dispose(app)


def _engine(app: Flask) -> sa.Engine:
    with app.app_context():
        return db.engine


def test_mariadb_kill_query_answers_503() -> None:
    url = mysql_url()
    if url is None:
        pytest.skip("no MariaDB/MySQL reachable (see the report header)")
    app = create_app(url)
    admin = sa.create_engine(url)
    holder = admin.connect()
    try:
        # An uncommitted row the view's locking read waits on, until it is killed.
        holder.execute(sa.text("INSERT INTO outage_code_charges (id, note) VALUES (1, 'lock')"))
        _running.clear()

        def kill() -> None:
            deadline = time.monotonic() + 10
            while not _running and time.monotonic() < deadline:
                time.sleep(0.02)
            # Only a query in its lock wait: KILL QUERY on an idle connection does nothing.
            waiting = sa.text(
                "SELECT count(*) FROM information_schema.innodb_trx"
                " WHERE trx_mysql_thread_id = :id AND trx_state = 'LOCK WAIT'"
            )
            with admin.connect() as conn:
                while time.monotonic() < deadline + 20:
                    if conn.execute(waiting, {"id": _running[0]}).scalar_one():
                        break
                    conn.rollback()  # a fresh snapshot of the view each time
                    time.sleep(0.02)
                conn.execute(sa.text(f"KILL QUERY {_running[0]}"))

        killer = threading.Thread(target=kill)
        killer.start()
        try:
            response = app.test_client().post(
                "/waits", json={}, headers={"Idempotency-Key": "killed"}
            )
        finally:
            killer.join()
        holder.rollback()
        assert response.status_code == 503, response.get_data(as_text=True)[:300]
        assert response.mimetype == PROBLEM_JSON
        with app.app_context():
            assert db.session.query(Charge).count() == 0
        assert records(app) == 0
    finally:
        holder.close()
        admin.dispose()
        dispose(app)
