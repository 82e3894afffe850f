"""The replay guard: the app's last word before a stored answer goes to a retry.

A replay answers whoever presents the key in its scope; a caller who lost access
since the first attempt (a revoked token, a suspended account) would still get
it. The guard sees the operation's metadata and may refuse.
"""

from __future__ import annotations

import logging
import typing as t

from flask import current_app, request
from werkzeug.exceptions import HTTPException

from .._storage import Record
from ..errors import ReplayRefusedError
from ..scope import ReplayAttempt
from .steps import RECOVERY_ENVIRON_KEY

if t.TYPE_CHECKING:
    from .flow import Flow

logger = logging.getLogger("flask_idempotency")


def check_replay(flow: Flow, record: Record) -> None:
    """Run the route's (or app's) replay guard before ``record`` is replayed.

    A false value raises :class:`ReplayRefusedError`; an ``HTTPException`` of the
    guard's (``abort(403)``) goes out as it is. Either way the request is counted
    as ``replay_refused``, and nothing was written: the record stays as it was.
    Any other exception of the guard's is a failure of the request (500).
    """
    guard = flow.settings.replay_guard
    if guard is None or RECOVERY_ENVIRON_KEY in request.environ:
        # The recovery job's re-run answers no caller: nothing is replayed to anyone.
        return
    attempt = ReplayAttempt(
        endpoint=request.endpoint,
        scope=record.scope,
        key=record.key,
        created_at=record.created_at,
        completed_at=record.completed_at,
        status=record.response_code,
    )
    try:
        allowed = current_app.ensure_sync(guard)(attempt)  # an async guard is awaited
    except HTTPException:  # the app's own refusal (abort(403)): it answers as usual
        flow.telemetry.replay_refused()
        raise
    if not allowed:
        flow.telemetry.replay_refused()
        logger.info("the replay guard refused to replay %r in scope %r", record.key, record.scope)
        raise ReplayRefusedError(
            "The operation with this idempotency key is complete, but its stored response "
            "is not given to this caller. Nothing was changed."
        )
