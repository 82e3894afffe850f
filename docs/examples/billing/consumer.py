"""A kombu consumer of charge requests (``{"invoice_id": ..., "amount": ...}``).

A broker delivers at least once: a consumer that died after the charge and
before its ack gets the message again (or another consumer does), and a
producer that retried its publish sent it twice. Each delivery calls the
idempotent function, so only the first makes a charge; the others get its
result. The message is acked after the function returned, never before: a
crash in between means a redelivery, which the function answers from the
record.
"""

from __future__ import annotations

import typing as t

import kombu
from flask import Flask

from flask_idempotency import FunctionOutcome

from .app import charge_invoice

#: Where charge requests are published.
EXCHANGE = kombu.Exchange("billing", type="direct", durable=True)


def charge_queue(name: str = "billing.charges") -> kombu.Queue:
    """The queue of charge requests, bound by its name."""
    return kombu.Queue(name, EXCHANGE, routing_key=name, durable=True)


def request_charge(
    connection: kombu.Connection, queue: kombu.Queue, invoice_id: str, amount: int
) -> None:
    """Publish a charge request (what the producer side does)."""
    with connection.Producer() as producer:
        producer.publish(
            {"invoice_id": invoice_id, "amount": amount},
            exchange=queue.exchange,
            routing_key=queue.routing_key,
            declare=[queue],
            serializer="json",
            retry=True,
        )


def process(app: Flask, body: dict[str, t.Any]) -> FunctionOutcome:
    """One delivery's work: the charge, made or read back."""
    with app.app_context():
        return charge_invoice.outcome(body["invoice_id"], body["amount"])


def consume(
    app: Flask, connection: kombu.Connection, queue: kombu.Queue, count: int, timeout: float = 10
) -> list[FunctionOutcome]:
    """Take ``count`` messages off ``queue``, process and ack each; their outcomes."""
    outcomes: list[FunctionOutcome] = []

    def on_message(body: dict[str, t.Any], message: kombu.Message) -> None:
        outcomes.append(process(app, body))
        message.ack()  # after the commit: a crash before it is a redelivery

    with kombu.Consumer(connection, queues=[queue], callbacks=[on_message], accept=["json"]):
        while len(outcomes) < count:
            connection.drain_events(timeout=timeout)
    return outcomes
