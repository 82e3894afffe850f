"""The command line for operators and cron: exit codes, one-line problems, a line per run.

``flask idempotency ...`` exits 0 when done, 1 when not all was done, 2 on a
usage error, 69 when the database failed (unreachable, read-only, refused),
75 when the relay could not reach the broker and 78 when the app is
misconfigured (README, "Command line"). Each problem is one line on stderr,
never a traceback. The in-process runner (``app.test_cli_runner()``) covers
every command on every engine; the codes cron sees are checked again in real
``flask`` processes, and the per-run lines of the long-running commands there
too. Side effects are read from the database: a refused command changed
nothing, a relay run marked what it published and nothing else.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import typing as t
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import Result
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_idempotency._cli import (
    EXIT_BROKER,
    EXIT_CONFIG,
    EXIT_DATABASE,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
)
from flask_idempotency._messaging.outbox import add_event
from flask_idempotency._storage import text_param
from flask_idempotency._storage.schema import outbox_table
from flask_idempotency.cli import idempotency_cli
from flask_idempotency.publishers import CallablePublisher, KombuPublisher
from tests.support import outbox_app, pgbouncer
from tests.support.live import ROOT
from tests.support.tables import recreate_tables
from tests.support.tcp_proxy import TcpProxy, upstream_of


def reset(url: str) -> None:
    """Empty tables of the outbox test app (its own, and the extension's, which
    ``init_app`` puts on its metadata)."""
    outbox_app.create_app(url)
    recreate_tables(outbox_app.db.metadata, url, ())


def drop_all(url: str) -> None:
    engine = sa.create_engine(url)
    try:
        outbox_app.db.metadata.drop_all(engine)
    finally:
        engine.dispose()


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def dead_broker() -> KombuPublisher:
    """A broker that refuses connections: nothing listens on the port."""
    return KombuPublisher(f"amqp://guest:guest@127.0.0.1:{closed_port()}//", timeout=3)


def seed(app: Flask, *, events: int = 0, expired: int = 0, parked: int = 0) -> None:
    """Outbox events (pending, or parked) and expired completed records."""
    with app.app_context():
        session = outbox_app.db.session
        for i in range(events + parked):
            add_event(session, "t", {"n": i}, event_id=f"e{i}")
        session.commit()
        state = app.extensions["idempotency"]
        table = outbox_table(outbox_app.db.metadata)
        now = dt.datetime.now(dt.timezone.utc)
        with outbox_app.db.engine.begin() as conn:
            if parked:
                ids = list(conn.execute(sa.select(table.c.id).order_by(table.c.id)).scalars())
                conn.execute(
                    sa.update(table)
                    .where(table.c.id.in_(ids[events:]))
                    .values(failed_at=now, attempts=10)
                )
            for i in range(expired):
                insert_record(
                    conn,
                    state.store.table,
                    key=f"old-{i}",
                    status="completed",
                    response_code=201,
                    response_body=b"{}",
                    created_at=now - dt.timedelta(days=2),
                    expires_at=now - dt.timedelta(hours=1),
                )


def insert_record(conn: sa.Connection, table: sa.Table, **values: t.Any) -> None:
    """One idempotency record in scope "s" (scope and key bound as the store
    binds them: MySQL's columns are VARBINARY)."""
    row = {"scope": "s", "request_hash": "h", "fencing_token": 1, "body_omitted": False}
    stmt = sa.insert(table).values(scope=text_param("scope"), key=text_param("key"))
    conn.execute(stmt, [{**row, **values}])


def outbox_rows(url: str) -> list[dict[str, t.Any]]:
    engine = sa.create_engine(url)
    table = outbox_table(outbox_app.db.metadata)
    try:
        with engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(sa.select(table).order_by(table.c.id))]
    finally:
        engine.dispose()


def record_count(url: str) -> int:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM idempotency_keys")).scalar_one())
    finally:
        engine.dispose()


def invoke(app: Flask, *args: str, input: str | None = None) -> Result:
    return app.test_cli_runner().invoke(args=["idempotency", *args], input=input)


def assert_one_line_error(result: Result, code: int, *phrases: str) -> str:
    """Exit ``code``, the problem in one ``Error:`` line, no exception escaped."""
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.stderr
    for phrase in phrases:
        assert phrase in errors[0], errors[0]
    return errors[0]


