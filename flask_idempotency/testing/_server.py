"""The ``api`` fixture's object: the user's app served by a real WSGI server in a
subprocess, and a small HTTP client for it (stdlib ``http.client``)."""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import importlib.util
import json as jsonlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import typing as t
from pathlib import Path

from ._control import (
    APP_ENV,
    CONFIG_ENV,
    CONTROL_ENV,
    DOWNSTREAM_ENV,
    PARENT_ENV,
    PORT_ENV,
    READY_PATH,
    Control,
)

#: How long a start may take before the kit gives up (and shows the logs).
START_TIMEOUT = 60.0


@dataclasses.dataclass
class Response:
    """An answer of the served app."""

    #: The HTTP status.
    status_code: int
    #: The headers (case-insensitive lookups: ``headers["content-type"]``).
    headers: http.client.HTTPMessage
    #: The body, as sent.
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> t.Any:
        return jsonlib.loads(self.content)

    @property
    def replayed(self) -> bool:
        """Whether the extension replayed a stored response (``Idempotent-Replayed: true``)."""
        return (self.headers.get("Idempotent-Replayed") or "").lower() == "true"

    @property
    def is_problem(self) -> bool:
        """Whether the body is ``application/problem+json``."""
        content_type = self.headers.get("Content-Type") or ""
        return content_type.split(";")[0].strip() == "application/problem+json"

    def __repr__(self) -> str:
        return f"<Response {self.status_code} {self.text[:120]!r}>"


#: Where :func:`free_port` looks first: from here up to the start of the range
#: the kernel gives outgoing connections their local ports from.
PORTS_FROM = 15000

#: The start of Linux's default range for those ports, where the machine does
#: not say its own.
_EPHEMERAL_LOW_DEFAULT = 32768

_pick = random.SystemRandom()  # not the random a test may seed


