"""Prometheus for the monitoring tests: the shipped rules and docs, promtool, and a
private Prometheus server.

The server is Debian's ``prometheus`` binary (2.42 in CI), started on a free
127.0.0.1 port with a config and a storage directory of its own, never the
system-wide one on :9090 that the package's service may run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import typing as t
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.support.live import ROOT

T = t.TypeVar("T")

DOCS = ROOT / "docs"
RULES = DOCS / "examples" / "prometheus" / "idempotency-rules.yml"
RULES_TESTS = DOCS / "examples" / "prometheus" / "idempotency-rules.test.yml"
GUNICORN_CONF = DOCS / "examples" / "gunicorn_otel.conf.py"
MONITORING = DOCS / "monitoring.md"


def binary(name: str) -> str:
    """The path of ``name`` (``promtool``, ``prometheus``), or the test is skipped
    saying what to install."""
    found = shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/bin"]))
    if found is None:
        pytest.skip(f"{name} is not installed (Debian: apt-get install prometheus)")
    return found


def run_promtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary("promtool"), *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def fenced_blocks(markdown: str, language: str) -> list[str]:
    """The contents of every ```language block of a Markdown page, in order."""
    pattern = rf"^```{re.escape(language)}[ \t]*\n(.*?)^```[ \t]*$"
    return [block.strip() for block in re.findall(pattern, markdown, re.M | re.S)]


def dashboard_queries() -> list[str]:
    """Every PromQL expression of docs/monitoring.md."""
    return fenced_blocks(MONITORING.read_text(encoding="utf-8"), "promql")


def free_ports(count: int) -> range:
    """``count`` consecutive ports on 127.0.0.1, free when asked."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = int(probe.getsockname()[1])
        ports = range(first, first + count)
        if ports[-1] < 65536 and all(_free(port) for port in ports):
            return ports
    raise RuntimeError(f"no {count} consecutive free ports")


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class Prometheus:
    """A private Prometheus: one scrape job of ``targets`` every second, the given
    rule files, its storage in ``workdir``. Stop it with :meth:`stop` (the caller's
    ``finally``)."""

    def __init__(
        self, workdir: Path, job: str, targets: t.Iterable[str], rule_files: t.Iterable[Path] = ()
    ) -> None:
        from tests.support.private_servers import free_port

        self.port = free_port()
        config = {
            "global": {
                "scrape_interval": "1s",
                "evaluation_interval": "1s",
                "scrape_timeout": "1s",
            },
            "rule_files": [str(path) for path in rule_files],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": list(targets)}]}],
        }
        config_file = workdir / "prometheus.yml"
        config_file.write_text(json.dumps(config), encoding="utf-8")  # JSON is YAML
        self.log = (workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                binary("prometheus"),
                f"--config.file={config_file}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self._wait_ready(60)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while True:
            assert self.proc.poll() is None, f"prometheus exited: {self.output()}"
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.port}/-/ready", timeout=2
                ) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"prometheus not ready: {self.output()}"
            time.sleep(0.2)

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(encoding="utf-8")[-3000:]

    def api(self, path: str, **params: str) -> t.Any:
        """The ``data`` of an HTTP API answer; a failed answer fails the test."""
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as answer:
                body = json.load(answer)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        assert body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str) -> list[dict[str, t.Any]]:
        """An instant query's result vector."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return t.cast("list[dict[str, t.Any]]", data["result"])

    def value(self, expr: str) -> float | None:
        """The value of a query that gives one sample (or none)."""
        result = self.query(expr)
        assert len(result) <= 1, (expr, result)
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, expr: str, expected: float, seconds: float = 60) -> None:
        """Until ``expr`` gives ``expected`` (scrapes come every second)."""
        deadline = time.monotonic() + seconds
        while (got := self.value(expr)) != expected:
            assert time.monotonic() < deadline, f"{expr} is {got}, not {expected}"
            time.sleep(0.5)

    def holds(self, check: t.Callable[[], T], seconds: float = 60) -> T:
        """``check()``'s value once it stops failing its asserts. A scrape that
        failed (a worker slow to answer on a loaded machine) makes its series
        stale until the next: a check of several series waits for one where all
        are fresh."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                return check()
            except AssertionError:
                if time.monotonic() >= deadline:
                    raise
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
