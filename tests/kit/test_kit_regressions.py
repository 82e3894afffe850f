"""Regressions of the testing kit's defects found by an outside review (its
reproductions, review/r00..r08, became these tests): the plugin's load cost, an
app built before the kit's config reaches it, downstream calls and writes the
kit cannot attribute, a key header of the app's own, servers and databases a
killed test run left behind, typed primary keys, Core writes, and the proxy's
port during an outage. Each runs against the real thing: a pytest subprocess,
the suite's PostgreSQL (both drivers), SQLite, a served app (tests/kit/user_app.py).
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import typing as t
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from flask_idempotency.testing import (
    Database,
    Downstream,
    Fault,
    KitConfig,
    ServedApp,
    assert_exactly_one,
)
from flask_idempotency.testing._app import load_app
from flask_idempotency.testing._control import Control, TraceEntry
from flask_idempotency.testing._database import Provisioned, sweep_stale
from flask_idempotency.testing._proxy import TcpProxy, upstream_of
from tests.conftest import postgres_url
from tests.support import pgbouncer

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.kit.user_app:create_app"


def _pytest(
    project: Path, *args: str, pythonpath: t.Sequence[Path] = ()
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "IDEMPOTENCY_KIT"))}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in [ROOT, *pythonpath])
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _entry_point_site(tmp_path: Path) -> Path:
    """A folder with a distribution's metadata holding setup.py's entry points,
    as ``pip install`` leaves them."""
    egg = tmp_path / "egg"
    egg.mkdir()
    built = subprocess.run(
        [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(egg)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stderr
    entry_points = (next(egg.glob("*.egg-info")) / "entry_points.txt").read_text()
    site = tmp_path / "site"
    dist = site / "flask_idempotency_kit_probe-0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: flask-idempotency-kit-probe\n")
    (dist / "entry_points.txt").write_text(entry_points)
    return site


# -- r00: the plugin's load cost ----------------------------------------------


def test_the_entry_point_loads_the_plugin_without_importing_the_package(tmp_path: Path) -> None:
    site = _entry_point_site(tmp_path)
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_plain.py").write_text(
        textwrap.dedent(
            """
            import sys

            def test_nothing_of_the_package_was_imported(request):
                assert request.config.pluginmanager.has_plugin("flask_idempotency_pytest")
                heavy = ("flask_idempotency", "flask", "sqlalchemy")
                assert [m for m in heavy if m in sys.modules] == []
            """
        )
    )
    # The shared venv's install may still carry the previous entry point (the
    # package's module): blocked, so that only setup.py's own is at work here.
    done = _pytest(project, "-p", "no:flask_idempotency.testing.plugin", pythonpath=[site])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


@pytest.mark.parametrize("how", ["-p", "pytest_plugins"])
def test_the_package_s_plugin_name_next_to_the_entry_point_is_one_plugin(
    tmp_path: Path, how: str
) -> None:
    site = _entry_point_site(tmp_path)
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_uses_it.py").write_text(
        "def test_downstream(downstream, request):\n"
        "    assert downstream.url.startswith('http://127.0.0.1:')\n"
        "    names = [n for n, _ in request.config.pluginmanager.list_name_plugin()]\n"
        "    assert names.count('flask_idempotency_pytest') == 1\n"
    )
    args: list[str] = []
    if how == "-p":
        args = ["-p", "flask_idempotency.testing.plugin"]
    else:
        (project / "conftest.py").write_text(
            'pytest_plugins = ["flask_idempotency.testing.plugin"]\n'
        )
    done = _pytest(project, *args, pythonpath=[site])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


def test_the_plugin_s_constants_are_the_kit_s() -> None:
    import flask_idempotency_pytest
    from flask_idempotency.testing import _config

    assert flask_idempotency_pytest.DATABASE_ENV == _config.DATABASE_ENV
    assert flask_idempotency_pytest.DEFAULT_DOWNSTREAM_CONFIG == _config.DEFAULT_DOWNSTREAM_CONFIG


# -- r01: the extension's settings of an app built without the kit's config ----


@pytest.mark.parametrize("spec", ["tests.kit.user_app:create_bare", "tests.kit.user_app:app"])
def test_extension_settings_for_an_app_built_without_them_are_refused(
    spec: str, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'kit.sqlite3'}"
    with pytest.raises(RuntimeError, match="takes a config mapping") as refused:
        load_app(spec, {"SQLALCHEMY_DATABASE_URI": url, "IDEMPOTENCY_WAIT": 1})
    assert "IDEMPOTENCY_WAIT=1" in str(refused.value)
    with pytest.raises(RuntimeError, match="IDEMPOTENCY_HEADER='Idempotency-Key'"):
        load_app(spec, {"SQLALCHEMY_DATABASE_URI": url, "IDEMPOTENCY_HEADER": "Idempotency-Key"})


def test_extension_settings_the_app_has_already_are_no_reason_to_refuse(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'kit.sqlite3'}"
    app = load_app(
        "tests.kit.user_app:create_bare",
        {"SQLALCHEMY_DATABASE_URI": url, "IDEMPOTENCY_HEADER": "X-Request-Id"},
    )
    assert app.extensions["idempotency"].settings.header == "X-Request-Id"


def test_a_factory_taking_the_config_gets_the_extension_settings(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'kit.sqlite3'}"
    app = load_app(APP, {"SQLALCHEMY_DATABASE_URI": url, "IDEMPOTENCY_WAIT": 1})
    assert app.extensions["idempotency"].settings.wait == dt.timedelta(seconds=1)


def test_the_db_fixture_refuses_before_the_test_runs(tmp_path: Path) -> None:
    from flask_idempotency.testing._plugin import database

    kit = KitConfig(
        app="tests.kit.user_app:create_bare",
        database="sqlite://",
        app_config={"IDEMPOTENCY_WAIT": 1},
    )
    with pytest.raises(RuntimeError, match="takes a config mapping"):
        next(database(kit, Control(tmp_path / "control"), tmp_path))


# -- the served user app --------------------------------------------------------


@pytest.fixture
def idempotency_config(request: pytest.FixtureRequest) -> KitConfig:
    """The user app on the suite's PostgreSQL (``psycopg2`` unless a test's
    ``driver`` parameter says otherwise), one gunicorn worker."""
    param = getattr(request, "param", "psycopg2")
    driver, extra = param if isinstance(param, tuple) else (param, {})
    database = "sqlite://" if driver == "sqlite" else postgres_url(driver)
    return KitConfig(
        app=APP,
        database=database,
        workers=1,
        threads=4,
        # Behind the suite's PgBouncer: configured as docs/poolers.md says.
        app_config={"IDEMPOTENCY_WAIT": 1, **pgbouncer.user_config(database), **extra},
    )


def _note(api: ServedApp, key: str, path: str = "/notes") -> t.Any:
    return api.post(path, json={"body": "x"}, key=key)


# -- r03: downstream calls the kit cannot attribute ------------------------------


@pytest.mark.slow
def test_downstream_calls_made_off_the_request_thread_fail_the_assertion(
    api: ServedApp, db: Database, downstream: Downstream
) -> None:
    key = str(uuid.uuid4())
    assert _note(api, key, "/notes-parallel").status_code == 201
    assert len(downstream.calls()) == 1
    assert downstream.calls()[0].origin is None  # made from a worker thread
    with pytest.raises(AssertionError) as failed:
        assert_exactly_one(db, downstream, key)
    message = str(failed.value)
    assert "the downstream received 1 call(s) without Idempotency-Kit-Origin" in message
    assert "downstream calls without an origin: /index: 1" in message
    # Told they are not this operation's: the rest holds.
    assert_exactly_one(db, downstream, key, unattributed_ok=True)


def test_a_call_the_test_made_itself_needs_the_explicit_opt_out(
    tmp_path: Path, downstream: Downstream
) -> None:
    import urllib.request

    url = f"sqlite:///{tmp_path / 'kit.sqlite3'}"
    database = Database.build(APP, url, {}, Control(tmp_path / "control"))
    try:
        with urllib.request.urlopen(
            urllib.request.Request(downstream.url + "/index", data=b"{}", method="POST"), timeout=5
        ):
            pass
        with pytest.raises(AssertionError, match="1 call\\(s\\) without Idempotency-Kit-Origin"):
            assert_exactly_one(database, downstream, "k", rows={})
    finally:
        database.close()


# -- r04: the app's own key header ----------------------------------------------


def test_the_downstream_reads_the_key_from_the_app_s_header(downstream: Downstream) -> None:
    import urllib.request

    downstream.key_header = "X-Request-Id"
    for _ in range(2):
        req = urllib.request.Request(
            downstream.url + "/index",
            data=b"{}",
            method="POST",
            headers={"X-Request-Id": '"k-1"', "Idempotency-Kit-Origin": "k-1"},
        )
        with urllib.request.urlopen(req, timeout=5):
            pass
    assert [c.key for c in downstream.calls()] == ["k-1", "k-1"]
    assert len(downstream.effects("k-1")) == 1


@pytest.mark.slow
def test_a_retry_with_the_app_s_own_key_header_is_one_downstream_effect(
    api: ServedApp, db: Database, fault: Fault, downstream: Downstream
) -> None:
    assert api.key_header == downstream.key_header == "X-Request-Id"
    key = str(uuid.uuid4())
    fault.kill_after_call()
    with pytest.raises(ConnectionError):
        _note(api, key)
    api.restart()
    assert _note(api, key).status_code == 201
    assert [c.key for c in downstream.calls()] == [key, key]
    assert db.count("SELECT count(*) FROM notes") == 1
    assert_exactly_one(db, downstream, key)


# -- r06: typed primary keys ----------------------------------------------------


@pytest.fixture(params=["psycopg2", "psycopg", "sqlite"])
def typed_db(request: pytest.FixtureRequest, tmp_path: Path) -> t.Iterator[Database]:
    admin = "sqlite://" if request.param == "sqlite" else postgres_url(request.param)
    provisioned = Provisioned(admin, tmp_path / "db")
    url = provisioned.create()
    database = Database.build(APP, url, {}, Control(tmp_path / "control"))
    try:
        yield database
    finally:
        database.close()
        provisioned.drop()


def _through_the_trace(table: str, columns: tuple[str, ...], pk: tuple[t.Any, ...]) -> TraceEntry:
    """An entry as the test process reads it back from the served process's trace."""
    line = TraceEntry("r", "k", "row", table, columns, pk, 1).as_json()
    return TraceEntry.from_json(line)


