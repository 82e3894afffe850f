"""Load generators: wrk with ``bench/keys.lua`` where installed, else Python.

Both keep 6 connections busy for a fixed time (wrk: ``-t2 -c6``; Python: 6
processes, one request at a time each, a new connection per request since
gunicorn's sync workers close the connection after each answer) and give the
requests answered, the time they took, and latency percentiles:

* wrk: from the request written to the response read; reconnecting is not in it;
* Python: from the connect to the response read, so a loopback connect is in it.

Any answer outside 2xx (or a socket error) is a failure: the run ends with
:class:`LoadError`, which carries the status and body.
"""

from __future__ import annotations

import dataclasses
import http.client
import multiprocessing
import multiprocessing.pool
import re
import shutil
import signal
import subprocess
import time
import typing as t
from pathlib import Path

from bench.harness import percentile

KeyMode = t.Literal["new", "fixed", "none"]
#: What every request sends (bench/keys.lua sends the same).
BODY = b'{"amount": 500, "note": "bench"}'
KEY_HEADER = "Idempotency-Key"
CONNECTIONS = 6
WRK_THREADS = 2
LUA_SCRIPT = Path(__file__).with_name("keys.lua")


class LoadError(RuntimeError):
    """A request failed (non-2xx answer or socket error)."""


@dataclasses.dataclass(frozen=True)
class Target:
    """What to send: ``POST path`` on ``port``, with keys per ``key_mode``."""

    port: int
    path: str
    key_mode: KeyMode
    fixed_key: str = ""
    host: str = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class LoadResult:
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float

    @property
    def rate(self) -> float:
        """Requests answered per second of the run."""
        return self.requests / self.seconds if self.seconds > 0 else 0.0


def send_once(target: Target, key: str | None) -> tuple[int, bytes]:
    """One request on a new connection: status and body."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers[KEY_HEADER] = key
    conn = http.client.HTTPConnection(target.host, target.port, timeout=60)
    try:
        conn.request("POST", target.path, BODY, headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _key(target: Target, prefix: str, counter: int) -> str | None:
    if target.key_mode == "new":
        return f"{prefix}-{counter}"
    if target.key_mode == "fixed":
        return target.fixed_key
    return None


class Generator(t.Protocol):
    name: str

    def run(self, target: Target, seconds: float, run_id: str) -> LoadResult: ...

    def close(self) -> None: ...


# -- wrk ------------------------------------------------------------------------------------

_RESULT = re.compile(r"^BENCH-RESULT (.*)$", re.MULTILINE)
_BODY = re.compile(r"^BENCH-BODY (.*)$", re.MULTILINE)


class Wrk:
    """``wrk -t2 -c6 -d<s>s -s bench/keys.lua``; durations are whole seconds (at least 1)."""

    name = "wrk"

    def __init__(self) -> None:
        path = shutil.which("wrk")
        if path is None:
            raise FileNotFoundError("wrk is not installed")
        self.path = path
        self._proc: subprocess.Popen[str] | None = None
        version = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
        first = (version.stdout or version.stderr).splitlines()
        self.version = first[0].split(" Copyright")[0] if first else "wrk"

    def run(self, target: Target, seconds: float, run_id: str) -> LoadResult:
        whole = max(1, round(seconds))
        command = [
            self.path,
            f"-t{WRK_THREADS}",
            f"-c{CONNECTIONS}",
            f"-d{whole}s",
            "--timeout",
            "30s",
            "-s",
            str(LUA_SCRIPT),
            f"http://{target.host}:{target.port}",
            "--",
            run_id,
            target.key_mode,
            target.path,
            target.fixed_key,
        ]
        self._proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            out, _ = self._proc.communicate(timeout=whole + 60)
        finally:
            self.close()
        match = _RESULT.search(out)
        if match is None:
            raise LoadError(f"wrk printed no result:\n{out}")
        fields = {k: int(v) for k, v in (pair.split("=") for pair in match.group(1).split())}
        body = _BODY.search(out)
        if fields["failures"]:
            raise LoadError(
                f"POST {target.path}: {fields['failures']} non-2xx answer(s); the first: "
                f"{fields['status']} {body.group(1) if body else ''}"
            )
        socket_errors = {k: fields[k] for k in ("connect", "read", "write", "timeout") if fields[k]}
        if socket_errors:
            raise LoadError(f"POST {target.path}: socket errors {socket_errors}\n{out}")
        return LoadResult(
            requests=fields["requests"],
            seconds=fields["duration_us"] / 1e6,
            p50_ms=fields["p50_us"] / 1000,
            p99_ms=fields["p99_us"] / 1000,
        )

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


# -- Python -----------------------------------------------------------------------------------


def _ignore_sigint() -> None:
    # Ctrl-C is the harness's to handle: it terminates the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@dataclasses.dataclass(frozen=True)
class _Share:
    """One process's part of a run: until ``stop_at`` (wall clock) or ``count`` requests."""

    target: Target
    prefix: str
    start_at: float
    stop_at: float | None
    count: int | None


