"""The testing kit's parts, each against the real thing: the ``step_saved`` signal
in a real request, the fake downstream over HTTP, the client's errors, the
exactly-once assertion against a real database and its failure messages, and
the plugin's options, inertness and entry point in fresh pytest runs."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import typing as t
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idempotency import signals
from flask_idempotency.testing import (
    Database,
    Downstream,
    ServedApp,
    assert_exactly_one,
)
from flask_idempotency.testing._control import Control, TraceEntry
from flask_idempotency.testing._server import free_port
from tests.conftest import Clock, insert_records, reset_tables
from tests.support import testapp

ROOT = Path(__file__).resolve().parents[2]


def call(url: str, *, key: str | None = None, origin: str | None = None) -> tuple[int, t.Any]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    if origin is not None:
        headers["Idempotency-Kit-Origin"] = origin
    req = urllib.request.Request(url, data=b"{}", method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as error:
        with error:
            return error.code, json.load(error)


# -- the step_saved signal -----------------------------------------------------


def test_step_saved_is_sent_once_per_step_after_its_result_is_committed(
    database_url: str, clock: Clock, downstream: Downstream
) -> None:
    reset_tables(database_url)
    app = testapp.create_app(database_url, clock=clock, DOWNSTREAM_URL=downstream.url)
    seen: list[tuple[str, t.Any, str | None]] = []

    def saved(sender: Flask, **kw: t.Any) -> None:
        # Sent after the commit: a connection of its own already reads the point.
        with testapp.db.engine.connect() as conn:
            stored = conn.execute(sa.text("SELECT recovery_points FROM idempotency_keys")).scalar()
        seen.append((kw["name"], kw["result"], stored))

    signals.step_saved.connect(saved, app)
    try:
        client = app.test_client()
        first = client.post("/checkout", json={"amount": 5}, headers={"Idempotency-Key": "k1"})
        assert first.status_code == 201, first.get_data(as_text=True)
        # A replay runs no step and sends nothing.
        again = client.post("/checkout", json={"amount": 5}, headers={"Idempotency-Key": "k1"})
        assert again.headers["Idempotent-Replayed"] == "true"
    finally:
        signals.step_saved.disconnect(saved, app)
        with app.app_context():
            testapp.db.engine.dispose()
    assert [name for name, _, _ in seen] == ["charge", "email"]
    assert seen[0][1] == {"id": "effect-1", "effect": 1}
    assert seen[0][2] is not None
    assert "charge" in json.loads(seen[0][2])
    assert {"charge", "email"} <= set(json.loads(seen[1][2]))
    assert len(downstream.effects()) == 2


# -- the fake downstream -------------------------------------------------------


def test_the_downstream_counts_one_effect_per_key_and_fails_on_command(
    downstream: Downstream,
) -> None:
    url = downstream.url + "/charges"
    downstream.fail_next(1, status=503)
    assert call(url, key="a", origin="k")[0] == 503
    status, first = call(url, key="a", origin="k")
    assert status == 200
    assert call(url, key="a", origin="k") == (200, first)  # the same answer, no new effect
    assert call(url, origin="k")[0] == 200  # unkeyed: an effect of its own
    assert call(url, key="b", origin="other")[0] == 200
    assert [c.status for c in downstream.calls("/charges", origin="k")] == [503, 200, 200, 200]
    assert len(downstream.calls(key="a")) == 3
    assert [e.key for e in downstream.effects("k")] == ["a", None]
    assert [e.key for e in downstream.effects("other")] == ["b"]
    downstream.answer("/orders", {"order": 1}, status=201)
    assert call(downstream.url + "/orders", key="x") == (201, {"order": 1})


def test_a_late_answer_makes_its_effect_first(downstream: Downstream) -> None:
    downstream.answer_late(5)
    req = urllib.request.Request(downstream.url + "/charges", data=b"{}", method="POST")
    with pytest.raises(TimeoutError):
        urllib.request.urlopen(req, timeout=0.5)
    assert len(downstream.effects()) == 1  # made, though its caller gave up


def test_a_stalled_call_holds_its_effect(downstream: Downstream) -> None:
    downstream.stall_next(5)
    req = urllib.request.Request(downstream.url + "/charges", data=b"{}", method="POST")
    with pytest.raises(TimeoutError):
        urllib.request.urlopen(req, timeout=0.5)
    assert downstream.effects() == []  # still held


# -- the client ----------------------------------------------------------------


def test_a_refused_connection_is_the_builtin_connection_error(tmp_path: Path) -> None:
    served = ServedApp(app="x:y", config={}, control=Control(tmp_path), downstream=None)
    served.port = free_port()  # nothing listens there
    with pytest.raises(ConnectionError):
        served.get("/")


# -- assert_exactly_one --------------------------------------------------------


@pytest.fixture
def kit_db(database_url: str, tmp_path: Path) -> t.Iterator[Database]:
    """A Database on the test app's tables, with a trace of our own making."""
    reset_tables(database_url)
    app = testapp.create_app(database_url)
    database = Database(app, database_url, Control(tmp_path / "control"))
    yield database
    database.close()


def _ledger(db: Database, route: str) -> int:
    table = testapp.Ledger.__table__
    with db.engine.begin() as conn:
        return int(conn.execute(sa.insert(table).values(route=route)).inserted_primary_key[0])


def _complete(db: Database, key: str) -> None:
    now = dt.datetime.now(dt.timezone.utc)
    with db.engine.begin() as conn:
        insert_records(
            conn,
            [
                {
                    "scope": "s",
                    "key": key,
                    "request_hash": "h",
                    "status": "completed",
                    "fencing_token": 1,
                    "body_omitted": False,
                    "created_at": now,
                    "expires_at": now + dt.timedelta(hours=1),
                }
            ],
        )