def test_rows_keyed_by_a_uuid_or_a_timestamp_are_found(typed_db: Database) -> None:
    invoice = uuid.uuid4()
    at = dt.datetime(2024, 5, 1, 9, 30, 15, 123456, tzinfo=dt.timezone.utc)
    with typed_db.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM invoices"))
        invoices = typed_db.app.extensions["sqlalchemy"].metadatas[None].tables["invoices"]
        slots = typed_db.app.extensions["sqlalchemy"].metadatas[None].tables["slots"]
        conn.execute(sa.insert(invoices).values(id=invoice, total=1))
        conn.execute(sa.insert(slots).values(at=at, room=1))
    assert typed_db.exists(_through_the_trace("invoices", ("id",), (invoice,)))
    assert not typed_db.exists(_through_the_trace("invoices", ("id",), (uuid.uuid4(),)))
    assert typed_db.exists(_through_the_trace("slots", ("at", "room"), (at, 1)))
    later = at + dt.timedelta(seconds=1)
    assert not typed_db.exists(_through_the_trace("slots", ("at", "room"), (later, 1)))


@pytest.mark.slow
@pytest.mark.parametrize("idempotency_config", ["psycopg", "sqlite"], indirect=True)
def test_a_retry_on_a_uuid_keyed_model_passes(
    api: ServedApp, db: Database, fault: Fault, downstream: Downstream
) -> None:
    key = str(uuid.uuid4())
    fault.kill_after_commit()
    with pytest.raises(ConnectionError):
        api.post("/invoices", json={"total": 10}, key=key)
    api.restart()
    retry = api.post("/invoices", json={"total": 10}, key=key)
    assert retry.status_code == 201
    assert retry.replayed
    assert db.count("SELECT count(*) FROM invoices") == 1
    assert_exactly_one(db, downstream, key)