@pytest.fixture
def make_app(database_url: str) -> t.Iterator[t.Callable[..., Flask]]:
    made: list[Flask] = []

    def make(**config: t.Any) -> Flask:
        app = outbox_app.create_app(database_url, **config)
        made.append(app)
        return app

    reset(database_url)
    yield make
    for app in made:
        with app.app_context():
            outbox_app.db.engine.dispose()


# -- relay --once: success, broker unavailable, misconfigured ----------------------------


def test_relay_once_publishes_everything_and_exits_0(
    make_app: t.Callable[..., Flask], database_url: str
) -> None:
    got: list[str] = []
    app = make_app(IDEMPOTENCY_PUBLISHER=CallablePublisher(lambda ev: got.append(ev.event_id)))
    seed(app, events=3)
    result = invoke(app, "relay", "--once")
    assert result.exit_code == EXIT_OK, result.output
    assert result.stdout == "outbox relay: published 3\n"
    assert got == ["e0", "e1", "e2"]
    assert all(r["published_at"] is not None for r in outbox_rows(database_url))


def test_relay_once_without_a_publisher_is_misconfigured(
    make_app: t.Callable[..., Flask], database_url: str
) -> None:
    """Before: a RuntimeError's traceback, exit 1."""
    app = make_app()
    seed(app, events=1)
    assert_one_line_error(invoke(app, "relay", "--once"), EXIT_CONFIG, "IDEMPOTENCY_PUBLISHER")
    assert [r["published_at"] for r in outbox_rows(database_url)] == [None]


@pytest.mark.parametrize(
    "publisher",
    [
        "no.such.module:publisher",
        "tests.support.outbox_app",  # no attribute named
        "tests.support.outbox_app:nothing_here",
        "tests.support.outbox_app:FilePublisher",  # a class that needs a path
        "tests.support.outbox_app:Order",  # a class without publish()
    ],
)
def test_relay_once_with_an_unusable_publisher_is_misconfigured(
    make_app: t.Callable[..., Flask], publisher: str
) -> None:
    app = make_app(IDEMPOTENCY_PUBLISHER=publisher)
    seed(app, events=1)
    assert_one_line_error(
        invoke(app, "relay", "--once"), EXIT_CONFIG, "IDEMPOTENCY_PUBLISHER is unusable"
    )


def test_relay_once_with_the_broker_down_exits_75_and_the_events_stay_pending(
    make_app: t.Callable[..., Flask], database_url: str
) -> None:
    """Before: ``published 0`` and exit 0, so cron never saw the outage."""
    publisher = dead_broker()
    app = make_app(IDEMPOTENCY_PUBLISHER=publisher)
    seed(app, events=3)
    result = invoke(app, "relay", "--once")
    publisher.close()
    assert_one_line_error(result, EXIT_BROKER, "broker is unavailable", "published 0")
    events = outbox_rows(database_url)
    assert [r["published_at"] for r in events] == [None, None, None]
    assert [r["failed_at"] for r in events] == [None, None, None]  # never parked for it
    # One try per run, not one per event; an outage is not the event's failure,
    # so it counts no attempt (toward parking), but the event says what happened.
    assert [r["attempts"] for r in events] == [0, 0, 0]
    assert events[0]["last_error"] is not None
    assert [r["last_error"] for r in events[1:]] == [None, None]


def refused_broker() -> t.Any:
    """A publisher factory that connects when called, to a broker that refuses."""
    socket.create_connection(("127.0.0.1", closed_port()), timeout=3)


@pytest.mark.parametrize("command", ["relay --once", "scheduler"])
def test_a_publisher_that_cannot_be_made_without_the_broker_exits_75(
    make_app: t.Callable[..., Flask], command: str
) -> None:
    app = make_app(IDEMPOTENCY_PUBLISHER="tests.unit.test_cli_ops:refused_broker")
    assert_one_line_error(
        invoke(app, *COMMANDS[command]), EXIT_BROKER, "broker is unavailable", "refused"
    )


def test_relay_once_with_a_refused_event_exits_1_and_publishes_the_rest(
    make_app: t.Callable[..., Flask], database_url: str
) -> None:
    def publish(event: t.Any) -> None:
        if event.event_id == "e1":
            raise ValueError("refused by the broker")

    app = make_app(IDEMPOTENCY_PUBLISHER=CallablePublisher(publish))
    seed(app, events=3)
    result = invoke(app, "relay", "--once")
    assert_one_line_error(result, EXIT_FAILED, "published 2", "1 failed")
    published = [r["published_at"] is not None for r in outbox_rows(database_url)]
    assert published == [True, False, True]