def _trace(db: Database, request: str, key: str, pk: int) -> None:
    db._control.append_trace(
        [TraceEntry(request, key, "row", "ledger", ("id",), (pk,), os.getpid())]
    )


def test_exactly_one_passes_on_one_execution(kit_db: Database, downstream: Downstream) -> None:
    _complete(kit_db, "k1")
    _trace(kit_db, "r1", "k1", _ledger(kit_db, "one"))
    call(downstream.url + "/charges", key="d1", origin="k1")
    call(downstream.url + "/charges", key="d1", origin="k1")  # a retry: the same effect
    assert_exactly_one(kit_db, downstream, "k1")


def test_exactly_one_names_what_it_counted_when_it_fails(
    kit_db: Database, downstream: Downstream
) -> None:
    first, second = _ledger(kit_db, "one"), _ledger(kit_db, "two")
    _trace(kit_db, "r1", "k1", first)
    _trace(kit_db, "r2", "k1", second)
    _trace(kit_db, "r3", "k1", 999_999)  # rolled back: not in the database, not counted
    call(downstream.url + "/charges", key="d1", origin="k1")
    call(downstream.url + "/charges", key="d2", origin="k1")
    with pytest.raises(AssertionError) as failed:
        assert_exactly_one(kit_db, downstream, "k1")
    message = str(failed.value)
    assert "0 completed idempotency records for the key, not 1" in message
    assert "the view's rows come from 2 executions (requests), not 1" in message
    assert f"request r1: ledger id={first}" in message
    assert f"request r2: ledger id={second}" in message
    assert "999999" not in message
    assert (
        "downstream /charges: 2 effects for the key (distinct Idempotency-Key values), not 1"
        in (message)
    )


def test_exactly_one_needs_a_row(kit_db: Database) -> None:
    _complete(kit_db, "k1")
    with pytest.raises(AssertionError, match="no committed write by a request with this key"):
        assert_exactly_one(kit_db, None, "k1")


# -- the plugin in a fresh project ---------------------------------------------


def _pytest(project: Path, *args: str, pythonpath: t.Sequence[Path] = ()) -> t.Any:
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


def test_the_plugin_is_inert_for_tests_that_do_not_use_it(tmp_path: Path) -> None:
    # The app named does not exist: any import of it would fail the run.
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nidempotency_app = no_such_module:create_app\nfilterwarnings = error\n"
    )
    (tmp_path / "test_plain.py").write_text(
        "import sys\n"
        "def test_nothing_was_loaded():\n"
        "    assert 'no_such_module' not in sys.modules\n"
        "    assert 'flask_idempotency.testing._serve' not in sys.modules\n"
        "    assert 'gunicorn' not in sys.modules\n"
    )
    done = _pytest(tmp_path, "-p", "flask_idempotency.testing.plugin")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout
    helped = _pytest(tmp_path, "-p", "flask_idempotency.testing.plugin", "--help")
    for option in (
        "--idempotency-app",
        "--idempotency-database",
        "--idempotency-downstream-config",
        "idempotency_workers",
    ):
        assert option in helped.stdout


def test_the_entry_point_registers_the_plugin(tmp_path: Path) -> None:
    """setup.py's pytest11 entry point, as an installed distribution's metadata
    gives it (a dist-info folder on the path), loads the plugin with no ``-p``;
    ``-p`` with the module's name next to it does not register it twice."""
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
    info = next(egg.glob("*.egg-info"))
    entry_points = (info / "entry_points.txt").read_text()
    assert "[pytest11]" in entry_points
    assert "flask_idempotency_pytest = flask_idempotency_pytest" in entry_points
    site = tmp_path / "site"
    dist = site / "flask_idempotency_kit_probe-0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: flask-idempotency-kit-probe\n")
    (dist / "entry_points.txt").write_text(entry_points)
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_uses_it.py").write_text(
        "def test_downstream(downstream):\n    assert downstream.url.startswith('http://127.0.0.1:')\n"
    )
    done = _pytest(project, pythonpath=[site])
    assert done.returncode == 0, done.stdout + done.stderr
    twice = _pytest(project, "-p", "flask_idempotency.testing.plugin", pythonpath=[site])
    assert twice.returncode == 0, twice.stdout + twice.stderr


# -- the served app's port ---------------------------------------------------------------


def _outgoing_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except OSError:
        return 32768


def test_the_served_port_is_outside_the_range_outgoing_connections_take() -> None:
    """A port from the kernel's range for outgoing connections can be taken by any
    connection opened before the server binds it (seen: "Address already in use"
    on a busy run); the kit's ports come from below that range, and are free."""
    import socket

    from flask_idempotency.testing import _server

    low = _outgoing_low()
    if low - _server.PORTS_FROM < 1000:
        pytest.skip(f"this machine's outgoing range starts at {low}: no room below it")
    ports = [free_port() for _ in range(50)]
    assert all(_server.PORTS_FROM <= port < low for port in ports), ports
    assert len(set(ports)) > 40  # at random: concurrent runs rarely pick the same
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
            sock.listen()


def test_a_port_something_listens_on_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from flask_idempotency.testing import _server

    if _outgoing_low() - _server.PORTS_FROM < 1000:
        pytest.skip("no room below this machine's outgoing range")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        other = free_port()
        picks = iter([taken, other])
        monkeypatch.setattr(_server._pick, "randrange", lambda *_: next(picks))
        assert free_port() == other
        # Nowhere to look below the range: the kernel's pick.
        monkeypatch.setattr(_server, "_ephemeral_low", lambda: _server.PORTS_FROM + 10)
        assert free_port() != taken
