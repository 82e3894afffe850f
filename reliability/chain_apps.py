"""The example chain's services as the chain scenario runs them, with faults.

* ``reliability.chain_apps:payments_app()`` and ``:orders_app()``: the example's
  payments and order services (``example_app``), configured from the
  environment as they document (``EXAMPLE_DATABASE_URL``,
  ``EXAMPLE_ORDERS_DATABASE_URL``, ``EXAMPLE_PAYMENTS_URL``, ``EXAMPLE_BROKER_URL``,
  ``EXAMPLE_EXCHANGE``, ``EXAMPLE_SHIPPING_QUEUE``), plus the in-process faults:
  during a POST, each COMMIT of the app's session may SIGKILL its process right
  before it (``before_commit``) or right after it (``after_commit``), at the rates
  in ``RELIABILITY_FAULTS`` (JSON), each logged to ``RELIABILITY_FAULT_LOG`` first
  as ``"<service> <point>"``. The request's content never decides, so fingerprints
  are untouched. The order service's lease is ``RELIABILITY_LEASE`` seconds.
* ``python -m reliability.chain_apps consume SECONDS LOG``: the shipping consumer
  (``example_app.shipping.consume``) in a loop that rides out a broker outage
  (a failed ``consume`` is logged, and it connects again after 0.5 s) and stops
  by itself after ``SECONDS``; each delivery the inbox skips as a duplicate
  appends a JSON line ``{"skipped": event_id}`` to ``LOG`` as it happens.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import signal
import sys
import time
import typing as t

from flask import Flask, has_request_context, request
from sqlalchemy import event, orm

FAULTS_ENV = "RELIABILITY_FAULTS"
FAULT_LOG_ENV = "RELIABILITY_FAULT_LOG"
LEASE_ENV = "RELIABILITY_LEASE"


def _install_faults(service: str) -> None:
    rates = {k: float(v) for k, v in json.loads(os.environ.get(FAULTS_ENV, "{}")).items()}
    if not any(rates.values()):
        return
    rng = random.Random(f"{service}:{os.getpid()}:{time.time_ns()}")

    def fire(point: str) -> None:
        if not (has_request_context() and request.method == "POST"):
            return
        rate = rates.get(point, 0.0)
        if rate <= 0 or rng.random() >= rate:
            return
        path = os.environ.get(FAULT_LOG_ENV)
        if path:
            line = json.dumps({"point": f"{service} {point}", "pid": os.getpid()}) + "\n"
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)

    event.listen(orm.Session, "before_commit", lambda session: fire("before_commit"))
    event.listen(orm.Session, "after_commit", lambda session: fire("after_commit"))


def payments_app() -> Flask:
    from example_app import create_app

    app = create_app()
    _install_faults("payments")
    return app


def orders_app() -> Flask:
    from example_app import orders

    config: dict[str, t.Any] = {}
    if os.environ.get(LEASE_ENV):
        config["IDEMPOTENCY_LEASE"] = dt.timedelta(seconds=float(os.environ[LEASE_ENV]))
    app = orders.create_app(config)
    # Liveness, which the order service lacks (the harness waits for it at start).
    app.add_url_rule("/healthz", "healthz", lambda: {"alive": True})
    _install_faults("orders")
    return app


def consume(seconds: float, log: str) -> int:
    """The shipping consumer until ``seconds`` have passed (see the module's doc)."""
    from example_app import shipping
    from flask_idempotency import signals

    app = shipping.create_app()

    def skipped(sender: Flask, consumer: str, event_id: str) -> None:
        with open(log, "a") as out:
            out.write(json.dumps({"skipped": event_id}) + "\n")

    signals.event_skipped_duplicate.connect(skipped, weak=False)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            shipping.consume(app, idle=1.0)
        except Exception as exc:  # the broker went away: connect again
            print(f"consume failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            time.sleep(0.5)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["consume"] or len(sys.argv) != 4:
        sys.exit("usage: python -m reliability.chain_apps consume SECONDS LOG")
    sys.exit(consume(float(sys.argv[2]), sys.argv[3]))
