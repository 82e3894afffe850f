"""The benchmark's app: one business write per request, made idempotent each way
the benchmark compares.

Every route does the same work, one ``orders`` row written in the Flask-SQLAlchemy
session, and answers 201 with the same JSON body (``{"id": ...}``):

* ``POST /plain``: no idempotency; the view writes and commits.
* ``POST /floor``: the hand-written floor, the least correct code a careful user
  would write by hand. In one transaction on the same session: a conflict-tolerant
  claim insert into ``floor_keys`` (``INSERT ... ON CONFLICT DO NOTHING``); when it
  inserted nothing, read the stored row, roll back and replay it (409 while it is
  still in progress); otherwise the business insert, an ``UPDATE`` storing the
  response, one commit. Its statements are built once, at import.
* ``POST /ext``: ``@idem.idempotent()``, default settings (``IDEMPOTENCY_WAIT``
  10 s, so each claim sets and restores ``lock_timeout``).
* ``POST /ext-nowait``: ``@idem.idempotent(wait=None)``, no bound of ours.
* ``POST /ext-optimistic``: ``@idem.idempotent(optimistic=True)``, only where the
  extension has that option (:data:`OPTIMISTIC_MISSING` says why not otherwise).
* On psycopg 3 only, ``/ext`` with the claim sent another way than the
  extension's one string through ``psycopg.ClientCursor``
  (:mod:`bench.claim_paths`): ``POST /ext-pipeline`` (the same statements in
  psycopg's pipeline mode), ``POST /ext-serial`` (one by one), ``POST
  /ext-generic`` (the extension's path where it has no batch).

``gunicorn 'bench.app:create_app()'`` serves it; the database URL comes from
``BENCH_DATABASE_URL``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import typing as t

import sqlalchemy as sa
from flask import Blueprint, Flask, Response, current_app, jsonify, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import orm
from sqlalchemy.dialects import postgresql, sqlite

from bench import claim_paths
from flask_idempotency import Idempotency
from tests.support.tables import recreate_tables

DATABASE_ENV = "BENCH_DATABASE_URL"
KEY_HEADER = "Idempotency-Key"

db = SQLAlchemy()
idem = Idempotency()
bp = Blueprint("bench", __name__)


class Order(db.Model):  # type: ignore[name-defined,misc]
    """The business row every route writes."""

    __tablename__ = "orders"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    amount: orm.Mapped[int]
    note: orm.Mapped[str | None] = orm.mapped_column(db.String(200))


# -- the hand-written floor ------------------------------------------------------------

IN_PROGRESS, COMPLETED = "in_progress", "completed"

#: The floor's own key table; an index only on its primary key.
floor_keys = sa.Table(
    "floor_keys",
    db.metadata,
    sa.Column("key", sa.String(255), primary_key=True),
    sa.Column("request_hash", sa.String(64), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("response_code", sa.Integer, nullable=True),
    sa.Column("response_body", sa.LargeBinary, nullable=True),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
)

_CLAIM_VALUES = {
    "key": sa.bindparam("key"),
    "request_hash": sa.bindparam("request_hash"),
    "status": IN_PROGRESS,
    "created_at": sa.bindparam("created_at"),
}
#: The claim, per engine: it inserts one row or, when the key exists, none. The row
#: count is kept: psycopg 3 under SQLAlchemy 2.1 reports -1 for an INSERT otherwise
#: (psycopg2 and SQLite report it anyway; nothing more travels either way).
FLOOR_CLAIM: dict[str, t.Any] = {
    "postgresql": postgresql.insert(floor_keys)
    .values(_CLAIM_VALUES)
    .on_conflict_do_nothing(index_elements=["key"])
    .execution_options(preserve_rowcount=True),
    "sqlite": sqlite.insert(floor_keys)
    .values(_CLAIM_VALUES)
    .on_conflict_do_nothing(index_elements=["key"])
    .execution_options(preserve_rowcount=True),
}
FLOOR_LOAD = sa.select(
    floor_keys.c.request_hash,
    floor_keys.c.status,
    floor_keys.c.response_code,
    floor_keys.c.response_body,
).where(floor_keys.c.key == sa.bindparam("w_key"))
FLOOR_DONE = (
    sa.update(floor_keys)
    .where(floor_keys.c.key == sa.bindparam("w_key"))
    .values(
        status=COMPLETED,
        response_code=sa.bindparam("response_code"),
        response_body=sa.bindparam("response_body"),
    )
)
_FLOOR_CLAIM_CONFIG = "BENCH_FLOOR_CLAIM"


def write_order() -> int:
    """The business write: one ``orders`` row in the session, flushed for its id."""
    data = request.get_json()
    order = Order(amount=data["amount"], note=data.get("note"))
    db.session.add(order)
    db.session.flush()
    return order.id


def created(order_id: int) -> Response:
    """The answer of every route: 201 ``{"id": ...}``."""
    response = jsonify(id=order_id)
    response.status_code = 201
    return response


def _error(status: int, detail: str) -> Response:
    response = jsonify(detail=detail)
    response.status_code = status
    return response


@bp.post("/plain")
def plain() -> Response:
    order_id = write_order()
    db.session.commit()
    return created(order_id)


@bp.post("/floor")
def floor() -> Response:
    key = request.headers.get(KEY_HEADER)
    if not key:
        return _error(400, f"{KEY_HEADER} required")
    digest = hashlib.sha256(request.get_data()).hexdigest()
    session = db.session
    claim = session.execute(
        current_app.config[_FLOOR_CLAIM_CONFIG],
        {"key": key, "request_hash": digest, "created_at": dt.datetime.now(dt.timezone.utc)},
    )
    if t.cast("sa.CursorResult[t.Any]", claim).rowcount != 1:
        row = session.execute(FLOOR_LOAD, {"w_key": key}).first()
        session.rollback()
        if row is None or row.status != COMPLETED:
            return _error(409, "in progress")
        if row.request_hash != digest:
            return _error(422, "key reused with another payload")
        replayed = Response(row.response_body, status=row.response_code)
        replayed.content_type = "application/json"
        replayed.headers["Idempotent-Replayed"] = "true"
        return replayed
    response = created(write_order())
    session.execute(
        FLOOR_DONE,
        {"w_key": key, "response_code": response.status_code, "response_body": response.get_data()},
    )
    session.commit()
    return response


# -- the extension's routes --------------------------------------------------------------


def _order_view() -> Response:
    # No commit: the extension commits the record with the order.
    return created(write_order())


bp.add_url_rule("/ext", "ext", idem.idempotent()(_order_view), methods=["POST"])
bp.add_url_rule(
    "/ext-nowait", "ext_nowait", idem.idempotent(wait=None)(_order_view), methods=["POST"]
)

#: Why ``/ext-optimistic`` is missing (the extension has no ``optimistic=``), or None.
OPTIMISTIC_MISSING: str | None = None
_decorate: t.Callable[..., t.Callable[[t.Callable[[], Response]], t.Any]] = idem.idempotent
try:
    _optimistic = _decorate(optimistic=True)
except TypeError as exc:
    OPTIMISTIC_MISSING = f"@idem.idempotent(optimistic=True) is not available: {exc}"
else:
    bp.add_url_rule("/ext-optimistic", "ext_optimistic", _optimistic(_order_view), methods=["POST"])


#: The same route as ``/ext``, claiming another way: on psycopg 3 apps only.
claim_bp = Blueprint("claim", __name__)
for _path in (claim_paths.PIPELINE, claim_paths.SERIAL, claim_paths.GENERIC):
    claim_bp.add_url_rule(
        f"/ext-{_path}",
        f"ext_{_path.replace('-', '_')}",
        claim_paths.claiming(_path, idem.idempotent()(_order_view)),
        methods=["POST"],
    )


@bp.get("/healthz")
def healthz() -> Response:
    """Liveness, without the database: the harness waits for it after starting."""
    return jsonify(ok=True, optimistic=OPTIMISTIC_MISSING is None)


# -- the app ----------------------------------------------------------------------------


def create_app(database_url: str | None = None) -> Flask:
    """The app on ``database_url`` (default ``$BENCH_DATABASE_URL``), with the
    engine options Flask-SQLAlchemy gives by default."""
    url = database_url or os.environ[DATABASE_ENV]
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = url
    app.config[_FLOOR_CLAIM_CONFIG] = FLOOR_CLAIM[sa.make_url(url).get_backend_name()]
    db.init_app(app)
    idem.init_app(app, db)
    app.register_blueprint(bp)
    if sa.make_url(url).get_dialect().driver == "psycopg":
        claim_paths.install()
        app.register_blueprint(claim_bp)
    return app


def reset_database(url: str) -> None:
    """Drop and create every table the app uses, empty."""
    recreate_tables(db.metadata, url)