# -- configuration -----------------------------------------------------------------------


def test_a_command_on_an_app_without_the_extension_is_misconfigured(tmp_path: Path) -> None:
    app = Flask("bare")
    app.config["SQLALCHEMY_DATABASE_URI"] = f"sqlite:///{tmp_path / 'bare.db'}"
    SQLAlchemy().init_app(app)
    app.cli.add_command(idempotency_cli)
    for command in (["purge"], ["stats"], ["relay", "--once"], ["scheduler"]):
        assert_one_line_error(invoke(app, *command), EXIT_CONFIG, "init_app")


def test_an_app_that_never_called_init_app_has_no_such_command(tmp_path: Path) -> None:
    """The group comes with init_app: without it, ``flask idempotency`` is
    click's usage error (exit 2), as the README's exit codes say, not 78."""
    (tmp_path / "bare.py").write_text("from flask import Flask\n\napp = Flask(__name__)\n")
    done = subprocess.run(
        [sys.executable, "-m", "flask", "--app", "bare", "idempotency", "stats"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == EXIT_USAGE, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == "Error: No such command 'idempotency'."
    documented = (ROOT / "docs" / "operations.md").read_text()
    assert "| 2 | usage error: a bad option or argument; also `No such command 'idempotency'`" in (
        documented
    )


COMMANDS: dict[str, tuple[str, ...]] = {
    "create-tables": ("create-tables",),
    "purge": ("purge",),
    "purge --dry-run": ("purge", "--dry-run"),
    "stats": ("stats",),
    "show": ("show", "s", "k"),
    "list": ("list",),
    "release": ("release", "s", "old-0", "--yes"),
    "recover": ("recover",),
    "relay --once": ("relay", "--once"),
    "relay": ("relay",),
    "scheduler": ("scheduler",),
    "outbox-retry": ("outbox-retry",),
    "outbox-purge": ("outbox-purge",),
}
#: What each command needs that a fresh database lacks.
NEEDS_TABLES = [name for name in COMMANDS if name != "create-tables"]


@pytest.mark.parametrize("command", NEEDS_TABLES)
def test_a_missing_table_is_misconfigured_and_says_what_to_run(
    make_app: t.Callable[..., Flask], database_url: str, command: str
) -> None:
    """Before: the database's "no such table" as a traceback (exit 1)."""
    app = make_app(IDEMPOTENCY_PUBLISHER=CallablePublisher(lambda ev: None))
    drop_all(database_url)
    assert_one_line_error(invoke(app, *COMMANDS[command]), EXIT_CONFIG, "create-tables")


# -- option values out of range: a usage error, never a traceback -------------------------

#: Values click's declared ranges let through before, which crashed the command
#: (timedelta overflow, NaN, an int past SQL's BIGINT or SQLite's INTEGER, an
#: Event.wait past its limit) with a traceback and exit 1, or exit 69.
OUT_OF_RANGE = [
    ("outbox-purge", "--older-than", "1e9"),
    ("outbox-purge", "--older-than", "nan"),
    ("outbox-purge", "--older-than", "inf"),
    ("outbox-purge", "--older-than", "-1"),
    ("recover", "--limit", "99999999999999999999"),
    ("recover", "--limit", "0"),
    ("relay --once", "--batch", "99999999999999999999"),
    ("relay", "--poll", "inf"),
    ("relay", "--poll", "1e308"),
    ("relay", "--poll", "nan"),
    ("purge", "--batch-size", "99999999999999999999"),
    ("purge", "--pause", "nan"),
    ("purge", "--pause", "inf"),
    ("purge", "--pause", "-1"),
    ("list", "--limit", "99999999999999999999"),
    ("list", "--scope-prefix", "a\x00b"),
]


@pytest.mark.parametrize(("command", "option", "value"), OUT_OF_RANGE)
def test_an_option_value_out_of_range_is_a_usage_error_in_one_line(
    tmp_path: Path, command: str, option: str, value: str
) -> None:
    url = f"sqlite:///{tmp_path / 'values.sqlite3'}"
    reset(url)
    app = outbox_app.create_app(url, IDEMPOTENCY_PUBLISHER=CallablePublisher(lambda ev: None))
    seed(app, events=1)  # pending: a relay run by mistake would publish it
    try:
        result = invoke(app, *command.split(), option, value)
        assert_one_line_error(result, EXIT_USAGE, option)
        assert [row["published_at"] for row in outbox_rows(url)] == [None]  # nothing ran
    finally:
        with app.app_context():
            outbox_app.db.engine.dispose()


@pytest.mark.parametrize(
    ("command", "option", "value"),
    [
        ("outbox-purge", "--older-than", "876000"),  # 100 years
        ("recover", "--limit", "100000"),
        ("relay --once", "--batch", "10000"),
    ],
)
def test_the_largest_option_values_run(
    tmp_path: Path, command: str, option: str, value: str
) -> None:
    url = f"sqlite:///{tmp_path / 'values.sqlite3'}"
    reset(url)
    app = outbox_app.create_app(url, IDEMPOTENCY_PUBLISHER=CallablePublisher(lambda ev: None))
    try:
        result = invoke(app, *command.split(), option, value)
        assert result.exit_code == EXIT_OK, (result.output, result.exception)
    finally:
        with app.app_context():
            outbox_app.db.engine.dispose()


# -- a database that is down or read-only ----------------------------------------------------


def unreachable_url(database_url: str, tmp_path: Path) -> str:
    """The same kind of database, where none answers."""
    url = sa.make_url(database_url)
    if url.get_backend_name() == "sqlite":  # a file that cannot be opened
        return f"sqlite:///{tmp_path / 'no-such-folder' / 'db.sqlite3'}"
    return (
        url.set(host="127.0.0.1", port=closed_port(), query={})
        .difference_update_query(["options", "host"])
        .render_as_string(hide_password=False)
    )


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_with_the_database_down_exits_69_in_one_line(
    database_url: str, tmp_path: Path, command: str
) -> None:
    """Before: the driver's traceback, exit 1 (``relay`` and ``scheduler``
    would start and fail on every run; now they refuse to start)."""
    app = outbox_app.create_app(
        unreachable_url(database_url, tmp_path),
        IDEMPOTENCY_PUBLISHER=CallablePublisher(lambda ev: None),
    )
    line = assert_one_line_error(
        invoke(app, *COMMANDS[command]), EXIT_DATABASE, "the database", "is unavailable"
    )
    assert "INSERT" not in line  # the driver's line, not the statement
    assert "SELECT" not in line


def read_only_app(database_url: str, tmp_path: Path, pooled_role: t.Callable[..., str]) -> Flask:
    """The app on the same database, through connections that cannot write:
    PostgreSQL ``default_transaction_read_only`` (a replica after failover
    answers the same), MariaDB/MySQL ``SET SESSION TRANSACTION READ ONLY``,
    SQLite opened ``mode=ro``."""
    url = sa.make_url(database_url)
    config: dict[str, t.Any] = {"IDEMPOTENCY_PUBLISHER": CallablePublisher(lambda ev: None)}
    backend = url.get_backend_name()
    if backend == "postgresql" and pgbouncer.is_pooled(database_url):
        # Behind the pooler: a role whose sessions are read-only.
        url = sa.make_url(pooled_role(database_url, default_transaction_read_only="on"))
    elif backend == "postgresql":
        given = url.query.get("options", "")
        options = f"{given if isinstance(given, str) else ' '.join(given)}"
        url = url.update_query_dict(
            {"options": f"{options} -c default_transaction_read_only=on".strip()}
        )
    elif backend == "mysql":
        config["SQLALCHEMY_ENGINE_OPTIONS"] = {
            "connect_args": {"init_command": "SET SESSION TRANSACTION READ ONLY"}
        }
    else:
        url = sa.make_url(f"sqlite:///file:{url.database}?mode=ro&uri=true")
    return outbox_app.create_app(url.render_as_string(hide_password=False), **config)


#: Commands that write, and what each would have changed.
WRITES = ["purge", "release", "recover", "relay --once", "outbox-retry", "outbox-purge"]
READS = ["purge --dry-run", "stats", "list", "create-tables"]


@pytest.mark.parametrize("command", WRITES + READS)
def test_a_read_only_database_fails_writes_with_69_and_serves_reads(
    make_app: t.Callable[..., Flask],
    database_url: str,
    tmp_path: Path,
    command: str,
    pooled_role: t.Callable[..., str],
) -> None:
    writer = make_app()
    seed(writer, events=1, parked=1, expired=2)
    with writer.app_context():
        outbox = outbox_table(outbox_app.db.metadata)
        with outbox_app.db.engine.begin() as conn:
            conn.execute(  # published long ago: what outbox-purge would delete
                sa.update(outbox)
                .where(outbox.c.id == sa.select(sa.func.min(outbox.c.id)).scalar_subquery())
                .values(published_at=dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc))
            )
            state = writer.extensions["idempotency"]
            insert_record(  # an abandoned operation: what recover would release
                conn,
                state.store.table,
                key="stuck",
                status="in_progress",
                fencing_token=7,
                locked_until=dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc),
                created_at=dt.datetime.now(dt.timezone.utc),
                expires_at=dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=1),
            )
        outbox_app.db.engine.dispose()
    before = (outbox_rows(database_url), record_count(database_url))
    app = read_only_app(database_url, tmp_path, pooled_role)
    try:
        result = invoke(app, *COMMANDS[command])
    finally:
        with app.app_context():
            outbox_app.db.engine.dispose()
    if command in WRITES:
        assert_one_line_error(result, EXIT_DATABASE, "the database")
    else:
        assert result.exit_code == EXIT_OK, result.output
    assert (outbox_rows(database_url), record_count(database_url)) == before