# -- r07: a charge written with Core -------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "idempotency_config",
    [("psycopg2", {"IDEMPOTENCY_LEASE": 2}), ("sqlite", {"IDEMPOTENCY_LEASE": 2})],
    indirect=True,
    ids=["psycopg2", "sqlite"],
)
def test_a_core_charge_made_twice_fails_the_assertion(
    idempotency_config: KitConfig,
    api: ServedApp,
    db: Database,
    fault: Fault,
    downstream: Downstream,
) -> None:
    key = str(uuid.uuid4())
    fault.kill_after_commit()  # right after the view's first commit: the charge
    with pytest.raises(ConnectionError):
        api.post("/pay", json={"amount": 5}, key=key)
    api.restart()
    retry = None
    for _ in range(80):  # in progress (409) until the claim's lease ends (bounded)
        retry = api.post("/pay", json={"amount": 5}, key=key)
        if retry.status_code != 409:
            break
        time.sleep(0.25)
    assert retry is not None
    # The view had committed: the operation happened, and is not run again
    # after the lease; the failure its commit stored is the answer.
    assert retry.status_code == 500, retry
    assert retry.json()["type"].endswith("failed-after-commit")
    assert db.count("SELECT count(*) FROM charges") == 1
    assert_exactly_one(db, downstream, key)
    # An operator deletes the record (a forced release): the next retry charges
    # again, the duplicate the kit must see.
    with db.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM idempotency_keys"))
    assert api.post("/pay", json={"amount": 5}, key=key).status_code == 201
    assert db.count("SELECT count(*) FROM charges") == 2
    with pytest.raises(AssertionError) as failed:
        assert_exactly_one(db, downstream, key)
    message = str(failed.value)
    assert "the view's rows come from 2 executions (requests), not 1" in message
    assert "charges id=1" in message
    assert "charges id=2" in message


