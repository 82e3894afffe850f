"""Serve an app for the live tests: ``python -m tests.support.live_server APP URL [CONFIG_JSON]``.

APP is ``tests`` (tests/support/testapp.py) or ``example`` (example_app); CONFIG_JSON
is extra ``app.config`` for the test app (durations in seconds). Prints
``READY <port>`` once listening. A request carrying ``X-Test-Crash: after-commit``
kills this process with SIGKILL right after the record and the business rows
commit, before the response is written; ``X-Test-Crash: before-commit`` kills it
right after the claim, inside the open transaction.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import typing as t

from flask import request
from werkzeug.serving import make_server

from flask_idempotency import signals
from tests.support import pgbouncer


def _crash_at(point: str) -> t.Callable[..., None]:
    def receiver(sender: t.Any, **kwargs: t.Any) -> None:
        if request.headers.get("X-Test-Crash") == point:
            os.kill(os.getpid(), signal.SIGKILL)

    return receiver


def main() -> None:
    which, url = sys.argv[1], sys.argv[2]
    if which == "example":
        os.environ["EXAMPLE_DATABASE_URL"] = url
        if pgbouncer.is_pooled(url):  # as its README says behind a transaction pooler
            os.environ["EXAMPLE_DATABASE_POOLER"] = "transaction"
        from example_app import create_app

        app = create_app({"SQLALCHEMY_ENGINE_OPTIONS": {"pool_size": 40, "max_overflow": 10}})
    else:
        from tests.support import testapp

        extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
        app = testapp.create_app(url, **extra)
    # after-commit: the record and the business rows are committed, the response
    # is not sent. before-commit: the key is claimed in the open transaction.
    signals.record_completed.connect(_crash_at("after-commit"), weak=False)
    signals.key_claimed.connect(_crash_at("before-commit"), weak=False)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    print(f"READY {server.server_port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
