"""A database that does not accept writes: every protected request answers 503
problem+json with ``Retry-After`` and stores nothing, and readiness says
"not ready" (``database: read_only``, with the reason) exactly when a claim
would fail.

Read-only for real, on each engine and each way it happens in production:

* per session, on the shared test servers: PostgreSQL's
  ``default_transaction_read_only`` (psycopg2 and psycopg 3), MariaDB's
  ``SET SESSION TRANSACTION READ ONLY``, a SQLite file opened ``mode=ro``;
* a PostgreSQL hot standby, then promoted (a failover), on a cluster of the
  test's own (tests/support/private_servers.py);
* MariaDB's ``read_only`` (for an ordinary user; a user allowed to write
  anyway is ready and served) and ``innodb_read_only``, on a server of the
  test's own.

Each test counts the business rows and records left, not only the status.
"""

from __future__ import annotations

import contextlib
import datetime as dt
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
from flask_idempotency._storage.schema import record_table
from flask_idempotency.errors import PROBLEM_JSON
from tests.conftest import mysql_url, postgres_url
from tests.support import pgbouncer
from tests.support.private_servers import PgCluster, PrivateMariaDB, mariadb_binaries
from tests.support.tables import recreate_tables

db = SQLAlchemy()
idem = Idempotency()


class Entry(db.Model):  # type: ignore[name-defined,misc]
    """One row per side effect."""

    __tablename__ = "read_only_entries"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    tag: orm.Mapped[str] = orm.mapped_column(db.String(100))
    method: orm.Mapped[str] = orm.mapped_column(db.String(10))


def _write(tag: str | None) -> tuple[dict[str, t.Any], int]:
    from flask import request

    entry = Entry(tag=tag or request.headers.get("X-Tag", "none"), method=request.method)
    db.session.add(entry)
    db.session.flush()
    return {"id": entry.id}, 201


