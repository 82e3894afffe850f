"""The testing kit: prove, against your own app and its real database, that a
retried request takes effect once.

The pytest plugin (the module ``flask_idempotency_pytest``, registered by
installing the ``testing`` extra; ``flask_idempotency.testing.plugin``
loads it too) gives a test four fixtures: ``api``
(your app served by a real WSGI server in a subprocess, restartable), ``db``
(a database of the test's own on your database server), ``fault`` (one-shot
fault points: kills after and before a commit, after a recovery point or an
outgoing call, the database cut, the first request held) and ``downstream`` (a
fake HTTP service that records calls). The helpers here fire concurrent
duplicates, reuse a key with another payload and assert that an operation took
effect exactly once by counting rows, outbox events and downstream effects,
never status codes. See ``docs/testing-kit.md``.

Nothing here needs pytest but the plugin module; the kit needs nothing beyond
the package's own dependencies (gunicorn is used when installed).
"""

from __future__ import annotations

from ._config import KitConfig
from ._database import Database
from ._downstream import Downstream, DownstreamCall, Effect
from ._fault import Fault, HeldRequest
from ._helpers import assert_exactly_one, concurrent_duplicates, reuse_key
from ._server import Response, ServedApp

__all__ = [
    "Database",
    "Downstream",
    "DownstreamCall",
    "Effect",
    "Fault",
    "HeldRequest",
    "KitConfig",
    "Response",
    "ServedApp",
    "assert_exactly_one",
    "concurrent_duplicates",
    "reuse_key",
]