@pytest.mark.slow
def test_core_writes_of_one_execution_pass(
    api: ServedApp, db: Database, downstream: Downstream
) -> None:
    key = str(uuid.uuid4())
    assert api.post("/pay", json={"amount": 5}, key=key).status_code == 201
    assert_exactly_one(db, downstream, key)


def test_update_delete_and_sql_text_count_as_writes_of_their_request(tmp_path: Path) -> None:
    """The served process's hooks, in this process: what a keyed request commits
    through Core (no primary key to name) is a write of that request; a rolled
    back one is nothing; one outside any request while a request is in flight
    has no key."""
    from flask_idempotency.testing import _hooks

    control = Control(tmp_path / "control")
    _hooks.install(control, None)  # for good, in this process: disarmed at the end
    app = load_app(APP, {"SQLALCHEMY_DATABASE_URI": f"sqlite:///{tmp_path / 'app.sqlite3'}"})
    ext = app.extensions["sqlalchemy"]
    with app.app_context():
        ext.create_all()
    try:
        with app.test_request_context(headers={"X-Request-Id": "k1"}), app.app_context():
            with ext.engine.begin() as conn:
                conn.execute(sa.text("INSERT INTO notes (body) VALUES ('a')"))
                conn.execute(sa.text("UPDATE notes SET body = 'b'"))
            with ext.engine.connect() as conn:
                conn.execute(sa.text("DELETE FROM notes"))
                conn.rollback()
        _hooks.request_started()
        try:
            with app.app_context(), ext.engine.begin() as conn:
                conn.execute(sa.text("UPDATE notes SET body = 'c'"))
        finally:
            _hooks.request_ended()
        with app.app_context(), ext.engine.begin() as conn:  # no request in flight
            conn.execute(sa.text("UPDATE notes SET body = 'd'"))
    finally:
        _hooks._control = None  # the listeners stay, writing nowhere
        with app.app_context():
            ext.engine.dispose()
    trace = control.read_trace()
    assert [(e.key, e.kind, e.verb, e.table) for e in trace] == [
        ("k1", "write", "INSERT", "notes"),
        ("k1", "write", "UPDATE", "notes"),
        (None, "write", "UPDATE", "notes"),
    ]


@pytest.mark.slow
def test_a_write_from_a_thread_of_the_view_fails_the_assertion(
    api: ServedApp, db: Database, downstream: Downstream
) -> None:
    key = str(uuid.uuid4())
    assert api.post("/notes-thread-write", json={"body": "x"}, key=key).status_code == 201
    with pytest.raises(AssertionError) as failed:
        assert_exactly_one(db, downstream, key)
    assert "1 committed write(s) made outside any request" in str(failed.value)
    assert_exactly_one(db, downstream, key, unattributed_ok=True)


