"""A retrying nginx in front of two gunicorn instances whose workers are killed at random."""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import typing as t
from pathlib import Path

from reliability import _harness as h
from reliability._context import Context

NAME = "nginx"
TITLE = "A retrying nginx in front of two gunicorn instances, workers killed at random"
DESCRIPTION = """\
nginx (Debian's package, run as a child with a config of the scenario's own) balances two gunicorn
instances (2 sync workers each, `--preload`: a killed worker is forked again from a master that has
the app loaded, so the kills, not the workers' boots, set the pace) and **re-sends a request, POST
included, to the other instance** when the first fails: `proxy_next_upstream error timeout
non_idempotent`, `proxy_next_upstream_tries 3`, connect timeout 1 s, read timeout 5 s,
`max_fails=0` (an instance is never taken out, so the retries always have somewhere to go). A
killer thread SIGKILLs a random worker of a random instance every 0.2-0.5 s (`sigkill` faults); on
top, each worker kills itself right after the COMMIT that carries the work on 3% of requests
(`after_commit`), the window where a re-send makes a duplicate. Clients send to nginx only and
retry with the same key. nginx's access log records every upstream try (`$upstream_addr`,
`$upstream_status`): the figure *nginx re-sends* counts the requests nginx itself sent a second or
third time. nginx's own error pages (502/503/504 when no instance answered) are problem+json, so
*HTML 500s* counts only what the app sends. The last run is the same on the route without the
extension: the duplicates the proxy's re-sends (and the client's retries) make there.
"""

#: (label, route, expect duplicates)
RUNS: list[tuple[str, str, bool]] = [
    ("plain route", "/plain", False),
    ("leased route", "/leased", False),
    ("no extension", "/unprotected", True),
]

#: Each worker kills itself after the commit on this share of requests.
AFTER_COMMIT = 0.03

_LOG_FORMAT = (
    "log_format retries escape=json '$status\\t$upstream_addr\\t$upstream_status\\t"
    "$http_idempotency_key\\t$request_uri';"
)


def find_nginx() -> tuple[str | None, str]:
    """nginx's path, or ``None`` and what is missing. Installed from Debian's
    packages when absent and this process is root with apt-get."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"])
    found = shutil.which("nginx", path=path)
    if found:
        return found, ""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None, "nginx is not installed: `apt-get install nginx-light` (or nginx) as root"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for package in ("nginx-light", "nginx"):
        done = subprocess.run(
            ["apt-get", "install", "-y", "--no-install-recommends", package],
            env=env,
            capture_output=True,
            timeout=600,
        )
        found = shutil.which("nginx", path=path)
        if done.returncode == 0 and found:
            return found, ""
    return None, "nginx is missing and `apt-get install -y nginx-light` (or nginx) failed"


def _problem_location(status: int, title: str) -> str:
    body = json.dumps(
        {
            "type": "about:blank",
            "title": title,
            "status": status,
            "detail": "nginx got no answer from any instance",
        }
    )
    return f"""
        location = /nginx-problem-{status}.json {{
            internal;
            default_type application/problem+json;
            return {status} '{body}';
        }}"""


def nginx_config(workdir: Path, port: int, upstreams: t.Sequence[tuple[str, int]]) -> str:
    servers = "\n".join(f"        server {host}:{p} max_fails=0;" for host, p in upstreams)
    temp = "\n".join(
        f"    {kind}_temp_path {workdir / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    problems = "".join(
        _problem_location(status, title)
        for status, title in (
            (502, "Bad Gateway"),
            (503, "Service Unavailable"),
            (504, "Gateway Timeout"),
        )
    )
    return f"""
