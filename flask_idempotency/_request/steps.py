"""Recovery points (named steps whose results are saved on the record), and the
marker of a request the lease recovery job re-runs.

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

import dataclasses
import datetime as dt
import json
import logging
import typing as t

from .. import signals
from .._context import resolve_app
from ..errors import LeaseLostError, StepNotStoredError
from .claim_guard import Claim

if t.TYPE_CHECKING:
    from .._context import RequestState

T = t.TypeVar("T")

#: WSGI environ key the recovery job sets to re-run a stored request. Only code
#: in the same process can put a Python object there, never an HTTP client.
RECOVERY_ENVIRON_KEY = "flask_idempotency.recovery"


@dataclasses.dataclass(frozen=True)
class RecoveryRun:
    """Marks a request the recovery job re-runs for an abandoned record."""

    scope: str


logger = logging.getLogger("flask_idempotency")

#: The recovery point of a step that ran but whose result could not be saved.
UNSTORED = "flask_idempotency:result-not-stored"


def _unstored(saved: t.Any) -> bool:
    return isinstance(saved, dict) and len(saved) == 1 and UNSTORED in saved


def _not_stored(name: str) -> StepNotStoredError:
    return StepNotStoredError(
        f"Step {name!r} of this operation ran, but the server could not save its result "
        "(a programming error); the operation stopped there and will not run that step "
        "again with this idempotency key. Retrying with the same key gives this answer "
        "until the server is fixed; the step's effect may have happened: check the "
        "resource's state before you start a new operation with a new key."
    )


def run_step(state: RequestState, name: str, fn: t.Callable[[], T]) -> T:
    """Return the saved result of step ``name``, or call ``fn`` and save its result.

    The result must be JSON-serializable; what a resumed attempt gets is the
    JSON round trip of it. Before calling ``fn`` the record's lease is renewed,
    fenced by the token, and after it the result is saved the same way: an
    attempt that another request has overtaken gets :class:`LeaseLostError`
    instead of calling ``fn``, and stops before doing more.
    """
    if state.key is None:
        return fn()  # no key, no operation to resume
    flow, guard = state.flow, state.guard
    if flow is None or guard is None or state.fencing_token is None:
        raise RuntimeError("idem.step() can only be called inside an idempotent request with a key")
    if not state.claim_committed:
        raise RuntimeError(
            "idem.step() needs a leased route: use @idem.idempotent(lease=...) so the "
            "record is committed before the view runs and steps can be saved on it"
        )
    if not name:
        raise ValueError("a step needs a non-empty name")
    if name in state.recovery_points:
        saved = state.recovery_points[name]
        if _unstored(saved):
            raise _not_stored(name)
        logger.debug("step %r of %r already done; reusing its result", name, state.key)
        return t.cast(T, saved)
    _fenced(state, name, None)
    result = fn()
    try:
        saved = json.loads(json.dumps(result))
    except (TypeError, ValueError, RecursionError) as exc:
        # fn ran: its side effect happened. A marker takes the result's place,
        # so no retry runs fn again (the record keeps it, as any recovery
        # point); the client gets a problem, the developer an error line.
        logger.error(
            "the result of step %r of %r in scope %r (a %s) is not JSON-serializable: "
            "the step ran but nothing could be saved, so the key answers step-not-stored "
            "until the view is fixed and the record released",
            name,
            state.key,
            state.scope,
            type(result).__name__,
            exc_info=exc,
        )
        points = {**state.recovery_points, name: {UNSTORED: type(result).__name__}}
        _fenced(state, name, points)
        state.recovery_points = points
        raise _not_stored(name) from exc
    points = {**state.recovery_points, name: saved}
    _fenced(state, name, points)
    state.recovery_points = points
    signals.step_saved.send(
        resolve_app(), scope=state.scope, key=state.key, name=name, result=saved
    )
    return t.cast(T, saved)


def _fenced(state: RequestState, name: str, points: dict[str, t.Any] | None) -> None:
    """Renew the lease (and save ``points``, if given) while this holder still has
    the record; otherwise mark the claim lost and raise."""
    flow, guard = state.flow, state.guard
    assert flow is not None
    assert guard is not None
    assert state.scope is not None
    assert state.key is not None
    assert state.fencing_token is not None
    locked_until = flow.now() + flow.settings.lease
    # A connection of its own: the view's transaction (its business writes)
    # must not commit here, only the lease and the recovery point.
    scope, key, token = state.scope, state.key, state.fencing_token
    with flow.session.get_bind().engine.connect() as conn:
        if points is None:
            ok = flow.store.renew_lease(conn, scope, key, token, locked_until)
        else:
            ok = flow.store.save_recovery_points(conn, scope, key, token, points, locked_until)
        conn.commit()
    if not ok:
        guard.claim = Claim.LOST
        raise LeaseLostError(
            f"Another request took this idempotency key over at step {name!r}; "
            "this request stops here and its work is rolled back.",
            retry_after=dt.timedelta(seconds=1),
        )
