"""The payments service: ``POST /payments`` charges a customer once per key.

Every route is its caller's: the merchant (:func:`merchant`) is the scope of
its keys, is stored on each charge, and is the filter of every read. Another
merchant's charge is a 404, as one that does not exist.
"""

from __future__ import annotations

import datetime as dt
import decimal
import os
import typing as t

import sqlalchemy as sa
from flask import Flask, abort, request, url_for
from flask_sqlalchemy import SQLAlchemy
from marshmallow import Schema, ValidationError, fields, validate
from sqlalchemy import orm
from werkzeug.exceptions import HTTPException

from flask_idempotency import Idempotency, ProblemError

db = SQLAlchemy()
idem = Idempotency()

DEFAULT_DATABASE_URL = "sqlite:///example.sqlite3"

# What the ledger's columns hold; the schema refuses anything else with 422
# instead of letting the database fail the request with a 500.
MERCHANT_LENGTH = 64
CUSTOMER_ID_LENGTH = 64
DESCRIPTION_LENGTH = 200
AMOUNT_MAX = 2**31 - 1  # INTEGER on PostgreSQL and MySQL is 32-bit
#: The largest id a route takes, the id columns' own (INTEGER): a larger one
#: matches no route (404) instead of reaching the database, which refuses to
#: bind it (SQLite past 64 bits, psycopg 3 past 32: a 500).
ID_MAX = 2**31 - 1


class LedgerEntry(db.Model):  # type: ignore[name-defined,misc]
    """One row per charge: the side effect that must happen once."""

    __tablename__ = "ledger"

    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    #: Whose charge it is: only this merchant reads it.
    merchant: orm.Mapped[str] = orm.mapped_column(db.String(MERCHANT_LENGTH), index=True)
    customer_id: orm.Mapped[str] = orm.mapped_column(db.String(CUSTOMER_ID_LENGTH))
    amount: orm.Mapped[int] = orm.mapped_column(db.Integer)
    currency: orm.Mapped[str] = orm.mapped_column(db.String(3))
    description: orm.Mapped[str | None] = orm.mapped_column(db.String(DESCRIPTION_LENGTH))
    created_at: orm.Mapped[dt.datetime] = orm.mapped_column(
        default=lambda: dt.datetime.now(dt.timezone.utc)
    )

    def as_dict(self) -> dict[str, t.Any]:
        return {
            "charge_id": self.id,
            "customer_id": self.customer_id,
            "amount": self.amount,
            "currency": self.currency,
            "description": self.description,
        }


def merchant() -> str:
    """The calling merchant. A stand-in for authentication: a real service takes
    it from the verified credential (an API key, a client certificate), never
    from a header anyone can set. Without one the request is refused (401): a
    caller with no identity shares nothing with another."""
    name = request.headers.get("X-Merchant", "")
    if not name or len(name) > MERCHANT_LENGTH or not name.isprintable():
        abort(401, description="Send your merchant in X-Merchant (1 to 64 printable characters).")
    return name


def problem(status: int, title: str, detail: str) -> tuple[dict[str, t.Any], int, dict[str, str]]:
    """An RFC 9457 problem response."""
    body = {"type": "about:blank", "title": title, "status": status, "detail": detail}
    return body, status, {"Content-Type": "application/problem+json"}


def http_problem(exc: HTTPException) -> t.Any:
    """Werkzeug's HTTP errors (401, 404, 405, 413...) as problem+json; the
    extension's errors are problem+json already."""
    if isinstance(exc, ProblemError):
        return exc.get_response()
    return problem(exc.code or 500, exc.name, exc.description or exc.name)


def storable_text(value: str) -> None:
    """Refuse text no database column can hold: NUL (PostgreSQL refuses it) and
    lone surrogates (not encodable as UTF-8)."""
    if "\x00" in value:
        raise ValidationError("Must not contain NUL characters.")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError("Must be valid Unicode text.") from None


