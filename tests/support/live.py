"""A live server in a subprocess, and a small HTTP client for it."""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import typing as t
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The caller the example's payments service needs on every request
#: (``example_app.app.merchant``: its scope, and the filter of its reads).
MERCHANT = {"X-Merchant": "shop-1"}


@dataclasses.dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def replayed(self) -> bool:
        return self.headers.get("idempotent-replayed") == "true"

    def json(self) -> t.Any:
        return json.loads(self.body)


def start_ready(module: str, *args: str) -> tuple[subprocess.Popen[str], int]:
    """``python -m module *args`` as a child process, once it printed ``READY <port>``
    (killed if it has not within 30 s)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = ""
    timer = threading.Timer(30, proc.kill)
    timer.start()
    try:
        line = proc.stdout.readline()
    finally:
        timer.cancel()
    if not line.startswith("READY "):
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
        raise RuntimeError(f"{module} {args[0]} did not start (got {line!r})")
    return proc, int(line.split()[1])


class LiveServer:
    """``python -m tests.support.live_server`` as a child process that can be killed."""

    def __init__(
        self, which: str, database_url: str, config: dict[str, t.Any] | None = None
    ) -> None:
        self.which = which
        self.database_url = database_url
        self.config = config or {}
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0

    def start(self) -> LiveServer:
        self.proc, self.port = start_ready(
            "tests.support.live_server", self.which, self.database_url, json.dumps(self.config)
        )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_dead(self, timeout: float = 10) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def post(
        self,
        path: str,
        body: t.Any,
        key: str | None,
        headers: dict[str, str] | None = None,
        timeout: float = 60,
    ) -> Reply:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            sent = {"Content-Type": "application/json", **(headers or {})}
            if key is not None:
                sent["Idempotency-Key"] = key
            conn.request("POST", path, body=json.dumps(body), headers=sent)
            response = conn.getresponse()
            return Reply(
                response.status,
                {k.lower(): v for k, v in response.getheaders()},
                response.read(),
            )
        finally:
            conn.close()

    def get(self, path: str) -> Reply:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return Reply(
                response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
            )
        finally:
            conn.close()


def chunked(*chunks: bytes) -> bytes:
    """``chunks`` in HTTP/1.1 chunked transfer coding, with the last, empty chunk."""
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


def raw_request(
    port: int,
    path: str,
    headers: t.Sequence[tuple[str | bytes, str | bytes]],
    body: bytes,
    *,
    method: str = "POST",
    timeout: float = 30,
) -> Reply:
    """Send one request byte for byte (headers as given, ``body`` as is) and read the answer.

    Unlike http.client it lets a test send a framing of its own: a chunked body
    (with ``Transfer-Encoding: chunked`` among ``headers``), a broken chunk size,
    or header values http.client refuses. Adds only ``Host`` and
    ``Connection: close``.
    """

    def as_bytes(value: str | bytes) -> bytes:
        return value if isinstance(value, bytes) else value.encode("latin-1")

    head = [f"{method} {path} HTTP/1.1".encode(), f"Host: 127.0.0.1:{port}".encode()]
    head += [as_bytes(name) + b": " + as_bytes(value) for name, value in headers]
    head.append(b"Connection: close")
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
        # All is sent: a server waiting for more of a cut-short body reads EOF.
        sock.shutdown(socket.SHUT_WR)
        response = http.client.HTTPResponse(sock)
        try:
            response.begin()
            return Reply(
                response.status,
                {k.lower(): v for k, v in response.getheaders()},
                response.read(),
            )
        finally:
            response.close()


def concurrently(n: int, call: t.Callable[[], Reply]) -> list[Reply]:
    """Run ``call`` in ``n`` threads released at the same instant."""
    barrier = threading.Barrier(n)
    results: list[Reply | BaseException] = [RuntimeError("not run")] * n

    def worker(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = call()
        except BaseException as exc:  # reported below, with the others
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise AssertionError(f"{len(errors)} of {n} requests failed: {errors[:3]!r}")
    return t.cast(list[Reply], results)
