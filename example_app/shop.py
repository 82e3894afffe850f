"""The shop: a browser checkout on the order service, where a double click is one order.

A person, not a client library, sends these POSTs: a plain HTML form, no
JavaScript, no ``Idempotency-Key`` header. Each rendering of the checkout page
carries a key of its own in a hidden field (``{{ idempotency_field() }}``), so
every way a browser repeats that submission is the same operation, run once:

* a double click, or a second click while the first is still loading: the
  browser sends the form twice with the same key; the second waits for the
  first and gets its answer (one order, both land on the order page);
* the back button, then submit again: the page comes back from the browser's
  history with the key it was rendered with: the same order, not a second;
* a reload of the page a POST answered (``EXAMPLE_CHECKOUT_REDIRECT`` off): the
  browser posts the form again, the stored page is replayed;
* two tabs, each showing the checkout: two renderings, two keys, two orders
  (two intents);
* a form refused for a wrong field comes back with a new key: correcting it and
  submitting places the order (the refused attempt is an operation of its own).

After an order the browser is sent on with ``303 See Other`` to the order's
page (Post/Redirect/Get); a replayed 303 sends it to the same page.

The checkout leases its key (``lease=True``), as a checkout that calls a payment
provider must (the order service's ``POST /orders`` does): the claim commits
before the view runs. A browser's second submission finds it, waits for the first
to finish and gets its answer. The ``fetch()`` page's JSON route keeps the
default, the claim in the order's transaction: a duplicate waits on the database
for it. The browser tests double-submit on each.

Who the customer is: a random id kept in the session cookie (a stand-in for a
login). The route keeps the extension's default scope, which tells browsers
apart by their session; a form key minted for one session is refused in
another, as is one altered, too old (``IDEMPOTENCY_FORM_KEY_MAX_AGE``) or
minted for another form.

The shop's orders are rows of the order service's ``orders`` table (tenant
``shop``), paid on delivery: no charge at the payments service. Each writes its
``order-created`` event to the outbox in the order's transaction, as an API
order does.

Settings (``app.config``, or the environment for ``python -m example_app shop``):

* ``EXAMPLE_SHOP_FLASK_WTF`` (``create_app(flask_wtf=True)``): the checkout is a
  Flask-WTF ``FlaskForm`` (``shop_wtf.py``) and ``CSRFProtect`` guards every form
  and ``fetch()`` POST of the app (the order service's JSON API, whose callers
  name themselves in a header, not a cookie, is exempt);
* ``EXAMPLE_CHECKOUT_REDIRECT`` (default on): Post/Redirect/Get; off, the POST
  answers the order page itself;
* ``EXAMPLE_CHECKOUT_DELAY``: seconds each order takes (the payment provider a
  real checkout would call), so a double click lands twice before the first answer;
* ``SECRET_KEY`` (``EXAMPLE_SECRET_KEY``): signs the session and the form keys.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
import typing as t

from flask import (
    Blueprint,
    Flask,
    abort,
    current_app,
    redirect,
    render_template,
    request,
    session,
    url_for,
)
from marshmallow import Schema, ValidationError, fields, validate

from flask_idempotency.errors import FormKeyError

from . import broker, orders
from .app import ID_MAX
from .orders import Order, db, idem

logger = logging.getLogger(__name__)

#: The tenant of every shop order in the ``orders`` table.
SHOP_TENANT = "shop"
CURRENCY = "EUR"
#: What the shop sells: id -> (name, unit price in cents).
PRODUCTS = {
    "mug": ("Mug", 1250),
    "tee": ("T-shirt", 2400),
    "poster": ("Poster", 900),
}
QUANTITY_MAX = 10

bp = Blueprint("shop", __name__, url_prefix="/shop", template_folder="templates")


@bp.context_processor
def catalogue() -> dict[str, t.Any]:
    """What every shop page may show."""
    return {"products": PRODUCTS}


class CheckoutSchema(Schema):
    """What a checkout asks for: a product and how many."""

    product = fields.String(required=True, validate=validate.OneOf(list(PRODUCTS)))
    quantity = fields.Integer(
        required=True, strict=False, validate=validate.Range(min=1, max=QUANTITY_MAX)
    )


def customer() -> str:
    """This browser's customer id, made on its first visit and kept in its session
    cookie. A stand-in for a login: a real shop takes it from its user."""
    if "customer" not in session:
        session["customer"] = "cus_" + secrets.token_hex(8)
    return t.cast(str, session["customer"])


def flask_wtf() -> bool:
    return bool(current_app.config.get("EXAMPLE_SHOP_FLASK_WTF"))


def place_order(product: str, quantity: int) -> Order:
    """Write the order and its event, in the request's transaction (the extension
    commits them with the record of the key)."""
    delay = float(current_app.config.get("EXAMPLE_CHECKOUT_DELAY") or 0)
    if delay > 0:
        time.sleep(delay)  # the slow part of a checkout: a payment provider, say
    row = Order(
        tenant=SHOP_TENANT,
        customer_id=customer(),
        amount=PRODUCTS[product][1] * quantity,
        currency=CURRENCY,
        charge_id=None,  # paid on delivery
    )
    db.session.add(row)
    db.session.flush()
    idem.emit(broker.ORDER_CREATED, row.as_dict())
    return row


def placed(row: Order) -> t.Any:
    """The answer to a checkout: ``303`` to the order's page (Post/Redirect/Get), or,
    with ``EXAMPLE_CHECKOUT_REDIRECT`` off, that page itself."""
    if current_app.config.get("EXAMPLE_CHECKOUT_REDIRECT", True):
        return redirect(url_for("shop.order", order_id=row.id), 303)
    return render_order(row), 201


@bp.route("/checkout", methods=["GET", "POST"])
@idem.idempotent(lease=True)
def checkout() -> t.Any:
    """The checkout page (GET) and its submission (POST): one view, so the form's key
    is minted for it (``idempotency_field()``'s default endpoint)."""
    customer()  # this browser's customer, kept in its session
    if flask_wtf():
        from .shop_wtf import checkout_with_flask_wtf  # Flask-WTF: only when asked for

        return checkout_with_flask_wtf()
    return checkout_with_template()


def checkout_with_template() -> t.Any:
    """The checkout as a template with ``{{ idempotency_field() }}`` in its form."""
    form = {"product": request.form.get("product", ""), "quantity": request.form.get("quantity")}
    if request.method == "GET":
        return render_template("shop/checkout.html", form=form, errors={})
    try:
        order = CheckoutSchema().load(form)
    except ValidationError as exc:
        # The page again, with the errors and so with a new key: the corrected form
        # is a new operation, not this one again with another payload.
        return render_template("shop/checkout.html", form=form, errors=exc.messages), 422
    row = place_order(order["product"], order["quantity"])
    return placed(row)


@bp.get("/quick")
def quick() -> t.Any:
    """A page that orders with ``fetch()``: its script sends the key the page was
    rendered with in the ``Idempotency-Key`` header."""
    customer()
    return render_template("shop/quick.html")


@bp.post("/api/orders")
@idem.idempotent(schema=CheckoutSchema(), required=True)
def api_order() -> t.Any:
    """The quick page's JSON checkout (refusals are the extension's problem+json)."""
    order = idem.payload
    row = place_order(order["product"], order["quantity"])
    location = url_for("shop.order", order_id=row.id)
    return {**row.as_dict(), "url": location}, 201, {"Location": location}


@bp.get(f"/orders/<int(max={ID_MAX}):order_id>")
def order(order_id: int) -> t.Any:
    """One of this browser's orders; another's is a 404, as a missing one."""
    mine = db.select(Order).where(
        Order.id == order_id, Order.tenant == SHOP_TENANT, Order.customer_id == customer()
    )
    row: Order | None = db.session.execute(mine).scalar_one_or_none()
    if row is None:
        abort(404)
    return render_order(row)


def render_order(row: Order) -> str:
    count = db.select(db.func.count()).where(
        Order.tenant == SHOP_TENANT, Order.customer_id == row.customer_id
    )
    return render_template(
        "shop/order.html", order=row, orders=db.session.execute(count).scalar_one()
    )


#: What the shop tells a person whose form key was refused, by the refusal's reason.
REFUSALS = {
    "expired": "This checkout page was open too long.",
    "other_caller": "This checkout page was opened in another session.",
    "other_form": "This page was made for another form.",
}


@bp.errorhandler(FormKeyError)
def form_key_refused(exc: FormKeyError) -> t.Any:
    """A form key the extension refused (too old, another session's or another
    form's, altered): for a browser, the shop's own page with the way back to a
    fresh form (without this handler, the extension's plain page); for anyone
    else (``fetch()``, an API client) the extension's problem+json."""
    wanted = request.accept_mimetypes.best_match(["application/problem+json", "text/html"])
    if wanted != "text/html":
        return exc.get_response()
    reason = REFUSALS.get(exc.reason, "This checkout page cannot be used.")
    return render_template("shop/form_refused.html", reason=reason), 400


def create_app(
    config: t.Mapping[str, t.Any] | None = None,
    *,
    flask_wtf: bool | None = None,
    clock: orders.Clock | None = None,
) -> Flask:
    """The order service with the shop's pages (``/shop/checkout``, ``/shop/quick``).

    ``config`` as for :func:`example_app.orders.create_app`; ``flask_wtf`` sets
    ``EXAMPLE_SHOP_FLASK_WTF`` (default: the environment's). ``clock`` is the
    extension's (tests move it to age a form key)."""
    settings: dict[str, t.Any] = {
        "EXAMPLE_SHOP_FLASK_WTF": os.environ.get("EXAMPLE_SHOP_FLASK_WTF", "") in ("1", "true"),
        "EXAMPLE_CHECKOUT_DELAY": float(os.environ.get("EXAMPLE_CHECKOUT_DELAY", "0")),
        # A rendered checkout stays good for two hours; an older one is refused
        # (the extension's default: the route's retention, IDEMPOTENCY_TTL).
        "IDEMPOTENCY_FORM_KEY_MAX_AGE": 2 * 60 * 60,
        **(config or {}),
    }
    if flask_wtf is not None:
        settings["EXAMPLE_SHOP_FLASK_WTF"] = flask_wtf
    if not settings.get("SECRET_KEY"):
        settings["SECRET_KEY"] = os.environ.get("EXAMPLE_SECRET_KEY") or _throwaway_secret()
    app = orders.create_app(settings, clock=clock)
    app.register_blueprint(bp)
    if app.config["EXAMPLE_SHOP_FLASK_WTF"]:
        from .shop_wtf import protect

        protect(app)
    return app


def _throwaway_secret() -> str:
    logger.warning(
        "EXAMPLE_SECRET_KEY is not set: a random one for this process only. Sessions and "
        "rendered forms do not survive a restart, nor work across processes."
    )
    return secrets.token_hex(32)