# -- verbosity ----------------------------------------------------------------------------


def test_quiet_prints_no_report_and_verbose_adds_the_traceback(
    make_app: t.Callable[..., Flask], database_url: str, tmp_path: Path
) -> None:
    app = make_app()
    seed(app, expired=2)
    quiet = invoke(app, "purge", "-q")
    assert (quiet.exit_code, quiet.output) == (EXIT_OK, "")
    assert record_count(database_url) == 0
    seed(app, expired=1)
    before_the_name = invoke(app, "-q", "purge")
    assert (before_the_name.exit_code, before_the_name.output) == (EXIT_OK, "")
    assert record_count(database_url) == 0
    down = outbox_app.create_app(unreachable_url(database_url, tmp_path))
    result = down.test_cli_runner().invoke(args=["idempotency", "-v", "purge"])
    assert result.exit_code == EXIT_DATABASE
    assert isinstance(result.exception, SystemExit)


# -- in real processes: what cron and the service manager see ----------------------------------


def flask_run(
    app: str, *args: str, env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flask", "--app", app, "idempotency", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_cron_sees(done: subprocess.CompletedProcess[str], code: int, phrase: str) -> None:
    """Exit ``code``; stderr: one ``Error:`` line saying ``phrase`` (after the
    log's one-line warnings, such as the event the broker did not take), no
    traceback."""
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    *log, line = done.stderr.splitlines()
    assert line.startswith("Error:"), line
    assert phrase in line, line
    assert all(" WARNING " in entry for entry in log), log


@pytest.mark.slow
def test_cron_sees_each_outcome_of_relay_once(pg_url: str, tmp_path: Path) -> None:
    reset(pg_url)
    app = outbox_app.create_app(pg_url)
    seed(app, events=2)
    with app.app_context():
        outbox_app.db.engine.dispose()
    out = tmp_path / "published.jsonl"
    files = {"OUTBOX_TEST_DB": pg_url, "OUTBOX_TEST_FILE": str(out)}
    broker = {
        "OUTBOX_TEST_DB": pg_url,
        "OUTBOX_BROKER_URL": f"amqp://guest:guest@127.0.0.1:{closed_port()}//",
        "OUTBOX_EXCHANGE": f"cli-{uuid.uuid4().hex[:8]}",
        "OUTBOX_QUEUE": f"cli-{uuid.uuid4().hex[:8]}",
    }
    down = flask_run("tests.support.outbox_app:broker_from_env", "relay", "--once", env=broker)
    assert_cron_sees(down, EXIT_BROKER, "broker is unavailable")
    assert [r["published_at"] for r in outbox_rows(pg_url)] == [None, None]
    bare = {"IDEMPOTENCY_TEST_APP_DB": pg_url}
    assert_cron_sees(
        flask_run("tests.support.cli_app", "relay", "--once", env=bare),
        EXIT_CONFIG,
        "IDEMPOTENCY_PUBLISHER",
    )
    fine = flask_run("tests.support.outbox_app:from_env", "relay", "--once", env=files)
    assert (fine.returncode, fine.stdout, fine.stderr) == (0, "outbox relay: published 2\n", "")
    assert [json.loads(line)["event_id"] for line in out.read_text().splitlines()] == ["e0", "e1"]
    assert all(r["published_at"] is not None for r in outbox_rows(pg_url))
    quiet = flask_run("tests.support.outbox_app:from_env", "relay", "--once", "-q", env=files)
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "", "")