class WholeNumber(fields.Integer):
    """An integer that also accepts its string spelling (``"1250"``) and
    integral floats (``1250.0``), and refuses fractions instead of truncating
    them: ``12.5`` minor units is a client error, not a charge of 12."""

    def _deserialize(self, value: t.Any, attr: str | None, data: t.Any, **kwargs: t.Any) -> int:
        if isinstance(value, float | decimal.Decimal):
            try:
                fraction = value != int(value)
            except (OverflowError, ValueError):
                fraction = False  # infinite or NaN: the Integer field says why
            if fraction:
                raise self.make_error("invalid")
        return super()._deserialize(value, attr, data, **kwargs)


class AmountSchema(Schema):
    """Who pays how much: the fields an order and a charge share. ``client_sent_at``
    changes on every retry, so the routes exclude it from the fingerprint. Every
    field that reaches a table is held to what its column can store."""

    customer_id = fields.String(
        required=True,
        validate=[validate.Length(min=1, max=CUSTOMER_ID_LENGTH), storable_text],
    )
    amount = WholeNumber(
        required=True, strict=False, validate=validate.Range(min=1, max=AMOUNT_MAX)
    )
    currency = fields.String(required=True, validate=validate.OneOf(["EUR", "USD", "GBP"]))
    client_sent_at = fields.AwareDateTime(load_default=None)


class PaymentSchema(AmountSchema):
    """A charge request."""

    description = fields.String(
        load_default=None,
        validate=[validate.Length(max=DESCRIPTION_LENGTH), storable_text],
    )


#: The server-side bound on each statement (ms): above IDEMPOTENCY_WAIT (10 s), so
#: a duplicate waiting for the first request still gets its 409 or replay, not a
#: cancel.
STATEMENT_TIMEOUT_MS = 15_000


def behind_transaction_pooler(app: Flask) -> bool:
    """Whether the app's PostgreSQL is reached through a transaction pooler
    (PgBouncer's ``pool_mode = transaction``): ``IDEMPOTENCY_DATABASE_POOLER`` in
    the config, else ``EXAMPLE_DATABASE_POOLER`` from the environment (the same
    values: ``transaction``, ``transaction+prepared``, ``session``)."""
    if not app.config.get("IDEMPOTENCY_DATABASE_POOLER"):
        app.config["IDEMPOTENCY_DATABASE_POOLER"] = os.environ.get("EXAMPLE_DATABASE_POOLER")
    pooler = str(app.config["IDEMPOTENCY_DATABASE_POOLER"] or "").strip().lower()
    return pooler.startswith("transaction")