def create_app(url: str, engine_options: dict[str, t.Any] | None = None) -> Flask:
    app = Flask(__name__)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=url,
        SQLALCHEMY_ENGINE_OPTIONS={"pool_pre_ping": True, **(engine_options or {})},
        IDEMPOTENCY_SCOPE=lambda: "tenant",
        IDEMPOTENCY_READY_TIMEOUT=10,  # a loaded machine; "read-only" is answered at once
    )
    db.init_app(app)
    idem.init_app(app, db)
    app.add_url_rule("/readyz", view_func=idem.readiness_view)

    # Every unsafe method is protected; GET runs as a request without a key, still
    # under the decorator (a write there meets the read-only database too).
    @app.route("/pay", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    @idem.idempotent()
    def pay() -> tuple[dict[str, t.Any], int]:
        return _write(idem.key)

    @app.post("/leased")
    @idem.idempotent(lease=dt.timedelta(seconds=30))
    def leased() -> tuple[dict[str, t.Any], int]:
        return _write(idem.key)

    @app.post("/optimistic")
    @idem.idempotent(optimistic=True)
    def optimistic() -> tuple[dict[str, t.Any], int]:
        return _write(idem.key)

    return app


def counts(url: str) -> tuple[int, int]:
    """(business rows, records), read on a connection of its own."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            entries = conn.execute(sa.select(sa.func.count()).select_from(Entry)).scalar_one()
            table = db.metadata.tables["idempotency_keys"]
            records = conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()
            return int(entries), int(records)
    finally:
        engine.dispose()


def dispose(app: Flask) -> None:
    with app.app_context():
        db.engine.dispose()


def assert_read_only_503(response: t.Any) -> None:
    assert response.status_code == 503, response.data[:500]
    assert response.content_type == PROBLEM_JSON  # never Flask's text/html 500
    assert int(response.headers["Retry-After"]) >= 1
    problem = response.get_json()
    assert problem["type"].endswith("/database-unavailable")
    assert "read-only" in problem["detail"]


def assert_not_ready(app: Flask, reason: str) -> dict[str, t.Any]:
    response = app.test_client().get("/readyz")
    assert response.status_code == 503, response.data
    assert response.content_type == PROBLEM_JSON
    assert response.headers["Cache-Control"] == "no-store"
    assert int(response.headers["Retry-After"]) >= 1
    problem = t.cast(dict[str, t.Any], response.get_json())
    assert problem["ready"] is False
    assert problem["database"] == "read_only"
    assert reason in problem["reason"]
    return problem


def wait_ready(app: Flask, within: float = 30) -> None:
    deadline = time.monotonic() + within
    while app.test_client().get("/readyz").status_code != 200:
        if time.monotonic() > deadline:
            raise AssertionError(f"not ready within {within} s")
        time.sleep(0.2)


def post(app: Flask, path: str, key: str | None, method: str = "POST") -> t.Any:
    headers = {"Idempotency-Key": key} if key else {"X-Tag": "no-key"}
    return app.test_client().open(path, method=method, json={"amount": 1}, headers=headers)


def assert_every_route_refused(app: Flask, url: str, before: tuple[int, int]) -> None:
    """Every way into the decorated views answers the read-only 503 and adds nothing."""
    for path, method, key in [
        ("/pay", "POST", str(uuid.uuid4())),
        ("/pay", "PATCH", str(uuid.uuid4())),
        ("/pay", "PUT", str(uuid.uuid4())),
        ("/pay", "DELETE", str(uuid.uuid4())),
        ("/pay", "POST", None),  # a request without a key
        ("/pay", "GET", None),
        ("/leased", "POST", str(uuid.uuid4())),  # the claim commits first: refused there
        ("/optimistic", "POST", str(uuid.uuid4())),
    ]:
        assert_read_only_503(post(app, path, key, method))
    assert counts(url) == before


# -- read-only sessions on the shared servers, every engine and driver ----------------------


def _with_options(url: str, extra: str) -> str:
    """``url`` with ``-c`` options added to the libpq ``options`` it has (a search_path)."""
    made = sa.make_url(url)
    given = made.query.get("options", "")
    options = f"{given if isinstance(given, str) else ' '.join(given)} {extra}".strip()
    return made.update_query_dict({"options": options}).render_as_string(hide_password=False)


Target = tuple[str, str, dict[str, t.Any]]  # writable URL, read-only URL, engine options


@pytest.fixture(params=["psycopg2", "psycopg", "sqlite", "mysql"])
def read_only_target(
    request: pytest.FixtureRequest, tmp_path: Path, pooled_role: t.Callable[..., str]
) -> Target:
    """A writable URL, and a read-only way into the same database."""
    if request.param in ("psycopg2", "psycopg"):
        url = sa.make_url(postgres_url()).set(drivername=f"postgresql+{request.param}")
        writable = url.render_as_string(hide_password=False)
        if pgbouncer.is_pooled(writable):  # a read-only role's sessions
            return writable, pooled_role(writable, default_transaction_read_only="on"), {}
        return writable, _with_options(writable, "-c default_transaction_read_only=on"), {}
    if request.param == "mysql":
        found = mysql_url()
        if found is None:
            pytest.skip("no MariaDB/MySQL reachable (see the report header)")
        return found, found, {"connect_args": {"init_command": "SET SESSION TRANSACTION READ ONLY"}}
    path = tmp_path / "read-only.sqlite3"
    return f"sqlite:///{path}", f"sqlite:///file:{path}?mode=ro&uri=true", {}


def test_read_only_database_answers_503_and_is_not_ready(read_only_target: Target) -> None:
    writable_url, read_only_url, options = read_only_target
    writable = create_app(writable_url)
    recreate_tables(db.metadata, writable_url)
    done = str(uuid.uuid4())
    try:
        assert post(writable, "/pay", done).status_code == 201
        assert writable.test_client().get("/readyz").status_code == 200
        before = counts(writable_url)
        assert before == (1, 1)

        read_only = create_app(read_only_url, options)
        try:
            assert_every_route_refused(read_only, writable_url, before)
            # The retry of a completed request waits for writes too (the claim is
            # the first statement): 503, then its replay once writes are back.
            assert_read_only_503(post(read_only, "/pay", done))
            assert_not_ready(read_only, "read-only")
        finally:
            dispose(read_only)

        # Writes are back: the refused keys run once, the completed one replays.
        replay = post(writable, "/pay", done)
        assert replay.status_code == 201
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert post(writable, "/pay", "after").status_code == 201
        assert counts(writable_url) == (2, 2)
    finally:
        dispose(writable)
        recreate_tables(db.metadata, writable_url)


# -- a PostgreSQL standby, then a failover ---------------------------------------------------


@pytest.fixture(scope="module")
def primary() -> t.Iterator[PgCluster]:
    cluster = PgCluster.create().start()
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_standby_is_not_ready_until_promoted(primary: PgCluster, driver: str) -> None:
    """A replica after a failover (the app still pointing at a standby): 503 and not
    ready, with the reason; promoted, it serves the refused keys once."""
    recreate_tables(db.metadata, primary.url(driver))
    seeded = create_app(primary.url(driver))
    try:
        assert post(seeded, "/pay", "seed").status_code == 201
    finally:
        dispose(seeded)
    standby = primary.standby().start(hot_standby="on")
    try:
        app = create_app(standby.url(driver))
        try:
            assert_every_route_refused(app, standby.url(driver), (1, 1))
            assert_not_ready(app, "standby")
            refused = str(uuid.uuid4())
            assert_read_only_503(post(app, "/pay", refused))

            standby.promote()  # the failover
            wait_ready(app)
            assert post(app, "/pay", refused).status_code == 201
            replay = post(app, "/pay", refused)
            assert replay.headers["Idempotent-Replayed"] == "true"
            assert counts(standby.url(driver)) == (2, 2)
        finally:
            dispose(app)
    finally:
        standby.stop()


# -- MariaDB: read_only and innodb_read_only, on a server of the test's own -------------------


@pytest.fixture(scope="module")
def private_mariadb() -> t.Iterator[PrivateMariaDB]:
    if mariadb_binaries() is None:
        pytest.skip("mariadbd is not installed: MariaDB's read_only needs a server of our own")
    server = PrivateMariaDB().start()
    server.execute(
        "DELETE FROM mysql.global_priv WHERE User = ''",  # anonymous users shadow ours
        "FLUSH PRIVILEGES",
        "CREATE DATABASE shop",
        "CREATE USER app@'localhost', app@'127.0.0.1'",
        "GRANT ALL ON shop.* TO app@'localhost'",
        "GRANT ALL ON shop.* TO app@'127.0.0.1'",
    )
    yield server
    server.stop()


def test_mariadb_read_only_server(private_mariadb: PrivateMariaDB) -> None:
    """``read_only``: an ordinary user's claims are refused and readiness fails; a
    user the server lets write anyway (root: READ_ONLY ADMIN) is ready and served,
    since readiness asks the server, not the setting."""
    server = private_mariadb
    user_url, root_url = server.url("shop", user="app"), server.url("shop")
    recreate_tables(db.metadata, root_url)
    user_app, root_app = create_app(user_url), create_app(root_url)
    try:
        assert post(user_app, "/pay", "before").status_code == 201
        server.execute("SET GLOBAL read_only = 1")
        try:
            assert_every_route_refused(user_app, root_url, (1, 1))
            assert_not_ready(user_app, "read_only")
            assert root_app.test_client().get("/readyz").status_code == 200
            assert post(root_app, "/pay", "admin").status_code == 201
        finally:
            server.execute("SET GLOBAL read_only = 0")
        wait_ready(user_app)
        assert post(user_app, "/pay", "after").status_code == 201
        assert counts(root_url) == (3, 3)
    finally:
        dispose(user_app)
        dispose(root_app)


def test_mariadb_innodb_read_only(private_mariadb: PrivateMariaDB) -> None:
    """``innodb_read_only`` (a server started read-only, as for a snapshot): MariaDB
    10.11 refuses with 1036 "Table is read only", for every user."""
    server = private_mariadb
    root_url = server.url("shop")
    recreate_tables(db.metadata, root_url)
    app = create_app(root_url)
    try:
        assert post(app, "/pay", "before").status_code == 201
        server.restart("--innodb-read-only")
        try:
            assert_every_route_refused(app, root_url, (1, 1))
            assert_not_ready(app, "innodb_read_only")
        finally:
            server.restart()
        wait_ready(app)
        assert post(app, "/pay", "after").status_code == 201
        assert counts(root_url) == (2, 2)
    finally:
        dispose(app)


def test_write_check_passes_sql_safe_updates() -> None:
    """MySQL's safe-update mode refuses a DELETE whose WHERE names no key column;
    readiness's no-row write names one, so a writable server stays ready."""
    url = mysql_url()
    if url is None:
        pytest.skip("no MariaDB/MySQL reachable (see the report header)")
    recreate_tables(db.metadata, url)
    app = create_app(url, {"connect_args": {"init_command": "SET SESSION sql_safe_updates = 1"}})
    try:
        response = app.test_client().get("/readyz")
        assert response.status_code == 200, response.data
        assert post(app, "/pay", "safe").status_code == 201
        assert counts(url) == (1, 1)
    finally:
        dispose(app)
        recreate_tables(db.metadata, url)


def test_a_user_without_delete_is_ready_as_its_claims_work() -> None:
    """A claim needs SELECT, INSERT and UPDATE (cleanup may run as another
    role). Before, the write check was a DELETE: such a user's claims and replays
    worked while readiness answered 503 for ever."""
    url = mysql_url()
    if url is None:
        pytest.skip("no MariaDB/MySQL reachable (see the report header)")
    root = sa.make_url(url)
    user = f"nodel_{uuid.uuid4().hex[:8]}"
    app = create_app(root.set(username=user, password=None).render_as_string(False))
    recreate_tables(db.metadata, url)  # init_app put the record's table on the metadata
    admin = sa.create_engine(root)
    try:
        with admin.begin() as conn:
            conn.execute(sa.text(f"CREATE USER '{user}'@'%'"))
            conn.execute(
                sa.text(f"GRANT SELECT, INSERT, UPDATE ON `{root.database}`.* TO '{user}'@'%'")
            )
        try:
            first, retry = post(app, "/pay", "nodel"), post(app, "/pay", "nodel")
            assert first.status_code == 201, first.data
            assert retry.headers["Idempotent-Replayed"] == "true"
            response = app.test_client().get("/readyz")
            assert response.status_code == 200, response.data
            assert counts(url) == (1, 1)
        finally:
            dispose(app)
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f"DROP USER IF EXISTS '{user}'@'%'"))
        admin.dispose()
        recreate_tables(db.metadata, url)


