"""The app the tests drive: routes for each behaviour, one ledger row per side effect.

Every route that "does the work" adds a :class:`Ledger` row, so tests can count
side effects in the real database instead of trusting status codes.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import signal
import time
import typing as t
import urllib.error
import urllib.request
import uuid

import sqlalchemy as sa
from flask import Blueprint, Flask, Response, current_app, request, stream_with_context
from flask_sqlalchemy import SQLAlchemy
from marshmallow import Schema, fields
from sqlalchemy import orm

from flask_idempotency import Idempotency
from tests.support import pgbouncer

db = SQLAlchemy()
idem = Idempotency()
bp = Blueprint("t", __name__)


class Ledger(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "ledger"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    route: orm.Mapped[str] = orm.mapped_column(db.String(50))
    key: orm.Mapped[str | None] = orm.mapped_column(db.String(300))
    amount: orm.Mapped[int | None]


class MetaSchema(Schema):
    note = fields.String(load_default=None)
    trace_id = fields.String(load_default=None)


class ChargeSchema(Schema):
    amount = fields.Integer(required=True)
    currency = fields.String(required=True)
    meta = fields.Nested(MetaSchema, load_default=None)
    client_sent_at = fields.String(load_default=None)


#: The ttl of the routes with a lease of their own (60 s). A record must outlive
#: its lease, so init_app refuses such a route under an IDEMPOTENCY_TTL of 60 s or
#: less; with a ttl of their own these routes keep the default retention, and a
#: test (or a review script) may set a short IDEMPOTENCY_TTL for the routes it drives.
LEASED_TTL = dt.timedelta(days=1)


def write_ledger(route: str, amount: int | None = None) -> Ledger:
    row = Ledger(route=route, key=idem.key, amount=amount)
    db.session.add(row)
    db.session.flush()
    return row


@bp.post("/charges")
@idem.idempotent(schema=ChargeSchema, exclude=["client_sent_at", "meta.trace_id"])
def charges() -> Response:
    row = write_ledger("charges", idem.payload["amount"])
    response = Response(
        json.dumps({"id": row.id, "amount": row.amount, "currency": idem.payload["currency"]}),
        status=201,
        content_type="application/json",
    )
    response.headers["Location"] = f"/charges/{row.id}"
    response.headers["X-Request-Cost"] = "3"
    # Not the session cookie (SESSION_COOKIE_NAME): that one is part of the default
    # scope, and the tests that retry here retry as the same caller.
    response.set_cookie("visitor", "secret-of-the-first-caller")
    return response


@bp.post("/optimistic")
@idem.idempotent(schema=ChargeSchema, exclude=["client_sent_at", "meta.trace_id"], optimistic=True)
def optimistic() -> tuple[dict[str, t.Any], int, dict[str, str]]:
    """The record is written at the end: a duplicate runs this too, and its
    ledger row rolls back. ``?delay=`` sleeps after the write (live races)."""
    row = write_ledger("optimistic", idem.payload["amount"])
    time.sleep(float(request.args.get("delay", 0)))
    body = {"id": row.id, "amount": row.amount, "currency": idem.payload["currency"]}
    return body, 201, {"Location": f"/optimistic/{row.id}"}


@bp.post("/required")
@idem.idempotent(required=True)
def required_route() -> tuple[dict[str, t.Any], int]:
    row = write_ledger("required")
    return {"id": row.id}, 201


@bp.post("/raw")
@idem.idempotent()
def raw() -> tuple[dict[str, t.Any], int]:
    row = write_ledger("raw")
    return {"id": row.id, "seen": len(request.get_data())}, 200


@bp.post("/status/<int:code>")
@idem.idempotent()
def status(code: int) -> tuple[dict[str, t.Any], int]:
    row = write_ledger(f"status/{code}")
    return {"id": row.id, "code": code}, code


@bp.post("/raise")
@idem.idempotent()
def raise_route() -> t.NoReturn:
    write_ledger("raise")
    raise RuntimeError("the view failed after writing")


@bp.post("/big/<int:size>")
@idem.idempotent()
def big(size: int) -> tuple[str, int, dict[str, str]]:
    row = write_ledger("big")
    return "x" * size, 201, {"Location": f"/big/{row.id}", "Content-Type": "text/plain"}


@bp.post("/stream")
@idem.idempotent()
def stream() -> Response:
    row = write_ledger("stream")

    def chunks() -> t.Iterator[str]:
        yield "part-1;"
        yield "part-2"

    response = Response(stream_with_context(chunks()), status=201, mimetype="text/plain")
    response.headers["Location"] = f"/stream/{row.id}"
    return response


@bp.post("/slow")
@idem.idempotent()
def slow() -> tuple[dict[str, t.Any], int]:
    delay = float((request.get_json(silent=True) or {}).get("delay", 0.3))
    row = write_ledger("slow")
    time.sleep(delay)
    return {"id": row.id, "at": time.time()}, 201


@bp.post("/commits-itself")
@idem.idempotent()
def commits_itself() -> tuple[dict[str, t.Any], int]:
    """Commits the session in the middle of the view, as some real views do."""
    delay = float((request.get_json(silent=True) or {}).get("delay", 0.3))
    row = write_ledger("commits-itself")
    db.session.commit()
    time.sleep(delay)
    return {"id": row.id}, 201


def tenant_scope() -> str:
    return "tenant:" + request.headers.get("X-Tenant", "none")


@bp.post("/tenant")
@idem.idempotent(scope=tenant_scope)
def tenant() -> tuple[dict[str, t.Any], int]:
    row = write_ledger("tenant")
    return {"id": row.id, "tenant": request.headers.get("X-Tenant")}, 201


@bp.post("/short-ttl")
@idem.idempotent(ttl=dt.timedelta(minutes=5))
def short_ttl() -> tuple[dict[str, t.Any], int]:
    row = write_ledger("short-ttl")
    return {"id": row.id}, 201


@bp.post("/leased/<int:code>")
@idem.idempotent(lease=True)
def leased(code: int) -> tuple[dict[str, t.Any], int]:
    """The record is committed (leased) before this runs."""
    row = write_ledger("leased")
    return {"id": row.id}, code


@bp.post("/commits-then-fails")
@idem.idempotent()
def commits_then_fails() -> tuple[dict[str, t.Any], int]:
    write_ledger("commits-then-fails")
    db.session.commit()
    write_ledger("commits-then-fails")
    return {"error": "downstream failed"}, 503


@bp.post("/commits-then-hangs")
@idem.idempotent()
def commits_then_hangs() -> tuple[dict[str, t.Any], int]:
    """Commits a charge, then outlives the WSGI server's worker timeout when the
    request asks (``X-Hang`` seconds): gunicorn's sync worker then raises
    SystemExit inside the view."""
    row = write_ledger("commits-then-hangs")
    db.session.commit()
    time.sleep(float(request.headers.get("X-Hang", "0")))
    return {"id": row.id}, 201


@bp.post("/leased-commits-then-hangs")
@idem.idempotent(lease=dt.timedelta(seconds=60), ttl=LEASED_TTL)
def leased_commits_then_hangs() -> tuple[dict[str, t.Any], int]:
    """As ``/commits-then-hangs``, on a leased route."""
    row = write_ledger("leased-commits-then-hangs")
    db.session.commit()
    time.sleep(float(request.headers.get("X-Hang", "0")))
    return {"id": row.id}, 201


@bp.post("/catches-commit-failure")
@idem.idempotent()
def catches_commit_failure() -> tuple[dict[str, t.Any], int]:
    """Commits a charge and, if that COMMIT fails (the connection lost before
    its answer), catches the error as views do for an outage: rolls back when
    the request says ``X-Rollback: 1``, and answers 503."""
    row = write_ledger("catches-commit-failure")
    try:
        db.session.commit()
    except sa.exc.OperationalError:
        if request.headers.get("X-Rollback") == "1":
            db.session.rollback()
        return {"error": "database unavailable, retry"}, 503
    return {"id": row.id}, 201


@bp.post("/leased-deferred-check")
@idem.idempotent(lease=dt.timedelta(seconds=60), ttl=LEASED_TTL)
def leased_deferred_check() -> tuple[dict[str, t.Any], int]:
    """Writes a row a deferred constraint (a table the test makes) refuses at
    COMMIT when the request says ``X-Refuse: 1``: the database's own refusal of
    the COMMIT, nothing in doubt."""
    tag = "taken" if request.headers.get("X-Refuse") == "1" else uuid.uuid4().hex
    db.session.execute(sa.text("INSERT INTO deferred_check (tag) VALUES (:t)"), {"t": tag})
    row = write_ledger("leased-deferred-check")
    db.session.commit()
    return {"id": row.id}, 201


@bp.post("/leased-autocommit-view")
@idem.idempotent(lease=dt.timedelta(seconds=60), ttl=LEASED_TTL)
def leased_autocommit_view() -> tuple[dict[str, t.Any], int]:
    """Asks for an AUTOCOMMIT connection after its claim committed, writes, fails."""
    db.session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})
    write_ledger("leased-autocommit-view")
    raise RuntimeError("the view failed after writing")


class DownstreamError(Exception):
    pass


def crash_point(name: str) -> None:
    """Kill this process (SIGKILL) here when the request asks for it: a real crash."""
    if request.headers.get("X-Test-Crash") == name:
        os.kill(os.getpid(), signal.SIGKILL)


def call_downstream(operation: str, key: str, body: dict[str, t.Any]) -> dict[str, t.Any]:
    """POST to the fake downstream with the derived key, as a real client would."""
    req = urllib.request.Request(
        current_app.config["DOWNSTREAM_URL"] + "/" + operation,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Idempotency-Key": key},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as response:
            answer: dict[str, t.Any] = json.load(response)
    except urllib.error.HTTPError as error:
        raise DownstreamError(f"{operation} answered {error.code}") from error
    crash_point(f"in-{operation}")  # the call happened; its step is not saved yet
    return answer


@bp.post("/checkout")
@idem.idempotent(lease=True, recover=True)
def checkout() -> tuple[dict[str, t.Any], int]:
    """Charge a card and email a receipt (two external steps), then book it."""
    order = idem.payload
    crash_point("before-charge")
    try:
        charge = idem.step(
            "charge", lambda: call_downstream("charge", idem.derived_key("charge"), order)
        )
        crash_point("between-steps")
        receipt = idem.step(
            "email", lambda: call_downstream("email", idem.derived_key("email"), order)
        )
    except DownstreamError as error:
        return {"error": str(error)}, 502
    crash_point("before-complete")
    time.sleep(float(request.headers.get("X-Test-Slow", 0)))
    write_ledger("checkout", order.get("amount"))
    return {"charge": charge["id"], "receipt": receipt["id"]}, 201


@bp.post("/step-without-lease")
@idem.idempotent()
def step_without_lease() -> dict[str, t.Any]:
    return {"x": idem.step("x", lambda: 1)}


def create_app(
    database_url: str,
    *,
    clock: t.Callable[[], dt.datetime] | None = None,
    **config: t.Any,
) -> Flask:
    app = Flask(__name__)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=database_url,
        SQLALCHEMY_ENGINE_OPTIONS=(
            {"pool_size": 40, "max_overflow": 10} if database_url.startswith("postgresql") else {}
        ),
    )
    # Behind the tests' PgBouncer, configured as docs/poolers.md tells a user to.
    # A test's own config wins.
    app.config.update(pgbouncer.user_config(database_url))
    app.config.update(**config)
    db.init_app(app)
    idem.init_app(app, db, clock=clock)
    app.register_blueprint(bp)
    return app


# --- scope routes ---
# Routes for the default scope (tests/unit/test_scope.py) and the key options
# (tests/unit/test_keys.py): each writes one ledger row and says which caller it saw.


def _caller() -> str | None:
    from flask import session

    auth = request.authorization
    if auth is not None and auth.username:
        return auth.username
    return t.cast("str | None", session.get("user"))


@bp.get("/scope/login/<name>")
def scope_login(name: str) -> dict[str, t.Any]:
    """A cookie-session login: puts the user name in Flask's signed session cookie."""
    from flask import session

    session["user"] = name
    return {"user": name}


