"""Maintenance jobs as plain functions: the CLI and the scheduler call them.

Each takes the app (or uses the current one) and is safe to run from several
processes at once: every change it makes is a conditional statement on the
record's fencing token, the same ones requests use. :class:`KeyStats` is what
:meth:`Idempotency.stats <flask_idempotency.Idempotency.stats>` returns: the
record table's figures, to watch what the jobs keep in check; :class:`ErasureReport`
what :meth:`Idempotency.erase <flask_idempotency.Idempotency.erase>` did.
"""

from __future__ import annotations

from ._deprecated import forward
from ._maintenance.erasure import ErasureReport as ErasureReport
from ._maintenance.gauges import KeyStats as KeyStats
from ._maintenance.jobs import PurgeReport as PurgeReport
from ._maintenance.jobs import RecoveryReport as RecoveryReport
from ._maintenance.jobs import purge_expired as purge_expired
from ._maintenance.jobs import recover_abandoned as recover_abandoned

__all__ = [
    "ErasureReport",
    "KeyStats",
    "PurgeReport",
    "RecoveryReport",
    "purge_expired",
    "recover_abandoned",
]

__getattr__ = forward(__name__, "flask_idempotency._maintenance.jobs")