@pytest.mark.slow
@pytest.mark.parametrize("command", ["purge", "recover", "relay --once", "scheduler"])
def test_cron_sees_69_when_the_database_is_down(command: str, tmp_path: Path) -> None:
    url = f"postgresql+psycopg2://postgres@127.0.0.1:{closed_port()}/nowhere"
    env = {"OUTBOX_TEST_DB": url, "OUTBOX_TEST_FILE": str(tmp_path / "out.jsonl")}
    done = flask_run("tests.support.outbox_app:from_env", *COMMANDS[command], env=env)
    assert_cron_sees(done, EXIT_DATABASE, "is unavailable")


def wait_for_listener(url: str, timeout: float = 30) -> None:
    """Until a session of the server has ``LISTEN`` as its last statement (the
    relay's wake-up connection, idle on its channel)."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            with engine.connect() as conn:
                listening = conn.execute(
                    sa.text(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE pid <> pg_backend_pid() AND query ILIKE 'LISTEN %'"
                    )
                ).scalar_one()
            if listening:
                return
            time.sleep(0.05)
    finally:
        engine.dispose()
    raise AssertionError("no session LISTENs on the server")


class Process:
    """A long-running ``flask idempotency`` command whose stderr is collected."""

    def __init__(self, app: str, *args: str, env: dict[str, str]) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "flask", "--app", app, "idempotency", *args],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stderr is not None
        for line in self.popen.stderr:
            self.lines.append(line.rstrip("\n"))

    def mark(self) -> int:
        """Where the next :meth:`wait_for` with ``after=`` starts looking."""
        return len(self.lines)

    def wait_for(self, phrase: str, timeout: float = 30, *, after: int = 0) -> str:
        """The first line from ``after`` on with ``phrase``, once it comes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines)[after:]:
                if phrase in line:
                    return line
            if self.popen.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no line with {phrase!r} in {self.lines}")

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            code = self.popen.wait(20)
        finally:
            if self.popen.poll() is None:
                self.popen.kill()
                self.popen.wait()
            self._reader.join(10)
            for stream in (self.popen.stdout, self.popen.stderr):
                if stream is not None:
                    stream.close()
        return code


