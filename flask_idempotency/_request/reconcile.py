"""Reconcile: the answer of an operation whose outcome the extension could not
keep, rebuilt by the app's hook (``reconcile=``, ``IDEMPOTENCY_RECONCILE``)
from the committed state, and stored in place of the failure.

Two kinds of record qualify (:class:`~flask_idempotency.scope.ReconcileAttempt`'s
``why``): one whose view committed work of its own and whose request never
answered (completed with the 500 ``failed-after-commit``, or still in progress
holding it, its lease over), and, on a leased route, one in progress whose
holder went away (the view may or may not have committed). The hook's answer
is stored fenced like any completion (:meth:`.held.HeldRecord.reconcile`: the
token read, a new token drawn, one of two callers wins) and commits with what
the hook left pending in the session. Anything else it gives (``None``, an
error, a 5xx, an answer the route would not store) leaves the record as it
was, logged without bodies.

The request flow (:mod:`.claim`), the lease recovery job and the CLI
(:mod:`.._maintenance.reconcile`) ask through :func:`rebuild`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import typing as t

from flask import current_app, request
from sqlalchemy.orm import Session

from .._config import Settings
from .._storage import COMPLETED, Record, Store, answer_values, dberrors, new_fencing_token
from ..errors import ClaimWaitExceeded
from ..scope import ReconcileAttempt
from .responses import Captured, capture, stored_failure
from .steps import RECOVERY_ENVIRON_KEY, RecoveryRun

if t.TYPE_CHECKING:
    from .flow import Flow

logger = logging.getLogger("flask_idempotency")

FAILED_AFTER_COMMIT: t.Final = "failed-after-commit"
LEASE_ENDED: t.Final = "lease-ended"
Why = t.Literal["failed-after-commit", "lease-ended"]


@dataclasses.dataclass(frozen=True)
class Rebuilt:
    """What :func:`rebuild` came to: ``record`` is the record as now stored
    (the rebuilt answer, this caller's or a concurrent one's), else ``None``
    and ``reason`` says why not (for the log and the CLI)."""

    record: Record | None
    reason: str = ""
    #: Whether this caller's hook gave the answer stored (not a concurrent one's).
    mine: bool = False


def why_of(record: Record) -> Why | None:
    """Why ``record`` may be reconciled, or ``None``: it may not (an answer of
    the view's, a tombstone, an unreadable record, an operation still running
    is judged by the caller)."""
    if record.unreadable is not None:
        return None
    if record.status == COMPLETED:
        return FAILED_AFTER_COMMIT if stored_failure(record) else None
    if record.view_committed:
        return FAILED_AFTER_COMMIT
    return None


def attempt_for(
    record: Record, why: Why, endpoint: str | None, *, from_client: bool
) -> ReconcileAttempt:
    """The hook's argument for ``record``."""
    return ReconcileAttempt(
        endpoint=endpoint,
        scope=record.scope,
        key=record.key,
        created_at=record.created_at,
        why=why,
        status=record.response_code,
        recovery_points=dict(record.recovery_points),
        from_client=from_client,
    )


def ask(
    hook: t.Callable[[t.Any], t.Any], attempt: ReconcileAttempt, settings: Settings
) -> Captured | str:
    """Run ``hook`` (awaited if async) in the current request context; the answer
    it rebuilt, as stored, or why there is none. An ``Exception`` of the hook's
    is "none" (logged); any other ``BaseException`` goes on."""
    try:
        value = current_app.ensure_sync(hook)(attempt)
        if value is None:
            return "the hook returned None"
        response = current_app.make_response(value)
    except Exception as exc:
        logger.warning(
            "the reconcile hook failed on %r in scope %r (%s); nothing was rebuilt",
            attempt.key,
            attempt.scope,
            type(exc).__name__,
            exc_info=True,
        )
        return f"the hook raised {type(exc).__name__}"
    code = response.status_code
    if code >= 500 or not settings.storable(code):
        return f"the hook answered {code}, which is not stored"
    return capture(response, settings.replayed_header_names, settings.max_body)


