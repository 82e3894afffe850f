"""The options other idempotency libraries give their users, per app and per route:
protected methods, stored statuses, a skip predicate, manual mode, replaying all
headers, and unknown settings refused. On every engine, counting ledger rows.
"""

from __future__ import annotations

import json
import typing as t
from datetime import timedelta

import pytest
from flask import Flask, Response, request
from flask_sqlalchemy import SQLAlchemy

from flask_idempotency import Idempotency
from tests.conftest import Clock, ledger_count, record_rows, reset_tables
from tests.support import testapp
from tests.support.flow import assert_problem

idem = testapp.idem

HOP_BY_HOP = {
    "Keep-Alive": "timeout=5",
    "Upgrade": "h2c",
    "TE": "trailers",
    "Trailer": "Expires",
    "Trailers": "Expires",
    "Proxy-Connection": "keep-alive",
}


def options_app(database_url: str, clock: Clock, **config: t.Any) -> Flask:
    app = testapp.create_app(database_url, clock=clock, **config)

    @app.route("/both", methods=["GET", "HEAD", "OPTIONS", "POST", "PUT", "DELETE"])
    @idem.idempotent(required=True)
    def both() -> tuple[dict[str, t.Any], int]:
        row = testapp.write_ledger(f"both-{request.method}")
        return {"id": row.id, "method": request.method}, 200

    @app.route("/put", methods=["PUT", "POST"])
    @idem.idempotent(methods=["PUT"])
    def put() -> tuple[dict[str, t.Any], int]:
        row = testapp.write_ledger(f"put-{request.method}")
        return {"id": row.id}, 200

    @app.post("/only-2xx/<int:code>")
    @idem.idempotent(stored_statuses=range(200, 300))
    def only_2xx(code: int) -> tuple[dict[str, t.Any], int]:
        row = testapp.write_ledger("only-2xx")
        return {"id": row.id}, code

    @app.post("/skippable")
    @idem.idempotent(skip=lambda: request.headers.get("X-Internal") == "yes")
    def skippable() -> tuple[dict[str, t.Any], int]:
        row = testapp.write_ledger("skippable")
        return {"id": row.id}, 201

    @app.post("/manual")
    @idem.idempotent(manual=True)
    def manual() -> Response | tuple[dict[str, t.Any], int]:
        previous = idem.previous
        if previous is not None:
            testapp.write_ledger("manual-retry")  # rolled back: the operation happened
            if request.headers.get("X-Want") == "replay":
                return idem.replay()
            return {
                "already": previous.response_code,
                "first_body": previous.response_body.decode(),
            }, 200
        row = testapp.write_ledger("manual")
        return {"id": row.id}, 201

    @app.post("/all-headers")
    @idem.idempotent(replay_headers="*")
    def all_headers() -> Response:
        row = testapp.write_ledger("all-headers")
        response = Response(f'{{"id": {row.id}}}', status=201, content_type="application/json")
        response.headers["X-Trace"] = "t-1"
        response.headers["ETag"] = '"v1"'
        response.set_cookie("visitor", "first-callers-secret")
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    @app.post("/hop-by-hop")
    @idem.idempotent(replay_headers="*")
    def hop_by_hop() -> Response:
        row = testapp.write_ledger("hop-by-hop")
        response = Response(f'{{"id": {row.id}}}', status=201, content_type="application/json")
        for name, value in HOP_BY_HOP.items():
            response.headers[name] = value
        response.headers["Connection"] = "X-Hop"  # names one more hop-by-hop header
        response.headers["X-Hop"] = "1"
        response.headers["X-Trace"] = "t-1"
        return response

    reset_tables(database_url)
    return app


def call(client: t.Any, method: str, path: str, key: str | None = "K", **headers: str) -> t.Any:
    if key is not None:
        headers["Idempotency-Key"] = key
    return client.open(
        path, method=method, json={} if method in ("POST", "PUT") else None, headers=headers
    )


