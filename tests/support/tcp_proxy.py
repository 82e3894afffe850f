"""The TCP proxy the suite's outage tests use: the testing kit's own
(:mod:`flask_idempotency.testing._proxy`), kept importable by this path."""

from __future__ import annotations

from flask_idempotency.testing._proxy import COMMIT_MESSAGE, TcpProxy, Upstream, upstream_of

__all__ = ["COMMIT_MESSAGE", "TcpProxy", "Upstream", "upstream_of"]
