"""Where the order service's events go and where the shipping service reads them.

``EXAMPLE_BROKER_URL`` names any broker kombu speaks (RabbitMQ:
``amqp://guest:guest@127.0.0.1:5672//``, Redis: ``redis://127.0.0.1:6379/0``).
Without it, kombu's filesystem transport in a folder (``EXAMPLE_BROKER_FOLDER``,
default ``<instance folder>/broker``), so the example needs no server.

The filesystem transport is for one machine and development. It deletes a
message as a consumer reads it, so a consumer that dies before committing loses
that message there (a real broker delivers an unacked message again); and its
producer creates a message file before writing it, so a consumer polling at
that instant can read it empty. Run the relay and the consumer one after the
other there (as the demo does), or point both at a real broker.

``EXAMPLE_EXCHANGE`` (default ``orders``) and ``EXAMPLE_SHIPPING_QUEUE``
(default ``shipping``) name the exchange and the shipping service's queue.
"""

from __future__ import annotations

import os
import typing as t

from flask import Flask

from flask_idempotency.publishers import KombuPublisher

ORDER_CREATED = "order-created"
DEFAULT_BROKER_URL = "filesystem://"


def configure(app: Flask) -> None:
    """Fill the broker settings from the environment unless the app's config
    already has them."""
    defaults = {
        "EXAMPLE_BROKER_URL": DEFAULT_BROKER_URL,
        "EXAMPLE_BROKER_FOLDER": os.path.join(app.instance_path, "broker"),
        "EXAMPLE_EXCHANGE": "orders",
        "EXAMPLE_SHIPPING_QUEUE": "shipping",
    }
    for name, default in defaults.items():
        app.config.setdefault(name, os.environ.get(name, default))


def transport_options(app: Flask) -> dict[str, t.Any]:
    """kombu transport options: the folders of the filesystem transport (its
    control folder too, which kombu would otherwise create in the working
    directory)."""
    if not app.config["EXAMPLE_BROKER_URL"].startswith("filesystem:"):
        return {}
    folder = app.config["EXAMPLE_BROKER_FOLDER"]
    control = os.path.join(folder, "control")
    os.makedirs(control, exist_ok=True)
    return {"data_folder_in": folder, "data_folder_out": folder, "control_folder": control}


def _kombu() -> t.Any:
    import kombu  # the ``kombu`` extra; kombu ships no type hints

    return kombu


def shipping_queue(app: Flask) -> t.Any:
    """The shipping service's queue, bound to ``order-created`` on the exchange."""
    kombu = _kombu()
    exchange = kombu.Exchange(app.config["EXAMPLE_EXCHANGE"], type="topic", durable=True)
    return kombu.Queue(
        app.config["EXAMPLE_SHIPPING_QUEUE"], exchange, routing_key=ORDER_CREATED, durable=True
    )


def publisher(app: Flask) -> KombuPublisher:
    """The outbox relay's publisher. It declares the shipping queue, so an event
    published before the shipping service first ran is kept for it, not dropped."""
    return KombuPublisher(
        app.config["EXAMPLE_BROKER_URL"],
        exchange=app.config["EXAMPLE_EXCHANGE"],
        queues=[shipping_queue(app)],
        transport_options=transport_options(app),
        timeout=5,
    )


def connection(app: Flask) -> t.Any:
    """A kombu connection to the broker, for a consumer."""
    return _kombu().Connection(
        app.config["EXAMPLE_BROKER_URL"], transport_options=transport_options(app)
    )


def delete_queue(app: Flask) -> None:
    """Delete the shipping queue and the exchange (the demo's own, when it runs
    on a shared broker)."""
    with connection(app) as conn:
        queue = shipping_queue(app)(conn.channel())
        queue.delete()
        queue.exchange.delete()