@pytest.mark.slow
def test_the_scheduler_logs_a_line_per_run(pg_url: str, tmp_path: Path) -> None:
    """Before: nothing between "running" and "stopped". Now each run of each
    job is a line at INFO: what it did and how long it took."""
    reset(pg_url)
    app = outbox_app.create_app(pg_url)
    seed(app, expired=2)
    config = {"IDEMPOTENCY_PURGE_EVERY": 0.5, "IDEMPOTENCY_RECOVER_EVERY": 0.5}
    out = tmp_path / "published.jsonl"
    env = {
        "OUTBOX_TEST_DB": pg_url,
        "OUTBOX_TEST_FILE": str(out),
        "OUTBOX_TEST_CONFIG": json.dumps(config),
    }
    scheduler = Process("tests.support.outbox_app:from_env", "scheduler", env=env)
    try:
        assert "deleted 2 expired record(s)" in scheduler.wait_for("INFO job purge:")
        assert "completed 0, released 0" in scheduler.wait_for("INFO job recover:")
        seed(app, events=1)
        scheduler.wait_for("INFO job relay: published 1 event(s)")
    finally:
        code = scheduler.stop()
        with app.app_context():
            outbox_app.db.engine.dispose()
    assert code == 0
    assert record_count(pg_url) == 0
    assert [r["published_at"] is not None for r in outbox_rows(pg_url)] == [True]
    assert not any("Traceback" in line for line in scheduler.lines)
    # The jobs' own summary is not repeated beside the run's line.
    assert not any(" cleanup: " in line for line in scheduler.lines), scheduler.lines