def _ephemeral_low() -> int:
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return _EPHEMERAL_LOW_DEFAULT


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As servers bind (gunicorn, werkzeug, PostgreSQL): a port left in
        # TIME_WAIT by an earlier server is free for them.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on, for a server about to start.

    Chosen at random below the kernel's range for outgoing connections' local
    ports where there is room (on Linux, 15000-32767 by default): a port the
    kernel picked from that range could be taken by any connection the machine
    opens between this call and the server's bind, which a busy test run does.
    Falls back to the kernel's pick.
    """
    low = _ephemeral_low()
    if low - PORTS_FROM >= 1000:
        for _ in range(100):
            port = _pick.randrange(PORTS_FROM, low)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _no_control_socket() -> list[str]:
    """gunicorn's control socket (newer releases) is at one path per user by
    default; servers of tests running side by side would take it from each other."""
    try:
        from gunicorn import config  # type: ignore[import-untyped]
    except ImportError:
        return []
    names = {setting.name for setting in getattr(config, "KNOWN_SETTINGS", [])}
    return ["--no-control-socket"] if "control_socket_disable" in names else []


def gunicorn_available() -> bool:
    return sys.platform != "win32" and importlib.util.find_spec("gunicorn") is not None


class ServedApp:
    """The app in a subprocess on 127.0.0.1, restartable on the same port.

    ``server`` is ``"gunicorn"`` (gthread workers: ``workers`` x ``threads``) or
    ``"werkzeug"`` (one threaded process). Its output goes to the control
    directory's ``server.log`` (:meth:`logs`), across restarts. On Linux the
    server dies with the thread that started it (:meth:`start`, :meth:`restart`:
    call them from the test's thread), so a test process killed before its
    teardown leaves no server behind.
    """

    def __init__(
        self,
        *,
        app: str,
        config: t.Mapping[str, t.Any],
        control: Control,
        downstream: str | None,
        key_header: str = "Idempotency-Key",
        server: str = "gunicorn",
        workers: int = 2,
        threads: int = 8,
        cwd: Path | None = None,
    ) -> None:
        self.app = app
        self.config = dict(config)
        self.control = control
        self.downstream = downstream
        self.key_header = key_header
        self.server = server
        self.workers = workers
        self.threads = threads
        self.cwd = cwd or Path.cwd()
        self.port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- the process -----------------------------------------------------------

    def _command(self) -> list[str]:
        launch = [sys.executable, "-m", "flask_idempotency.testing._launch"]
        if self.server == "werkzeug":
            return [*launch, "werkzeug"]
        return [
            *launch,
            "gunicorn",
            "--bind",
            f"127.0.0.1:{self.port}",
            "--worker-class",
            "gthread",
            "--workers",
            str(self.workers),
            "--threads",
            str(self.threads),
            "--timeout",
            "60",
            "--graceful-timeout",
            "5",
            "--error-logfile",
            "-",
            "--access-logfile",
            "-",
            *_no_control_socket(),
            "flask_idempotency.testing._serve:create()",
        ]

    def _environment(self) -> dict[str, str]:
        # The served process imports the app as this process does: the same
        # sys.path (the project's root, a src/ layout, pytest's pythonpath).
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(paths),
            "PYTHONUNBUFFERED": "1",
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
            APP_ENV: self.app,
            CONFIG_ENV: jsonlib.dumps(self.config),
            CONTROL_ENV: str(self.control.root),
            PORT_ENV: str(self.port),
            PARENT_ENV: str(os.getpid()),
        }
        if self.downstream:
            env[DOWNSTREAM_ENV] = self.downstream
        env.pop("PYTEST_XDIST_WORKER", None)
        return env

    def start(self) -> ServedApp:
        """Start the server and wait until the app answers (at most 60 s)."""
        if self.alive():
            return self
        self.control.clear_booted()
        with self.control.log_path.open("ab") as log:
            log.write(f"--- idempotency kit: starting {self.server} on {self.url}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self._command(),
                cwd=self.cwd,
                env=self._environment(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # One process group: stopped as a whole. Killed with the test
                # process too (_lifeline), which a session of its own escapes.
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self._proc.poll() is not None:
                self._proc = None
                raise RuntimeError(f"the served app exited at start:\n{self.logs(tail=60)}")
            # Every worker has built the app (none still booting when a test
            # cuts the database), and one answers.
            if self.control.booted() >= self._processes() and self._ready():
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"the served app did not start in {START_TIMEOUT:.0f} s:\n{self.logs(tail=60)}"
                )
            time.sleep(0.05)

    def _processes(self) -> int:
        return 1 if self.server == "werkzeug" else self.workers

    def _ready(self) -> bool:
        try:
            return self.request("GET", READY_PATH, timeout=2).status_code == 200
        except (ConnectionError, TimeoutError):
            return False

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        """Stop the server: SIGTERM, then SIGKILL to its whole process group."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
        self._kill_group(proc)

    def kill(self) -> None:
        """Kill the server (SIGKILL to its process group), as a crash of the host."""
        proc, self._proc = self._proc, None
        if proc is not None:
            self._kill_group(proc)

    @staticmethod
    def _kill_group(proc: subprocess.Popen[bytes]) -> None:
        # The workers too, even when the master is gone already.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)

    def restart(self) -> ServedApp:
        """Stop (or clear away a crashed) server and start it again on the same port."""
        self.stop()
        return self.start()

    def logs(self, tail: int | None = None) -> str:
        """The server's output so far (the last ``tail`` lines)."""
        try:
            text = self.control.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""
        if tail is not None:
            text = "\n".join(text.splitlines()[-tail:])
        return text

    # -- the client ------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        json: t.Any = None,
        data: bytes | str | None = None,
        key: str | None = None,
        headers: t.Mapping[str, str] | None = None,
        timeout: float = 30,
    ) -> Response:
        """Send one request. A connection dropped, reset or refused raises the
        builtin :class:`ConnectionError`; no answer within ``timeout`` seconds
        raises :class:`TimeoutError`."""
        sent = dict(headers or {})
        body: bytes | None
        if json is not None:
            body = jsonlib.dumps(json).encode("utf-8")
            sent.setdefault("Content-Type", "application/json")
        else:
            body = data.encode("utf-8") if isinstance(data, str) else data
        if key is not None:
            sent[self.key_header] = key
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=sent)
            answer = conn.getresponse()
            return Response(answer.status, answer.headers, answer.read())
        except (TimeoutError, ConnectionError):
            raise
        except (http.client.HTTPException, OSError) as exc:
            raise ConnectionError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        finally:
            conn.close()

    def post(self, path: str, **kwargs: t.Any) -> Response:
        return self.request("POST", path, **kwargs)

    def get(self, path: str, **kwargs: t.Any) -> Response:
        return self.request("GET", path, **kwargs)

    def __repr__(self) -> str:
        return f"<ServedApp {self.app} on {self.url} ({self.server})>"
