"""The outbox test app with encryption at rest, served for the rotation test
(tests/live/test_rotation_live.py), and the ``flask --app`` target of its
``reseal`` (``tests.support.sealed_server:from_env``).

``python -m tests.support.sealed_server URL KEYS`` serves
``tests.support.outbox_app`` on 127.0.0.1 (any free port) with ``KEYS`` as
IDEMPOTENCY_ENCRYPTION_KEYS (``"id:base64key,id:base64key"``, the first
seals), and prints ``READY <port>``. ``from_env`` makes the same app from
``SEALED_TEST_DB`` and ``SEALED_TEST_KEYS``.
"""

from __future__ import annotations

import logging
import os
import sys

from flask import Flask
from werkzeug.serving import make_server

from tests.support import outbox_app
from tests.support.keyrings import keys_app


def create_app(url: str, keys: str) -> Flask:
    return keys_app(outbox_app.create_app, url, keys)


def from_env() -> Flask:
    return create_app(os.environ["SEALED_TEST_DB"], os.environ["SEALED_TEST_KEYS"])


def main() -> None:
    app = create_app(sys.argv[1], sys.argv[2])
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    print(f"READY {server.server_port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