# -- methods ------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS"])
def test_unprotected_methods_pass_straight_through(
    database_url: str, clock: Clock, method: str
) -> None:
    """No key needed (even with required=True), no record, no replay; each call
    runs the view."""
    app = options_app(database_url, clock)
    client = app.test_client()
    for key in (None, "K", "K"):
        response = call(client, method, "/both", key)
        assert response.status_code == 200, response.get_data(as_text=True)
        assert "Idempotent-Replayed" not in response.headers
    assert record_rows(app) == []
    if method != "OPTIONS":  # Flask answers OPTIONS itself
        assert ledger_count(app, f"both-{method}") == 3


def test_get_with_the_posts_key_is_not_a_mismatch(database_url: str, clock: Clock) -> None:
    app = options_app(database_url, clock)
    client = app.test_client()
    assert call(client, "POST", "/both").status_code == 200
    [posted] = record_rows(app)
    got = call(client, "GET", "/both")
    assert got.status_code == 200
    assert got.get_json()["method"] == "GET"
    assert record_rows(app) == [posted]  # untouched
    replay = call(client, "POST", "/both")
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert ledger_count(app, "both-POST") == 1


def test_post_without_a_key_on_a_required_route_is_still_400(
    database_url: str, clock: Clock
) -> None:
    app = options_app(database_url, clock)
    assert_problem(call(app.test_client(), "POST", "/both", None), 400)
    assert ledger_count(app) == 0


def test_a_route_can_protect_put_and_leave_post_alone(database_url: str, clock: Clock) -> None:
    app = options_app(database_url, clock)
    client = app.test_client()
    for _ in range(3):
        call(client, "PUT", "/put")
        call(client, "POST", "/put")
    assert ledger_count(app, "put-PUT") == 1
    assert ledger_count(app, "put-POST") == 3


def test_methods_setting_applies_to_every_route(database_url: str, clock: Clock) -> None:
    app = options_app(database_url, clock, IDEMPOTENCY_METHODS=["post", "PUT", "DELETE"])
    client = app.test_client()
    for _ in range(2):
        assert call(client, "DELETE", "/both").status_code == 200
    assert ledger_count(app, "both-DELETE") == 1
    assert_problem(call(client, "PUT", "/both", None), 400)  # required, and now protected


@pytest.mark.parametrize("method", ["PUT", "DELETE", "PATCH"])
def test_every_unsafe_method_a_view_serves_is_protected_by_default(
    database_url: str, clock: Clock, method: str
) -> None:
    """A decorated view registered for PUT or DELETE once ran on every retry and
    took requests without a key, silently: now every method but the safe ones is
    protected unless the app or the route says otherwise."""
    app = options_app(database_url, clock)

    @app.route("/edit", methods=["GET", "PUT", "PATCH", "DELETE"])
    @idem.idempotent(required=True)
    def edit() -> tuple[dict[str, t.Any], int]:
        row = testapp.write_ledger(f"edit-{request.method}")
        return {"id": row.id}, 200

    client = app.test_client()
    assert_problem(call(client, method, "/edit", None), 400)  # required: a key
    for _ in range(3):
        response = call(client, method, "/edit")
        assert response.status_code == 200
    assert response.headers["Idempotent-Replayed"] == "true"
    assert ledger_count(app, f"edit-{method}") == 1
    assert call(client, "GET", "/edit", None).status_code == 200  # safe: unprotected


def test_a_view_serving_a_method_the_app_setting_leaves_out_is_refused(
    database_url: str, clock: Clock
) -> None:
    """``IDEMPOTENCY_METHODS`` narrowed app-wide, and a decorated view serving PUT
    and DELETE: refused at the first request, naming the view and the fix; no
    request runs (a route's own ``methods=`` is a choice, and stands)."""
    app = options_app(database_url, clock, IDEMPOTENCY_METHODS=["POST"])
    app.testing = True  # the error reaches the test, not an error page
    client = app.test_client()
    with pytest.raises(RuntimeError) as info:
        call(client, "POST", "/status/201")
    message = str(info.value)
    assert "both (/both): DELETE, PUT" in message
    assert "/put" not in message  # methods=["PUT"] on the route: its own choice
    assert "pass methods=[...] to @idem.idempotent" in message
    assert ledger_count(app) == 0