@bp.post("/scope/charge")
@idem.idempotent()
def scope_charge() -> tuple[dict[str, t.Any], int]:
    row = write_ledger("scope/charge", (request.get_json(silent=True) or {}).get("amount"))
    return {"id": row.id, "caller": _caller()}, 201


@bp.post("/scope/refund")
@idem.idempotent()
def scope_refund() -> tuple[dict[str, t.Any], int]:
    row = write_ledger("scope/refund")
    return {"id": row.id, "caller": _caller()}, 201


@bp.post("/scope/uuid-key")
@idem.idempotent(key_format="uuid")
def scope_uuid_key() -> tuple[dict[str, t.Any], int]:
    row = write_ledger("scope/uuid-key")
    return {"id": row.id}, 201


@bp.post("/scope/order-key")
@idem.idempotent(key_format=r"order-[0-9]+", key_max_length=12)
def scope_order_key() -> tuple[dict[str, t.Any], int]:
    row = write_ledger("scope/order-key")
    return {"id": row.id}, 201


# --- body and fingerprint routes ---


def _file_digest(storage: t.Any) -> str:
    return hashlib.sha256(storage.read()).hexdigest()


@bp.post("/body/echo")
@idem.idempotent()
def body_echo() -> tuple[dict[str, t.Any], int]:
    """Reads the body every way a view can, after the extension read it."""
    data = request.get_data()
    row = write_ledger("body/echo", len(data))
    return {
        "id": row.id,
        "length": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "json": request.get_json(silent=True) if request.is_json else None,
        "form": request.form.to_dict(flat=False),
        "files": {
            name: [[s.filename, _file_digest(s)] for s in storages]
            for name, storages in request.files.lists()
        },
    }, 201


class OrderLineSchema(Schema):
    sku = fields.String(required=True)
    line_id = fields.UUID(load_default=uuid.uuid4)


class OrderSchema(Schema):
    """Defaults the server invents on every load, and an excluded client timestamp."""

    amount = fields.Integer(required=True)
    order_ref = fields.UUID(load_default=uuid.uuid4, data_key="orderRef")
    received_at = fields.AwareDateTime(load_default=lambda: dt.datetime.now(dt.timezone.utc))
    lines = fields.List(fields.Nested(OrderLineSchema), load_default=list)
    client_sent_at = fields.AwareDateTime()


@bp.post("/body/order")
@idem.idempotent(schema=OrderSchema, exclude=["client_sent_at"])
def body_order() -> tuple[dict[str, t.Any], int]:
    order = idem.payload
    row = write_ledger("body/order", order["amount"])
    return {
        "id": row.id,
        "order_ref": str(order["order_ref"]),
        "line_ids": [str(line["line_id"]) for line in order["lines"]],
    }, 201
