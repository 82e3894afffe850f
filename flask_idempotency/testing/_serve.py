"""The served process: builds the user's app from the environment the kit sets,
installs the kit's hooks, and serves it.

gunicorn: ``gunicorn 'flask_idempotency.testing._serve:create()'``; werkzeug's
threaded server: ``python -m flask_idempotency.testing._serve`` (the kit starts
both through :mod:`._launch`, which ties the server to the test process). The kit sets
``IDEMPOTENCY_KIT_APP`` (the import string), ``IDEMPOTENCY_KIT_CONFIG`` (the app's
config as JSON), ``IDEMPOTENCY_KIT_CONTROL`` (the control directory),
``IDEMPOTENCY_KIT_DOWNSTREAM`` (``host:port`` of the fake downstream) and, for
werkzeug, ``IDEMPOTENCY_KIT_PORT``.
"""

from __future__ import annotations

import json
import logging
import os
import typing as t

from flask import Flask

from . import _hooks, _lifeline
from ._app import load_app
from ._control import (
    APP_ENV,
    CONFIG_ENV,
    CONTROL_ENV,
    DOWNSTREAM_ENV,
    PORT_ENV,
    READY_PATH,
    Control,
)

WSGIApp = t.Callable[[dict[str, t.Any], t.Callable[..., t.Any]], t.Iterable[bytes]]


class _ReadyProbe:
    """Answers the kit's readiness probe itself, never reaching the app; counts
    the requests in flight (a write off any request's thread meanwhile is one
    the kit cannot attribute)."""

    def __init__(self, app: WSGIApp) -> None:
        self.app = app

    def __call__(self, environ: dict[str, t.Any], start_response: t.Callable[..., t.Any]) -> t.Any:
        if environ.get("PATH_INFO") == READY_PATH:
            start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "5")])
            return [b"ready"]
        _hooks.request_started()
        try:
            return self.app(environ, start_response)
        finally:
            _hooks.request_ended()


def create() -> Flask:
    """The app, built from the environment, with the kit's hooks installed."""
    # A gunicorn worker dies with its main process (which dies with the test
    # process); under werkzeug this is the main process, tied already.
    _lifeline.die_with_parent()
    control = Control(os.environ[CONTROL_ENV])
    downstream = None
    if os.environ.get(DOWNSTREAM_ENV):
        host, _, port = os.environ[DOWNSTREAM_ENV].rpartition(":")
        downstream = (host, int(port))
    _hooks.install(control, downstream)
    app = load_app(os.environ[APP_ENV], json.loads(os.environ.get(CONFIG_ENV) or "{}"))
    app.wsgi_app = _ReadyProbe(app.wsgi_app)  # type: ignore[method-assign]
    control.mark_booted()
    return app


def main() -> None:
    from werkzeug.serving import make_server

    app = create()
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = make_server("127.0.0.1", int(os.environ[PORT_ENV]), app, threaded=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
