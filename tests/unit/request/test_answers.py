"""Every answer to a keyed request echoes its key, and every documented way of
handling the extension's problems sees every one of them, whatever its status:
``@app.errorhandler(ProblemError)`` before or after ``init_app``, one for
``IdempotencyError``, one for a single subclass; a framework's handler for every
``HTTPException`` (flask-smorest's, APIFlask's) does not turn them into its own
envelope. An app's own envelope keeps the problem's headers. Views may be
methods of a ``MethodView``. On the suite's PostgreSQL, with real threads."""

from __future__ import annotations

import threading
import typing as t
import uuid

import pytest
import sqlalchemy as sa
from flask import Flask, abort, jsonify
from flask.views import MethodView
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import orm
from werkzeug.exceptions import HTTPException

from flask_idempotency import Idempotency
from flask_idempotency.errors import (
    PROBLEM_JSON,
    IdempotencyError,
    KeyReusedError,
    ProblemError,
)
from tests.conftest import postgres_url
from tests.support.tables import recreate_tables

db = SQLAlchemy()
idem = Idempotency()


class Charge(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "answers_charges"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    amount: orm.Mapped[int]


#: What the first request of the 409 case waits for, and what it signals.
_started = threading.Event()
_go_on = threading.Event()

Handler = t.Callable[[Flask], None]


def make_app(url: str, before: Handler | None = None, after: Handler | None = None) -> Flask:
    app = Flask(__name__)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=url,
        IDEMPOTENCY_SCOPE=lambda: "tenant",
        IDEMPOTENCY_WAIT=0,  # a duplicate answers 409 at once
    )
    if before is not None:
        before(app)
    db.init_app(app)
    idem.init_app(app, db)
    if after is not None:
        after(app)

    @app.post("/charges")
    @idem.idempotent()
    def charge() -> tuple[dict[str, t.Any], int]:
        from flask import request

        body = request.get_json()
        if body.get("hold"):
            _started.set()
            _go_on.wait(30)
        row = Charge(amount=body["amount"])
        db.session.add(row)
        db.session.flush()
        return {"id": row.id}, 201

    @app.post("/commits-then-fails")
    @idem.idempotent()
    def commits_then_fails() -> t.NoReturn:
        db.session.add(Charge(amount=99))
        db.session.commit()
        raise RuntimeError("after the commit")

    @app.post("/required")
    @idem.idempotent(required=True)
    def required() -> tuple[dict[str, t.Any], int]:
        return {}, 201

    class Refunds(MethodView):
        @idem.idempotent()
        def post(self, charge_id: int) -> tuple[dict[str, t.Any], int]:
            row = Charge(amount=-charge_id)
            db.session.add(row)
            db.session.flush()
            return {"id": row.id, "view": type(self).__name__}, 201

        def get(self, charge_id: int) -> dict[str, t.Any]:
            return {"charge": charge_id}

    class Payouts(MethodView):
        decorators = [idem.idempotent()]

        def post(self) -> tuple[dict[str, t.Any], int]:
            row = Charge(amount=7)
            db.session.add(row)
            db.session.flush()
            return {"id": row.id}, 201

    app.add_url_rule("/charges/<int:charge_id>/refunds", view_func=Refunds.as_view("refunds"))
    app.add_url_rule("/payouts", view_func=Payouts.as_view("payouts"))
    return app


@pytest.fixture(scope="module")
def url() -> str:
    return postgres_url("psycopg2")


@pytest.fixture(autouse=True)
def tables(url: str) -> None:
    make_app(url)  # init_app puts the extension's tables on the metadata
    recreate_tables(db.metadata, url)


def charges(app: Flask) -> int:
    with app.app_context():
        return int(db.session.execute(sa.select(sa.func.count()).select_from(Charge)).scalar_one())


def post(app: Flask, path: str, key: str | None, **body: t.Any) -> t.Any:
    headers = {"Idempotency-Key": key} if key is not None else {}
    return app.test_client().post(path, json=body, headers=headers)


