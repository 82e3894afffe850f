"""A Stripe-like API: ``POST /v1/charges``, whose client is Stripe's own Python SDK.

It speaks Stripe's dialect, so the official SDK (``pip install stripe``) works
against it unchanged, retries included:

* form-encoded bodies (``amount=1250&currency=eur&description=...``);
* the API key as the credential (``Authorization: Bearer sk_test_...`` as the
  SDK sends it, or Basic with the key as the user name, as ``curl -u`` does);
  each key belongs to an account, and the account is the scope of its keys:
  two accounts' identical ``Idempotency-Key`` are two charges;
* every error in Stripe's envelope,
  ``{"error": {"type", "code", "message", "doc_url"}}``, the extension's
  problems included (:func:`stripe_problem`, an ``errorhandler(ProblemError)``),
  with the status and type the SDK picks its exception by, and
  ``Stripe-Should-Retry``, which its retry loop obeys;
* ``Request-Id`` on every answer (the SDK shows it in each error).

The SDK sends an ``Idempotency-Key`` with every POST (its own UUID unless the
caller passes one) and retries a lost connection, a 409 and a 5xx with it,
``max_network_retries`` times; the extension makes each retry replay the first
answer instead of charging again.

Run it with ``python -m example_app stripe`` (127.0.0.1:5003), then::

    import stripe
    client = stripe.StripeClient(
        "sk_test_acme", base_addresses={"api": "http://127.0.0.1:5003"}, max_network_retries=3
    )
    charge = client.v1.charges.create(
        params={"amount": 1250, "currency": "eur"}, options={"idempotency_key": "order-6735"}
    )
"""

from __future__ import annotations

import functools
import os
import secrets
import time
import typing as t

import marshmallow as ma
from flask import Blueprint, Flask, current_app, g, jsonify, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import orm
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from flask_idempotency import Idempotency, ProblemError
from flask_idempotency.errors import (
    ConflictError,
    KeyReusedError,
    PayloadTooLargeError,
    ValidationProblem,
)

from .app import AMOUNT_MAX, DESCRIPTION_LENGTH, create_tables, init_database

db = SQLAlchemy()
idem = Idempotency()

DEFAULT_DATABASE_URL = "sqlite:///stripe_like.sqlite3"
#: API key -> account (``STRIPE_LIKE_API_KEYS`` in the config replaces them).
DEMO_API_KEYS = {"sk_test_acme": "acct_acme", "sk_test_globex": "acct_globex"}
CURRENCIES = ("eur", "gbp", "usd")
#: Each problem's ``doc_url``: its page in the extension's documentation.
PROBLEM_DOCS = "https://flask-idempotency.readthedocs.io/en/latest/problems/{slug}.html"

Answer = tuple[t.Any, int, dict[str, str]]
View = t.Callable[..., t.Any]


class Charge(db.Model):  # type: ignore[name-defined,misc]
    """One row per charge: the side effect that must happen once."""

    __tablename__ = "charges"

    id: orm.Mapped[str] = orm.mapped_column(
        db.String(32), primary_key=True, default=lambda: "ch_" + secrets.token_hex(12)
    )
    account: orm.Mapped[str] = orm.mapped_column(db.String(64), index=True)
    amount: orm.Mapped[int] = orm.mapped_column(db.Integer)
    currency: orm.Mapped[str] = orm.mapped_column(db.String(3))
    description: orm.Mapped[str | None] = orm.mapped_column(db.String(DESCRIPTION_LENGTH))
    created: orm.Mapped[int] = orm.mapped_column(db.Integer, default=lambda: int(time.time()))

    def as_stripe(self) -> dict[str, t.Any]:
        """The charge as Stripe shows one (``object`` tells the SDK its class)."""
        return {
            "id": self.id,
            "object": "charge",
            "amount": self.amount,
            "currency": self.currency,
            "description": self.description,
            "created": self.created,
            "livemode": False,
            "paid": True,
            "status": "succeeded",
        }


def stripe_error(
    status: int,
    kind: str,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    doc_url: str | None = None,
    headers: t.Mapping[str, str] | None = None,
) -> Answer:
    """An error in Stripe's envelope. The SDK raises, by status and ``kind``:
    400 or 404 with ``idempotency_error`` -> ``IdempotencyError``, other 400 and
    404 -> ``InvalidRequestError``, 401 -> ``AuthenticationError``, any other ->
    ``APIError``; ``message`` is the exception's text, ``code`` its ``.code``
    (``InvalidRequestError``) or ``.error.code`` (every class)."""
    members = {"type": kind, "code": code, "param": param, "message": message, "doc_url": doc_url}
    error = {name: value for name, value in members.items() if value is not None}
    return jsonify(error=error), status, dict(headers or {})


