"""One service of the example chain, for tests/test_chain_live.py.

``python -m tests.chain_server SERVICE PORT CONFIG_JSON`` serves ``payments``
(example_app/app.py) or ``orders`` (example_app/orders.py) on 127.0.0.1:PORT (0:
any free port) with ``CONFIG_JSON`` as extra ``app.config``, and prints
``READY <port>``. For the order service, ``CONFIG_JSON`` may also hold:

* ``"crash_at"``: ``"after-commit"`` (the order, its event and the record
  committed, the response not sent) or ``"after-charge"`` (the payments service
  answered, nothing of the order committed and the step not saved), and
  ``"crash_file"``: while that file exists, the process removes it and kills
  itself with SIGKILL at that point. Removing it first means that the process
  started again after the crash serves the retry normally.
* ``"broken_keys": true``: the charge goes out with a fresh random key on each
  attempt instead of ``idem.derived_key("charge")``, the mistake derived keys
  exist to prevent.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import typing as t
import uuid

from werkzeug.serving import make_server

from flask_idempotency import extension, signals


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
    signals.record_completed.connect(
        lambda sender, **kw: _crash_here("after-commit", options), weak=False
    )
    charge = orders.charge

    def charge_then_maybe_crash(order: dict[str, t.Any]) -> dict[str, t.Any]:
        payment = charge(order)
        _crash_here("after-charge", options)
        return payment

    orders.charge = charge_then_maybe_crash  # the view looks it up at each call
    if options.get("broken_keys"):
        derived = extension.current_derived_key

        def random_key(step: str, **kwargs: t.Any) -> str:
            return uuid.uuid4().hex if step == "charge" else derived(step, **kwargs)

        # The client's step= asks this module for the key at each call.
        extension.current_derived_key = random_key  # type: ignore[assignment]
    return app


def main() -> None:
    service, port, config = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    options = {k: config.pop(k) for k in ("crash_at", "crash_file", "broken_keys") if k in config}
    if "IDEMPOTENCY_LEASE" in config:
        config["IDEMPOTENCY_LEASE"] = float(config["IDEMPOTENCY_LEASE"])
    if service == "orders":
        app = _orders(config, options)
    else:
        from example_app import create_app

        app = create_app(config)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = make_server("127.0.0.1", port, app, threaded=True)
    print(f"READY {server.server_port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
