"""Each protected request's outcome is counted once, with bounded attributes,
through a real request sequence against the real database; its phases are
spans under the Flask server span; its log line is structured."""

from __future__ import annotations

import concurrent.futures
import logging
import tempfile
import threading
import types
import typing as t
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from flask import Flask, request
from opentelemetry import trace
from opentelemetry.instrumentation.flask import FlaskInstrumentor
from opentelemetry.trace import SpanKind, StatusCode

from flask_idempotency._context import app_state
from flask_idempotency._request import claim as claim_module
from flask_idempotency._telemetry import OUTCOMES
from flask_idempotency._telemetry.request import KEY_REFUSALS
from tests.conftest import Clock, ledger_count, postgres_url, reset_tables
from tests.support import testapp
from tests.support.flow import assert_problem, post
from tests.support.gates import Gates, send

from .conftest import Otel

CHARGE = {"amount": 500, "currency": "EUR"}


def test_each_outcome_is_counted_once_with_its_route_and_method(
    otel: Otel, app: Flask, monkeypatch: pytest.MonkeyPatch
) -> None:
    @app.route("/both", methods=["GET", "POST"])
    @testapp.idem.idempotent()
    def both() -> dict[str, t.Any]:
        return {"method": request.method}

    client = app.test_client()
    assert post(client, "/charges", CHARGE, key="k1").status_code == 201
    assert post(client, "/charges", CHARGE, key="k1").headers["Idempotent-Replayed"] == "true"
    assert post(client, "/charges", CHARGE, key="k1").headers["Idempotent-Replayed"] == "true"
    assert_problem(post(client, "/charges", {**CHARGE, "amount": 1}, key="k1"), 422)
    assert_problem(post(client, "/charges", {"amount": "x", "currency": "EUR"}, key="k2"), 422)
    assert_problem(post(client, "/charges", CHARGE, key="a,b"), 400)  # malformed
    assert_problem(post(client, "/charges", CHARGE, key="x" * 256), 400)  # too long
    assert_problem(post(client, "/required", {}, key=None), 400)  # missing
    assert post(client, "/raw", {}, key=None).status_code == 200  # optional: passed through
    assert client.get("/both").status_code == 200  # a method the route leaves unprotected
    assert post(client, "/raise", {}, key="k3").status_code == 500
    assert post(client, "/status/500", {}, key="k4").status_code == 500  # ran, not stored
    # A view that committed a charge, then failed: recorded, never run again.
    monkeypatch.setattr(testapp, "time", types.SimpleNamespace(sleep=_raise, time=lambda: 0.0))
    assert post(client, "/commits-then-hangs", {}, key="k5").status_code == 500
    assert_problem(post(client, "/commits-then-hangs", {}, key="k5"), 500)  # its replay

    assert otel.outcomes() == {
        ("executed", "/charges", "POST"): 1,
        ("replayed", "/charges", "POST"): 2,
        ("mismatch", "/charges", "POST"): 1,
        ("invalid_payload", "/charges", "POST"): 1,
        ("key_refused", "/charges", "POST", "malformed"): 1,
        ("key_refused", "/charges", "POST", "too_long"): 1,
        ("key_refused", "/required", "POST", "missing"): 1,
        ("passed_through", "/raw", "POST"): 1,
        ("failed", "/raise", "POST"): 1,
        ("executed", "/status/<int:code>", "POST"): 1,
        ("failed_after_commit", "/commits-then-hangs", "POST"): 1,
        ("replayed", "/commits-then-hangs", "POST"): 1,
    }
    points = otel.collect()
    # The histograms: a claim per claiming request, a replay per replay, a size per
    # stored answer (the charge, the 500's stored failure is not an answer of the view).
    claims: dict[str, float] = {}
    for p in otel.series("idempotency.claim.duration", points):
        outcome = p.attributes["idempotency.outcome"]
        claims[outcome] = claims.get(outcome, 0) + p.value
    # Every request that reached the claim; the refused ones never did.
    assert claims == {
        "executed": 2,
        "replayed": 3,
        "mismatch": 1,
        "failed": 1,
        "failed_after_commit": 1,
    }
    replays = otel.series("idempotency.replay.duration", points)
    assert sum(p.value for p in replays) == 3
    [size] = otel.series(
        "idempotency.response.size",
        [p for p in points if p.attributes.get("http.route") == "/charges"],
    )
    assert size.value == 1
    assert size.total > 0
    assert size.attributes == {"http.route": "/charges", "http.request.method": "POST"}
    assert otel.series("idempotency.wait.duration", points) == []
    assert ledger_count(app, "charges") == 1