def every_problem(app: Flask) -> dict[str, t.Any]:
    """The four statuses a client meets: 400 (no key on a required route), 409
    (a duplicate while the first runs), 422 (a key reused with another body) and
    503 (the database away), each answered by ``app``."""
    answers: dict[str, t.Any] = {"400": post(app, "/required", None)}
    key = str(uuid.uuid4())
    _started.clear()
    _go_on.clear()
    first = threading.Thread(
        target=post, args=(app, "/charges", key), kwargs={"amount": 1, "hold": 1}
    )
    first.start()
    try:
        assert _started.wait(30)
        answers["409"] = post(app, "/charges", key, amount=1, hold=1)
    finally:
        _go_on.set()
        first.join(30)
    answers["422"] = post(app, "/charges", key, amount=2)
    with app.app_context():
        engine = db.engine
    down = sa.make_url(engine.url).set(host="127.0.0.1", port=1, query={})
    away = make_app(down.render_as_string(hide_password=False))
    for name, handler in app.error_handler_spec[None][None].items():
        away.error_handler_spec[None][None][name] = handler
    answers["503"] = post(away, "/charges", str(uuid.uuid4()), amount=3)
    return answers


# -- the documented handlers see every problem -----------------------------------


def envelope(problem: ProblemError) -> tuple[t.Any, int]:
    """An app's own error format (no problem's headers copied: the extension's)."""
    document = problem.problem()
    return jsonify(error={"code": problem.slug, "message": document["detail"]}), problem.code or 500


def register_after(app: Flask) -> None:
    app.register_error_handler(ProblemError, envelope)


def register_idempotency_error(app: Flask) -> None:
    app.register_error_handler(IdempotencyError, envelope)


@pytest.mark.parametrize(
    ("before", "after"),
    [(register_after, None), (None, register_after), (None, register_idempotency_error)],
    ids=["ProblemError-before-init_app", "ProblemError-after-init_app", "IdempotencyError"],
)
def test_the_app_handler_sees_every_problem_whatever_its_status(
    url: str, before: Handler | None, after: Handler | None
) -> None:
    app = make_app(url, before, after)
    answers = every_problem(app)
    for status, response in answers.items():
        assert response.status_code == int(status), (status, response.data)
        assert response.content_type == "application/json", (status, response.data)
        assert "error" in response.get_json(), status
    assert answers["409"].get_json()["error"]["code"] == "request-in-progress"
    assert answers["422"].get_json()["error"]["code"] == "key-reused"
    assert answers["503"].get_json()["error"]["code"] == "database-unavailable"
    # The problem's headers survive the app's envelope, and the key is echoed.
    assert int(answers["503"].headers["Retry-After"]) >= 1
    assert int(answers["409"].headers["Retry-After"]) >= 1
    assert answers["422"].headers["Idempotency-Key"]
    assert charges(app) == 1


def test_a_handler_for_one_problem_type_sees_only_that_type(url: str) -> None:
    def only_reuse(app: Flask) -> None:
        app.register_error_handler(KeyReusedError, envelope)

    app = make_app(url, after=only_reuse)
    answers = every_problem(app)
    assert answers["422"].get_json()["error"]["code"] == "key-reused"
    for status in ("400", "409", "503"):
        assert answers[status].content_type == PROBLEM_JSON, status


def test_a_frameworks_handler_for_every_http_exception_leaves_problems_in_problem_json(
    url: str,
) -> None:
    """flask-smorest and APIFlask answer every HTTPException in their own JSON:
    the extension's problems stay problem+json (as its OpenAPI says); other
    HTTP errors still go to the framework's handler."""

    def framework(app: Flask) -> None:
        def own(error: HTTPException) -> tuple[t.Any, int]:
            return jsonify(framework=True, message=error.description), error.code or 500

        app.register_error_handler(HTTPException, own)
        app.register_error_handler(Exception, own)

    for before, after in ((framework, None), (None, framework)):
        app = make_app(url, before, after)
        answers = every_problem(app)
        for status, response in answers.items():
            assert response.status_code == int(status)
            assert response.content_type == PROBLEM_JSON, (status, response.data)
            assert response.get_json()["status"] == int(status)
        missing = app.test_client().get("/nowhere")
        assert missing.status_code == 404
        assert missing.get_json()["framework"] is True