@pytest.mark.slow
def test_the_relay_logs_its_runs_and_rides_out_a_database_outage_in_a_few_lines(
    pg_url: str, tmp_path: Path
) -> None:
    """The foreground relay through a proxy that is cut for a while: one WARNING
    when the database goes, one INFO when it is back, no traceback; then it
    publishes what was committed meanwhile."""
    reset(pg_url)
    app = outbox_app.create_app(pg_url)
    out = tmp_path / "published.jsonl"
    with TcpProxy(upstream_of(pg_url)) as proxy:
        env = {"OUTBOX_TEST_DB": proxy.url(pg_url), "OUTBOX_TEST_FILE": str(out)}
        relay = Process("tests.support.outbox_app:from_env", "relay", "--poll", "0.1", env=env)
        try:
            seed(app, events=2)
            relay.wait_for("INFO outbox relay: published 2")
            proxy.cut()
            relay.wait_for("WARNING outbox relay: the database failed")
            time.sleep(1.0)  # about ten polls while it is away
            with app.app_context():
                add_event(outbox_app.db.session, "t", {}, event_id="after-the-outage")
                outbox_app.db.session.commit()
            healed = relay.mark()
            proxy.heal()
            relay.wait_for("INFO outbox relay: working again", after=healed)
            relay.wait_for("INFO outbox relay: published 1", after=healed)
        finally:
            code = relay.stop()
            with app.app_context():
                outbox_app.db.engine.dispose()
    assert code == 0
    assert not any("Traceback" in line for line in relay.lines), relay.lines
    assert not any(line.startswith(" ") for line in relay.lines), relay.lines  # one line each
    warnings = [line for line in relay.lines if "WARNING outbox relay: the database" in line]
    assert len(warnings) == 1, relay.lines
    published = [json.loads(line)["event_id"] for line in out.read_text().splitlines()]
    assert "after-the-outage" in published


@pytest.mark.slow
def test_the_relay_makes_one_connection_attempt_per_pause_while_the_broker_is_away(
    pg_url: str, tmp_path: Path
) -> None:
    """The foreground relay, the broker down, 30 events committed by another
    process in 1.5 s (each a NOTIFY that wakes it): a run, a connection
    attempt, per pause, not per commit; once the broker is back every event
    goes out, long before the 60 s poll."""
    reset(pg_url)
    app = outbox_app.create_app(pg_url)
    out = tmp_path / "published.jsonl"
    away = Path(str(out) + ".away")
    attempts = Path(str(out) + ".attempts")
    away.touch()
    env = {"OUTBOX_TEST_DB": pg_url, "OUTBOX_TEST_FILE": str(out)}
    relay = Process("tests.support.outbox_app:from_env", "relay", "--poll", "60", env=env)
    try:
        # Listening before the commits, however slowly the process started on a
        # busy machine: a NOTIFY sent before its LISTEN wakes nothing, and the
        # test would wait for the 60 s poll.
        wait_for_listener(pg_url)
        for i in range(30):
            with app.app_context():
                add_event(outbox_app.db.session, "t", {"i": i}, event_id=f"e{i}")
                outbox_app.db.session.commit()
            time.sleep(0.05)
        relay.wait_for("outbox broker")  # the first run found it away
        tried = len(attempts.read_text().splitlines())
        assert 1 <= tried <= 2, tried  # it was one per commit
        away.unlink()
        relay.wait_for("INFO outbox relay: published 30", timeout=20)
    finally:
        relay.stop()
        with app.app_context():
            outbox_app.db.engine.dispose()
    published = [json.loads(line)["event_id"] for line in out.read_text().splitlines()]
    assert sorted(published) == sorted(f"e{i}" for i in range(30))


@pytest.mark.slow
def test_the_logging_the_app_configures_gets_the_lines(pg_url: str, tmp_path: Path) -> None:
    """An app that configured logging keeps it: the lines come through its
    handlers and format, and the CLI adds none of its own."""
    reset(pg_url)
    app = outbox_app.create_app(pg_url)
    seed(app, events=1)
    with app.app_context():
        outbox_app.db.engine.dispose()
    env = {
        "OUTBOX_TEST_DB": pg_url,
        "OUTBOX_TEST_FILE": str(tmp_path / "out.jsonl"),
        "OUTBOX_TEST_LOGGING": "APP %(levelname)s %(name)s %(message)s",
    }
    relay = Process("tests.support.outbox_app:from_env", "relay", "--poll", "0.1", env=env)
    try:
        line = relay.wait_for("outbox relay: published 1")
    finally:
        assert relay.stop() == 0
    assert line == "APP INFO flask_idempotency outbox relay: published 1"
