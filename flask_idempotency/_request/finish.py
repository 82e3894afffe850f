"""How a claimed request ends: its answer stored on the record (completed,
fenced by the token, committed with the view's writes), or the key released
for a retry, or the operation kept for it; and a commit whose outcome an
interruption hid, settled before either.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import typing as t

from flask import Response

from .. import signals
from .._context import RequestState
from .._storage import answer_values, dberrors
from ..errors import FailedAfterCommitError, LeaseLostError
from .claim_guard import Claim, lost_error
from .responses import capture

if t.TYPE_CHECKING:
    from .flow import Flow

logger = logging.getLogger("flask_idempotency")


def settle_commit(flow: Flow, state: RequestState) -> None:
    """Roll the session back and settle the view's commit whose outcome a
    failure hid (:meth:`.ClaimGuard.settle_commit`)."""
    assert state.guard is not None
    try:
        flow.session.rollback()
    except Exception:  # the connection is gone: the judgement uses another
        logger.debug("rollback before judging a commit failed", exc_info=True)
    state.guard.settle_commit()


def failure_answer(flow: Flow) -> dict[str, t.Any]:
    """The columns of the 500 ``failed-after-commit`` answer, as stored: what
    each commit of the view writes on the record, still in progress (see
    :mod:`.claim_guard`)."""
    response = t.cast(Response, FailedAfterCommitError().get_response())
    captured = capture(response, flow.settings.replayed_header_names, flow.settings.max_body)
    return answer_values(captured.status, captured.headers, captured.body, captured.body_omitted)


def record_failure_after_commit(flow: Flow, state: RequestState, app: t.Any) -> None:
    """Record a 500 ``failed-after-commit`` for an operation whose view
    committed work of its own and then did not finish: what the view had not
    committed is rolled back, and every retry gets this answer (the
    operation may not run again). If even that cannot be stored (the
    database is gone too), the record stays in progress under its lease,
    holding that answer since the view's commit: once the lease ends, the
    next claim (or the recovery job) completes it with that answer, and the
    view never runs again (:func:`.claim.settle_view_committed`)."""
    flow.telemetry.failed_after_commit()
    failure = FailedAfterCommitError()
    complete(flow, state, app, t.cast(Response, failure.get_response()), failure=True)


def complete(
    flow: Flow,
    state: RequestState,
    app: t.Any,
    response: Response,
    *,
    rollback_first: bool = True,
    failure: bool = False,
) -> None:
    """Store ``response`` on the record, fenced by the token, and commit it with
    the view's writes (or, ``rollback_first``, after rolling back what the
    view had not committed).

    Interrupted (any ``BaseException``: gunicorn's worker timeout raises
    ``SystemExit`` wherever the worker is) once the view has committed work
    of its own, a ``failed-after-commit`` answer is recorded instead before
    the exception goes on (unless ``failure``: this is that recording), so
    that no retry runs the view again; otherwise the key is released."""
    guard = state.guard
    assert guard is not None
    assert state.scope is not None
    assert state.key is not None
    assert state.fencing_token is not None
    scope, key, token = state.scope, state.key, state.fencing_token
    session = flow.session
    try:
        with flow.telemetry.complete():
            if rollback_first:
                session.rollback()
            if guard.claim is Claim.ROLLED_BACK and not guard.reclaim(session):
                # The view rolled its transaction back and left it at that; a
                # duplicate took the key in between.
                session.rollback()
                raise lost_error()
            captured = capture(
                response, flow.settings.replayed_header_names, flow.settings.max_body
            )
            now = flow.now()
            completed = flow.store.complete(
                session,
                scope,
                key,
                token,
                response_code=captured.status,
                response_headers=captured.headers,
                response_body=captured.body,
                body_omitted=captured.body_omitted,
                now=now,
                # Kept for its ttl from now, not from the claim: a view that
                # ran longer than its ttl stores an answer that lasts.
                expires_at=now + flow.settings.ttl,
            )
            if not completed:
                session.rollback()
                logger.warning("lost the lease on %r in scope %r; rolled back", key, scope)
                raise LeaseLostError(
                    "This request took longer than its lease and another request took "
                    "the idempotency key over; what this request had not committed was "
                    "rolled back.",
                    retry_after=dt.timedelta(seconds=1),
                )
            session.commit()
            if not failure:
                flow.telemetry.stored(len(captured.body or b""))
    except LeaseLostError:
        raise
    except BaseException as exc:
        if guard.view_committed and not failure:
            logger.warning(
                "%r in scope %r: storing the answer failed (%s) after the view "
                "committed; recording the failure",
                key,
                scope,
                type(exc).__name__,
            )
            try:
                record_failure_after_commit(flow, state, app)
            except BaseException as second:
                if second is not exc and not isinstance(second, Exception):
                    raise  # a second interruption: it goes on, not the first
            raise
        release(flow, state)
        raise
    signals.record_completed.send(app, scope=scope, key=key, fencing_token=token, response=response)


def release(flow: Flow, state: RequestState, *, commit: bool = False) -> None:
    """Roll back the view's work and free the key so a retry runs again.

    ``commit=True``: commit the view's pending work instead, in the same
    transaction as the record's release (an answer not stored, whose work
    stays); a retry runs the view again.

    A claim that was never committed goes with the rollback. A durable one
    (a leased route's, the view having committed nothing itself) is deleted,
    or, when it has recovery points, kept with its lease ended so the retry
    resumes from them. Fenced by the token: a record another request has taken over (or
    claimed afresh after a delete, with a token of its own) is left alone.

    When the view handed a derived key out, the operation is kept instead
    (see :func:`keep_operation`), whatever the route.
    """
    assert state.scope is not None
    assert state.key is not None
    assert state.fencing_token is not None
    assert state.guard is not None
    session = flow.session
    guard = state.guard
    durable = guard.claim is Claim.DURABLE
    if commit:
        commit_without_record(flow, state)
        return
    session.rollback()
    if not durable:
        return
    if guard.view_committed or guard.commit_sent:
        # The view's work is committed, or its COMMIT went out and no answer
        # came back: freeing the key would let a retry run the operation
        # again. The record stays as it is, under its lease.
        logger.warning(
            "%r in scope %r is kept under its lease: the view's work was (or may "
            "have been) committed",
            state.key,
            state.scope,
        )
        return
    try:
        if state.keys_handed_out:
            released = keep_operation(flow, state)
        else:
            released = release_own(flow, state)
        session.commit()
        if released:
            logger.debug("released %r in scope %r", state.key, state.scope)
    except Exception as exc:  # the original failure matters more; the lease still frees the key
        if dberrors.classify(exc) is None:
            logger.exception("could not release %r in scope %r", state.key, state.scope)
        else:  # an outage: the request's own failure is logged already
            logger.warning(
                "could not release %r in scope %r (%s); it frees when its lease ends",
                state.key,
                state.scope,
                dberrors.summary(exc),
            )
        with contextlib.suppress(Exception):
            session.rollback()


def commit_without_record(flow: Flow, state: RequestState) -> None:
    """Commit the view's pending writes and free the key in the same
    transaction: no answer is kept, so a retry runs the view again. (With a
    derived key handed out, the operation is kept for the retry instead, as
    :func:`release` does, so the downstream sees the same key again.)"""
    assert state.scope is not None
    assert state.key is not None
    assert state.fencing_token is not None
    assert state.guard is not None
    session = flow.session
    claim = state.guard.claim
    try:
        if claim is Claim.DURABLE and state.keys_handed_out:
            keep_operation(flow, state)
        elif claim in (Claim.DURABLE, Claim.IN_TRANSACTION):
            # Our own row, committed or still in this transaction: fenced.
            release_own(flow, state)
        session.commit()
    except BaseException:
        with contextlib.suppress(Exception):
            session.rollback()
        raise
    logger.debug(
        "%r in scope %r: answer not stored; the view's work committed", state.key, state.scope
    )


def release_own(flow: Flow, state: RequestState) -> bool:
    """Free the key of this request's own record (fenced by its token), keeping
    its recovery points when it has any; whether a row was released."""
    assert state.scope is not None
    assert state.key is not None
    assert state.fencing_token is not None
    return flow.store.release(
        flow.session,
        state.scope,
        state.key,
        state.fencing_token,
        keep_recovery_points=bool(state.recovery_points),
    )


def keep_operation(flow: Flow, state: RequestState) -> bool:
    """Keep a failed attempt's operation, with its lease ended, for the retry.

    The view sent a derived key downstream (only a committed claim may:
    see ``current_derived_key``), and a call whose outcome it does not
    know (a timeout) may have acted there. Deleting the record would make
    the retry a new operation, with new derived keys, and the downstream
    would act again. Kept, the retry reclaims the same operation (same
    start, same derived keys) and the downstream dedupes it. The record
    keeps its recovery points (an empty set counts) and drops its stored
    request, so neither a release nor the recovery job takes it: it waits
    for the client's retry, or its expiry.
    """
    assert state.scope is not None
    assert state.key is not None
    assert state.fencing_token is not None
    return flow.store.keep_for_retry(
        flow.session,
        state.scope,
        state.key,
        state.fencing_token,
        recovery_points=state.recovery_points,
    )
