"""``python -m example_app``: the example's services and its demo.

* ``payments`` (the default, also ``serve``): the payments service on 127.0.0.1:5000.
* ``orders``: the order service on 127.0.0.1:5001; it charges at
  ``EXAMPLE_PAYMENTS_URL`` and relays its events itself (an in-process scheduler,
  woken at each commit).
* ``shop``: the order service with the shop's browser checkout
  (``/shop/checkout``, ``shop.py``) on 127.0.0.1:5002; ``EXAMPLE_SHOP_FLASK_WTF=1``
  for its Flask-WTF form under CSRFProtect.
* ``stripe``: the Stripe-like API (``POST /v1/charges``, ``stripe_like.py``) on
  127.0.0.1:5003, for Stripe's own Python SDK.
* ``shipping``: the shipping consumer, until Ctrl-C.
* ``demo``: the whole chain in one process, on SQLite files in a temporary folder
  and kombu's filesystem transport (or ``EXAMPLE_BROKER_URL``): a client whose
  first response is lost retries with its key; the order, the charge, the event
  and the shipment each happen once. Exits 0 when every count is right.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import threading
import time
import typing as t
import uuid

import sqlalchemy as sa
from werkzeug.serving import make_server

from flask_idempotency._messaging.relay import relay_batch
from flask_idempotency.client import IdempotentSession

from . import broker, create_app, orders, shipping, shop, stripe_like
from .app import db as payments_db

WSGIApp = t.Callable[[dict[str, t.Any], t.Callable[..., t.Any]], t.Iterable[bytes]]

#: The client's read timeout in the demo, and how long the lost response is held.
CLIENT_TIMEOUT = 2.0


class LoseFirstResponse:
    """Demo only: the first ``POST /orders`` runs to the end (the order, the
    charge and the event commit) but its response is held past the client's
    timeout, as when a proxy or the network loses it."""

    def __init__(self, app: WSGIApp) -> None:
        self.app = app
        self.lost = threading.Event()

    def __call__(self, environ: dict[str, t.Any], start_response: t.Callable[..., t.Any]) -> t.Any:
        if environ["REQUEST_METHOD"] != "POST" or self.lost.is_set():
            return self.app(environ, start_response)
        self.lost.set()
        sent: list[t.Any] = []
        body = b"".join(self.app(environ, lambda *args: sent.append(args)))  # commits
        print("  (order service: order committed; its response is lost on the way)")
        time.sleep(CLIENT_TIMEOUT + 0.5)  # the client gave up and retried meanwhile
        start_response(*sent[0])
        return [body]


def _serve(app: WSGIApp) -> tuple[t.Any, str]:
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}"


def _count(app: t.Any, db: t.Any, sql: str) -> int:
    with app.app_context(), db.engine.connect() as conn:
        return int(conn.execute(sa.text(sql)).scalar_one())


def _show(title: str, response: t.Any) -> None:
    replayed = response.headers.get("Idempotent-Replayed", "false")
    body = json.dumps(response.json()) if response.content else ""
    print(f"{title:44} -> {response.status_code} replayed={replayed} {body}")


def demo() -> int:
    """The order -> payment -> events -> shipping chain, with a lost response.

    Everything lives in a temporary folder removed at the end; on a broker of
    ``EXAMPLE_BROKER_URL`` the demo uses an exchange and a queue of its own and
    deletes them, so it never takes another consumer's events."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # keep the story readable
    with tempfile.TemporaryDirectory(prefix="example-chain-") as folder:
        tag = uuid.uuid4().hex[:8]
        shared = {
            "EXAMPLE_BROKER_FOLDER": os.path.join(folder, "broker"),
            "EXAMPLE_EXCHANGE": f"orders-demo-{tag}",
            "EXAMPLE_SHIPPING_QUEUE": f"shipping-demo-{tag}",
        }
        payments_app = create_app({"SQLALCHEMY_DATABASE_URI": f"sqlite:///{folder}/payments.db"})
        orders_app = orders.create_app(
            {"SQLALCHEMY_DATABASE_URI": f"sqlite:///{folder}/orders.db", **shared}
        )
        shipping_app = shipping.create_app(
            {"SQLALCHEMY_DATABASE_URI": f"sqlite:///{folder}/shipping.db", **shared}
        )
        print(f"broker: {orders_app.config['EXAMPLE_BROKER_URL']}")
        try:
            return _run_demo(payments_app, orders_app, shipping_app)
        finally:
            broker.delete_queue(shipping_app)
            for app, db in ((payments_app, payments_db), (orders_app, orders.db)):
                with app.app_context():
                    db.engine.dispose()
            with shipping_app.app_context():
                shipping.db.engine.dispose()


