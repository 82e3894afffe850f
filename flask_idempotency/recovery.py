"""Recovery points: named steps whose results are saved on the record.

A leased view splits work that cannot join its transaction (a card charge, an
email) into steps. A finished step's result is saved on the record at once, in
its own short transaction, fenced by the fencing token; when a later attempt
resumes the record (after a crash, a lost lease or a released failure), the
step returns the saved result without calling its function again.

Keep database writes out of step functions: they belong to the view's
transaction, which commits with the completed record. Steps are for work
outside the database, ideally called with a derived key so that even a step
interrupted mid-call is deduplicated downstream.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import typing as t

from .errors import LeaseLostError

if t.TYPE_CHECKING:
    from .flow import RequestState

T = t.TypeVar("T")

logger = logging.getLogger("flask_idempotency")


def run_step(state: RequestState, name: str, fn: t.Callable[[], T]) -> T:
    """Return the saved result of step ``name``, or call ``fn`` and save its result.

    The result must be JSON-serializable; what a resumed attempt gets is the
    JSON round trip of it. Raises :class:`LeaseLostError` if another request
    took the record over, so this attempt stops before doing more.
    """
    flow = state.flow
    if flow is None or state.fencing_token is None:
        raise RuntimeError("idem.step() can only be called inside an idempotent request with a key")
    if not state.claim_committed:
        raise RuntimeError(
            "idem.step() needs a leased route: use @idem.idempotent(lease=...) so the "
            "record is committed before the view runs and steps can be saved on it"
        )
    if not name:
        raise ValueError("a step needs a non-empty name")
    if name in state.recovery_points:
        logger.debug("step %r of %r already done; reusing its result", name, state.key)
        return t.cast(T, state.recovery_points[name])
    result = fn()
    try:
        saved = json.loads(json.dumps(result))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"the result of step {name!r} must be JSON-serializable") from exc
    points = {**state.recovery_points, name: saved}
    assert state.scope is not None
    assert state.key is not None
    # A connection of its own: the view's transaction (its business writes)
    # must not commit here, only the recovery point.
    with flow.session.get_bind().engine.connect() as conn:
        ok = flow.store.save_recovery_points(
            conn, state.scope, state.key, state.fencing_token, points
        )
        conn.commit()
    if not ok:
        raise LeaseLostError(
            f"Another request took this idempotency key over during step {name!r}; "
            "this request stops here and its work is rolled back.",
            retry_after=dt.timedelta(seconds=1),
        )
    state.recovery_points = points
    return t.cast(T, saved)
