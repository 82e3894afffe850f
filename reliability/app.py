"""The app the fault suite drives: ``reliability.app:create_app()``.

Three routes write one :class:`Ledger` row per execution, carrying the request's
``Idempotency-Key``, so a scenario counts executions per key in the database:

* ``POST /plain``: ``@idem.idempotent()``: the record commits with the row;
* ``POST /leased``: ``@idem.idempotent(lease=..., recover=True)``: the record
  commits first under a lease, the row commits at the end, fenced;
* ``POST /committing``: ``@idem.idempotent()``, the view committing its row itself;
* ``POST /unprotected``: no extension, the row committed directly: what a
  retrying proxy or client does to a route without it.

Faults are injected by the process itself, at random, at the rates named in
``RELIABILITY_FAULTS`` (JSON, rates from 0 to 1), never by the request, so
fingerprints are untouched:

* ``after_commit``: SIGKILL right after the COMMIT that carries the ledger row,
  before the response is written;
* ``before_commit``: SIGKILL right before that COMMIT, inside the transaction;
* ``hang_after_commit``: sleep ``RELIABILITY_HANG`` seconds after that COMMIT,
  so the WSGI server's worker timeout ends the worker (gunicorn: SIGABRT, then
  ``SystemExit`` in the worker) with the work committed and no response sent.

Each fault appends one line to ``RELIABILITY_FAULT_LOG`` before it fires, which
the scenario counts. ``RELIABILITY_SEED`` seeds the draws (per process: the pid
is mixed in).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import signal
import time
import typing as t

import sqlalchemy as sa
from flask import Flask, g, has_request_context, request
from flask_sqlalchemy import SQLAlchemy
from marshmallow import Schema, fields, validate
from sqlalchemy import event, orm
from werkzeug.exceptions import HTTPException

from flask_idempotency import Idempotency

DATABASE_ENV = "RELIABILITY_DATABASE_URL"
FAULTS_ENV = "RELIABILITY_FAULTS"
FAULT_LOG_ENV = "RELIABILITY_FAULT_LOG"
LEASE_ENV = "RELIABILITY_LEASE"

db = SQLAlchemy()
idem = Idempotency()


class Ledger(db.Model):  # type: ignore[name-defined,misc]
    """One row per execution of a route's work."""

    __tablename__ = "reliability_ledger"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    route: orm.Mapped[str] = orm.mapped_column(sa.String(20))
    key: orm.Mapped[str | None] = orm.mapped_column(sa.String(255), index=True)
    amount: orm.Mapped[int]
    pid: orm.Mapped[int]


class ChargeSchema(Schema):
    # Held to what the ledger's INTEGER column stores: a larger number is the
    # client's error (422), not a database error in the view (500).
    amount = fields.Integer(required=True, strict=True, validate=validate.Range(1, 2**31 - 1))
    currency = fields.String(required=True)
    note = fields.String(load_default=None)


_rng = random.Random()
_faults: dict[str, float] = {}


def _draw(point: str) -> bool:
    rate = _faults.get(point, 0.0)
    return rate > 0 and _rng.random() < rate


def _reseed() -> None:
    _rng.seed(f"{os.environ.get('RELIABILITY_SEED', '0')}:{os.getpid()}:{time.time_ns()}")


# A worker forked from a master that loaded the app (gunicorn --preload) draws
# its own faults, not a copy of the master's sequence.
os.register_at_fork(after_in_child=_reseed)


def _log_fault(point: str) -> None:
    path = os.environ.get(FAULT_LOG_ENV)
    if path:
        line = json.dumps({"point": point, "key": request.headers.get("Idempotency-Key")})
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


def _write(route: str, amount: int) -> dict[str, t.Any]:
    # The key as the extension parsed it: lease recovery re-runs a request with
    # the key quoted (a Structured Field string), which names the same key.
    key = idem.key if route != "unprotected" else request.headers.get("Idempotency-Key")
    row = Ledger(route=route, key=key, amount=amount, pid=os.getpid())
    db.session.add(row)
    db.session.flush()
    g.reliability_work = True  # the next COMMIT carries the work: the fault points
    return {"id": row.id, "amount": amount}


def _before_commit(session: orm.Session) -> None:
    if has_request_context() and g.get("reliability_work") and _draw("before_commit"):
        _log_fault("before_commit")
        os.kill(os.getpid(), signal.SIGKILL)


def _after_commit(session: orm.Session) -> None:
    if not (has_request_context() and g.pop("reliability_work", False)):
        return
    if _draw("after_commit"):
        _log_fault("after_commit")
        os.kill(os.getpid(), signal.SIGKILL)
    if _draw("hang_after_commit"):
        _log_fault("hang_after_commit")
        time.sleep(float(os.environ.get("RELIABILITY_HANG", "5")))


def _problem(error: HTTPException) -> tuple[dict[str, t.Any], int, dict[str, str]]:
    body = {
        "type": "about:blank",
        "title": error.name,
        "status": error.code,
        "detail": error.description,
    }
    return body, error.code or 500, {"Content-Type": "application/problem+json"}


def create_app(config: t.Mapping[str, t.Any] | None = None) -> Flask:
    """The app, on ``RELIABILITY_DATABASE_URL`` with the example's fail-fast engine settings."""
    from example_app.app import engine_options

    app = Flask(__name__)
    url = os.environ[DATABASE_ENV]
    app.config["SQLALCHEMY_DATABASE_URI"] = url
    app.config["SQLALCHEMY_ENGINE_OPTIONS"] = engine_options(url)
    app.config["IDEMPOTENCY_CLAIM_IDLE_TIMEOUT"] = 5
    if config:
        app.config.update(config)
    _faults.update({k: float(v) for k, v in json.loads(os.environ.get(FAULTS_ENV, "{}")).items()})
    _reseed()
    db.init_app(app)
    idem.init_app(app, db)
    lease = dt.timedelta(seconds=float(os.environ.get(LEASE_ENV, "3")))

    @app.post("/plain")
    @idem.idempotent(schema=ChargeSchema())
    def plain() -> tuple[dict[str, t.Any], int]:
        return _write("plain", idem.payload["amount"]), 201

    @app.post("/leased")
    @idem.idempotent(schema=ChargeSchema(), lease=lease, recover=True)
    def leased() -> tuple[dict[str, t.Any], int]:
        return _write("leased", idem.payload["amount"]), 201

    @app.post("/committing")
    @idem.idempotent(schema=ChargeSchema())
    def committing() -> tuple[dict[str, t.Any], int]:
        # The view commits its work itself: when that COMMIT's answer is lost, the
        # extension settles whether it landed (and then keeps the failure, since
        # the work stays) or not (and frees the key for the retry).
        answer = _write("committing", idem.payload["amount"])
        db.session.commit()
        return answer, 201

    @app.post("/unprotected")
    def unprotected() -> tuple[dict[str, t.Any], int]:
        body = request.get_json(silent=True)
        if not isinstance(body, dict) or not isinstance(body.get("amount"), int):
            return {"type": "about:blank", "title": "Bad Request", "status": 400}, 400
        answer = _write("unprotected", body["amount"])
        db.session.commit()
        return answer, 201

    @app.get("/healthz")
    def healthz() -> tuple[str, int]:
        return "ok", 200

    app.add_url_rule("/readyz", view_func=idem.readiness_view)
    app.register_error_handler(HTTPException, _problem)
    return app


event.listen(orm.Session, "before_commit", _before_commit)
event.listen(orm.Session, "after_commit", _after_commit)