@contextlib.contextmanager
def pg_role(url: str, prefix: str, *grants: str) -> t.Iterator[Flask]:
    """The test app connecting to the suite's PostgreSQL as a role of its own,
    allowed the schema and given ``grants`` (statements naming ``{role}``);
    dropped after, the tables made again."""
    role = f"{prefix}_{uuid.uuid4().hex[:8]}"
    app = create_app(sa.make_url(url).set(username=role).render_as_string(False))
    recreate_tables(db.metadata, url)
    admin = sa.create_engine(url)
    try:
        with admin.begin() as conn:
            schema = conn.execute(sa.text("SELECT current_schema()")).scalar_one()
            conn.execute(sa.text(f"CREATE ROLE {role} LOGIN"))
            conn.execute(sa.text(f'GRANT USAGE ON SCHEMA "{schema}" TO {role}'))
            for grant in grants:
                conn.execute(sa.text(grant.format(role=role, schema=schema)))
        try:
            yield app
        finally:
            dispose(app)
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f"DROP OWNED BY {role}"))
            conn.execute(sa.text(f"DROP ROLE IF EXISTS {role}"))
        admin.dispose()
        recreate_tables(db.metadata, url)


SEQUENCES = 'GRANT USAGE ON ALL SEQUENCES IN SCHEMA "{schema}" TO {role}'


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_a_role_that_may_not_insert_answers_503_and_is_not_ready(driver: str) -> None:
    """PostgreSQL's insufficient_privilege (42501) on the claim. Before: an HTML
    500 from the claim, while readiness answered 200 (it checked read-only only)."""
    url = postgres_url(driver)
    grant = 'GRANT SELECT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "{schema}" TO {role}'
    with pg_role(url, "noins", grant) as app:
        response = post(app, "/pay", "noins")
        assert response.status_code == 503, response.data
        assert response.content_type == PROBLEM_JSON
        assert "Retry-After" in response.headers
        ready = app.test_client().get("/readyz")
        assert ready.status_code == 503
        assert ready.content_type == PROBLEM_JSON
        assert ready.get_json()["database"] == "forbidden"
        assert counts(url) == (0, 0)


