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

from sqlalchemy import exc as sa_exc

from .. import signals
from .._context import resolve_app
from .._failures import SealBroken
from .._storage import is_unstored, unstored_mark
from ..errors import LeaseLostError, StepNotStoredError, TooLargeToStore
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
    #: The record's fingerprint: its kept request, without the fields the
    #: route redacts, no longer hashes to it.
    request_hash: str | None = None
    #: The record's fingerprint rules version and request digest, kept as they are.
    rules_version: str | None = None
    digest: str | None = None
    #: What the re-run tells the job back (``"reconciled"``: the app's hook
    #: rebuilt the record's answer). A set of the job's own: the test client
    #: copies the environ, not the objects in it.
    told: set[str] = dataclasses.field(default_factory=set, compare=False)


logger = logging.getLogger("flask_idempotency")


def _not_stored(state: RequestState, name: str) -> StepNotStoredError:
    expires = _expiry(state)
    until = f"it expires at {expires.isoformat()}" if expires is not None else "it expires"
    return StepNotStoredError(
        f"Step {name!r} of this operation ran, but the server could not save its result "
        "(a programming error, or a result larger than the database takes); the "
        "operation stopped there and will not run that step again with this idempotency "
        "key. Retrying with the same key gives this answer until an operator releases "
        f"the operation's record or {until}. The step's effect may have happened: check "
        "the resource's state before you start a new operation with a new key."
    )


def _expiry(state: RequestState) -> dt.datetime | None:
    """When the operation's record expires, read on a connection of its own
    (``None`` where that read fails: the answer goes out all the same)."""
    flow = state.flow
    if flow is None or state.scope is None or state.key is None:
        return None
    try:
        with flow.session.get_bind().engine.connect() as conn:
            record = flow.store.load(conn, state.scope, state.key, stored_request=False)
    except (sa_exc.SQLAlchemyError, SealBroken):
        return None
    return record.expires_at if record is not None else None


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
        if is_unstored(saved):
            raise _not_stored(state, name)
        logger.debug("step %r of %r already done; reusing its result", name, state.key)
        return t.cast(T, saved)
    _fenced(state, name, None)
    result = fn()
    try:
        saved = json.loads(json.dumps(result))
    except (TypeError, ValueError, RecursionError) as exc:
        _mark_unstored(state, name, type(result).__name__, "is not JSON-serializable", exc)
        raise _not_stored(state, name) from exc
    points = {**state.recovery_points, name: saved}
    try:
        _fenced(state, name, points)
    except TooLargeToStore as exc:
        _mark_unstored(state, name, "too large", f"is larger than the database takes ({exc})", exc)
        raise _not_stored(state, name) from exc
    state.recovery_points = points
    signals.step_saved.send(
        resolve_app(), scope=state.scope, key=state.key, name=name, result=saved
    )
    return t.cast(T, saved)


def _mark_unstored(
    state: RequestState, name: str, why: str, problem: str, exc: BaseException
) -> None:
    """Save the mark of a step that ran but whose result cannot be saved.

    ``fn`` ran: its side effect may have happened. The mark takes the result's
    place, so no retry runs ``fn`` again (the record keeps it, as any recovery
    point); the client gets a problem, the developer an error line."""
    logger.error(
        "the result of step %r of %r in scope %r %s: the step ran but its result could "
        "not be saved, so the key answers step-not-stored until an operator releases "
        "the record or it expires",
        name,
        state.key,
        state.scope,
        problem,
        # Not for a refusal for size: its cause, SQLAlchemy's error, carries the
        # statement's parameters (the result itself) into the traceback.
        exc_info=None if isinstance(exc, TooLargeToStore) else exc,
    )
    points = {**state.recovery_points, name: unstored_mark(why)}
    _fenced(state, name, points)
    state.recovery_points = points


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