def test_the_decorator_without_parentheses(database_url: str, clock: Clock) -> None:
    app = options_app(database_url, clock)

    @app.post("/bare")
    @idem.idempotent
    def bare() -> tuple[dict[str, t.Any], int]:
        row = testapp.write_ledger("bare")
        return {"id": row.id}, 201

    client = app.test_client()
    for _ in range(2):
        assert call(client, "POST", "/bare").status_code == 201
    assert ledger_count(app, "bare") == 1
    with pytest.raises(TypeError, match="takes its options as keywords"):
        idem.idempotent("POST")  # type: ignore[call-overload]


@pytest.mark.parametrize("methods", [["GET", "POST"], ["HEAD"], [], "POST"])
def test_safe_or_empty_methods_are_refused(methods: t.Any) -> None:
    app = Flask("m")
    app.config.update(SQLALCHEMY_DATABASE_URI="sqlite://", IDEMPOTENCY_METHODS=methods)
    with pytest.raises((ValueError, TypeError), match="METHODS"):
        Idempotency(app, SQLAlchemy(app))
    with pytest.raises((ValueError, TypeError), match="methods"):
        Idempotency().idempotent(methods=methods)


# -- stored statuses ----------------------------------------------------------------


def test_only_the_configured_statuses_are_stored(database_url: str, clock: Clock) -> None:
    app = options_app(database_url, clock)
    client = app.test_client()
    # A 400 is deterministic, but this route stores only 2xx: rolled back, not kept.
    for _ in range(2):
        response = call(client, "POST", "/only-2xx/400")
        assert response.status_code == 400
        assert "Idempotent-Replayed" not in response.headers
    assert ledger_count(app, "only-2xx") == 0
    assert record_rows(app) == []
    assert call(client, "POST", "/only-2xx/201").status_code == 201
    assert call(client, "POST", "/only-2xx/201").headers["Idempotent-Replayed"] == "true"
    assert ledger_count(app, "only-2xx") == 1


def test_stored_statuses_setting_and_its_checks(database_url: str, clock: Clock) -> None:
    app = options_app(database_url, clock, IDEMPOTENCY_STORED_STATUSES=[201])
    client = app.test_client()
    # A success the setting does not store: its work commits (never a 200 for
    # work rolled back), and no record is kept, so the retry runs again.
    for _ in range(2):
        response = call(client, "POST", "/status/200", "a")
        assert response.status_code == 200
        assert "Idempotent-Replayed" not in response.headers
    assert ledger_count(app, "status/200") == 2
    assert record_rows(app) == []
    # A stored one is stored, and replayed.
    call(client, "POST", "/status/201", "b")
    assert call(client, "POST", "/status/201", "b").headers["Idempotent-Replayed"] == "true"
    assert ledger_count(app, "status/201") == 1
    # Without a key: the same transaction rule (a 200 commits).
    assert call(client, "POST", "/status/200", None).status_code == 200
    assert ledger_count(app, "status/200") == 3
    for bad in ([500], [199], ["201"], 201):
        with pytest.raises((ValueError, TypeError), match="stored_statuses"):
            Idempotency().idempotent(stored_statuses=bad)


# -- skip -------------------------------------------------------------------------------


def test_skip_predicate_runs_the_request_unprotected(database_url: str, clock: Clock) -> None:
    app = options_app(database_url, clock)
    client = app.test_client()
    for _ in range(2):
        assert call(client, "POST", "/skippable", **{"X-Internal": "yes"}).status_code == 201
    assert record_rows(app) == []
    assert ledger_count(app, "skippable") == 2  # committed, unprotected
    for _ in range(2):
        call(client, "POST", "/skippable")
    assert ledger_count(app, "skippable") == 3
    assert len(record_rows(app)) == 1


