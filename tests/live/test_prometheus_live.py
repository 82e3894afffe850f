"""A real Prometheus scrapes the test app under gunicorn with 4 workers, set up by
the documented recipe (docs/examples/gunicorn_otel.conf.py, used as it is), and the
totals it reports equal the requests sent, with no series per key.

The Prometheus is Debian's binary on a free 127.0.0.1 port, with a config, rules
(the shipped docs/examples/prometheus/idempotency-rules.yml) and storage of its
own, scraping every second; the test is skipped, saying so, where the binary is
missing. Every process it starts is killed at the end, failed or not.

And the recipe's fallback: a worker that finds every port of the range taken keeps
serving, and exports on the first port that frees up.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import typing as t
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.conftest import reset_tables
from tests.support.live import ROOT
from tests.support.private_servers import free_port
from tests.support.prometheus import (
    GUNICORN_CONF,
    RULES,
    Prometheus,
    binary,
    dashboard_queries,
    free_ports,
)

WORKERS = 4
JOB = "testapp"
#: The labels a series of ours may carry: the scrape's, the exporter's scope, and
#: the attributes of the telemetry contract. Never a key, a scope, a body.
LABELS = {
    "__name__",
    "job",
    "instance",
    "otel_scope_name",
    "otel_scope_version",
    "otel_scope_schema_url",
    "http_route",
    "http_request_method",
    "idempotency_outcome",
    "idempotency_key_refusal",
    "idempotency_job",
    "idempotency_job_result",
    "db_namespace",
    "le",
}


class Gunicorn:
    """``tests.support.gunicorn_app`` on gunicorn, configured by the shipped recipe."""

    def __init__(
        self,
        workdir: Path,
        database_url: str,
        metrics_ports: range,
        workers: int = WORKERS,
        options: t.Sequence[str] = (),
    ) -> None:
        self.port = free_port()
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
            "PYTHONPATH": str(ROOT),
            "TEST_DATABASE_URL": database_url,
            "TEST_APP_METRIC": "1",
            "METRICS_PORTS": f"{metrics_ports[0]}-{metrics_ports[-1]}",
            "METRICS_HOST": "127.0.0.1",
            "OTEL_SERVICE_NAME": JOB,
            # The gauges read the database every second here (30 s by default); the
            # jobs run in every worker, often.
            "TEST_APP_CONFIG": json.dumps(
                {
                    "IDEMPOTENCY_METRICS_INTERVAL": 1,
                    "IDEMPOTENCY_SCHEDULER": True,
                    "IDEMPOTENCY_RECOVER_EVERY": 1,
                    "IDEMPOTENCY_PURGE_EVERY": 1,
                }
            ),
        }
        self.log = (workdir / "gunicorn.log").open("w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gunicorn",
                "--config",
                str(GUNICORN_CONF),
                "--workers",
                str(workers),
                *options,
                "--worker-class",
                "sync",
                "--timeout",
                "60",
                "--bind",
                f"127.0.0.1:{self.port}",
                "tests.support.gunicorn_app:app",
            ],
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def output(self, tail: int | None = 3000) -> str:
        self.log.flush()
        text = Path(self.log.name).read_text(encoding="utf-8")
        return text if tail is None else text[-tail:]

    def metrics_ports(self) -> dict[int, int]:
        """Each worker's metrics port, by pid, from the recipe's log lines."""
        found = re.findall(r"Worker (\d+) serves /metrics on [\d.]+:(\d+)", self.output(None))
        return {int(pid): int(port) for pid, port in found}

    def stop(self) -> None:
        """The master and every worker (the session the test started), whatever state
        they are in."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # a worker the master left behind
        self.proc.wait()
        self.log.close()


def _post(port: int, path: str, key: str | None, body: dict[str, t.Any]) -> tuple[int, bool]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Idempotency-Key"] = key
        conn.request("POST", path, body=json.dumps(body), headers=headers)
        answer = conn.getresponse()
        answer.read()
        return answer.status, answer.getheader("Idempotent-Replayed") == "true"
    finally:
        conn.close()