def stripe_problem(problem: ProblemError) -> Answer:
    """Every problem the extension raises, in Stripe's envelope.

    The status is the one Stripe's API gives the same case, so the SDK raises
    its specific exception: a key reused with other parameters is
    400 ``idempotency_error`` (``stripe.IdempotencyError``; at 422 the SDK would
    raise a bare ``APIError``), a request still in progress 409, an outage 503,
    any other bad request 400 ``invalid_request_error``. ``code`` is the
    problem's slug, but for a parameter that failed validation
    (``ValidationProblem``), which is ``parameter_invalid`` with ``param``
    naming it, as Stripe's own. ``Stripe-Should-Retry`` says whether the same request may
    succeed later: so for the problems that carry ``Retry-After`` (the
    extension adds that header back, with ``Idempotency-Key``, to this answer).
    """
    status = problem.code or 500
    if isinstance(problem, KeyReusedError):
        status, kind = 400, "idempotency_error"
    elif isinstance(problem, ConflictError):
        kind = "idempotency_error"
    elif status >= 500:
        kind = "api_error"
    else:
        status, kind = 400, "invalid_request_error"
    retry = "Retry-After" in problem.extra_headers
    headers = {"Stripe-Should-Retry": "true" if retry else "false"}
    if isinstance(problem, ValidationProblem):
        # Stripe names the first refused parameter, with the reason as the message.
        param, reasons = next(iter(problem.extra.get("errors", {}).items()), (None, None))
        if param is not None:
            reason = reasons[0] if isinstance(reasons, list) and reasons else problem.detail
            return stripe_error(
                400, kind, str(reason), code="parameter_invalid", param=param, headers=headers
            )
    return stripe_error(
        status,
        kind,
        problem.detail,
        code=problem.slug,
        doc_url=PROBLEM_DOCS.format(slug=problem.slug),
        headers=headers,
    )


def http_error(exc: HTTPException) -> Answer:
    """Werkzeug's own HTTP errors (404, 405, 413...) in the same envelope."""
    status = exc.code or 500
    kind = "api_error" if status >= 500 else "invalid_request_error"
    return stripe_error(status, kind, exc.description or exc.name)


bp = Blueprint("stripe_like", __name__)


@bp.before_request
def authenticate() -> Answer | None:
    """The account of the API key: ``Bearer <key>`` (the SDK) or Basic with the
    key as the user name (``curl -u sk_test_acme:``). A missing or unknown key
    is 401 (the SDK's ``AuthenticationError``) before anything else runs."""
    auth = request.authorization
    api_key = (auth.token if auth.type == "bearer" else auth.username) if auth else None
    accounts = current_app.config["STRIPE_LIKE_API_KEYS"]
    if not api_key or api_key not in accounts:
        return stripe_error(401, "invalid_request_error", "Invalid API Key provided.")
    g.account = accounts[api_key]
    return None


class Cents(ma.fields.Integer):
    """A whole number of cents as the form sends it: ASCII digits only (``int``
    itself would take ``" 12"``, ``"1_000"`` or other scripts' digits)."""

    def _deserialize(self, value: t.Any, attr: t.Any, data: t.Any, **kwargs: t.Any) -> t.Any:
        if not (isinstance(value, str) and value.isascii() and value.isdigit()):
            raise self.make_error("invalid")
        if len(value) > len(str(AMOUNT_MAX)):
            raise self.make_error("invalid")
        return super()._deserialize(value, attr, data, **kwargs)


def _one_of_currencies(value: str) -> None:
    if value.lower() not in CURRENCIES:
        raise ma.ValidationError(f"currency: one of {', '.join(CURRENCIES)}.")


def _text(value: str) -> None:
    if len(value) > DESCRIPTION_LENGTH or "\x00" in value:
        raise ma.ValidationError(f"description: at most {DESCRIPTION_LENGTH} characters.")


