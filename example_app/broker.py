"""Where the order service's events go and where the shipping service reads them.

``EXAMPLE_BROKER_URL`` names any broker kombu speaks (RabbitMQ:
``amqp://guest:guest@127.0.0.1:5672//``, Redis: ``redis://127.0.0.1:6379/0``).
Without it, kombu's filesystem transport in a folder (``EXAMPLE_BROKER_FOLDER``,
default ``<instance folder>/broker``), so the example needs no server. The
filesystem transport is for one machine and development: its producer creates a
message file before writing it, and a consumer polling at that instant can read
it empty, so run the relay and the consumer one after the other there (as the
demo does), or point both at a real broker.
"""

from __future__ import annotations

import os
import typing as t

from flask import Flask

from flask_idempotency.publishers import KombuPublisher

EXCHANGE = "orders"
#: The shipping service's queue: it receives ``order-created`` events.
SHIPPING_QUEUE = "shipping"
ORDER_CREATED = "order-created"
DEFAULT_BROKER_URL = "filesystem://"


def configure(app: Flask) -> None:
    """Fill ``EXAMPLE_BROKER_URL`` and ``EXAMPLE_BROKER_FOLDER`` from the
    environment unless the app's config already has them."""
    app.config.setdefault(
        "EXAMPLE_BROKER_URL", os.environ.get("EXAMPLE_BROKER_URL", DEFAULT_BROKER_URL)
    )
    app.config.setdefault(
        "EXAMPLE_BROKER_FOLDER",
        os.environ.get("EXAMPLE_BROKER_FOLDER", os.path.join(app.instance_path, "broker")),
    )


def transport_options(app: Flask) -> dict[str, t.Any]:
    """kombu transport options: the folder for the filesystem transport."""
    if not app.config["EXAMPLE_BROKER_URL"].startswith("filesystem:"):
        return {}
    folder = app.config["EXAMPLE_BROKER_FOLDER"]
    os.makedirs(folder, exist_ok=True)
    return {"data_folder_in": folder, "data_folder_out": folder}


def _kombu() -> t.Any:
    import kombu  # the ``kombu`` extra; kombu ships no type hints

    return kombu


def shipping_queue() -> t.Any:
    """The shipping service's queue, bound to ``order-created`` on the exchange."""
    kombu = _kombu()
    exchange = kombu.Exchange(EXCHANGE, type="topic", durable=True)
    return kombu.Queue(SHIPPING_QUEUE, exchange, routing_key=ORDER_CREATED, durable=True)


def publisher(app: Flask) -> KombuPublisher:
    """The outbox relay's publisher. It declares the shipping queue, so an event
    published before the shipping service first ran is kept for it, not dropped."""
    return KombuPublisher(
        app.config["EXAMPLE_BROKER_URL"],
        exchange=EXCHANGE,
        queues=[shipping_queue()],
        transport_options=transport_options(app),
        timeout=5,
    )


def connection(app: Flask) -> t.Any:
    """A kombu connection to the broker, for a consumer."""
    return _kombu().Connection(
        app.config["EXAMPLE_BROKER_URL"], transport_options=transport_options(app)
    )
