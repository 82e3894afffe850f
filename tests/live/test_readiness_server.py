"""``idem.serve_readiness``: readiness on a port of its own, answered by a thread
of each serving process, so a load balancer gets its answer when every worker
of the host is waiting on the database.

The live test runs the example on a real gunicorn (sync workers, the README's
``post_worker_init`` hook) with PostgreSQL behind tests/support/tcp_proxy.py in
blackhole mode: every worker hangs in a request, the app's own ``/readyz``
waits in the queue, and the readiness port answers 503 problem+json.
"""

from __future__ import annotations

import http.client
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
import warnings
from pathlib import Path

import pytest
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_idempotency import Idempotency
from flask_idempotency.errors import PROBLEM_JSON
from tests.support import pgbouncer
from tests.support.private_servers import free_port
from tests.support.tcp_proxy import TcpProxy

ROOT = Path(__file__).resolve().parents[2]


def _get(port: int, path: str = "/readyz", method: str = "GET", timeout: float = 30) -> t.Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def _app(url: str) -> tuple[Flask, Idempotency]:
    db, idem = SQLAlchemy(), Idempotency()
    app = Flask(__name__)
    app.config.update(SQLALCHEMY_DATABASE_URI=url, IDEMPOTENCY_READY_TIMEOUT=5)
    db.init_app(app)
    idem.init_app(app, db)
    with app.app_context():
        db.create_all()
    return app, idem


def test_serves_readiness_on_its_own_port(tmp_path: Path) -> None:
    app, idem = _app(f"sqlite:///{tmp_path / 'ready.sqlite3'}")
    server = idem.serve_readiness(app, host="127.0.0.1", port=0)
    try:
        assert idem.serve_readiness(app, host="127.0.0.1", port=0) is server  # once per process
        status, headers, body = _get(server.port)
        assert status == 200
        assert headers["Content-Type"] == "application/json"
        assert headers["Cache-Control"] == "no-store"
        details = json.loads(body)
        assert details["ready"] is True
        assert details["database"] == "ok"
        head = _get(server.port, method="HEAD")
        assert (head[0], head[2]) == (200, b"")
        assert _get(server.port, "/other")[0] == 404
    finally:
        server.close()
        with app.app_context():
            app.extensions["sqlalchemy"].engine.dispose()


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "BREW"])
def test_another_method_is_a_405_problem_and_another_path_a_404_problem(
    tmp_path: Path, method: str
) -> None:
    """As the app's own readiness view answers; before: http.server's HTML 501
    and 404 pages."""
    app, idem = _app(f"sqlite:///{tmp_path / 'ready.sqlite3'}")
    server = idem.serve_readiness(app, host="127.0.0.1", port=0)
    try:
        status, headers, body = _get(server.port, method=method)
        assert status == 405
        assert headers["Content-Type"] == PROBLEM_JSON
        assert headers["Allow"] == "GET, HEAD"
        assert json.loads(body)["status"] == 405
        for path_method in ("GET", method):
            status, headers, body = _get(server.port, "/other", method=path_method)
            assert status == 404
            assert headers["Content-Type"] == PROBLEM_JSON
            assert json.loads(body)["status"] == 404
        assert _get(server.port)[0] == 200  # the server answers on
    finally:
        server.close()
        with app.app_context():
            app.extensions["sqlalchemy"].engine.dispose()


def test_a_malformed_request_is_a_problem_too(tmp_path: Path) -> None:
    app, idem = _app(f"sqlite:///{tmp_path / 'ready.sqlite3'}")
    server = idem.serve_readiness(app, host="127.0.0.1", port=0)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
            conn.sendall(b"GET /readyz HTTP/1.1\r\n" + b"X: y\r\n" * 101 + b"\r\n")  # too many
            answer = b""
            while chunk := conn.recv(4096):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.split()[1] == b"431"
        assert b"Content-Type: " + PROBLEM_JSON.encode() in head
        assert json.loads(body)["status"] == 431
    finally:
        server.close()
        with app.app_context():
            app.extensions["sqlalchemy"].engine.dispose()


def test_not_ready_is_the_same_problem_as_the_view(tmp_path: Path) -> None:
    path = tmp_path / "ready.sqlite3"
    app, _ = _app(f"sqlite:///{path}")
    app_ro, idem_ro = _app(f"sqlite:///file:{path}?mode=ro&uri=true")
    server = idem_ro.serve_readiness(app_ro, host="127.0.0.1", port=0)
    try:
        status, headers, body = _get(server.port)
        assert status == 503
        assert headers["Content-Type"] == PROBLEM_JSON
        assert headers["Cache-Control"] == "no-store"
        assert int(headers["Retry-After"]) >= 1
        problem = json.loads(body)
        assert problem["type"].endswith("/database-unavailable")
        assert problem["database"] == "read_only"
        app_ro.add_url_rule("/readyz", view_func=idem_ro.readiness_view)
        assert app_ro.test_client().get("/readyz").get_json().keys() == problem.keys()
    finally:
        server.close()
        for made in (app, app_ro):
            with made.app_context():
                made.extensions["sqlalchemy"].engine.dispose()


def test_refuses_what_is_not_a_registered_flask_app(tmp_path: Path) -> None:
    app, idem = _app(f"sqlite:///{tmp_path / 'ready.sqlite3'}")
    with pytest.raises(TypeError, match="Flask app"):
        idem.serve_readiness(app.wsgi_app, port=0)
    with pytest.raises(RuntimeError, match="init_app"):
        Idempotency().serve_readiness(Flask("other"), port=0)
    with app.app_context():
        app.extensions["sqlalchemy"].engine.dispose()


