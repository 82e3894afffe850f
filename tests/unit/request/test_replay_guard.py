"""The replay guard (``replay_guard=``, ``IDEMPOTENCY_REPLAY_GUARD``) and where
authentication runs relative to the extension, on each of the suite's engines.

A replay answers whoever presents the key in its scope: a caller who lost access
after the first attempt still gets the stored answer, unless a guard refuses it.
A refusal answers 403 ``replay-refused`` (or the app's own ``abort``) and changes
nothing. Authentication above ``@idem.idempotent`` keeps a caller without valid
credentials away from both the claim and the replay; below it, the extension
replays the stored answer to a revoked token, or to no credentials at all."""

from __future__ import annotations

import functools
import logging
import threading
import time
import typing as t
import uuid

import flask_login
import pytest
import sqlalchemy as sa
from flask import Flask, abort, g, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import orm

from flask_idempotency import Idempotency, signals
from flask_idempotency.errors import PROBLEM_JSON, PROBLEM_TYPE_BASE
from flask_idempotency.models import TABLE_NAME
from flask_idempotency.scope import ReplayAttempt
from tests.conftest import Clock, ledger_count, record_rows, reset_tables
from tests.support import testapp
from tests.support.flow import post as flow_post
from tests.support.tables import recreate_tables

db = SQLAlchemy()
idem = Idempotency()

#: Bearer tokens and their users; a test revokes one by removing it.
TOKENS: dict[str, str] = {}
#: Users who may still create orders; the guard asks this.
ALLOWED: set[str | None] = set()
REFUSED = PROBLEM_TYPE_BASE + "replay-refused"
#: What each guard was shown, in order.
SEEN: list[ReplayAttempt] = []


