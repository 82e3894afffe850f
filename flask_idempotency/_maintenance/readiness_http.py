"""Readiness over HTTP: the answers, and a server on a port of its own.

A ready probe answers 200 JSON, one that is not 503 problem+json with
``Retry-After``, both never cached. A readiness view on the app's own port
needs a free worker to answer, and a host cut off from its database has none:
every worker waits on the database. :class:`ReadinessServer` answers on a port
of its own, from a thread of each serving process, so the answer comes within
the timeout whatever the workers are doing (``idem.serve_readiness``).
"""

from __future__ import annotations

import http
import http.server
import json
import logging
import os
import socket
import threading
import typing as t

from .._storage import dberrors
from ..errors import PROBLEM_JSON, DatabaseUnavailableError

logger = logging.getLogger("flask_idempotency")

#: What a readiness check tells, JSON-ready (``Idempotency.readiness``).
Details = dict[str, t.Any]


def not_ready_detail(details: Details) -> str:
    """The problem's ``detail`` for a probe that did not find the database ready."""
    if details.get("database") == "forbidden":
        return (
            "The app's database role may not write the record's table (a GRANT is "
            "missing); every idempotent request would fail here: take this host out "
            "of rotation."
        )
    if details.get("database") == "missing_table":
        return (
            "The record's table is missing from the database (run 'flask idempotency "
            "create-tables' or the migrations); every idempotent request would fail "
            "here: take this host out of rotation."
        )
    if details.get("database") == "read_only":
        return (
            "The record's database does not accept writes (it is read-only); every "
            "idempotent request would fail here: take this host out of rotation."
        )
    return (
        "The record's database did not answer the readiness probe in time or "
        "failed it; take this host out of rotation."
    )


def not_ready_error(details: Details) -> DatabaseUnavailableError:
    """The 503 problem+json a readiness check answers when not ready."""
    return DatabaseUnavailableError(
        not_ready_detail(details),
        retry_after=dberrors.RETRY_AFTER,
        extra=details,
        headers={"Cache-Control": "no-store"},
    )


def ready_body(details: Details) -> bytes:
    """The 200 answer's JSON body."""
    return json.dumps(details, separators=(",", ":"), sort_keys=True).encode()


