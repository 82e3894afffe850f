"""The shipped monitoring files hold: the rules file passes ``promtool check rules``,
each alert fires in ``promtool test rules`` on the condition it names, every alert
has its annotations and a runbook section on docs/monitoring.md, and every PromQL
expression and the scrape configuration on that page parse.

Skipped, saying so, where promtool is missing (Debian: ``apt-get install
prometheus``). The same expressions run against a real Prometheus in
tests/live/test_prometheus_live.py.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import yaml

from tests.support.prometheus import (
    MONITORING,
    RULES,
    RULES_TESTS,
    dashboard_queries,
    fenced_blocks,
    run_promtool,
)

DOCS_URL = "https://flask-idempotency.readthedocs.io/en/latest/monitoring.html#"


def _alerts() -> list[dict[str, object]]:
    groups = yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_the_rules_file_passes_promtool_check_rules() -> None:
    done = run_promtool("check", "rules", RULES)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_each_alert_fires_on_its_condition_in_promtool_unit_tests() -> None:
    done = run_promtool("test", "rules", RULES_TESTS.name, cwd=RULES_TESTS.parent)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_unit_tests_see_every_alert_fire() -> None:
    """Each alert has a test time where it is expected firing, and one where it is
    expected quiet: promtool then fails on a rule that fires too early or never."""
    tests = yaml.safe_load(RULES_TESTS.read_text(encoding="utf-8"))["tests"]
    firing, quiet = set(), set()
    for case in tests:
        for check in case["alert_rule_test"]:
            (firing if check["exp_alerts"] else quiet).add(check["alertname"])
    names = {str(alert["alert"]) for alert in _alerts()}
    assert firing == names
    assert quiet == names


def test_every_alert_says_what_it_means_and_where_its_runbook_is() -> None:
    page = MONITORING.read_text(encoding="utf-8")
    anchors = set(re.findall(r"^\(([a-z0-9-]+)\)=$", page, re.M))
    linked = set()
    for alert in _alerts():
        annotations = alert["annotations"]
        assert isinstance(annotations, dict), alert
        assert annotations.keys() == {"summary", "description", "runbook_url"}, alert["alert"]
        assert all(str(text).strip() for text in annotations.values()), alert["alert"]
        assert str(annotations["runbook_url"]).startswith(DOCS_URL), alert["alert"]
        anchor = str(annotations["runbook_url"]).removeprefix(DOCS_URL)
        assert anchor in anchors, f"{alert['alert']}: no section ({anchor})= on monitoring.md"
        # The section right after the anchor is named for the alert.
        assert f"({anchor})=\n### {alert['alert']}\n" in page
        assert alert["labels"]["severity"] in {"critical", "warning", "info"}  # type: ignore[index]
        linked.add(anchor)
    assert {anchor for anchor in anchors if anchor.startswith("alert-")} == linked


def test_every_promql_expression_on_the_page_parses(tmp_path: Path) -> None:
    """promtool 2.42 has no expression checker of its own: each expression becomes a
    recording rule, which ``check rules`` parses."""
    queries = dashboard_queries()
    assert len(queries) >= 30
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:panel_{n}", "expr": expr}
                    for n, expr in enumerate(queries)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard.yml"
    path.write_text(yaml.safe_dump(rules), encoding="utf-8")
    done = run_promtool("check", "rules", "--lint=none", path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_broken_expression_fails_that_check(tmp_path: Path) -> None:
    """The check above can fail."""
    path = tmp_path / "broken.yml"
    broken = {"groups": [{"name": "x", "rules": [{"record": "x", "expr": "sum by (job (up)"}]}]}
    path.write_text(yaml.safe_dump(broken), encoding="utf-8")
    assert run_promtool("check", "rules", path).returncode != 0


def test_the_scrape_configuration_on_the_page_passes_promtool(tmp_path: Path) -> None:
    (config,) = [
        block
        for block in fenced_blocks(MONITORING.read_text(), "yaml")
        if "scrape_configs" in block
    ]
    shutil.copy(RULES, tmp_path / "idempotency-rules.yml")
    (tmp_path / "prometheus.yml").write_text(config, encoding="utf-8")
    done = run_promtool("check", "config", tmp_path / "prometheus.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_page_shows_the_files_the_tests_use() -> None:
    page = MONITORING.read_text(encoding="utf-8")
    assert "```{literalinclude} examples/gunicorn_otel.conf.py\n" in page
    assert "```{literalinclude} examples/prometheus/idempotency-rules.yml\n" in page


def test_every_range_holds_five_scrapes_at_a_one_minute_scrape_interval() -> None:
    """rate() and increase() need two samples in their window: at Prometheus' default
    1-minute scrape, a window of a minute or two holds one when the evaluation falls
    between scrapes. Every range and offset of the rules and of the dashboard's page is
    at least 5 minutes, and the unit tests scrape every minute and evaluate between
    the scrapes."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    texts = [RULES.read_text(encoding="utf-8"), *dashboard_queries()]
    ranges = [
        (text, amount, unit)
        for text in texts
        for amount, unit in re.findall(r"(?:\[|offset )(\d+)([smhd])\b", text)
    ]
    assert len(ranges) > 40
    short = [(amount + unit) for _, amount, unit in ranges if int(amount) * units[unit] < 300]
    assert short == []
    tests = yaml.safe_load(RULES_TESTS.read_text(encoding="utf-8"))
    assert tests["evaluation_interval"] == "15s"
    assert {case["interval"] for case in tests["tests"]} == {"1m"}


def test_the_job_alerts_windows_are_three_intervals_of_the_defaults() -> None:
    """IdempotencyJobNotRunning looks back 3 default intervals of each job (at least 5
    minutes: 5 scrapes at a 1-minute scrape interval), so a change of a default shows
    here."""
    from datetime import timedelta

    from flask_idempotency import config

    every = {
        "cleanup": config.DEFAULTS["PURGE_EVERY"],
        "lease_recovery": config.DEFAULTS["RECOVER_EVERY"],
        "outbox_relay": config.DEFAULTS["RELAY_EVERY"],
    }
    windows = {}
    for alert in _alerts():
        if alert["alert"] == "IdempotencyJobNotRunning":
            job = alert["labels"]["idempotency_job"]  # type: ignore[index]
            (window,) = set(
                re.findall(r'idempotency_job="\w+", [^}]*\}\[(\d+)m\]', str(alert["expr"]))
            )
            windows[job] = timedelta(minutes=int(window))
    assert windows.keys() == every.keys()
    for job, interval in every.items():
        wanted = max(3 * interval, timedelta(minutes=5))
        assert wanted <= windows[job] < wanted + timedelta(minutes=1), job