def test_skip_setting_applies_to_every_route(database_url: str, clock: Clock) -> None:
    app = options_app(
        database_url, clock, IDEMPOTENCY_SKIP=lambda: request.path.startswith("/status")
    )
    client = app.test_client()
    for _ in range(2):
        call(client, "POST", "/status/201")
    assert ledger_count(app, "status/201") == 2
    assert record_rows(app) == []


# -- manual mode -----------------------------------------------------------------


def test_manual_mode_lets_the_view_answer_a_retry_without_a_second_effect(
    database_url: str, clock: Clock
) -> None:
    app = options_app(database_url, clock)
    client = app.test_client()
    first = call(client, "POST", "/manual")
    assert first.status_code == 201
    retry = call(client, "POST", "/manual")
    assert retry.status_code == 200
    assert retry.get_json() == {"already": 201, "first_body": first.get_data(as_text=True)}
    replayed = call(client, "POST", "/manual", **{"X-Want": "replay"})
    assert replayed.status_code == 201
    assert replayed.headers["Idempotent-Replayed"] == "true"
    assert replayed.get_data() == first.get_data()
    assert ledger_count(app, "manual") == 1
    assert ledger_count(app, "manual-retry") == 0  # the retries' writes rolled back
    # A different payload is still refused before the view runs.
    assert_problem(client.post("/manual", json={"other": 1}, headers={"Idempotency-Key": "K"}), 422)


# -- replayed headers ---------------------------------------------------------------


def test_replay_headers_star_replays_all_but_the_never_replayed(
    database_url: str, clock: Clock
) -> None:
    app = options_app(database_url, clock)
    client = app.test_client()
    first = call(client, "POST", "/all-headers")
    assert "Set-Cookie" in first.headers
    replay = call(client, "POST", "/all-headers")
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.headers["X-Trace"] == "t-1"
    assert replay.headers["ETag"] == '"v1"'
    assert "Set-Cookie" not in replay.headers
    assert "WWW-Authenticate" not in replay.headers
    assert ledger_count(app, "all-headers") == 1


def test_hop_by_hop_headers_are_never_stored_or_replayed(database_url: str, clock: Clock) -> None:
    from wsgiref.util import is_hop_by_hop

    app = options_app(database_url, clock)
    client = app.test_client()
    assert call(client, "POST", "/hop-by-hop").status_code == 201
    [record] = record_rows(app)
    stored = {name.lower() for name, _ in json.loads(record["response_headers"])}
    assert stored == {"content-type", "x-trace"}
    replay = call(client, "POST", "/hop-by-hop")
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.headers["X-Trace"] == "t-1"
    assert not [name for name, _ in replay.headers.items() if is_hop_by_hop(name)]
    assert "X-Hop" not in replay.headers
    assert ledger_count(app, "hop-by-hop") == 1


# -- settings the extension does not know --------------------------------------


@pytest.mark.parametrize(
    ("name", "hint"),
    [("IDEMPOTENCY_TLL", "IDEMPOTENCY_TTL"), ("IDEMPOTENCY_REQUIRE", "IDEMPOTENCY_REQUIRED")],
)
def test_unknown_setting_is_refused_with_a_hint(name: str, hint: str) -> None:
    app = Flask("typo")
    app.config.update({"SQLALCHEMY_DATABASE_URI": "sqlite://", name: 1})
    with pytest.raises(ValueError, match=f"{name} \\(did you mean {hint}\\?\\)"):
        Idempotency(app, SQLAlchemy(app))


def test_unknown_option_to_the_decorator_is_refused() -> None:
    with pytest.raises(TypeError):
        Idempotency().idempotent(tll=5)  # type: ignore[call-arg]


def test_manual_mode_retry_cannot_commit_a_second_effect(database_url: str, clock: Clock) -> None:
    app = options_app(database_url, clock)

    @app.post("/manual-commits")
    @idem.idempotent(manual=True)
    def manual_commits() -> tuple[dict[str, t.Any], int]:
        row = testapp.write_ledger("manual-commits")
        testapp.db.session.commit()  # on a retry this must not land
        return {"id": row.id}, 201

    client = app.test_client()
    assert call(client, "POST", "/manual-commits").status_code == 201
    app.config["PROPAGATE_EXCEPTIONS"] = True
    with pytest.raises(RuntimeError, match="must not commit"):
        call(client, "POST", "/manual-commits")
    assert ledger_count(app, "manual-commits") == 1