Check = t.Callable[[], tuple[bool, Details]]


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _HTTPServer
    #: Seconds a client may take to send its request: one that sends nothing does
    #: not keep a thread for longer.
    timeout = 10
    server_version = "flask-idempotency-readiness"

    def do_GET(self) -> None:  # the name http.server dispatches to
        self._answer(with_body=True)

    def do_HEAD(self) -> None:
        self._answer(with_body=False)

    def __getattr__(self, name: str) -> t.Any:
        # http.server dispatches a request to do_<METHOD>, and answers a method
        # without one with its own HTML 501: every other method is a 405 here,
        # as on the app's own readiness view.
        if name.startswith("do_"):
            return self._not_allowed
        raise AttributeError(name)

    def _not_allowed(self) -> None:
        if not self._on_path():
            return
        self._send(
            405,
            PROBLEM_JSON,
            _problem(405, "Method Not Allowed", "Readiness answers GET and HEAD only."),
            {"Allow": "GET, HEAD"},
            with_body=self.command != "HEAD",
        )

    def _on_path(self) -> bool:
        """Whether the request is for the readiness path; a 404 problem if not."""
        if self.path.split("?", 1)[0] == self.server.path:
            return True
        detail = f"Readiness is served at {self.server.path} on this port."
        self._send(404, PROBLEM_JSON, _problem(404, "Not Found", detail), {}, with_body=True)
        return False

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (a malformed request line, a header too
        long) as problem+json, not its HTML page."""
        try:
            title = http.HTTPStatus(code).phrase
        except ValueError:
            title = "Error"
        self.close_connection = True
        body = _problem(code, title, message or explain or title)
        self._send(code, PROBLEM_JSON, body, {"Connection": "close"}, with_body=True)

    def _send(
        self,
        status: int,
        content_type: str,
        body: bytes,
        headers: t.Mapping[str, str],
        *,
        with_body: bool,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if with_body and self.command != "HEAD":
            self.wfile.write(body)

    def _answer(self, *, with_body: bool) -> None:
        if not self._on_path():
            return
        status, content_type, body, headers = self.server.respond()
        self._send(status, content_type, body, headers, with_body=with_body)

    def log_message(self, format: str, *args: t.Any) -> None:
        # Load balancers check every few seconds; a line each would drown the log.
        logger.debug("readiness server: " + format, *args)


def _problem(status: int, title: str, detail: str) -> bytes:
    body = {"type": "about:blank", "title": title, "status": status, "detail": detail}
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


class _HTTPServer(http.server.ThreadingHTTPServer):
    # Every worker of a host binds the same port: the kernel spreads the load
    # balancer's checks over them (SO_REUSEPORT), and any one that is alive
    # answers, whatever its request threads are doing.
    allow_reuse_address = True
    allow_reuse_port = True
    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], check: Check, path: str) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.check, self.path = check, path
        super().__init__(address, _Handler)

    def respond(self) -> tuple[int, str, bytes, dict[str, str]]:
        try:
            ready, details = self.check()
        except Exception as exc:  # never leave a load balancer without an answer
            logger.exception("readiness server: the check failed")
            ready, details = (
                False,
                {"ready": False, "database": "error", "error": type(exc).__name__},
            )
        if ready:
            return 200, "application/json", ready_body(details), {"Cache-Control": "no-store"}
        error = not_ready_error(details)
        body = json.dumps(error.problem(), separators=(",", ":"), sort_keys=True).encode()
        return error.code, PROBLEM_JSON, body, error.extra_headers


class ReadinessServer:
    """Answers readiness over HTTP on a port of its own, from a thread of this
    process, without a worker of the app.

    ``GET`` (or ``HEAD``) on ``path`` answers as ``idem.readiness_view`` does:
    200 JSON when ready, else 503 problem+json with ``Retry-After``, both with
    ``Cache-Control: no-store``; any other path 404, any other method 405 (with
    ``Allow: GET, HEAD``), both problem+json. Each check waits at most
    ``IDEMPOTENCY_READY_TIMEOUT`` (one probe in flight per app and process).
    """

    def __init__(self, check: Check, *, host: str, port: int, path: str) -> None:
        self._httpd = _HTTPServer((host, port), check, path)
        self.host, self.path = host, path
        self.pid = os.getpid()
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.5},
            name="flask-idempotency-readiness-server",
            daemon=True,
        )
        self._thread.start()

    @property
    def port(self) -> int:
        """The port it listens on (the one the OS chose, for port 0)."""
        return int(self._httpd.server_address[1])

    @property
    def running(self) -> bool:
        return self.pid == os.getpid() and self._thread.is_alive()

    def close(self) -> None:
        """Stop answering and free the port."""
        if self.pid == os.getpid() and self._thread.is_alive():
            self._httpd.shutdown()
        self._httpd.server_close()

    def _abandon(self) -> None:
        """In a forked child, which has the socket but not the thread: close the
        socket, or the kernel would hand it checks that nobody answers."""
        self._httpd.socket.close()


# Keyed by the app itself, not its id(): an id is reused once its object is gone.
_servers: dict[tuple[t.Any, str, int, str], ReadinessServer] = {}
_servers_lock = threading.Lock()


def serve(app: t.Any, check: Check, *, host: str, port: int, path: str) -> ReadinessServer:
    """The readiness server of ``app`` on ``host:port`` in this process, started on
    the first call (and again in a forked child)."""
    key = (app, host, port, path)
    with _servers_lock:
        server = _servers.get(key)
        if server is not None and server.running:
            return server
        server = ReadinessServer(check, host=host, port=port, path=path)
        _servers[key] = server
        return server


def _after_fork_in_child() -> None:
    for server in _servers.values():
        if server.pid != os.getpid():
            server._abandon()
    _servers.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