def _raise(seconds: float) -> None:
    raise RuntimeError("the view failed after its commit")


def test_a_duplicate_in_flight_and_one_that_waited_then_replayed(
    otel: Otel, app: Flask, clock: Clock
) -> None:
    """A duplicate of a leased request still running gets 409 (in_flight); one
    of a request whose claim rides in its transaction waits for it on the key
    and replays its answer (waited_replayed): its wait is measured and traced."""
    gates = Gates()
    store = app_state(app).store
    claims: list[threading.Event] = [threading.Event(), threading.Event()]
    original = store.claim
    calls = {"n": 0}

    def claim(*args: t.Any, **kwargs: t.Any) -> t.Any:
        n, calls["n"] = calls["n"], calls["n"] + 1
        if n < len(claims):
            claims[n].set()
        return original(*args, **kwargs)

    @app.post("/held/<mode>")
    @testapp.idem.idempotent(lease=True)
    def held_leased(mode: str) -> tuple[dict[str, t.Any], int]:
        gates.pause("leased")
        return {"id": testapp.write_ledger("held").id}, 201

    @app.post("/held-in-transaction")
    @testapp.idem.idempotent()
    def held() -> tuple[dict[str, t.Any], int]:
        if request.headers.get("X-Who") == "first":
            gates.pause("first")
        return {"id": testapp.write_ledger("held").id}, 201

    first = send(app, "/held/x", {}, **{"Idempotency-Key": "lk"})
    try:
        assert gates.arrived("leased")
        assert_problem(post(app.test_client(), "/held/x", {}, key="lk"), 409)
    finally:
        gates.open("leased")
    assert first.result().status_code == 201

    store.claim = claim  # type: ignore[method-assign]
    try:
        first = send(app, "/held-in-transaction", {}, **{"Idempotency-Key": "k", "X-Who": "first"})
        try:
            assert gates.arrived("first")
            second = send(app, "/held-in-transaction", {}, **{"Idempotency-Key": "k"})
            # The duplicate has begun its claim (and waits on the first's key):
            # the first completes a second later on the app's clock.
            assert claims[1].wait(30)
            clock.advance(seconds=1)
        finally:
            gates.open("first")
        answers = [first.result(), second.result()]
    finally:
        del store.claim
    assert [a.status_code for a in answers] == [201, 201]
    assert answers[1].headers["Idempotent-Replayed"] == "true"
    assert answers[0].get_data() == answers[1].get_data()

    assert otel.outcomes() == {
        ("executed", "/held/<mode>", "POST"): 1,
        ("in_flight", "/held/<mode>", "POST"): 1,
        ("executed", "/held-in-transaction", "POST"): 1,
        ("waited_replayed", "/held-in-transaction", "POST"): 1,
    }
    [wait] = otel.series("idempotency.wait.duration")
    assert wait.attributes["idempotency.outcome"] == "waited_replayed"
    assert wait.value == 1
    [wait_span] = [s for s in otel.spans() if s.name == "idempotency wait"]
    [claim_span] = [s for s in otel.spans() if s.context.span_id == wait_span.parent.span_id]
    assert claim_span.name == "idempotency claim"
    assert wait_span.attributes["idempotency.outcome"] == "waited_replayed"


