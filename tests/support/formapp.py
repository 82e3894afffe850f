"""A small shop with HTML forms: each order a row, keys from rendered forms.

``create_app(url, clock, csrf=...)`` builds a fresh app (its own SQLAlchemy and
Idempotency objects) so tests can vary the order of ``CSRFProtect`` and
``init_app``. Routes:

* ``GET/POST /checkout``: the form; POST validates ``item`` and ``quantity``,
  re-renders with errors (422) or creates the order, flashes, and redirects 303
  to ``/orders/<id>`` (Post/Redirect/Get);
* ``POST /checkout-direct``: the same order, answered with its page (200),
  rendered from ``GET /checkout-direct``;
* ``GET /wtf`` / ``POST /wtf``: a Flask-WTF ``FlaskForm`` with
  :class:`~flask_idempotency.forms.IdempotencyKeyField`;
* ``POST /api/orders``: JSON, for ``fetch()`` with the rendered key as the header;
* ``GET /orders/<id>``: the order's page.
"""

from __future__ import annotations

import time
import typing as t

from flask import Flask, flash, get_flashed_messages, redirect, render_template_string, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import orm

from flask_idempotency import Idempotency

FORM = """<!doctype html><title>Checkout</title>
{% for m in get_flashed_messages() %}<p class=flash>{{ m }}</p>{% endfor %}
{% if errors %}<ul class=errors>{% for e in errors %}<li>{{ e }}</li>{% endfor %}</ul>{% endif %}
<form method=post action="{{ action }}">
  {{ idempotency_field(endpoint) }}
  {% if csrf %}<input type=hidden name=csrf_token value="{{ csrf_token() }}">{% endif %}
  <input name=item value="{{ item }}"><input name=quantity value="{{ quantity }}">
  <button type=submit>Buy</button>
</form>"""

ORDER = "<!doctype html><title>Order {{ order.id }}</title><h1 id=order>{{ order.id }}</h1>"


def create_app(
    url: str,
    clock: t.Callable[[], t.Any],
    *,
    csrf: str | None = None,
    create: bool = True,
    **config: t.Any,
) -> Flask:
    """``csrf``: ``None`` (no CSRFProtect), ``"before"`` (CSRFProtect set up before
    the extension) or ``"after"``."""
    app = Flask(__name__)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=url,
        SECRET_KEY="form-test-secret",
        WTF_CSRF_ENABLED=csrf is not None,
        **config,
    )
    db = SQLAlchemy()

    class Order(db.Model):  # type: ignore[name-defined,misc]
        __tablename__ = "form_orders"
        id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
        item: orm.Mapped[str] = orm.mapped_column(db.String(50))
        quantity: orm.Mapped[int]

    idem = Idempotency()
    db.init_app(app)
    protect = None
    if csrf is not None:
        from flask_wtf.csrf import CSRFProtect

        protect = CSRFProtect()
        if csrf == "before":
            protect.init_app(app)
    idem.init_app(app, db, clock=clock)
    if protect is not None and csrf == "after":
        protect.init_app(app)
    app.extensions["form_test"] = {"db": db, "Order": Order, "idem": idem}

    def render(endpoint: str | None, errors: list[str] = (), status: int = 200, **values: t.Any):  # type: ignore[assignment]
        return (
            render_template_string(
                FORM,
                endpoint=endpoint,
                action=request.path,
                errors=errors,
                csrf=csrf is not None,
                item=values.get("item", ""),
                quantity=values.get("quantity", ""),
                get_flashed_messages=get_flashed_messages,
            ),
            status,
        )

    def create() -> Order | list[str]:
        item = request.form.get("item", "").strip()
        quantity = request.form.get("quantity", "")
        errors = []
        if not item:
            errors.append("item is required")
        if not quantity.isdigit() or int(quantity) < 1:
            errors.append("quantity must be a whole number from 1")
        if errors:
            return errors
        order = Order(item=item, quantity=int(quantity))
        db.session.add(order)
        db.session.flush()
        return order

    @app.route("/checkout", methods=["GET", "POST"])
    @idem.idempotent
    def checkout() -> t.Any:
        if request.method == "GET":
            return render(None)
        made = create()
        if isinstance(made, list):
            return render(None, made, 422, **request.form)
        flash(f"Order {made.id} placed")  # the session changes: the reload must still replay
        return redirect(f"/orders/{made.id}", 303)

    @app.route("/checkout-leased", methods=["GET", "POST"])
    @idem.idempotent(lease=True)
    def checkout_leased() -> t.Any:
        if request.method == "GET":
            return render(None)
        time.sleep(app.config.get("CHECKOUT_DELAY", 0))
        made = create()
        if isinstance(made, list):
            return render(None, made, 422, **request.form)
        return redirect(f"/orders/{made.id}", 303)

    @app.get("/checkout-direct")
    def checkout_direct_page() -> t.Any:
        return render("checkout_direct")

    @app.post("/checkout-direct")
    @idem.idempotent
    def checkout_direct() -> t.Any:
        made = create()
        if isinstance(made, list):
            return render("checkout_direct", made, 422, **request.form)
        return render_template_string(ORDER, order=made)

    @app.get("/fetch")
    def fetch_page() -> t.Any:
        return render_template_string(
            "<!doctype html><script>const key = {{ idempotency_form_key('api_orders')|tojson }};"
            "</script>"
        )

    @app.post("/api/orders")
    @idem.idempotent
    def api_orders() -> t.Any:
        body = request.get_json()
        order = Order(item=body["item"], quantity=int(body["quantity"]))
        db.session.add(order)
        db.session.flush()
        return {"id": order.id}, 201

    @app.post("/webhook")
    @idem.idempotent
    def webhook() -> t.Any:
        # A view that checks a signature over the body as sent.
        return {"raw": request.get_data(as_text=True), "form": request.form.to_dict()}

    @app.get("/orders/<int:order_id>")
    def order_page(order_id: int) -> t.Any:
        return render_template_string(ORDER, order=db.get_or_404(Order, order_id))

    if csrf is not None:
        from flask_wtf import FlaskForm
        from wtforms import IntegerField, StringField
        from wtforms.validators import DataRequired, NumberRange

        from flask_idempotency.forms import IdempotencyKeyField

        class CheckoutForm(FlaskForm):  # type: ignore[misc]
            key = IdempotencyKeyField()
            item = StringField(validators=[DataRequired()])
            quantity = IntegerField(validators=[NumberRange(min=1)])

        @app.route("/wtf", methods=["GET", "POST"])
        @idem.idempotent
        def wtf() -> t.Any:
            form = CheckoutForm()
            if form.validate_on_submit():
                order = Order(item=form.item.data, quantity=form.quantity.data)
                db.session.add(order)
                db.session.flush()
                return redirect(f"/orders/{order.id}", 303)
            status = 422 if request.method == "POST" else 200
            page = render_template_string(
                "<form method=post>{{ form.hidden_tag() }}{{ form.item() }}"
                "{{ form.quantity() }}<button>Buy</button></form>",
                form=form,
            )
            return page, status

    if create:  # False: a second host on the same database
        with app.app_context():
            db.drop_all()
            db.create_all()
    return app


def order_count(app: Flask) -> int:
    parts = app.extensions["form_test"]
    with app.app_context():
        return int(parts["db"].session.query(parts["Order"]).count())