def _run_demo(payments_app: t.Any, orders_app: t.Any, shipping_app: t.Any) -> int:
    payments_server, payments_url = _serve(payments_app)
    orders_app.config["PAYMENTS_URL"] = payments_url
    orders_server, orders_url = _serve(LoseFirstResponse(orders_app.wsgi_app))
    # The caller's client: one key for the order, kept across its retries. Its
    # deadline outlasts the order service's lease (30 s), so a 409 with
    # Retry-After (an attempt still running, or one that died) is waited out.
    http = IdempotentSession(total=10, backoff_factor=0.2, backoff_max=5, deadline=90)
    key = str(uuid.uuid4())
    order = {"customer_id": "cus_demo", "amount": 1250, "currency": "EUR"}
    try:
        first = http.post(
            orders_url + "/orders",
            json=order,
            headers={"X-Tenant": "acme"},
            idempotency_key=key,
            timeout=CLIENT_TIMEOUT,
        )
        _show("acme: order, response lost, client retried", first)
        reused = http.post(
            orders_url + "/orders",
            json={**order, "amount": 9999},
            headers={"X-Tenant": "acme"},
            idempotency_key=key,
        )
        _show("acme: same key, another amount", reused)
        other = http.post(
            orders_url + "/orders", json=order, headers={"X-Tenant": "globex"}, idempotency_key=key
        )
        _show("globex: the same key (another tenant)", other)
        published = relay_batch(orders_app).published
        shipped = shipping.consume(shipping_app, idle=0.5)
        print(f"relay published {published}; shipping shipped {shipped.shipped}")
        # The relay dies after publishing and before marking: it publishes again.
        with orders_app.app_context():
            orders.db.session.execute(
                sa.text(
                    "UPDATE idempotency_outbox SET published_at = NULL, next_attempt_at = NULL"
                    " WHERE event_id = :e"
                ),
                {"e": first.json()["event_id"]},
            )
            orders.db.session.commit()
        again = relay_batch(orders_app).published
        redelivered = shipping.consume(shipping_app, idle=0.5)
        print(
            f"relay crashed before marking: published {again} again; "
            f"shipping skipped {redelivered.skipped} duplicate(s)"
        )
    finally:
        orders_server.shutdown()
        payments_server.shutdown()
        orders_app.config["IDEMPOTENCY_PUBLISHER"].close()
    counts = {
        "orders": _count(orders_app, orders.db, "SELECT count(*) FROM orders"),
        "charges": _count(payments_app, payments_db, "SELECT count(*) FROM ledger"),
        "events": _count(orders_app, orders.db, "SELECT count(*) FROM idempotency_outbox"),
        "shipments": _count(shipping_app, shipping.db, "SELECT count(*) FROM shipments"),
    }
    print("per tenant, once each: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    statuses = (first.status_code, first.headers.get("Idempotent-Replayed"), reused.status_code)
    right = (
        set(counts.values()) == {2}
        and statuses == (201, "true", 422)
        and other.status_code == 201
        and (shipped.shipped, redelivered.skipped, redelivered.shipped) == (2, 1, 0)
    )
    print("OK" if right else "WRONG: see above")
    return 0 if right else 1


def shipping_forever() -> int:
    app = shipping.create_app()
    print(f"shipping consumer on {app.config['EXAMPLE_BROKER_URL']} (Ctrl-C stops)")
    try:
        while True:
            done = shipping.consume(app, idle=1.0)
            if done.shipped or done.skipped:
                print(f"shipped {done.shipped}, skipped {done.skipped} duplicate(s)")
    except KeyboardInterrupt:
        return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m example_app", description=__doc__)
    parser.add_argument(
        "command",
        nargs="?",
        choices=["serve", "payments", "orders", "shop", "stripe", "shipping", "demo"],
        default="serve",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=None)
    args = parser.parse_args()
    if args.command == "demo":
        return demo()
    if args.command == "shipping":
        return shipping_forever()
    if args.command == "orders":
        app = orders.create_app({"IDEMPOTENCY_SCHEDULER": True})
        port = args.port or 5001
        print(
            f"order service on http://{args.host}:{port}  (payments: {app.config['PAYMENTS_URL']})"
        )
    elif args.command == "shop":
        app = shop.create_app({"IDEMPOTENCY_SCHEDULER": True})
        port = args.port or 5002
        print(f"shop on http://{args.host}:{port}/shop/checkout")
    elif args.command == "stripe":
        app = stripe_like.create_app()
        port = args.port or 5003
        print(f"Stripe-like API on http://{args.host}:{port}/v1/charges (keys: sk_test_acme, ...)")
    else:
        app = create_app()
        port = args.port or 5000
        print(
            f"payments service on http://{args.host}:{port}  (database: "
            f"{app.config['SQLALCHEMY_DATABASE_URI']})"
        )
    app.run(host=args.host, port=port, threaded=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