def engine_options(database_url: str, pooler: str | None = None) -> dict[str, t.Any]:
    """Engine settings that fail fast when the database is unreachable.

    Without them, a host cut off from its database hangs each request until the
    WSGI server kills the worker (gunicorn: 30 s). With them, a request fails
    within seconds with 503, which a client can retry elsewhere. See the
    README's "When the database is down". For the URLs the extras install a
    driver for: ``postgresql+psycopg2://`` (``[postgresql]``),
    ``postgresql+psycopg://`` (``[psycopg]``), ``mysql+pymysql://``
    (``[mysql]``); another driver gets the pool settings only.

    ``pooler`` is ``IDEMPOTENCY_DATABASE_POOLER``. Behind a transaction pooler
    the server's settings are not sent with the connection (PgBouncer refuses a
    connection's ``options``, and a server connection is shared): the statement
    timeout is set in each transaction instead (:func:`init_database`), and the
    pooler keeps its own connections to the server alive. psycopg 3 then
    prepares no statement (``prepare_threshold=None``), which a pooler that does
    not track them (``"transaction"``) would mix up between clients.
    """
    url = sa.engine.make_url(database_url)
    backend, driver = url.get_backend_name(), url.get_driver_name()
    if backend == "postgresql" and driver in ("psycopg2", "psycopg"):  # libpq parameters
        connect_args: dict[str, t.Any] = {
            "connect_timeout": 2,  # seconds to connect and log in (libpq's least)
            # A silent database: these end the wait, not a slow query (whose
            # server still acknowledges and answers probes).
            "tcp_user_timeout": 2_000,  # ms: sent data unacknowledged -> dead
            "keepalives": 1,  # awaiting a reply: probe the peer
            "keepalives_idle": 1,  # after 1 s of silence,
            "keepalives_interval": 1,  # then every 1 s;
            "keepalives_count": 2,  # dead when unanswered (tcp_user_timeout caps it)
        }
        mode = (pooler or "").strip().lower()
        if not mode.startswith("transaction"):
            # connect_args' options replace the URL's: keep those (a search_path, say).
            given = url.query.get("options", "")
            options = given if isinstance(given, str) else " ".join(given)
            # The tcp_ settings are the server's side of the connection: it
            # drops a session whose host went silent (cut off, powered off)
            # within about 5 s, and with it whatever that session held; a live
            # host's kernel answers the probes.
            connect_args["options"] = (
                f"{options} -c statement_timeout={STATEMENT_TIMEOUT_MS} -c tcp_keepalives_idle=2"
                " -c tcp_keepalives_interval=1 -c tcp_keepalives_count=3"
                " -c tcp_user_timeout=5000"
            ).strip()
        elif mode == "transaction" and driver == "psycopg":
            connect_args["prepare_threshold"] = None
        return {
            "pool_pre_ping": True,  # replace connections that died while pooled
            "pool_timeout": 5,  # wait at most 5 s for a pooled connection
            "connect_args": connect_args,
        }
    if backend in ("mysql", "mariadb") and driver in ("pymysql", "mysqldb"):
        return {
            "pool_pre_ping": True,
            "pool_timeout": 5,
            "connect_args": {"connect_timeout": 3, "read_timeout": 15, "write_timeout": 15},
        }
    if backend != "sqlite":
        return {"pool_pre_ping": True, "pool_timeout": 5}
    return {}


def init_database(app: Flask, db: SQLAlchemy) -> None:
    """``db.init_app`` with :func:`engine_options` (``SQLALCHEMY_ENGINE_OPTIONS`` in
    the config added, and winning). Behind a transaction pooler on PostgreSQL,
    each transaction begins with its statement timeout
    (``set_config(..., true)``, ``SET LOCAL``: it ends with the transaction, so
    the next client of that server connection never sees it)."""
    url = app.config["SQLALCHEMY_DATABASE_URI"]
    pooled = behind_transaction_pooler(app)
    app.config["SQLALCHEMY_ENGINE_OPTIONS"] = {
        **engine_options(url, app.config["IDEMPOTENCY_DATABASE_POOLER"]),
        **app.config.get("SQLALCHEMY_ENGINE_OPTIONS", {}),
    }
    db.init_app(app)
    if not pooled or sa.engine.make_url(url).get_backend_name() != "postgresql":
        return
    with app.app_context():
        engine = db.engine

    @sa.event.listens_for(engine, "begin")
    def bound_statements(conn: sa.Connection) -> None:
        conn.exec_driver_sql(
            f"SELECT set_config('statement_timeout', '{STATEMENT_TIMEOUT_MS}', true)"
        )


def create_tables(app: Flask, db: SQLAlchemy) -> None:
    """Create the app's tables where missing. A database that is down (or
    read-only) at start is one warning line, not a failed import: the app still
    loads, so ``flask --app example_app idempotency ...`` says what is wrong
    itself (exit 69), requests answer 503, and the next start creates the tables."""
    with app.app_context():
        try:
            db.create_all()
        except sa.exc.DBAPIError as exc:
            lines = str(exc.orig).strip().splitlines()
            app.logger.warning(
                "tables not created, the database failed: %s: %s",
                type(exc.orig).__name__,
                lines[0] if lines else "",
            )