def test_the_claim_and_the_completion_are_current_while_they_run(
    otel: Otel, app: Flask, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database instrumentation's statement spans nest under the phase that
    sent them: the store's claim and completion run with it current. The
    replay, which sends no statement, is not made current."""
    store = app_state(app).store
    seen: list[tuple[str, str]] = []

    def watched(name: str, function: t.Callable[..., t.Any]) -> t.Callable[..., t.Any]:
        def call(*args: t.Any, **kwargs: t.Any) -> t.Any:
            seen.append((name, getattr(trace.get_current_span(), "name", "no span")))
            return function(*args, **kwargs)

        return call

    monkeypatch.setattr(store, "claim", watched("claim", store.claim))
    monkeypatch.setattr(store, "complete", watched("complete", store.complete))
    monkeypatch.setattr(
        claim_module, "replay_answer", watched("replay", claim_module.replay_answer)
    )
    client = app.test_client()
    assert post(client, "/charges", CHARGE, key="k1").status_code == 201
    assert post(client, "/charges", CHARGE, key="k1").status_code == 201
    assert seen == [
        ("claim", "idempotency claim"),
        ("complete", "idempotency complete"),
        ("claim", "idempotency claim"),
        ("replay", "idempotency claim"),
    ]
    assert sorted(s.name for s in otel.spans()) == [
        "idempotency claim",
        "idempotency claim",
        "idempotency complete",
        "idempotency replay",
    ]


def test_database_outage_and_lock_conflict_are_their_own_outcomes(
    otel: Otel, app: Flask, monkeypatch: pytest.MonkeyPatch
) -> None:
    """503 (unavailable) and 409 transaction-conflict (busy), as the wrapper maps them."""
    store = app_state(app).store
    errors = {
        "unavailable": sa.exc.OperationalError(
            "INSERT", {}, ConnectionRefusedError("connection refused"), connection_invalidated=True
        ),
    }

    def claim(*args: t.Any, **kwargs: t.Any) -> t.Any:
        raise errors["unavailable"]

    monkeypatch.setattr(store, "claim", claim)
    assert_problem(post(app.test_client(), "/charges", CHARGE, key="k1"), 503)
    assert otel.outcomes() == {("unavailable", "/charges", "POST"): 1}
    [span] = [s for s in otel.spans() if s.name == "idempotency claim"]
    assert span.status.status_code is StatusCode.ERROR


@pytest.fixture
def instrumented(otel: Otel, app: Flask) -> t.Iterator[Flask]:
    FlaskInstrumentor().instrument_app(
        app, tracer_provider=otel.tracers, meter_provider=otel.meters
    )
    try:
        yield app
    finally:
        FlaskInstrumentor().uninstrument_app(app)


def test_the_phases_are_spans_under_the_flask_server_span(otel: Otel, instrumented: Flask) -> None:
    client = instrumented.test_client()
    assert post(client, "/charges", CHARGE, key="k1").status_code == 201
    assert post(client, "/charges", CHARGE, key="k1").status_code == 201
    assert_problem(post(client, "/charges", {**CHARGE, "amount": 2}, key="k1"), 422)
    spans = otel.spans()
    servers = [s for s in spans if s.kind is SpanKind.SERVER]
    assert len(servers) == 3
    ours = {s.context.trace_id: [] for s in servers}
    for span in spans:
        if span.name.startswith("idempotency "):
            ours[span.context.trace_id].append(span)
    first, retry, mismatch = (ours[s.context.trace_id] for s in servers)
    for server, children in zip(servers, (first, retry, mismatch), strict=True):
        for child in children:
            assert child.parent is not None
            assert child.parent.span_id == server.context.span_id, child.name
            assert child.attributes["http.route"] == "/charges"
    assert sorted(s.name for s in first) == ["idempotency claim", "idempotency complete"]
    assert sorted(s.name for s in retry) == ["idempotency claim", "idempotency replay"]
    assert [s.name for s in mismatch] == ["idempotency claim"]
    outcome = {s.name: s.attributes.get("idempotency.outcome") for s in first}
    assert outcome == {"idempotency claim": None, "idempotency complete": "executed"}
    outcome = {s.name: s.attributes.get("idempotency.outcome") for s in retry}
    assert outcome == {"idempotency claim": "replayed", "idempotency replay": "replayed"}
    [refused] = mismatch
    assert refused.attributes["idempotency.outcome"] == "mismatch"
    assert refused.status.status_code is StatusCode.ERROR
    assert [s.attributes["idempotency.outcome"] for s in servers] == [
        "executed",
        "replayed",
        "mismatch",
    ]


def test_one_structured_log_line_per_outcome_without_key_or_scope(
    otel: Otel, instrumented: Flask, caplog: pytest.LogCaptureFixture
) -> None:
    client = instrumented.test_client()
    with caplog.at_level(logging.INFO, logger="flask_idempotency"):
        post(client, "/tenant", {}, key="secret-key-1", headers={"X-Tenant": "acme-secret"})
        post(client, "/tenant", {}, key="secret-key-1", headers={"X-Tenant": "acme-secret"})
        post(client, "/charges", CHARGE, key="x" * 300)
    lines = [r for r in caplog.records if r.msg == "idempotency request"]
    assert [(r.idempotency_outcome, r.levelno) for r in lines] == [  # type: ignore[attr-defined]
        ("executed", logging.INFO),
        ("replayed", logging.INFO),
        ("key_refused", logging.INFO),
    ]
    servers = [s for s in otel.spans() if s.kind is SpanKind.SERVER]
    for line, server in zip(lines, servers, strict=True):
        assert line.http_route in ("/tenant", "/charges")  # type: ignore[attr-defined]
        assert line.trace_id == format(server.context.trace_id, "032x")  # type: ignore[attr-defined]
        assert line.duration_ms >= 0  # type: ignore[attr-defined]
        text = repr(vars(line))
        assert "secret" not in text
        assert "xxxxxxxx" not in text
    assert lines[2].idempotency_key_refusal == "too_long"  # type: ignore[attr-defined]


def test_the_log_line_has_no_trace_id_without_a_span(
    otel: Otel, app: Flask, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="flask_idempotency"):
        post(app.test_client(), "/charges", CHARGE, key="k1")
    [line] = [r for r in caplog.records if r.msg == "idempotency request"]
    assert line.trace_id is None  # type: ignore[attr-defined]
    assert line.idempotency_outcome == "executed"  # type: ignore[attr-defined]


@pytest.fixture(params=["sqlite", "psycopg"])
def busy_app(request: pytest.FixtureRequest, otel: Otel, clock: Clock) -> t.Iterator[Flask]:
    """The test app on SQLite in shared memory (no disk flush per request) or on
    PostgreSQL through psycopg 3."""
    if request.param == "sqlite":
        path = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        url = f"sqlite:///{path / f'idempotency-telemetry-{uuid.uuid4().hex}.sqlite3'}"
    else:
        url = postgres_url("psycopg")
    app = testapp.create_app(url, clock=clock)
    reset_tables(url)
    try:
        yield app
    finally:
        with app.app_context():
            testapp.db.engine.dispose()
        if url.startswith("sqlite"):
            Path(url.removeprefix("sqlite:///")).unlink(missing_ok=True)


@pytest.mark.slow
def test_ten_thousand_keys_in_a_thousand_scopes_make_no_more_series_than_routes_allow(
    otel: Otel, busy_app: Flask
) -> None:
    """The series count is bounded by routes x methods x outcomes, whatever the
    keys and scopes; no attribute value carries a key or a scope."""
    client = busy_app.test_client()
    keys = [f"key-{n:05d}" for n in range(10_000)]
    scopes = {f"tenant:tenant-{n % 1000:04d}" for n in range(10_000)}

    def send_one(n: int) -> list[int]:
        key, tenant = keys[n], f"tenant-{n % 1000:04d}"
        headers = {"X-Tenant": tenant}
        codes = [post(client, "/tenant", {}, key=key, headers=headers).status_code]
        if n % 100 == 0:  # a retry
            codes.append(post(client, "/tenant", {}, key=key, headers=headers).status_code)
        if n % 500 == 0:  # the key reused with another payload
            codes.append(post(client, "/tenant", {"n": n}, key=key, headers=headers).status_code)
        return codes

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        codes = [c for found in pool.map(send_one, range(len(keys))) for c in found]
    assert codes.count(201) == 10_000 + 100
    assert codes.count(422) == 20
    points = otel.collect()
    routes, methods = 1, 1
    bound = routes * methods * (len(OUTCOMES) + len(KEY_REFUSALS))
    requests = otel.series("idempotency.requests", points)
    assert len(requests) <= bound
    assert {p.attributes["idempotency.outcome"]: p.value for p in requests} == {
        "executed": 10_000,
        "replayed": 100,
        "mismatch": 20,
    }
    for metric in {p.metric for p in points}:
        assert len([p for p in points if p.metric == metric]) <= bound, metric
    values = {str(v) for p in points for v in p.attributes.values()}
    assert not values & set(keys)
    assert not values & scopes
    assert not any("key-" in v or "tenant-" in v or "tenant:" in v for v in values)


def test_a_lock_timeout_in_the_view_is_busy(otel: Otel, pg_url: str, clock: Clock) -> None:
    """The database gives up waiting for another transaction's lock: 409
    transaction-conflict, counted busy (not in_flight: no duplicate is running)."""
    app = testapp.create_app(pg_url, clock=clock)
    reset_tables(pg_url)
    # Advisory locks are the whole database's: one of this test's own.
    lock = {"id": uuid.uuid4().int >> 65}

    @app.post("/locks")
    @testapp.idem.idempotent()
    def locks() -> dict[str, t.Any]:
        testapp.db.session.execute(sa.text("SET LOCAL lock_timeout = '100ms'"))
        testapp.db.session.execute(sa.text("SELECT pg_advisory_xact_lock(:id)"), lock)
        return {"locked": True}

    engine = sa.create_engine(pg_url)
    try:
        with engine.connect() as holder:
            holder.execute(sa.text("SELECT pg_advisory_xact_lock(:id)"), lock)
            answer = post(app.test_client(), "/locks", {}, key="k1")
            holder.rollback()
    finally:
        engine.dispose()
    assert assert_problem(answer, 409)["type"].endswith("transaction-conflict")
    assert post(app.test_client(), "/locks", {}, key="k1").status_code == 200
    assert otel.outcomes() == {
        ("busy", "/locks", "POST"): 1,
        ("executed", "/locks", "POST"): 1,
    }
    with app.app_context():
        testapp.db.engine.dispose()


def test_optimistic_and_skipped_requests(otel: Otel, app: Flask) -> None:
    @app.post("/skipped")
    @testapp.idem.idempotent(skip=lambda: True)
    def skipped() -> dict[str, t.Any]:
        return {"ran": True}

    client = app.test_client()
    assert post(client, "/optimistic", CHARGE, key="k1").status_code == 201
    assert post(client, "/optimistic", CHARGE, key="k1").headers["Idempotent-Replayed"] == "true"
    assert post(client, "/skipped", {}, key="k1").status_code == 200
    assert otel.outcomes() == {
        ("executed", "/optimistic", "POST"): 1,
        ("replayed", "/optimistic", "POST"): 1,
        ("passed_through", "/skipped", "POST"): 1,
    }
    [size] = otel.series("idempotency.response.size")
    assert size.attributes["http.route"] == "/optimistic"
    assert ledger_count(app, "optimistic") == 1