@pytest.mark.parametrize("grants", ["columns", "view-table-refused"])
def test_privileges_on_postgres_decide_as_a_claim_would(grants: str) -> None:
    """``columns``: INSERT and UPDATE granted column by column on the record's
    table serve claims, so readiness says ready. ``view-table-refused``: the
    view's own table refuses the role's INSERT (42501): that is the app's error,
    permanent, answered as the app answers errors (500), never as an outage
    (503) that clients and the extension's own client would retry for ever."""
    url = postgres_url("psycopg")
    columns = ", ".join(f'"{column.name}"' for column in record_table(db.metadata).c)
    if grants == "columns":
        granted = (
            "GRANT SELECT, DELETE ON idempotency_keys TO {role}",
            f"GRANT INSERT ({columns}), UPDATE ({columns}) ON idempotency_keys TO {{role}}",
            "GRANT ALL ON read_only_entries TO {role}",
        )
    else:
        granted = (
            "GRANT ALL ON idempotency_keys TO {role}",
            "GRANT SELECT ON read_only_entries TO {role}",
        )
    with pg_role(url, "cols", SEQUENCES, *granted) as app:
        ready = app.test_client().get("/readyz")
        assert ready.status_code == 200, ready.data
        response = post(app, "/pay", "grants")
        if grants == "columns":
            assert response.status_code == 201, response.data
            assert counts(url) == (1, 1)
        else:
            assert response.status_code == 500, response.data
            assert counts(url) == (0, 0)  # released: the key runs again once granted