# -- setting values: refused at init_app, or working on every engine -------------------


def _init(**config: t.Any) -> Flask:
    app = Flask("values")
    app.config.update({"SQLALCHEMY_DATABASE_URI": "sqlite://", **config})
    Idempotency(app, SQLAlchemy(app))
    return app


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        # PostgreSQL holds lock_timeout / idle_in_transaction_session_timeout in ms,
        # at most 2**31 - 1 (24.8 days): more fails every claim, or every probe.
        ("IDEMPOTENCY_WAIT", timedelta(days=30), "at most 24 days"),
        ("IDEMPOTENCY_CLAIM_IDLE_TIMEOUT", timedelta(days=30), "at most 24 days"),
        ("IDEMPOTENCY_READY_TIMEOUT", 30 * 86400, "at most 24 days"),
        ("IDEMPOTENCY_TTL", timedelta(days=999_999), "at most 36500 days"),
        ("IDEMPOTENCY_TTL", 1e308, "at most 36500 days"),
        ("IDEMPOTENCY_TTL", float("nan"), "finite"),
        ("IDEMPOTENCY_LEASE", float("inf"), "finite"),
        ("IDEMPOTENCY_TTL", "10s", "a timedelta or a number of seconds"),
        ("IDEMPOTENCY_TTL", "60", "a timedelta or a number of seconds"),
        ("IDEMPOTENCY_WAIT", -1, "must not be negative"),
        ("IDEMPOTENCY_PURGE_EVERY", 0, "longer than zero"),
        ("IDEMPOTENCY_RECOVER_EVERY", 0, "longer than zero"),
        ("IDEMPOTENCY_JOB_LOCK", 0, "longer than zero"),
        ("IDEMPOTENCY_PURGE_BATCH", 2**63, "from 1 to 2147483647"),
        ("IDEMPOTENCY_PURGE_BATCH", "1000", "from 1 to 2147483647"),
        ("IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS", 0, "from 1 to 2147483647"),
        ("IDEMPOTENCY_MAX_BODY", "1e6", "a number of bytes"),
        ("IDEMPOTENCY_MAX_BODY", -1, "a number of bytes"),
        ("IDEMPOTENCY_REQUIRED", "maybe", "must be True or False"),
        ("IDEMPOTENCY_SCHEDULER", 2, "must be True or False"),
        ("IDEMPOTENCY_RELAY_WAKE", None, "must be True or False"),
        ("IDEMPOTENCY_DATABASE_POOLER", "statement", "statement pooling allows no transaction"),
        ("IDEMPOTENCY_DATABASE_POOLER", "pgbouncer", "must be None or one of 'session'"),
        ("IDEMPOTENCY_DATABASE_POOLER", True, "must be None or one of"),
        ("IDEMPOTENCY_RELAY_LISTEN_URL", "db-primary:5432", "must be a database URL"),
        ("IDEMPOTENCY_RELAY_LISTEN_URL", 5432, "must be a database URL"),
        ("IDEMPOTENCY_RELAY_LISTEN_URL", "sqlite:///x.db", "LISTEN is PostgreSQL's"),
    ],
)
def test_a_setting_out_of_range_is_refused_at_init_app_naming_it(
    name: str, value: t.Any, message: str
) -> None:
    with pytest.raises((ValueError, TypeError), match=f"{name}.*{message}"):
        _init(**{name: value})