daemon off;
master_process on;
worker_processes 1;
pid {workdir / "nginx.pid"};
error_log {workdir / "error.log"} warn;
events {{ worker_connections 256; }}
http {{
    {_LOG_FORMAT}
    access_log {workdir / "access.log"} retries;
{temp}
    upstream app {{
{servers}
    }}
    server {{
        listen 127.0.0.1:{port};
        error_page 502 /nginx-problem-502.json;
        error_page 503 /nginx-problem-503.json;
        error_page 504 /nginx-problem-504.json;
        location / {{
            proxy_pass http://app;
            proxy_next_upstream error timeout non_idempotent;
            proxy_next_upstream_tries 3;
            proxy_connect_timeout 1s;
            proxy_send_timeout 5s;
            proxy_read_timeout 5s;
        }}{problems}
    }}
}}
"""


class Nginx:
    """nginx in front of ``upstreams`` on a free port, its files in a temp dir."""

    def __init__(self, binary: str, upstreams: t.Sequence[tuple[str, int]]) -> None:
        self.binary = binary
        self.host, self.port = "127.0.0.1", h.free_port()
        self.workdir = Path(tempfile.mkdtemp(prefix="reliability-nginx-"))
        # nginx's workers drop root for `nobody`: they must reach the temp paths.
        self.workdir.chmod(0o755)
        self.config = self.workdir / "nginx.conf"
        self.config.write_text(nginx_config(self.workdir, self.port, upstreams))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def access_log(self) -> Path:
        return self.workdir / "access.log"

    def start(self, wait: float = 20) -> Nginx:
        with (self.workdir / "stderr.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, "-p", str(self.workdir), "-c", str(self.config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if h.request(self.host, self.port, "GET", "/healthz", None, {}, 2).status == 200:
                return self
            time.sleep(0.2)
        logs = "".join(
            p.read_text(errors="replace")
            for p in (self.workdir / "stderr.log", self.workdir / "error.log")
            if p.exists()
        )
        self.stop()
        raise RuntimeError(f"nginx did not answer in {wait} s:\n{logs}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGQUIT)  # graceful: the access log is flushed
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def cleanup(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Nginx:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def read_access_log(path: Path) -> collections.Counter[str]:
    """Requests and upstream tries from nginx's access log: ``requests``, ``re-sent``
    (requests nginx sent to an instance more than once) and ``re-sends`` (the
    extra tries), by what the tries got."""
    counts: collections.Counter[str] = collections.Counter()
    if not path.exists():
        return counts
    for line in path.read_text(errors="replace").splitlines():
        fields = line.split("\t")
        if len(fields) < 5 or not fields[4].startswith(("/plain", "/leased", "/unprotected")):
            continue
        counts["requests"] += 1
        # "502, 201" per try; " : " separates an internal redirect (the error page).
        tries = [s for s in re.split(r"[,:]", fields[2]) if s.strip() not in ("", "-")]
        if len(tries) > 1:
            counts["re-sent"] += 1
            counts["re-sends"] += len(tries) - 1
    return counts


class Killer:
    """SIGKILLs a random worker of a random server every 0.2-0.5 s until stopped."""

    def __init__(self, servers: t.Sequence[h.Gunicorn], rng: random.Random) -> None:
        self.servers, self.rng = list(servers), rng
        self.kills = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="killer", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.rng.uniform(0.2, 0.5)):
            if self.rng.choice(self.servers).kill_worker():
                self.kills += 1

    def __enter__(self) -> Killer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def run(ctx: Context) -> list[h.Result]:
    binary, missing = find_nginx()
    results: list[h.Result] = []
    if binary is None:
        for label, _, dup in RUNS:
            results.append(
                h.Result(f"{NAME}: {label}", label, expect_duplicates=dup, skipped=missing)
            )
            ctx.show(results[-1])
        return results
    operations = ctx.scale.pick(100_000, 10_000)
    seconds = ctx.scale.pick(180, 15)
    rng = random.Random(17)
    for label, route, expect_duplicates in RUNS:
        url = ctx.database(f"nginx_{len(results)}")
        h.reset_tables(url)
        result = h.Result(f"{NAME}: {label}", label, expect_duplicates=expect_duplicates)
        log = Path(tempfile.mkstemp(prefix="reliability-faults-")[1])
        env = {
            "RELIABILITY_DATABASE_URL": url,
            "RELIABILITY_FAULTS": json.dumps({"after_commit": AFTER_COMMIT}),
            "RELIABILITY_FAULT_LOG": str(log),
            "RELIABILITY_LEASE": "3",
        }
        servers = [
            h.Gunicorn("reliability.app:create_app()", env, workers=2, options=["--preload"])
            for _ in range(2)
        ]
        proxy = Nginx(binary, [(s.host, s.port) for s in servers])
        try:
            with h.timed(result), contextlib.ExitStack() as stack:
                for server in servers:
                    stack.enter_context(server)
                stack.enter_context(proxy)
                client = h.Client([(proxy.host, proxy.port)], timeout=15, budget=120)
                make = functools.partial(h.new_operation, route)
                with Killer(servers, rng) as killer:
                    ops = h.drive(client, make, count=operations, concurrency=6, seconds=seconds)
            access = read_access_log(proxy.access_log)
        finally:
            proxy.cleanup()
        result.add_operations(ops)
        result.faults["sigkill"] += killer.kills
        h.count_faults(log, result)
        h.count_ledger(url, ops, result)
        if route != "/unprotected":
            h.count_stuck(url, result)
        result.extra["requests through nginx"] = access["requests"]
        result.extra["nginx re-sends (requests sent to an instance again)"] = (
            f"{access['re-sends']} re-sends of {access['re-sent']} requests"
        )
        if expect_duplicates:
            result.notes.append(
                f"without the extension nginx's re-sends and the clients' retries made "
                f"{result.duplicates} duplicate executions"
            )
            if not result.duplicates:
                result.notes.append("expected duplicates here and saw none: the fault did not bite")
        if not access["re-sends"]:
            result.notes.append("nginx re-sent nothing: the proxy's retries were not exercised")
        ctx.show(result)
        results.append(result)
        log.unlink(missing_ok=True)
    return results