class ChargeParams(ma.Schema):
    """``POST /v1/charges``'s parameters; others (``metadata[...]``) are ignored."""

    class Meta:
        unknown = ma.EXCLUDE

    amount = Cents(
        required=True,
        validate=ma.validate.Range(1, AMOUNT_MAX, error=f"amount: 1 to {AMOUNT_MAX} cents."),
        error_messages={
            "required": "Missing required param: amount.",
            "invalid": f"amount: a whole number of cents, 1 to {AMOUNT_MAX}.",
        },
    )
    currency = ma.fields.String(
        required=True,
        validate=_one_of_currencies,
        error_messages={"required": "Missing required param: currency."},
    )
    description = ma.fields.String(load_default=None, validate=_text)


def validated(schema: ma.Schema) -> t.Callable[[View], View]:
    """Load the form through ``schema`` into ``g.params`` BEFORE the key is claimed.

    Placed above ``@idem.idempotent``: a refused parameter raises
    ``ValidationProblem`` (answered 400 ``invalid_request_error`` naming the
    parameter) before the extension sees the request, so nothing is stored and
    the corrected request, with the same key, charges once, as Stripe saves no
    result for a request whose parameters fail validation. The route option
    ``schema=`` does the same for JSON bodies only: it refuses a form body (415).
    """

    def decorate(view: View) -> View:
        @functools.wraps(view)
        def wrapper(*args: t.Any, **kwargs: t.Any) -> t.Any:
            try:
                form = request.form.to_dict()
            except RequestEntityTooLarge:
                # Read here first, the body over the limit is still the extension's problem
                # (400 for the SDK, which would raise a bare APIError at werkzeug's 413).
                raise PayloadTooLargeError(
                    f"The body is larger than this server accepts ({request.max_content_length}"
                    " bytes)."
                ) from None
            try:
                g.params = schema.load(form)
            except ma.ValidationError as exc:
                raise ValidationProblem(
                    "The request's parameters failed validation.", extra={"errors": exc.messages}
                ) from exc
            return view(*args, **kwargs)

        return wrapper

    return decorate


@bp.post("/v1/charges")
@validated(ChargeParams())  # first: a refused parameter never claims the key
# The account's keys are its own: another account's identical key is another charge.
@idem.idempotent(scope=lambda: f"account:{g.account}")
def create_charge() -> Answer:
    """Charge once per key. The form counts as its fields (``%20`` or ``+``,
    their order: the same request). Its parameters were validated before the
    key was claimed (:func:`validated`): a refused one stores nothing."""
    params = g.params
    charge = Charge(
        account=g.account,
        amount=params["amount"],
        currency=params["currency"].lower(),
        description=params["description"] or None,
    )
    db.session.add(charge)
    db.session.flush()  # the id and defaults; the extension commits with the record
    return charge.as_stripe(), 200, {}


@bp.get("/v1/charges/<charge_id>")
def retrieve_charge(charge_id: str) -> Answer:
    """One of the account's charges; another account's is missing, as Stripe's."""
    charge = db.session.get(Charge, charge_id)
    if charge is None or charge.account != g.account:
        return stripe_error(
            404, "invalid_request_error", f"No such charge: '{charge_id}'", code="resource_missing"
        )
    return charge.as_stripe(), 200, {}


def request_id(response: t.Any) -> t.Any:
    """Every answer names itself, as Stripe's do: the SDK shows it in errors."""
    response.headers.setdefault("Request-Id", "req_" + secrets.token_hex(8))
    return response


def create_app(config: t.Mapping[str, t.Any] | None = None) -> Flask:
    """Build the app. ``config`` overrides; the database comes from
    ``EXAMPLE_DATABASE_URL`` (as for the payments service) or is SQLite in the
    instance folder; the API keys from ``STRIPE_LIKE_API_KEYS``."""
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = os.environ.get(
        "EXAMPLE_DATABASE_URL", DEFAULT_DATABASE_URL
    )
    app.config["STRIPE_LIKE_API_KEYS"] = DEMO_API_KEYS
    app.config["MAX_CONTENT_LENGTH"] = 64 * 1024
    # An API renders no forms: a body parameter ``idempotency_key`` is a
    # parameter, never read as a rendered form's key (a browser's problem).
    app.config["IDEMPOTENCY_FORM_FIELD"] = None
    if config:
        app.config.update(config)
    init_database(app, db)
    idem.init_app(app, db)
    app.register_blueprint(bp)
    app.register_error_handler(ProblemError, stripe_problem)
    app.register_error_handler(HTTPException, http_error)
    app.after_request(request_id)
    create_tables(app, db)
    return app