def test_a_forked_child_lets_go_of_the_parents_port(tmp_path: Path) -> None:
    """A child forked after the server started has its socket, not its thread:
    it closes the socket (the kernel would otherwise hand it checks nobody
    answers) and starts a server of its own when asked."""
    app, idem = _app(f"sqlite:///{tmp_path / 'ready.sqlite3'}")
    server = idem.serve_readiness(app, host="127.0.0.1", port=0)
    read, write = os.pipe()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
            pid = os.fork()
        if pid == 0:  # the child
            verdict = b"ok"
            try:
                if server._httpd.socket.fileno() != -1:
                    verdict = b"the parent's socket is still open in the child"
                elif idem.serve_readiness(app, host="127.0.0.1", port=0) is server:
                    verdict = b"the child was handed the parent's server"
            except BaseException as exc:  # report anything to the parent
                verdict = repr(exc).encode()
            os.write(write, verdict)
            os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(read, 1000) == b"ok"
        assert _get(server.port)[0] == 200  # the parent still answers
    finally:
        os.close(read)
        os.close(write)
        server.close()
        with app.app_context():
            app.extensions["sqlalchemy"].engine.dispose()


# -- a real gunicorn whose every worker hangs on the database -----------------------------


class Gunicorn:
    """The example app on gunicorn (sync workers), readiness on a port of its own."""

    def __init__(self, database_url: str, workers: int, ready_port: int) -> None:
        self.port = free_port()
        self.ready_port = ready_port
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "EXAMPLE_DATABASE_URL": database_url,
            "BENCH_READY_PORT": str(ready_port),
            "BENCH_READY_HOST": "127.0.0.1",
            "BENCH_PARTITION_CONFIG": json.dumps({"IDEMPOTENCY_READY_TIMEOUT": 2}),
        }
        if pgbouncer.is_pooled(database_url):  # the example's setting behind a pooler
            env["EXAMPLE_DATABASE_POOLER"] = "transaction"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gunicorn",
                "--workers",
                str(workers),
                "--worker-class",
                "sync",
                "--timeout",
                "120",
                "--bind",
                f"127.0.0.1:{self.port}",
                "--config",
                str(ROOT / "bench" / "partition_gunicorn.py"),
                "bench.partition_app:create_app()",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # Every worker up (each binds the readiness port once its app is loaded:
        # a worker still booting when the database is cut would fail to boot,
        # and gunicorn would stop), and ready.
        deadline = time.monotonic() + 60
        try:
            while _listeners(ready_port) < workers or _ready_status(ready_port) != 200:
                assert self.proc.poll() is None, "gunicorn exited"
                assert time.monotonic() < deadline, (
                    "gunicorn's workers never all answered readiness"
                )
                time.sleep(0.2)
        except BaseException:
            # No caller holds it yet to stop it: left running, it would outlive
            # the test and fail the next one on this worker (a ResourceWarning).
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _listeners(port: int) -> int:
    """Sockets listening on 127.0.0.1:``port`` (one per worker, with SO_REUSEPORT)."""
    local = f"0100007F:{port:04X}"
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return sum(1 for row in rows if row[1] == local and row[3] == "0A")


def _ready_status(port: int) -> int | None:
    try:
        return int(_get(port, timeout=5)[0])
    except OSError:
        return None


def _charge(port: int, results: list[t.Any]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        body = json.dumps({"customer_id": "cus_1", "amount": 100, "currency": "EUR"})
        conn.request(
            "POST",
            "/payments",
            body=body,
            headers={
                "Content-Type": "application/json",
                "Idempotency-Key": str(uuid.uuid4()),
                "X-Merchant": "m1",
            },
        )
        results.append(conn.getresponse().status)
    except OSError as exc:
        results.append(exc)
    finally:
        conn.close()


def _example_tables(url: str) -> None:
    """The example's tables, made once: its workers would race to make them."""
    from example_app import app as example

    made = example.create_app({"SQLALCHEMY_DATABASE_URI": url, **pgbouncer.declared(url)})
    with made.app_context():
        example.db.engine.dispose()


@pytest.mark.slow
def test_readiness_answers_while_every_gunicorn_worker_hangs(pg_url: str) -> None:
    workers = 2
    _example_tables(pg_url)
    with TcpProxy(_upstream(pg_url)) as proxy:
        server = Gunicorn(proxy.url(pg_url), workers, free_port())
        try:
            proxy.blackhole()
            # One request per worker: each hangs on the database (the proxy's
            # kernel acknowledges, so no TCP timeout ends the wait).
            hung: list[t.Any] = []
            for _ in range(workers):
                threading.Thread(target=_charge, args=(server.port, hung), daemon=True).start()
            time.sleep(1)  # the requests reach their workers
            on_app_port: list[t.Any] = []
            waiting = threading.Thread(
                target=lambda: on_app_port.append(_get(server.port, timeout=300)), daemon=True
            )
            waiting.start()
            for _ in range(4):  # several checks: every worker's thread answers its share
                status, headers, body = _get(server.ready_port)
                assert status == 503
                assert headers["Content-Type"] == PROBLEM_JSON
                assert json.loads(body)["database"] in ("timeout", "unavailable")
            # All the while, the app's own /readyz waits for a worker, as do the charges.
            assert waiting.is_alive()
            assert not on_app_port
            assert hung == []

            proxy.heal()
            deadline = time.monotonic() + 60
            while _get(server.ready_port)[0] != 200:
                assert time.monotonic() < deadline, "not ready again after healing"
                time.sleep(0.2)
            waiting.join(60)
            assert [status for status, _, _ in on_app_port] == [200]
        finally:
            server.stop()


def _upstream(url: str) -> t.Any:
    from tests.support.tcp_proxy import upstream_of

    return upstream_of(url)