def test_a_plain_problem_error_answers_400() -> None:
    problem = ProblemError("something")
    assert problem.code == 400
    assert problem.problem()["status"] == 400
    assert problem.get_response().status_code == 400


# -- the key, echoed ------------------------------------------------------------


def test_every_answer_to_a_keyed_request_echoes_its_key(url: str) -> None:
    app = make_app(url)
    key = str(uuid.uuid4())
    first = post(app, "/charges", key, amount=5)
    assert first.status_code == 201
    assert first.headers["Idempotency-Key"] == key
    replay = post(app, "/charges", key, amount=5)
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.headers["Idempotency-Key"] == key
    assert replay.headers.getlist("Idempotency-Key") == [key]  # not stored, then added
    reused = post(app, "/charges", key, amount=6)
    assert reused.status_code == 422
    assert reused.headers["Idempotency-Key"] == key
    # No key, a refused key, an unprotected method or route: nothing to echo.
    assert "Idempotency-Key" not in post(app, "/charges", None, amount=1).headers
    too_long = post(app, "/charges", "k" * 300, amount=1)
    assert too_long.status_code == 400
    assert "Idempotency-Key" not in too_long.headers
    get = app.test_client().get("/charges/1/refunds", headers={"Idempotency-Key": key})
    assert "Idempotency-Key" not in get.headers
    assert charges(app) == 2


# -- MethodView -----------------------------------------------------------------


def test_a_method_view_is_protected_by_the_method_or_the_class_decorators(url: str) -> None:
    app = make_app(url)
    key = str(uuid.uuid4())
    first = post(app, "/charges/3/refunds", key)
    assert first.status_code == 201, first.data
    assert first.get_json()["view"] == "Refunds"
    again = post(app, "/charges/3/refunds", key)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.get_json() == first.get_json()
    payout = str(uuid.uuid4())
    assert post(app, "/payouts", payout).status_code == 201
    assert post(app, "/payouts", payout).headers["Idempotent-Replayed"] == "true"
    assert charges(app) == 2
    assert app.test_client().get("/charges/3/refunds").get_json() == {"charge": 3}


# -- a stored failure, replayed as the app answers problems ----------------------


@pytest.mark.parametrize("own_handler", [True, False], ids=["app-envelope", "default"])
def test_a_stored_failure_after_commit_replays_through_the_apps_handler(
    url: str, own_handler: bool
) -> None:
    """The extension stores the failure in its own rendering; a retry answers it
    as the app answers every other problem (an SDK reads its envelope), marked
    replayed, the key echoed; without a handler of the app's, the stored bytes."""
    app = make_app(url, after=register_after if own_handler else None)
    app.config["PROPAGATE_EXCEPTIONS"] = False  # the first answer: Flask's own 500
    key = str(uuid.uuid4())
    first = post(app, "/commits-then-fails", key)
    assert first.status_code == 500
    for _ in range(2):
        retry = post(app, "/commits-then-fails", key)
        assert retry.status_code == 500
        assert retry.headers["Idempotent-Replayed"] == "true"
        assert retry.headers["Idempotency-Key"] == key
        if own_handler:
            assert retry.content_type == "application/json"
            assert retry.get_json()["error"]["code"] == "failed-after-commit"
        else:
            assert retry.content_type == PROBLEM_JSON
            assert retry.get_json()["type"].endswith("/failed-after-commit")
    assert charges(app) == 1


# -- after the first review: manual views, shared contexts, async, blueprints ----