def _send(port: int) -> tuple[dict[str, int], list[str]]:
    """The traffic: what each outcome should count, and the keys sent."""
    keys: list[str] = []

    def key() -> str:
        keys.append(f"key-{uuid.uuid4()}")
        return keys[-1]

    charge = {"amount": 100, "currency": "EUR"}
    # Four slow requests at once: four sync workers each hold one.
    slow: list[tuple[int, bool]] = []
    threads = [
        threading.Thread(
            target=lambda k: slow.append(_post(port, "/slow", k, {"delay": 1})), args=(key(),)
        )
        for _ in range(WORKERS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert slow == [(201, False)] * WORKERS
    new = [key() for _ in range(10)]
    for sent in new:
        assert _post(port, "/charges", sent, charge) == (201, False)
    for sent in new[:6]:
        assert _post(port, "/charges", sent, charge) == (201, True)
    assert _post(port, "/charges", new[0], {"amount": 200, "currency": "EUR"})[0] == 422
    for _ in range(2):
        assert _post(port, "/required", None, {})[0] == 400
    assert _post(port, "/charges", "k" * 300, charge)[0] == 400
    for _ in range(2):
        assert _post(port, "/charges", None, charge) == (201, False)
    assert _post(port, "/commits-then-raises", key(), {}) == (500, False)
    expected = {
        "executed": WORKERS + 10,
        "replayed": 6,
        "mismatch": 1,
        "key_refused": 3,
        "passed_through": 2,
        "failed_after_commit": 1,
    }
    return expected, keys


@pytest.mark.slow
def test_prometheus_scrapes_exact_totals_from_four_gunicorn_workers(
    pg_url: str, tmp_path: Path
) -> None:
    binary("prometheus")
    reset_tables(pg_url)
    metrics_ports = free_ports(2 * WORKERS)  # twice the workers, as the recipe says
    targets = [f"127.0.0.1:{port}" for port in metrics_ports]
    server = prometheus = None
    try:
        server = Gunicorn(tmp_path, pg_url, metrics_ports)
        prometheus = Prometheus(tmp_path, JOB, targets, rule_files=[RULES])
        # Every worker serves its /metrics on a port of the range; the spares are down.
        prometheus.wait_for(f'count(up{{job="{JOB}"}} == 1)', WORKERS)
        assert server.proc.poll() is None, server.output()

        expected, keys = _send(server.port)
        sent = sum(expected.values())

        # The test app's own counter first: the harness sums every worker.
        prometheus.wait_for("sum(testapp_responses_total)", sent)
        # The extension's: exactly what was sent, by outcome, summed over workers.
        prometheus.wait_for("sum(idempotency_requests_total)", sent)

        def outcomes() -> dict[tuple[str, str], float]:
            by_outcome = {
                row["metric"]["idempotency_outcome"]: float(row["value"][1])
                for row in prometheus.query(
                    "sum by (idempotency_outcome) (idempotency_requests_total)"
                )
            }
            assert by_outcome == expected
            refusals = {
                row["metric"].get("idempotency_key_refusal"): float(row["value"][1])
                for row in prometheus.query(
                    "sum by (idempotency_key_refusal)"
                    ' (idempotency_requests_total{idempotency_outcome="key_refused"})'
                )
            }
            assert refusals == {"missing": 2, "too_long": 1}
            by_route = {
                (row["metric"]["http_route"], row["metric"]["idempotency_outcome"]): float(
                    row["value"][1]
                )
                for row in prometheus.query(
                    "sum by (http_route, idempotency_outcome) (idempotency_requests_total)"
                )
            }
            assert by_route == {
                ("/slow", "executed"): WORKERS,
                ("/charges", "executed"): 10,
                ("/charges", "replayed"): 6,
                ("/charges", "mismatch"): 1,
                ("/charges", "key_refused"): 1,
                ("/charges", "passed_through"): 2,
                ("/required", "key_refused"): 2,
                ("/commits-then-raises", "failed_after_commit"): 1,
            }
            return by_route

        by_route = prometheus.holds(outcomes)
        # The totals came from several workers (the slow requests were held at once).
        assert prometheus.value("count(count by (instance) (idempotency_requests_total))") >= 2

        # The database gauges: one figure, reported by every worker (hence max, not sum).
        # One completed record per key that ran: executed, or failed after its commit.
        records = expected["executed"] + expected["failed_after_commit"]
        prometheus.wait_for("max(idempotency_records_live)", records)

        def gauges() -> None:
            assert prometheus.value("min(idempotency_records_live)") == records
            assert prometheus.value("count(idempotency_records_live)") == WORKERS
            assert prometheus.value("max(idempotency_records_in_flight)") == 0
            assert prometheus.value("max(idempotency_records_past_lease)") == 0

        prometheus.holds(gauges)

        # The jobs, by the names the rules file's IdempotencyJobNotRunning expects.
        deadline = time.monotonic() + 60
        while (
            jobs := {
                row["metric"]["idempotency_job"]
                for row in prometheus.query(
                    "sum by (idempotency_job)"
                    ' (idempotency_job_runs_total{idempotency_job_result="ok"}) > 0'
                )
            }
        ) != {"cleanup", "lease_recovery"}:
            assert time.monotonic() < deadline, jobs
            time.sleep(0.5)

        # No series per key: few series, none naming a key, only the contract's labels.
        series = prometheus.api("series", **{"match[]": '{__name__=~"idempotency_.+"}'})
        assert series
        for labels in series:
            assert set(labels) <= LABELS, labels
            assert not any(key in value for key in keys for value in labels.values()), labels
        requests_series = prometheus.value("count(idempotency_requests_total)")
        assert requests_series is not None
        assert requests_series <= WORKERS * len(by_route) < len(keys) + sent

        # A worker's exposition passes promtool's lint (names, units, help).
        with urllib.request.urlopen(f"http://{targets[0]}/metrics", timeout=10) as answer:
            exposition = answer.read()
        lint = subprocess.run(
            [binary("promtool"), "check", "metrics"], input=exposition, capture_output=True
        )
        assert (lint.returncode, lint.stdout + lint.stderr) == (0, b"")

        # The shipped rules evaluate on these series without an error, and the alert
        # for a failed-after-commit fires on the one sent (its first, in a new series).
        prometheus.wait_for(
            'count(ALERTS{alertname="IdempotencyFailedAfterCommit", alertstate="firing",'
            f' job="{JOB}", http_route="/commits-then-raises"}})',
            1,
        )
        _wait_rules_evaluated(prometheus)
        # Every expression of the dashboard's page runs.
        first, *others = dashboard_queries()
        for expr in (first, *others):
            prometheus.query(expr)
        # The first panel shows every outcome sent, once rate() has two samples of each.
        deadline = time.monotonic() + 30
        while (
            shown := {row["metric"]["idempotency_outcome"] for row in prometheus.query(first)}
        ) != set(expected):
            assert time.monotonic() < deadline, shown
            time.sleep(0.5)

        # A worker killed and replaced: the replacement serves on the port its
        # predecessor freed (the lowest free one of the range), so the instance label
        # takes no new value.
        served = server.metrics_ports()
        assert len(served) == WORKERS
        assert set(served.values()) <= set(metrics_ports)
        victim, freed = min(served.items(), key=lambda worker: worker[1])  # the lowest port
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not (replacement := set(server.metrics_ports()) - set(served)):
            assert time.monotonic() < deadline, "no worker replaced the one killed"
            time.sleep(0.2)
        assert [server.metrics_ports()[pid] for pid in replacement] == [freed]
        prometheus.wait_for(f'count(up{{job="{JOB}", instance="127.0.0.1:{freed}"}} == 1)', 1)
    except BaseException:
        if server is not None:
            print("gunicorn:", server.output())
        if prometheus is not None:
            print("prometheus:", prometheus.output())
        raise
    finally:
        if prometheus is not None:
            prometheus.stop()
        if server is not None:
            server.stop()


def _wait_rules_evaluated(prometheus: Prometheus, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while True:
        rules = [rule for group in prometheus.api("rules")["groups"] for rule in group["rules"]]
        assert rules
        if all(not rule["lastEvaluation"].startswith("0001") for rule in rules):
            break
        assert time.monotonic() < deadline, "the rules were never all evaluated"
        time.sleep(0.5)
    unhealthy = [(rule["name"], rule.get("lastError")) for rule in rules if rule["health"] != "ok"]
    assert unhealthy == []


@pytest.mark.slow
def test_a_worker_without_a_free_metrics_port_serves_and_takes_the_first_that_frees(
    tmp_path: Path,
) -> None:
    """The recipe's fallback (with ``--preload``, the app imported before the fork):
    every port of the range taken, the worker still answers requests, and exports
    once a port frees up."""
    url = f"sqlite:///{tmp_path / 'app.sqlite3'}"
    reset_tables(url)
    (port,) = free_ports(1)
    holder = socket.create_server(("127.0.0.1", port))  # the range's only port, taken
    server = None
    try:
        server = Gunicorn(tmp_path, url, range(port, port + 1), workers=1, options=["--preload"])
        _wait_log(server, "no free port in METRICS_PORTS")
        charge = {"amount": 100, "currency": "EUR"}
        assert _post(server.port, "/charges", "first", charge) == (201, False)
        assert _post(server.port, "/charges", "first", charge) == (201, True)
        holder.close()
        _wait_log(server, f"serves /metrics on 127.0.0.1:{port}")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            exposition = answer.read().decode()
        counted = {
            outcome: float(value)
            for outcome, value in re.findall(
                r'^idempotency_requests_total{.*idempotency_outcome="(\w+)".*} (\S+)$',
                exposition,
                re.M,
            )
        }
        assert counted == {"executed": 1, "replayed": 1}  # counted before the port freed too
    except BaseException:
        if server is not None:
            print("gunicorn:", server.output())
        raise
    finally:
        holder.close()
        if server is not None:
            server.stop()


def _wait_log(server: Gunicorn, text: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while text not in server.output(None):
        assert server.proc.poll() is None, server.output()
        assert time.monotonic() < deadline, f"never logged {text!r}: {server.output()}"
        time.sleep(0.2)
