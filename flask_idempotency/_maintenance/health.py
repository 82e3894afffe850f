"""Readiness: can this process use the record's database right now?

A load balancer should stop sending requests to a host that is cut off from its
database: every request there would hang or fail. A liveness check that does
not touch the database cannot tell; this probe can. It runs a trivial query on
the record's table (``SELECT 1 FROM idempotency_keys LIMIT 1``) through the
app's own engine and pool, then checks that the database accepts writes, so it
fails exactly when a claim would:

* PostgreSQL: ``pg_is_in_recovery()`` (a standby) and ``transaction_read_only``
  (``default_transaction_read_only``, for the server, database or role), read
  without taking a lock, so a migration's table lock does not take every host
  out of rotation; and ``has_table_privilege`` for the claim's INSERT and UPDATE
  (``"forbidden"`` when a GRANT is missing, as the claim would be refused);
* MySQL/MariaDB and SQLite: a write that touches no row (``UPDATE ... WHERE
  scope IS NULL``, rolled back; the claim completes with an UPDATE, so it needs
  no privilege the claim does not), which the server refuses exactly as it would refuse
  the claim: ``read_only`` (unless the app's user may write anyway, READ_ONLY
  ADMIN or SUPER), ``innodb_read_only``, a read-only transaction default, a
  SQLite file opened read-only or ``PRAGMA query_only``.

The query runs in a background thread, so the answer comes within the timeout
even when the database hangs (a network partition does not fail a query, it
never answers it). At most one probe per app and process is in flight: while a
hung probe is running, every check answers "not ready" at once instead of
piling up threads and connections, until the probe returns.

A readiness view on the app's own port needs a free worker to answer, and a
host cut off from its database has none: every worker waits on the database.
:class:`ReadinessServer` answers on a port of its own, from a thread of each
serving process, so the answer comes within the timeout whatever the workers
are doing (``idem.serve_readiness``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import http
import http.server
import itertools
import json
import logging
import math
import os
import socket
import threading
import time
import typing as t
import weakref

import sqlalchemy as sa

from .._storage import dberrors, idle_bound
from ..errors import PROBLEM_JSON, DatabaseUnavailableError

logger = logging.getLogger("flask_idempotency")

Details = dict[str, t.Any]


@dataclasses.dataclass
class _Probe:
    number: int
    started: float  # time.monotonic()
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    ok: bool = False
    outcome: str = "running"  # "ok", a dberrors.Failure value, "read_only", "forbidden" or "error"
    error: str | None = None
    reason: str | None = None  # why a read-only database refuses writes
    duration: float = 0.0


class ReadinessProbe:
    """The probe state of one app in one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._current: _Probe | None = None
        self._numbers = itertools.count(1)

    def check(
        self, engine: sa.Engine, table: sa.Table, timeout: dt.timedelta
    ) -> tuple[bool, Details]:
        """Probe (or join the probe in flight) and wait for it at most ``timeout``
        from the probe's start."""
        seconds = timeout.total_seconds()
        with self._lock:
            if self._pid != os.getpid():
                # A forked child inherits the parent's probe, but not its thread.
                self._pid, self._current = os.getpid(), None
            probe = self._current
            if probe is None or probe.done.is_set():
                probe = _Probe(number=next(self._numbers), started=time.monotonic())
                self._current = probe
                threading.Thread(
                    target=_run,
                    args=(probe, engine, table, timeout),
                    name="flask-idempotency-readiness",
                    daemon=True,
                ).start()
        remaining = probe.started + seconds - time.monotonic()
        finished = probe.done.wait(max(0.0, remaining))
        details: Details = {
            "ready": finished and probe.ok,
            "table": table.name,
            "timeout_ms": round(seconds * 1000),
            "probe_id": probe.number,
        }
        if finished:
            details["database"] = probe.outcome
            details["duration_ms"] = round(probe.duration * 1000, 1)
            if probe.error is not None:
                details["error"] = probe.error
            if probe.reason is not None:
                details["reason"] = probe.reason
        else:
            details["database"] = "timeout"
            details["running_ms"] = round((time.monotonic() - probe.started) * 1000, 1)
        return bool(details["ready"]), details