# -- r08: the proxy's port during an outage ---------------------------------------


def _connects(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return False
    return True


def test_the_port_stays_the_proxy_s_while_the_database_refuses(tmp_path: Path) -> None:
    url = postgres_url("psycopg2")
    fault = Fault(Control(tmp_path / "control"), TcpProxy(upstream_of(url)))
    assert fault.proxy is not None
    port = fault.proxy.port
    engine = sa.create_engine(fault.proxy.url(url), poolclass=sa.NullPool)
    try:
        fault.database_down(30, mode="refuse")
        assert not _connects(port)  # refused
        squatter = socket.socket()
        try:
            with pytest.raises(OSError, match="Address already in use"):
                squatter.bind(("127.0.0.1", port))
        finally:
            squatter.close()
        fault.database_up()
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT 1")).scalar() == 1
    finally:
        engine.dispose()
        fault.close()


def test_a_failed_timed_heal_is_raised_at_the_next_fault_call(tmp_path: Path) -> None:
    fault = Fault(Control(tmp_path / "control"), TcpProxy(("127.0.0.1", 9)))
    assert fault.proxy is not None
    healed = threading.Event()

    def broken_heal() -> None:
        healed.set()
        raise OSError("the port is taken")

    fault.proxy.heal = broken_heal  # type: ignore[method-assign]
    try:
        fault.database_down(0.05, mode="refuse")
        assert healed.wait(10)
        timer = fault._up_timer
        if timer is not None:
            timer.join(10)
        with pytest.raises(RuntimeError, match="could not bring the database back") as raised:
            fault.kill_after_commit()
        assert "the port is taken" in str(raised.value)
    finally:
        fault.close()


# -- r05: a test run killed before its teardown -----------------------------------


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _databases(admin: str) -> list[str]:
    engine = sa.create_engine(admin, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.text("SELECT datname FROM pg_database")).scalars())
    finally:
        engine.dispose()


HANGING_TEST = """
import json, os, time

def test_hangs(api, db, request):
    master = api._proc.pid
    info = {"master": master, "database": db.engine.url.database}
    with open(os.environ["KIT_PROBE"] + ".tmp", "w") as f:
        json.dump(info, f)
    os.rename(os.environ["KIT_PROBE"] + ".tmp", os.environ["KIT_PROBE"])
    time.sleep(120)  # a test that hangs until CI kills the run
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_test_run_leaves_no_server_and_its_database_is_swept(
    tmp_path: Path, signum: signal.Signals
) -> None:
    import json

    admin = postgres_url("psycopg2")
    project = tmp_path / "project"
    project.mkdir()
    (project / "pytest.ini").write_text(
        f"[pytest]\nidempotency_app = {APP}\nidempotency_database = {admin}\n"
        "idempotency_workers = 2\nidempotency_threads = 2\n"
    )
    (project / "test_hang.py").write_text(HANGING_TEST)
    probe = tmp_path / "probe.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "IDEMPOTENCY_KIT"))}
    env["PYTHONPATH"] = str(ROOT)
    env["KIT_PROBE"] = str(probe)
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-s"],
        cwd=project,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    master = 0
    try:
        deadline = time.monotonic() + 90
        while not probe.exists():
            assert run.poll() is None, "the hanging test run ended early"
            assert time.monotonic() < deadline, "the served app never started"
            time.sleep(0.1)
        info = json.loads(probe.read_text())
        master, database = int(info["master"]), str(info["database"])
        workers = _children(master)
        assert workers, "gunicorn has no workers"
        assert database in _databases(admin)
        assert database not in sweep_stale(admin)  # its maker lives: left alone
        assert database in _databases(admin)

        run.send_signal(signum)
        run.wait(30)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in [master, *workers]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in [master, *workers] if _alive(p)] == []
        # The next run's db fixture sweeps what the killed run left.
        assert database in sweep_stale(admin)
        assert database not in _databases(admin)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(10)
        for pid in [master, *(_children(master) if master else [])]:
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)
