"""One service of the example chain, for tests/live/test_chain_live.py.

``python -m tests.support.chain_server SERVICE PORT CONFIG_JSON`` runs ``payments``
(example_app/app.py) or ``orders`` (example_app/orders.py) on 127.0.0.1:PORT (0:
any free port), or the ``shipping`` consumer (example_app/shipping.py) until
its queue has been idle for 10 s, with ``CONFIG_JSON`` as extra ``app.config``,
and prints ``READY <port>``. ``CONFIG_JSON`` may also hold:

* ``"crash_at"`` and ``"crash_file"``: while that file exists, the process
  removes it and kills itself with SIGKILL at that point, so that the process
  started again after the crash serves the retry normally. The points:

  - ``"after-commit"`` (payments, orders): the record and the business rows
    committed, the response not sent;
  - ``"before-charge"`` (orders): the claim committed (leased), the payments
    service not called;
  - ``"after-charge"`` (orders): the payments service answered; the step's
    result not saved, the order not committed;
  - ``"before-commit"`` (orders): the step's result saved, the order and its
    event about to commit;
  - ``"in-consumer"`` (shipping): the shipment and the event id written, their
    transaction not committed, the message not acked.

* ``"broken_keys": true`` (orders): the charge goes out with a fresh random key
  on each attempt instead of ``idem.derived_key("charge")``, the mistake derived
  keys exist to prevent.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import typing as t
import uuid

import sqlalchemy as sa
from sqlalchemy import orm
from werkzeug.serving import make_server

from flask_idempotency import client, signals
from tests.support import pgbouncer

OPTIONS = ("crash_at", "crash_file", "broken_keys")


def _crash_here(point: str, options: dict[str, t.Any]) -> None:
    if options.get("crash_at") != point:
        return
    try:
        os.remove(options["crash_file"])
    except FileNotFoundError:
        return  # crashed once already
    os.kill(os.getpid(), signal.SIGKILL)


def _orders(config: dict[str, t.Any], options: dict[str, t.Any]) -> t.Any:
    from example_app import orders

    app = orders.create_app(config)
    charge, emit = orders.charge, orders.idem.emit

    def charge_between_crashes(order: dict[str, t.Any]) -> dict[str, t.Any]:
        _crash_here("before-charge", options)
        payment = charge(order)
        _crash_here("after-charge", options)
        return payment

    def emit_after_a_crash(*args: t.Any, **kwargs: t.Any) -> str:
        _crash_here("before-commit", options)
        return emit(*args, **kwargs)

    orders.charge = charge_between_crashes  # the view looks both up at each call
    orders.idem.emit = emit_after_a_crash  # type: ignore[method-assign]
    if options.get("broken_keys"):
        derived = client.current_derived_key

        def random_key(step: str, **kwargs: t.Any) -> str:
            return uuid.uuid4().hex if step == "charge" else derived(step, **kwargs)

        # The client's step= asks its module for the key at each call.
        client.current_derived_key = random_key  # type: ignore[assignment]
    return app


def _shipping(config: dict[str, t.Any], options: dict[str, t.Any]) -> None:
    from example_app import shipping

    app = shipping.create_app(config)
    sa.event.listen(orm.Session, "before_commit", lambda s: _crash_here("in-consumer", options))
    print("READY 0", flush=True)
    shipping.consume(app, idle=10.0)


def main() -> None:
    service, port, config = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    options = {k: config.pop(k) for k in OPTIONS if k in config}
    # Behind the suite's PgBouncer: the pooler declared, as the example's docs say.
    config = {**pgbouncer.declared(config.get("SQLALCHEMY_DATABASE_URI") or "sqlite://"), **config}
    if "IDEMPOTENCY_LEASE" in config:
        config["IDEMPOTENCY_LEASE"] = float(config["IDEMPOTENCY_LEASE"])
    if service == "shipping":
        _shipping(config, options)
        return
    if service == "orders":
        app = _orders(config, options)
    else:
        from example_app import create_app

        app = create_app(config)
    signals.record_completed.connect(
        lambda sender, **kw: _crash_here("after-commit", options), weak=False
    )
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = make_server("127.0.0.1", port, app, threaded=True)
    print(f"READY {server.server_port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