class Order(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "replay_guard_orders"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    amount: orm.Mapped[int]


class User(flask_login.UserMixin):
    def __init__(self, name: str) -> None:
        self.id = name


def token_user() -> str | None:
    header = request.headers.get("Authorization", "")
    return TOKENS.get(header.removeprefix("Bearer ")) if header.startswith("Bearer ") else None


def bearer_required(view: t.Callable[..., t.Any]) -> t.Callable[..., t.Any]:
    """The app's own token check: 401 unless the token is known (not revoked)."""

    @functools.wraps(view)
    def checked(*args: t.Any, **kwargs: t.Any) -> t.Any:
        user = token_user()
        if user is None:
            abort(401)
        g.user = user
        return view(*args, **kwargs)

    return checked


AUTH: dict[str, t.Callable[[t.Callable[..., t.Any]], t.Callable[..., t.Any]]] = {
    "flask-login": flask_login.login_required,
    "bearer": bearer_required,
}


def allowed_guard(attempt: ReplayAttempt) -> bool:
    SEEN.append(attempt)
    return token_user() in ALLOWED


def aborting_guard(attempt: ReplayAttempt) -> bool:
    SEEN.append(attempt)
    if token_user() not in ALLOWED:
        abort(403, "suspended")
    return True


#: What a held first request signals, and waits for.
_started = threading.Event()
_go_on = threading.Event()


def create_order() -> tuple[dict[str, t.Any], int]:
    body = request.get_json()
    if body.get("hold"):
        _started.set()
        assert _go_on.wait(30)
    row = Order(amount=body["amount"])
    db.session.add(row)
    db.session.flush()
    return {"id": row.id}, 201


def build(
    url: str,
    auth: str = "bearer",
    *,
    right_order: bool = True,
    login_view: bool = False,
    **config: t.Any,
) -> Flask:
    app = Flask(__name__)
    # Keys are the account's (a tenant header), not the credential's: a token
    # revoked and a token reissued are the same caller's.
    config.setdefault(
        "IDEMPOTENCY_SCOPE", lambda: "account:" + request.headers.get("X-Account", "-")
    )
    app.config.update(SQLALCHEMY_DATABASE_URI=url, SECRET_KEY="test", **config)
    db.init_app(app)
    idem.init_app(app, db)
    # Without a LoginManager the default scope is the Bearer header's digest.
    if auth == "flask-login" or config["IDEMPOTENCY_SCOPE"] is not None:
        logins = flask_login.LoginManager(app)
        logins.request_loader(lambda _request: User(u) if (u := token_user()) else None)
        if login_view:  # Flask-Login then returns a redirect instead of raising 401
            logins.login_view = "login"
            app.add_url_rule("/login", "login", lambda: "log in")

    authenticate = AUTH[auth]
    if right_order:
        app.post("/orders")(authenticate(idem.idempotent(create_order)))
    else:
        app.post("/orders")(idem.idempotent(authenticate(create_order)))

    @app.post("/guarded")
    @bearer_required
    @idem.idempotent(replay_guard=aborting_guard)
    def guarded() -> tuple[dict[str, t.Any], int]:
        return create_order()

    @app.post("/optimistic")
    @bearer_required
    @idem.idempotent(optimistic=True, replay_guard=allowed_guard)
    def optimistic() -> tuple[dict[str, t.Any], int]:
        return create_order()

    @app.errorhandler(403)
    def forbidden(error: t.Any) -> tuple[dict[str, str], int]:
        return {"error": "forbidden"}, 403

    return app


@pytest.fixture(autouse=True)
def state(database_url: str) -> None:
    build(database_url)  # init_app puts the extension's tables on the metadata
    recreate_tables(db.metadata, database_url)
    TOKENS.clear()
    TOKENS.update({"t-alice": "alice", "t-bob": "bob"})
    ALLOWED.clear()
    ALLOWED.update({"alice", "bob"})
    SEEN.clear()


def post(
    app: Flask, key: str, token: str | None, path: str = "/orders", amount: int = 5, **body: t.Any
) -> t.Any:
    headers = {"Idempotency-Key": key, "X-Account": "acme"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return app.test_client().post(path, json={"amount": amount, **body}, headers=headers)


def claims_and_replays(app: Flask, send: t.Callable[[], t.Any]) -> tuple[t.Any, list[str]]:
    """``send()``'s answer, and the extension's signals it caused (``claimed``, ``replayed``)."""
    sent: list[str] = []
    with (
        signals.key_claimed.connected_to(lambda _app, **_: sent.append("claimed"), app),
        signals.response_replayed.connected_to(lambda _app, **_: sent.append("replayed"), app),
    ):
        return send(), sent


def rows(app: Flask) -> tuple[int, list[tuple[t.Any, ...]]]:
    """The orders, and every record row as stored (all columns)."""
    with app.app_context():
        orders = db.session.execute(sa.select(sa.func.count()).select_from(Order)).scalar_one()
        table = db.metadata.tables[TABLE_NAME]
        records = [tuple(r) for r in db.session.execute(sa.select(table)).all()]
        return int(orders), records


def test_a_refused_replay_answers_403_and_changes_nothing(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "flask_idempotency")
    app = build(database_url, IDEMPOTENCY_REPLAY_GUARD=allowed_guard)
    key = str(uuid.uuid4())
    first = post(app, key, "t-alice")
    assert first.status_code == 201
    before = rows(app)
    assert before[0] == 1
    assert len(before[1]) == 1
    assert SEEN == []  # not on a first run

    ALLOWED.discard("alice")  # alice lost the right to create orders
    refused = post(app, key, "t-alice")
    assert refused.status_code == 403
    assert refused.mimetype == PROBLEM_JSON
    assert refused.json["type"] == PROBLEM_TYPE_BASE + "replay-refused"
    assert "Idempotent-Replayed" not in refused.headers
    assert str(first.json["id"]) not in refused.get_data(as_text=True)
    assert rows(app) == before  # nothing stored, nothing changed
    outcomes = [getattr(r, "idempotency_outcome", None) for r in caplog.records]
    assert outcomes[-1] == "replay_refused"

    (attempt,) = SEEN
    assert attempt.endpoint == "create_order"
    assert (attempt.scope, attempt.key, attempt.status) == ("account:acme", key, 201)
    assert attempt.completed_at is not None
    assert attempt.created_at <= attempt.completed_at
    assert not hasattr(attempt, "body")

    replayed = post(app, key, "t-bob")  # an authorized caller of the account
    assert replayed.status_code == 201
    assert replayed.headers["Idempotent-Replayed"] == "true"
    assert replayed.json == first.json
    assert rows(app) == before


def test_the_route_guard_may_answer_with_the_apps_own_error(database_url: str) -> None:
    app = build(database_url)
    key = str(uuid.uuid4())
    assert post(app, key, "t-alice", "/guarded").status_code == 201
    before = rows(app)

    ALLOWED.discard("alice")
    refused = post(app, key, "t-alice", "/guarded")
    assert (refused.status_code, refused.json) == (403, {"error": "forbidden"})
    assert rows(app) == before
    ALLOWED.add("alice")
    assert post(app, key, "t-alice", "/guarded").headers["Idempotent-Replayed"] == "true"
    assert rows(app) == before


def test_an_optimistic_route_asks_the_guard_and_rolls_the_view_back(database_url: str) -> None:
    app = build(database_url)
    key = str(uuid.uuid4())
    assert post(app, key, "t-alice", "/optimistic").status_code == 201
    before = rows(app)
    ALLOWED.discard("alice")
    refused = post(app, key, "t-alice", "/optimistic")  # its view runs, then meets the record
    assert (refused.status_code, refused.json["type"]) == (403, REFUSED)
    assert rows(app) == before  # the view's order rolled back
    assert post(app, key, "t-bob", "/optimistic").headers["Idempotent-Replayed"] == "true"
    assert rows(app) == before
    assert len(SEEN) == 2


def test_the_guard_is_not_asked_on_a_first_run_or_a_mismatch(database_url: str) -> None:
    app = build(database_url, IDEMPOTENCY_REPLAY_GUARD=allowed_guard)
    key = str(uuid.uuid4())
    ALLOWED.clear()  # a guard that would refuse anyone
    assert post(app, key, "t-alice").status_code == 201
    mismatch = post(app, key, "t-alice", amount=6)
    assert mismatch.status_code == 422
    assert mismatch.json["type"] == PROBLEM_TYPE_BASE + "key-reused"
    assert SEEN == []
    assert post(app, key, "t-alice").status_code == 403  # the retry is asked
    assert len(SEEN) == 1


def test_a_duplicate_that_waited_is_asked_too(database_url: str) -> None:
    """A duplicate sent while the first request runs waits for it, then would get
    its answer: the guard is asked before that replay as well."""
    app = build(database_url, IDEMPOTENCY_REPLAY_GUARD=allowed_guard)
    key = str(uuid.uuid4())
    _started.clear()
    _go_on.clear()
    # keyed by sender: the two threads may append in either order once the first commits
    answers: dict[str, t.Any] = {}
    first = threading.Thread(
        target=lambda: answers.__setitem__("alice", post(app, key, "t-alice", hold=True))
    )
    first.start()
    try:
        assert _started.wait(30)
        ALLOWED.discard("bob")
        waiting = threading.Thread(
            target=lambda: answers.__setitem__("bob", post(app, key, "t-bob", hold=True))
        )
        waiting.start()
        time.sleep(0.5)  # the duplicate is waiting on the first one's claim
        assert waiting.is_alive()
    finally:
        _go_on.set()
        first.join(30)
    waiting.join(30)
    assert (answers["alice"].status_code, answers["bob"].status_code) == (201, 403)
    assert answers["bob"].json["type"] == REFUSED
    assert rows(app)[0] == 1
    assert len(SEEN) == 1


@pytest.mark.parametrize("auth", sorted(AUTH))
def test_authentication_above_the_extension_runs_first(database_url: str, auth: str) -> None:
    app = build(database_url, auth, right_order=True)
    key = str(uuid.uuid4())
    anonymous, sent = claims_and_replays(app, lambda: post(app, key, None))
    assert (anonymous.status_code, sent) == (401, [])  # never reached the claim
    assert rows(app) == (0, [])

    first = post(app, key, "t-alice")
    assert first.status_code == 201
    before = rows(app)
    del TOKENS["t-alice"]  # revoked
    retry, sent = claims_and_replays(app, lambda: post(app, key, "t-alice"))
    assert (retry.status_code, sent) == (401, [])
    assert "Idempotent-Replayed" not in retry.headers
    assert post(app, key, None).status_code == 401
    assert rows(app) == before


@pytest.mark.parametrize("auth", sorted(AUTH))
def test_authentication_below_the_extension_is_too_late(database_url: str, auth: str) -> None:
    app = build(database_url, auth, right_order=False)
    key = str(uuid.uuid4())
    # A request without credentials claims the key, then the 401 raised inside
    # the extension rolls its claim back (a failure: nothing stored)...
    anonymous, sent = claims_and_replays(app, lambda: post(app, key, None))
    assert (anonymous.status_code, sent) == (401, ["claimed"])
    assert rows(app) == (0, [])
    assert post(app, key, "t-alice").status_code == 201

    other = str(uuid.uuid4())
    first = post(app, other, "t-alice")
    assert first.status_code == 201
    del TOKENS["t-alice"]  # revoked: yet its retry gets the stored answer
    retry = post(app, other, "t-alice")
    assert (retry.status_code, retry.headers["Idempotent-Replayed"]) == (201, "true")
    assert retry.json == first.json
    assert post(app, other, None).status_code == 201  # no credentials at all


def test_below_the_extension_a_revoked_token_keeps_its_default_scope(database_url: str) -> None:
    """The default scope of a Bearer caller is the header's digest: a revoked
    token still sends it, so its retry is in the operation's scope."""
    app = build(database_url, "bearer", right_order=False, IDEMPOTENCY_SCOPE=None)
    key = str(uuid.uuid4())
    first = post(app, key, "t-alice")
    assert first.status_code == 201
    del TOKENS["t-alice"]
    retry = post(app, key, "t-alice")
    assert (retry.status_code, retry.headers["Idempotent-Replayed"]) == (201, "true")
    assert post(app, key, None).status_code == 401  # no header: another scope, the view runs
    assert rows(app)[0] == 1


@pytest.mark.parametrize("auth", sorted(AUTH))
def test_a_guard_still_refuses_below_the_extension(database_url: str, auth: str) -> None:
    """A guard that checks the caller itself closes the replay in the wrong order
    too (the claim of a request without credentials still happens)."""
    app = build(
        database_url,
        auth,
        right_order=False,
        IDEMPOTENCY_REPLAY_GUARD=lambda attempt: token_user() is not None,
    )
    key = str(uuid.uuid4())
    assert post(app, key, "t-alice").status_code == 201
    before = rows(app)
    del TOKENS["t-alice"]
    refused = post(app, key, "t-alice")
    assert (refused.status_code, refused.json["type"]) == (403, REFUSED)
    assert rows(app) == before
    assert post(app, key, "t-bob").headers["Idempotent-Replayed"] == "true"


@pytest.mark.parametrize("right_order", [True, False], ids=["right", "wrong"])
def test_a_login_redirect_below_the_extension_is_stored(
    database_url: str, right_order: bool
) -> None:
    """With a login view, Flask-Login's ``login_required`` returns its redirect
    (a 302, which is stored): in the wrong order the first request without
    credentials spends the key, and its redirect is replayed to the caller who
    logged in."""
    app = build(database_url, "flask-login", right_order=right_order, login_view=True)
    key = str(uuid.uuid4())
    anonymous = post(app, key, None)
    assert anonymous.status_code == 302
    assert "/login" in anonymous.headers["Location"]
    retry = post(app, key, "t-alice")
    orders, records = rows(app)
    if right_order:
        assert (retry.status_code, orders, len(records)) == (201, 1, 1)
        assert "Idempotent-Replayed" not in retry.headers
    else:
        assert (retry.status_code, retry.headers["Idempotent-Replayed"]) == (302, "true")
        assert (orders, len(records)) == (0, 1)


def test_a_guard_that_is_not_callable_is_refused_when_configured(database_url: str) -> None:
    with pytest.raises(TypeError, match="replay_guard"):
        idem.idempotent(replay_guard="allowed")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="IDEMPOTENCY_REPLAY_GUARD"):
        build(database_url, IDEMPOTENCY_REPLAY_GUARD=True)


def test_a_settled_operation_is_settled_then_asked(database_url: str, clock: Clock) -> None:
    """A record whose view committed and whose request died is settled by the retry
    after its lease (the operation happened: that is not the guard's to stop), and
    the guard is asked before its answer goes out."""
    from tests.unit.request.test_view_committed_unfinished import LEASE, ROUTE, _refuse_completions

    app = testapp.create_app(
        database_url, clock=clock, IDEMPOTENCY_LEASE=LEASE, IDEMPOTENCY_REPLAY_GUARD=allowed_guard
    )
    reset_tables(database_url)
    client = app.test_client()
    undo = _refuse_completions(app)
    try:
        assert flow_post(client, ROUTE, {"delay": 0}, key="k1").status_code == 500
    finally:
        undo()
    clock.advance(seconds=LEASE + 1)
    ALLOWED.clear()
    refused = flow_post(client, ROUTE, {"delay": 0}, key="k1")
    assert (refused.status_code, refused.json["type"]) == (403, REFUSED)
    [record] = record_rows(app)
    assert (record["status"], record["response_code"]) == ("completed", 500)
    assert ledger_count(app) == 1
    assert [attempt.status for attempt in SEEN] == [500]
    ALLOWED.add(None)  # testapp's caller sends no bearer token
    replayed = flow_post(client, ROUTE, {"delay": 0}, key="k1")
    assert (replayed.status_code, replayed.headers["Idempotent-Replayed"]) == (500, "true")
    assert ledger_count(app) == 1
    with app.app_context():
        testapp.db.engine.dispose()


def test_an_async_guard_is_awaited_and_refuses(database_url: str) -> None:
    """A coroutine function, as Flask allows for views and error handlers: its
    answer counts, not the coroutine object (which is always true)."""

    async def revoked(attempt: ReplayAttempt) -> bool:
        return False

    app = build(database_url, IDEMPOTENCY_REPLAY_GUARD=revoked)
    key = str(uuid.uuid4())
    assert post(app, key, "t-alice").status_code == 201
    refused = post(app, key, "t-alice")
    assert refused.status_code == 403, refused.data
    assert refused.get_json()["type"].endswith("/replay-refused")


def test_the_recovery_jobs_rerun_does_not_ask_the_guard(database_url: str) -> None:
    """The job re-runs a record that another request completed meanwhile: it
    replays to no caller, so no guard is asked (it would see a request without
    credentials) and the re-run counts as skipped, not failed."""
    from flask_idempotency._context import app_state
    from flask_idempotency._maintenance.jobs import _rerun

    asked: list[str] = []

    def guard(attempt: ReplayAttempt) -> bool:
        asked.append(attempt.key)
        return request.headers.get("Authorization") == "Bearer t-alice"

    app = build(database_url)

    @app.post("/recovered")
    @idem.idempotent(lease=30, recover=True, replay_guard=guard)
    def recovered() -> tuple[dict[str, t.Any], int]:
        return create_order()

    key = str(uuid.uuid4())
    assert post(app, key, "t-alice", path="/recovered").status_code == 201
    with app.app_context():
        record = app_state(app).store.load(db.session(), "account:acme", key)
        db.session.rollback()
    assert record is not None
    before = rows(app)
    assert _rerun(app, record) is None
    assert asked == []
    assert rows(app) == before


def test_flask_httpauths_401_below_the_extension_is_stored(database_url: str) -> None:
    """Flask-HTTPAuth returns its 401 (it does not raise it): below the extension
    that answer is stored, and the caller who then authenticates gets it replayed
    (docs/scope.md). Above the extension nothing is claimed."""
    from flask_httpauth import HTTPTokenAuth

    for right_order in (False, True):
        app = build(database_url)
        auth = HTTPTokenAuth(scheme="Bearer")
        auth.verify_token(lambda token: TOKENS.get(token))
        if right_order:
            view = auth.login_required(idem.idempotent(create_order))
        else:
            view = idem.idempotent(auth.login_required(create_order))
        app.add_url_rule("/httpauth", "httpauth", view, methods=["POST"])
        key = str(uuid.uuid4())

        def first_try(app: Flask = app, key: str = key) -> t.Any:
            return post(app, key, None, path="/httpauth")

        first, sent = claims_and_replays(app, first_try)
        assert first.status_code == 401
        retry = post(app, key, "t-alice", path="/httpauth")
        if right_order:
            assert sent == []
            assert retry.status_code == 201
        else:
            assert sent == ["claimed"]
            assert retry.status_code == 401
            assert retry.headers["Idempotent-Replayed"] == "true"