def create_app(config: t.Mapping[str, t.Any] | None = None) -> Flask:
    """Build the app. ``config`` overrides; the database comes from
    ``EXAMPLE_DATABASE_URL`` (with its driver: ``postgresql+psycopg2://user@host/db``,
    ``postgresql+psycopg://...``, ``mysql+pymysql://...``) or defaults to SQLite
    in the instance folder. Behind a transaction pooler, set
    ``EXAMPLE_DATABASE_POOLER=transaction`` (or ``IDEMPOTENCY_DATABASE_POOLER``
    in ``config``).
    ``SQLALCHEMY_ENGINE_OPTIONS`` in ``config`` are added to (and win over)
    :func:`engine_options`."""
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = os.environ.get(
        "EXAMPLE_DATABASE_URL", DEFAULT_DATABASE_URL
    )
    app.config["IDEMPOTENCY_REQUIRED"] = True
    # PostgreSQL ends a claim's transaction left idle this long (its host cut
    # off mid-request), so the retry on another host does not wait behind it.
    # Above the longest pause a view makes between two statements (these make none).
    app.config["IDEMPOTENCY_CLAIM_IDLE_TIMEOUT"] = 5
    app.config["MAX_CONTENT_LENGTH"] = 64 * 1024
    if config:
        app.config.update(config)
    init_database(app, db)
    idem.init_app(app, db)
    app.register_blueprint(bp)
    # Every HTTP error as problem+json (401 from merchant(), 404, 405, 413...).
    app.register_error_handler(HTTPException, http_problem)
    # Readiness, for the load balancer: 503 while the database cannot answer.
    app.add_url_rule("/readyz", view_func=idem.readiness_view)
    create_tables(app, db)
    return app


from flask import Blueprint  # noqa: E402

bp = Blueprint("payments", __name__)


@bp.post("/payments")
# The merchant's keys are its own: another merchant's identical key is another
# charge, and never gets this one's response replayed.
@idem.idempotent(
    schema=PaymentSchema(),
    exclude=["client_sent_at"],
    scope=lambda: f"merchant:{merchant()}",
)
def create_payment() -> tuple[dict[str, t.Any], int, dict[str, str]]:
    """Charge the customer: write one ledger row. The extension commits it,
    together with the idempotency record."""
    data = idem.payload
    entry = LedgerEntry(
        merchant=merchant(),
        customer_id=data["customer_id"],
        amount=data["amount"],
        currency=data["currency"],
        description=data["description"],
    )
    db.session.add(entry)
    db.session.flush()  # assigns the id; the commit happens after the view returns
    location = url_for("payments.get_payment", charge_id=entry.id)
    return entry.as_dict(), 201, {"Location": location}


@bp.get(f"/payments/<int(max={ID_MAX}):charge_id>")
def get_payment(charge_id: int) -> dict[str, t.Any]:
    """One of the caller's charges; another merchant's is a 404, as a missing one."""
    mine = db.select(LedgerEntry).where(
        LedgerEntry.id == charge_id, LedgerEntry.merchant == merchant()
    )
    entry: LedgerEntry | None = db.session.execute(mine).scalar_one_or_none()
    if entry is None:
        abort(404)
    return entry.as_dict()


@bp.get("/ledger")
def ledger() -> dict[str, t.Any]:
    """The caller's charges, oldest first."""
    entries = db.session.execute(
        db.select(LedgerEntry).where(LedgerEntry.merchant == merchant()).order_by(LedgerEntry.id)
    ).scalars()
    rows = [e.as_dict() for e in entries]
    return {"count": len(rows), "entries": rows}


@bp.get("/healthz")
def healthz() -> dict[str, t.Any]:
    """Liveness: the process serves requests. It never touches the database, so
    an outage does not get healthy workers restarted; ``/readyz`` covers that."""
    return {"alive": True}
