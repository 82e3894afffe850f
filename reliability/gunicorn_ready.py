"""gunicorn settings (``--config``) that serve readiness on a port of its own in
every worker, as docs/outages.md recommends for a host whose workers may all be
stuck on a silent database.

``RELIABILITY_READY_PORT`` (and ``RELIABILITY_READY_HOST``, default 0.0.0.0) turn
it on; the app is ``reliability.app``'s.
"""

from __future__ import annotations

import os
import typing as t

READY_PORT_ENV = "RELIABILITY_READY_PORT"
READY_HOST_ENV = "RELIABILITY_READY_HOST"


def post_worker_init(worker: t.Any) -> None:
    port = os.environ.get(READY_PORT_ENV)
    if not port:
        return
    from reliability.app import idem

    idem.serve_readiness(
        worker.wsgi, host=os.environ.get(READY_HOST_ENV, "0.0.0.0"), port=int(port)
    )