def rebuild(
    session: Session,
    store: Store,
    record: Record,
    why: Why,
    *,
    hook: t.Callable[[t.Any], t.Any],
    settings: Settings,
    now: dt.datetime,
    endpoint: str | None,
    from_client: bool = True,
) -> Rebuilt:
    """Ask ``hook`` for ``record``'s answer and store it, fenced by the token
    read, in the session's transaction (committed, with what the hook left
    pending). Not rebuilt, the session is rolled back: the record is as it was
    and the hook's writes are gone. Interrupted (a ``BaseException`` that is
    not an ``Exception``), the same, and the interruption goes on."""
    attempt = attempt_for(record, why, endpoint, from_client=from_client)
    try:
        answer = ask(hook, attempt, settings)
        if not isinstance(answer, str):
            answer = _hook_writes(session, session.flush) or answer
        if isinstance(answer, str):
            session.rollback()
            logger.warning(
                "%r in scope %r (%s): no answer rebuilt: %s", record.key, record.scope, why, answer
            )
            return Rebuilt(None, answer)
        values = answer_values(answer.status, answer.headers, answer.body, answer.body_omitted)
        token = new_fencing_token(record.fencing_token)
        try:
            with store.bounded_wait(session, settings.wait):
                won = store.reconcile(
                    session,
                    record.scope,
                    record.key,
                    record.fencing_token,
                    status=record.status,
                    new_token=token,
                    answer=values,
                    now=now,
                    retention=settings.ttl,
                )
        except ClaimWaitExceeded:
            won = False
        except Exception as exc:
            # Two callers that read the record alike and both write it: where
            # the engine resolves that as a deadlock (MySQL's shared locks of
            # the claim's read), one of them is the loser, as above.
            if dberrors.classify(exc) is not dberrors.CONFLICT:
                raise
            won = False
        if not won:
            session.rollback()
            return _other_outcome(session, store, record)
        refused = _hook_writes(session, session.commit)
        if refused is not None:  # a deferred constraint on the hook's writes
            session.rollback()
            logger.warning(
                "%r in scope %r (%s): no answer rebuilt: %s", record.key, record.scope, why, refused
            )
            return Rebuilt(None, refused)
    except BaseException:
        session.rollback()
        raise
    logger.warning(
        "%r in scope %r (%s): answer %d rebuilt by the reconcile hook and stored",
        record.key,
        record.scope,
        why,
        answer.status,
    )
    return Rebuilt(
        dataclasses.replace(
            record,
            status=COMPLETED,
            fencing_token=token,
            response_code=answer.status,
            response_headers=list(answer.headers),
            response_body=answer.body,
            body_omitted=answer.body_omitted,
            locked_until=None,
            completed_at=now,
            expires_at=max(record.expires_at, now + settings.ttl),
        ),
        mine=True,
    )


def _hook_writes(session: Session, send: t.Callable[[], None]) -> str | None:
    """``send`` (the session's flush, or its commit) what the hook left
    pending; why not, when the database refuses those writes (a constraint):
    that is the hook's failure, like an exception of its own, and nothing is
    rebuilt. The database gone, busy or read-only is raised, as anywhere."""
    try:
        send()
    except Exception as exc:
        if dberrors.classify(exc) is not None or dberrors.read_only_reason(exc):
            raise
        return f"the hook's writes were refused ({type(exc).__name__})"
    return None


def _other_outcome(session: Session, store: Store, record: Record) -> Rebuilt:
    """The record changed while the hook ran: another caller's rebuilt answer
    (the record to replay), or why not."""
    current = store.load(session, record.scope, record.key, stored_request=False)
    session.rollback()
    if (
        current is not None
        and current.status == COMPLETED
        and current.request_hash == record.request_hash
        and not stored_failure(current)
    ):
        # Rebuilt by a caller that ran at the same time (or, on a leased
        # route, completed by its holder after all): that answer stands.
        return Rebuilt(current)
    return Rebuilt(None, "the record changed meanwhile")


def at_retry(flow: Flow, record: Record, why: Why, now: dt.datetime) -> Rebuilt | None:
    """:func:`rebuild` in a request that found ``record`` (a client's retry, or
    the recovery job's re-run of the stored request), with the route's hook
    (else the app's); ``None``: none to ask (or a route in manual mode, whose
    view decides itself with ``idem.previous``)."""
    hook = flow.settings.reconcile
    if hook is None or flow.route.manual:
        return None
    rebuilt = rebuild(
        flow.session,
        flow.store,
        record,
        why,
        hook=hook,
        settings=flow.settings,
        now=now,
        endpoint=request.endpoint,
        from_client=RECOVERY_ENVIRON_KEY not in request.environ,
    )
    if rebuilt.mine:  # a concurrent caller's answer is a replay here
        flow.telemetry.reconciled()
        run = request.environ.get(RECOVERY_ENVIRON_KEY)
        if isinstance(run, RecoveryRun):  # the job counts the record completed
            run.told.add("reconciled")
    return rebuilt