@pytest.mark.parametrize(
    ("value", "expected"),
    [("false", False), ("False", False), ("0", False), ("off", False), ("no", False),
     (0, False), ("true", True), ("on", True), ("1", True), (1, True), (True, True)],
)  # fmt: skip
def test_on_off_settings_read_text_as_written(value: t.Any, expected: bool) -> None:
    settings = (
        _init(IDEMPOTENCY_REQUIRED=value, IDEMPOTENCY_SCHEDULER=value, IDEMPOTENCY_RELAY_WAKE=value)
        .extensions["idempotency"]
        .settings
    )
    assert (settings.required, settings.scheduler, settings.relay_wake) == (expected,) * 3


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None), ("", None), ("None", None), ("session", "session"),
        (" Transaction ", "transaction"), ("TRANSACTION+PREPARED", "transaction+prepared"),
    ],
)  # fmt: skip
def test_the_pooler_setting_reads_text_as_written(value: t.Any, expected: str | None) -> None:
    settings = _init(IDEMPOTENCY_DATABASE_POOLER=value).extensions["idempotency"].settings
    assert settings.database_pooler == expected
    assert settings.transaction_pooled == (expected is not None and expected != "session")


def test_the_listen_url_is_kept_whole_and_its_password_never_echoed() -> None:
    url = "postgresql+psycopg://app:s3cret@db-primary:5432/shop"
    assert (
        _init(IDEMPOTENCY_RELAY_LISTEN_URL=url).extensions["idempotency"].settings.relay_listen_url
        == url
    )
    with pytest.raises(ValueError, match="must be a database URL") as refused:
        _init(IDEMPOTENCY_RELAY_LISTEN_URL="app:s3cret@db-primary")
    assert "s3cret" not in str(refused.value)


def test_a_route_option_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="wait must be at most 24 days"):
        Idempotency().idempotent(wait=timedelta(days=30))
    with pytest.raises(ValueError, match="required must be True or False"):
        Idempotency().idempotent(required="maybe")  # type: ignore[arg-type]


def test_the_longest_bounds_accepted_work_on_every_engine(
    database_url: str, make_app: t.Callable[..., Flask]
) -> None:
    """The largest IDEMPOTENCY_WAIT, IDEMPOTENCY_CLAIM_IDLE_TIMEOUT and
    IDEMPOTENCY_READY_TIMEOUT init_app takes are ones the engine takes too: the
    claim stores, the retry replays, readiness is ready."""
    longest = timedelta(days=24)
    app = make_app(
        IDEMPOTENCY_WAIT=longest,
        IDEMPOTENCY_CLAIM_IDLE_TIMEOUT=longest,
        IDEMPOTENCY_READY_TIMEOUT=longest,
        IDEMPOTENCY_TTL=timedelta(days=36500),
    )
    client = app.test_client()
    first = call(client, "POST", "/required", key="long-bounds")
    again = call(client, "POST", "/required", key="long-bounds")
    assert first.status_code == 201, first.get_data(as_text=True)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert ledger_count(app, "required") == 1
    with app.app_context():
        ready, details = idem.readiness()
    assert ready, details


def test_the_decorator_above_the_route_is_refused(database_url: str) -> None:
    """``@idem.idempotent`` above ``@bp.post``: the route registered the bare view,
    which would run unprotected (and, its writes never committed, lose them)."""
    from flask import Blueprint, Flask
    from flask_sqlalchemy import SQLAlchemy

    from flask_idempotency import Idempotency

    app = Flask(__name__)
    app.config.update(SQLALCHEMY_DATABASE_URI=database_url, TESTING=True)
    db, idem = SQLAlchemy(), Idempotency()
    bp = Blueprint("pay", __name__)

    @idem.idempotent
    @bp.post("/payments")
    def payments() -> tuple[str, int]:
        return "", 201

    @bp.post("/fine")
    @idem.idempotent
    def fine() -> tuple[str, int]:
        return "", 201

    db.init_app(app)
    idem.init_app(app, db)
    app.register_blueprint(bp)
    with app.app_context():
        db.create_all()
    with pytest.raises(RuntimeError, match=r"pay\.payments \(/payments\).*below @app\.route"):
        app.test_client().post("/fine", headers={"Idempotency-Key": "k"})
    with app.app_context():
        db.engine.dispose()
