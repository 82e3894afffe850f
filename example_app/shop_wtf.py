"""The shop's checkout as a Flask-WTF form, under ``CSRFProtect``
(``EXAMPLE_SHOP_FLASK_WTF``; Flask-WTF is not a dependency of the example
otherwise, so only this module imports it).

The form's :class:`~flask_idempotency.forms.IdempotencyKeyField` renders a fresh
key each time the form is rendered, with ``form.hidden_tag()`` as the CSRF token.
Neither counts in the request's fingerprint: a form re-rendered with a new CSRF
token and submitted again is the same operation.
"""

from __future__ import annotations

import typing as t

from flask import Flask, render_template
from flask_wtf import FlaskForm
from flask_wtf.csrf import CSRFProtect
from wtforms import IntegerField, SelectField
from wtforms.fields.choices import SelectChoice
from wtforms.validators import InputRequired, NumberRange

from flask_idempotency.forms import IdempotencyKeyField

from . import orders
from .shop import PRODUCTS, QUANTITY_MAX, place_order, placed

csrf = CSRFProtect()


class CheckoutForm(FlaskForm):  # type: ignore[misc]
    """The checkout: a product and how many, and the form's idempotency key."""

    idempotency_key = IdempotencyKeyField()
    product = SelectField(
        "Product",
        choices=[
            SelectChoice(code, f"{name}, {price / 100:.2f} EUR")
            for code, (name, price) in PRODUCTS.items()
        ],
    )
    quantity = IntegerField(
        "Quantity",
        default=1,
        validators=[InputRequired(), NumberRange(min=1, max=QUANTITY_MAX)],
    )


def checkout_with_flask_wtf() -> t.Any:
    """``shop.checkout`` with the FlaskForm: ``validate_on_submit`` on a POST,
    the page again (a new key, a new CSRF token) when a field is wrong."""
    form = CheckoutForm()
    if form.validate_on_submit():
        return placed(place_order(form.product.data, form.quantity.data))
    status = 422 if form.is_submitted() else 200
    return render_template("shop/checkout_wtf.html", form=form), status


def protect(app: Flask) -> None:
    """``CSRFProtect`` on every POST of the app but the order service's JSON API,
    whose callers name themselves in ``X-Tenant``, not with a cookie a browser
    would send on its own."""
    csrf.init_app(app)
    csrf.exempt(orders.bp)