def _run(probe: _Probe, engine: sa.Engine, table: sa.Table, timeout: dt.timedelta) -> None:
    stmt: sa.Select[t.Any] = sa.select(sa.literal_column("1")).select_from(table).limit(1)
    try:
        with engine.connect() as conn:
            reason = _refuses_writes(conn, table, timeout)
            conn.execute(stmt).all()
            conn.rollback()
        if reason is None:
            probe.ok, probe.outcome = True, "ok"
        else:
            probe.outcome, probe.reason = "read_only", reason
            logger.warning("readiness probe of %s: read-only database: %s", table.name, reason)
    except _Forbidden as exc:
        probe.outcome, probe.reason, probe.error = "forbidden", str(exc), "InsufficientPrivilege"
        logger.warning("readiness probe of %s: %s", table.name, exc)
    except Exception as exc:  # any failure means "not ready"; say which kind
        reason = dberrors.read_only_reason(exc)
        if reason is not None:
            probe.outcome, probe.reason = "read_only", reason
        elif dberrors.privilege_refused(exc):  # the write check, as a claim would be
            probe.outcome = "forbidden"
        else:
            failure = dberrors.classify(exc)
            probe.outcome = failure.value if failure is not None else "error"
        # The class name only: driver messages can name hosts and users, and a
        # readiness endpoint is often reachable by more people than the logs.
        probe.error = type(exc).__name__
        logger.warning(
            "readiness probe of %s failed%s: %s",
            table.name,
            ": read-only database" if reason is not None else "",
            dberrors.summary(exc),
        )
    finally:
        probe.duration = time.monotonic() - probe.started
        probe.done.set()


class _Forbidden(Exception):
    """The app's role lacks a privilege the claim needs (PostgreSQL)."""


def _refuses_writes(conn: sa.Connection, table: sa.Table, timeout: dt.timedelta) -> str | None:
    """Why the database would refuse the claim's write, or ``None`` when it accepts
    writes (or the engine has no check here); raises the refusal itself where
    the check is a write. The first statement of ``conn``'s transaction, which
    the caller rolls back."""
    dialect = conn.dialect.name
    if dialect == "postgresql":
        # Lock-free: a standby, or transactions read-only by default (for the
        # server, the database or the role), which the new transaction shows.
        # The probe's transaction then reads the record's table, whose lock a
        # probe stranded by a partition would hold, and make an operator's
        # ALTER TABLE (and every claim queued behind it) wait: the server ends
        # it once it sits idle as long as the probe may take.
        # Also whether the app's role may INSERT and UPDATE the table, as a
        # claim does (a GRANT missing answers every claim 503; a catalog
        # lookup, no lock either), granted on the table or on its columns.
        standby, read_only, may_write, _ = conn.execute(
            sa.text(
                "SELECT pg_is_in_recovery(), current_setting('transaction_read_only'), "
                "has_any_column_privilege(CAST(:table AS text), 'INSERT') "
                "AND has_any_column_privilege(CAST(:table AS text), 'UPDATE'), "
                + idle_bound(":idle")
            ),
            {
                "idle": f"{max(1, math.ceil(timeout.total_seconds()))}s",
                "table": conn.dialect.identifier_preparer.format_table(table),
            },
        ).one()
        if standby:
            return "the server is a standby (pg_is_in_recovery())"
        if read_only == "on":
            return "transactions are read-only (default_transaction_read_only)"
        if not may_write:
            raise _Forbidden(f"the app's role may not INSERT and UPDATE {table.name}")
        return None
    if dialect in ("mysql", "mariadb", "sqlite"):
        # The server's own verdict: it refuses this write exactly as it would
        # refuse the claim (so a user allowed to write on a read_only server
        # passes); the refusal is raised, and the caller says why. "scope IS
        # NULL" matches no row (the column is NOT NULL: MySQL plans an
        # "Impossible WHERE", locking nothing), and names a key column, as
        # sql_safe_updates wants (it refuses WHERE false). An UPDATE, not a
        # DELETE: a claim needs INSERT and UPDATE, never DELETE (cleanup may run
        # as another role), so an app user without DELETE stays ready.
        conn.execute(sa.update(table).where(table.c.scope.is_(None)).values(status=table.c.status))
    return None


def not_ready_detail(details: Details) -> str:
    """The problem's ``detail`` for a probe that did not find the database ready."""
    if details.get("database") == "forbidden":
        return (
            "The app's database role may not write the record's table (a GRANT is "
            "missing); every idempotent request would fail here: take this host out "
            "of rotation."
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


_probes: weakref.WeakKeyDictionary[t.Any, ReadinessProbe] = weakref.WeakKeyDictionary()
_probes_lock = threading.Lock()


def probe_for(app: t.Any) -> ReadinessProbe:
    """The readiness probe of ``app`` (a Flask app), made on first use."""
    with _probes_lock:
        probe = _probes.get(app)
        if probe is None:
            probe = _probes[app] = ReadinessProbe()
        return probe


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


# -- readiness on a port of its own ------------------------------------------------------

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