@pytest.mark.parametrize("route", ["/pay", "/leased"])
def test_a_role_that_may_not_update_the_records_answers_503(route: str) -> None:
    """INSERT granted on the record's table, UPDATE not: the claim goes in, then
    the completion (or the lease renewal at the view's commit) is refused.
    This host cannot serve a claim: 503 problem+json (it was an HTML 500), as
    readiness says (forbidden), and nothing stays."""
    url = postgres_url("psycopg2")
    granted = (
        "GRANT SELECT, INSERT, DELETE ON idempotency_keys TO {role}",
        "GRANT ALL ON read_only_entries TO {role}",
    )
    with pg_role(url, "noupd", SEQUENCES, *granted) as app:
        response = post(app, route, "noupd")
        assert response.status_code == 503, response.data
        assert response.content_type == PROBLEM_JSON
        assert app.test_client().get("/readyz").get_json()["database"] == "forbidden"
        entries, records = counts(url)
        assert entries == 0
        assert records <= 1  # a leased claim, committed first, waits for its lease


# -- the jobs on a read-only database ---------------------------------------------------------


def test_jobs_on_a_read_only_database_say_so_in_one_line(
    read_only_target: Target, caplog: pytest.LogCaptureFixture
) -> None:
    """A scheduler on a read-only database (a standby after a failover) skips each
    tick with one warning saying read-only and why, instead of a traceback per
    tick (the job lock is a write), and runs again once writes return."""
    import logging

    from flask_idempotency._maintenance.jobs import purge_expired
    from flask_idempotency._maintenance.scheduler import JobScheduler

    writable_url, read_only_url, options = read_only_target
    app = create_app(read_only_url, options)
    writable = create_app(writable_url)
    recreate_tables(db.metadata, writable_url)  # after init_app: it adds the job lock table
    try:
        scheduler = JobScheduler(app)
        with caplog.at_level(logging.WARNING, logger="flask_idempotency"):
            ran = scheduler.run_job("cleanup", lambda a, keep_going: purge_expired(a))
        assert ran is False
        mine = [r for r in caplog.records if r.name == "flask_idempotency"]
        assert [r.levelno for r in mine] == [logging.WARNING]
        assert "job cleanup not run: database read-only" in mine[0].getMessage()
        assert mine[0].exc_info is None
        assert JobScheduler(writable).run_job("cleanup", lambda a, k: purge_expired(a)) is True
    finally:
        dispose(app)
        dispose(writable)