def _drive(share: _Share) -> tuple[list[float], str | None, float]:
    """Send requests one at a time; latencies (s), the failure if any, the end time."""
    latencies: list[float] = []
    time.sleep(max(0.0, share.start_at - time.time()))
    counter = 0
    while True:
        if share.count is not None and counter >= share.count:
            break
        if share.stop_at is not None and time.time() >= share.stop_at:
            break
        counter += 1
        started = time.perf_counter()
        try:
            status, body = send_once(share.target, _key(share.target, share.prefix, counter))
        except OSError as exc:
            return latencies, f"{type(exc).__name__}: {exc}", time.time()
        latencies.append(time.perf_counter() - started)
        if not 200 <= status < 300:
            return latencies, f"{status} {body[:2000].decode('utf-8', 'replace')}", time.time()
    return latencies, None, time.time()


class PythonLoad:
    """6 processes (spawned once, reused), one connection each, http.client."""

    name = "python (6 processes, http.client)"
    version = name

    def __init__(self, connections: int = CONNECTIONS) -> None:
        self.connections = connections
        context = multiprocessing.get_context("spawn")
        self._pool: multiprocessing.pool.Pool | None = context.Pool(
            connections, initializer=_ignore_sigint
        )

    def run(self, target: Target, seconds: float, run_id: str) -> LoadResult:
        return self._run(target, run_id, seconds=seconds, count=None)

    def run_count(self, target: Target, count: int, run_id: str) -> LoadResult:
        """``count`` requests in all, spread over the connections."""
        return self._run(target, run_id, seconds=None, count=count)

    def _run(
        self, target: Target, run_id: str, *, seconds: float | None, count: int | None
    ) -> LoadResult:
        assert self._pool is not None
        start_at = time.time() + 0.2
        stop_at = start_at + seconds if seconds is not None else None
        shares = []
        for i in range(self.connections):
            part = None
            if count is not None:
                part = count // self.connections + (i < count % self.connections)
            shares.append(_Share(target, f"{run_id}-{i}", start_at, stop_at, part))
        limit = (seconds or 0) + (count or 0) * 0.5 + 120
        results = self._pool.map_async(_drive, shares, chunksize=1).get(timeout=limit)
        failures = [failure for _, failure, _ in results if failure]
        if failures:
            raise LoadError(f"POST {target.path}: {failures[0]}")
        latencies = sorted(value for values, _, _ in results for value in values)
        ended = max(end for _, _, end in results)
        return LoadResult(
            requests=len(latencies),
            seconds=ended - start_at,
            p50_ms=percentile(latencies, 0.50) * 1000,
            p99_ms=percentile(latencies, 0.99) * 1000,
        )

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.terminate()
            pool.join()