def test_a_manual_views_own_answer_is_kept_after_it_read_a_stored_failure(url: str) -> None:
    app = make_app(url, after=register_after)
    app.config["PROPAGATE_EXCEPTIONS"] = False

    @app.post("/manual")
    @idem.idempotent(manual=True)
    def manual() -> t.Any:
        from flask import request

        if idem.previous is not None:
            old = idem.replay()
            if request.headers.get("X-Mode") == "replay":
                old.headers["X-Previous-At"] = "t0"
                return old
            return {"mine": True, "previous": old.status_code}, 200
        db.session.add(Charge(amount=11))
        db.session.commit()
        raise RuntimeError("after the commit")

    key = str(uuid.uuid4())
    assert post(app, "/manual", key).status_code == 500
    retry = post(app, "/manual", key)
    assert retry.status_code == 200, retry.data
    assert retry.get_json() == {"mine": True, "previous": 500}
    # Returned, idem.replay() answers as an automatic replay does, with what the view added.
    replayed = app.test_client().post(
        "/manual", json={}, headers={"Idempotency-Key": key, "X-Mode": "replay"}
    )
    assert replayed.status_code == 500
    assert replayed.get_json()["error"]["code"] == "failed-after-commit"
    assert replayed.headers["X-Previous-At"] == "t0"
    assert replayed.headers["Idempotent-Replayed"] == "true"


def test_nothing_of_an_answer_reaches_the_next_request_in_a_shared_context(url: str) -> None:
    """A test, a script or a CLI command sends several requests in one app
    context (``g`` is shared): the echo of a request that failed stays its own."""
    app = make_app(url)
    app.testing = True

    @app.post("/boom")
    @idem.idempotent()
    def boom() -> t.NoReturn:
        raise ValueError("the view's own error")

    @app.get("/plain")
    def plain() -> dict[str, t.Any]:
        return {}

    with app.app_context():
        client = app.test_client()
        with pytest.raises(ValueError, match="own error"):
            client.post("/boom", json={}, headers={"Idempotency-Key": "SECRET-KEY-OF-A"})
        assert "Idempotency-Key" not in client.get("/plain").headers


def test_an_async_handler_for_idempotency_error_sees_every_problem(url: str) -> None:
    def register(app: Flask) -> None:
        async def handler(problem: ProblemError) -> tuple[t.Any, int]:
            return envelope(problem)

        app.register_error_handler(IdempotencyError, handler)

    answers = every_problem(make_app(url, after=register))
    for status, response in answers.items():
        assert response.status_code == int(status)
        assert "error" in response.get_json(), status


def test_a_blueprints_catch_all_leaves_problems_to_the_app(url: str) -> None:
    """Flask asks the request's blueprint before the app: a blueprint's handler
    for every HTTPException does not turn the problems into its envelope, and
    the app's IdempotencyError handler still answers them."""
    from flask import Blueprint

    for app_handler in (None, register_idempotency_error, register_after):
        app = make_app(url, after=app_handler)
        api = Blueprint("api", __name__, url_prefix="/api")

        @api.errorhandler(HTTPException)
        def catch_all(error: HTTPException) -> tuple[t.Any, int]:
            return jsonify(api_error=error.name), error.code or 500

        @api.post("/x")
        @idem.idempotent(required=True)
        def x() -> tuple[dict[str, t.Any], int]:
            return {}, 201

        @api.get("/gone")
        def gone() -> t.NoReturn:
            abort(404)

        app.register_blueprint(api)
        missing = app.test_client().post("/api/x", json={})
        assert missing.status_code == 400
        if app_handler:
            assert missing.get_json()["error"]["code"] == "missing-key"
        else:
            assert missing.content_type == PROBLEM_JSON
        assert app.test_client().get("/api/gone").get_json() == {"api_error": "Not Found"}


def test_every_after_request_function_sees_the_echo(url: str) -> None:
    from flask import Blueprint

    seen: dict[str, str | None] = {}

    def watcher(name: str) -> t.Callable[[t.Any], t.Any]:
        def watch(response: t.Any) -> t.Any:
            seen[name] = response.headers.get("Idempotency-Key")
            return response

        return watch

    def before(app: Flask) -> None:
        app.after_request(watcher("app-before-init_app"))

    app = make_app(url, before=before)
    app.after_request(watcher("app-after-init_app"))
    shop = Blueprint("shop", __name__)
    shop.after_request(watcher("blueprint"))

    @shop.post("/orders")
    @idem.idempotent()
    def orders() -> tuple[dict[str, t.Any], int]:
        return {}, 201

    app.register_blueprint(shop)
    key = str(uuid.uuid4())
    assert post(app, "/orders", key).status_code == 201
    assert seen == dict.fromkeys(("app-before-init_app", "app-after-init_app", "blueprint"), key)
