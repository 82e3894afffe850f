"""gunicorn settings of ``python -m bench.partition``'s hosts (``-c``).

With ``BENCH_READY_PORT`` set, each worker answers readiness on that port from a
thread of its own (:meth:`flask_idempotency.Idempotency.serve_readiness`), as the
README shows for gunicorn.
"""

from __future__ import annotations

import os
import typing as t

READY_PORT_ENV = "BENCH_READY_PORT"
READY_HOST_ENV = "BENCH_READY_HOST"


def post_worker_init(worker: t.Any) -> None:
    port = os.environ.get(READY_PORT_ENV)
    if not port:
        return
    from example_app.app import idem

    idem.serve_readiness(
        worker.wsgi, host=os.environ.get(READY_HOST_ENV, "0.0.0.0"), port=int(port)
    )
