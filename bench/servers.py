"""The processes under test: gunicorn serving ``bench.app``, and PostgreSQL.

Both listen on 127.0.0.1 (or a Unix socket) only, and both are stopped by
:meth:`Gunicorn.stop` / :meth:`Postgres.stop`, which the harness calls on every
way out (normal end, failure, Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import importlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import typing as t
from pathlib import Path

import sqlalchemy as sa

from bench import procstats
from bench.app import DATABASE_ENV

ROOT = Path(__file__).resolve().parent.parent
_LISTENING = re.compile(r"Listening at: http://127\.0\.0\.1:(\d+)")


def _quiet_options() -> list[str]:
    """``--no-control-socket`` where gunicorn has a control socket (newer releases):
    its default path is one per user, shared with every other gunicorn running."""
    settings = importlib.import_module("gunicorn.config").Config().settings
    return ["--no-control-socket"] if "control_socket_disable" in settings else []


def terminate(proc: subprocess.Popen[t.Any], within: float) -> None:
    """SIGTERM to ``proc`` (a graceful stop), SIGKILL if it still runs after
    ``within`` seconds; returns once it is gone."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(within)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Gunicorn:
    """``gunicorn -w N 'bench.app:create_app()'`` (sync workers) on 127.0.0.1;
    another ``app`` (a factory call, as gunicorn spells it) and more of the
    workers' environment (``env``) where given. ``threads``: gthread workers
    with that many threads each. Started once every worker runs and ``health``
    (a path) answers 200 (``None``: an app without one)."""

    def __init__(
        self,
        database_url: str,
        workers: int = 3,
        *,
        app: str = "bench.app:create_app()",
        env: t.Mapping[str, str] | None = None,
        threads: int | None = None,
        health: str | None = "/healthz",
    ) -> None:
        self.database_url = database_url
        self.workers = workers
        self.app = app
        self.env = dict(env or {})
        self.threads, self.health = threads, health
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = Path(tempfile.mkstemp(prefix="bench-gunicorn-", suffix=".log")[1])

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def worker_pids(self) -> list[int]:
        return procstats.children_of({self.pid})

    def log_text(self) -> str:
        return self._log.read_text(errors="replace")

    def start(self, timeout: float = 60) -> Gunicorn:
        env = {
            **os.environ,
            DATABASE_ENV: self.database_url,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            **self.env,
        }
        with self._log.open("wb") as log:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gunicorn",
                    "--workers",
                    str(self.workers),
                    *(
                        ["--worker-class", "gthread", "--threads", str(self.threads)]
                        if self.threads
                        else ["--worker-class", "sync"]
                    ),
                    "--bind",
                    "127.0.0.1:0",
                    "--timeout",
                    "120",
                    "--log-level",
                    "info",
                    *_quiet_options(),
                    self.app,
                ],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited at start:\n{self.log_text()}")
            match = _LISTENING.search(self.log_text())
            if match and len(self.worker_pids()) == self.workers and self._healthy(match):
                self.port = int(match.group(1))
                return self
            if time.monotonic() > deadline:
                raise RuntimeError(f"gunicorn did not start in {timeout} s:\n{self.log_text()}")
            time.sleep(0.1)

    def _healthy(self, match: re.Match[str]) -> bool:
        if self.health is None:
            return True
        conn = http.client.HTTPConnection("127.0.0.1", int(match.group(1)), timeout=5)
        try:
            conn.request("GET", self.health)
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def stop(self) -> None:
        """SIGTERM (gunicorn's graceful stop), SIGKILL to all of it after 15 s."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        workers = procstats.children_of({proc.pid})
        terminate(proc, 15)
        for pid in workers:  # none outlives its master
            if procstats.parent_of(pid) in (proc.pid, 1):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self._log.unlink()

    def __enter__(self) -> Gunicorn:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclasses.dataclass
class Postgres:
    """The PostgreSQL the tests use: embedded (pgserver) unless
    ``IDEMPOTENCY_TEST_POSTGRES_URL`` names one (used in a schema of its own)."""

    url: str
    source: str
    version: str
    #: The postmaster, when it runs on this machine (its children are counted in CPU).
    postmaster_pid: int | None

    @classmethod
    def start(cls) -> Postgres:
        from tests import conftest

        url = conftest.postgres_url()
        engine = sa.create_engine(url)
        try:
            with engine.connect() as conn:
                version = str(conn.execute(sa.text("SHOW server_version")).scalar_one())
                backend = int(conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())
        finally:
            engine.dispose()
        server = conftest._PG.get("server")
        postmaster = None
        if server is not None:  # embedded: the first line of its data dir's postmaster.pid
            pid_file = Path(server.pgdata) / "postmaster.pid"
            postmaster = int(pid_file.read_text().splitlines()[0])
        else:  # configured: the parent of our backend, if that is a postgres on this machine
            parent = procstats.parent_of(backend)
            if parent is not None and procstats.command_of(parent).startswith("postgres"):
                postmaster = parent
        return cls(url, str(conftest._PG["source"]), version, postmaster)

    def url_for(self, driver: str) -> str:
        """:attr:`url` through ``driver``: ``"psycopg2"`` or ``"psycopg"`` (psycopg 3)."""
        from tests import conftest

        url = sa.make_url(self.url).set(drivername=conftest.PG_DRIVERS[driver])
        return url.render_as_string(hide_password=False)

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0].split()[0])


def stop_postgres() -> None:
    """Stop the embedded server, or drop our schema from a configured one; nothing
    when neither was started."""
    from tests import conftest

    server = conftest._PG.pop("server", None)
    conftest._PG.pop("url", None)
    if server is not None:
        server.cleanup()
    conftest.pytest_sessionfinish(t.cast(t.Any, None), 0)
