"""One request's state machine, top to bottom: key, scope, fingerprint, claim,
then run the view and finish, or replay, or refuse.

The claim is an insert in the app's session; the view runs in the same session
and transaction; the completed record commits with the business rows, once.
On a leased route the claim commits first, and the completion is a second step
fenced by the fencing token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import logging
import typing as t
import urllib.parse

from flask import Response, current_app, request
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session, scoped_session

from .. import signals
from .._context import RequestState, resolve_app, set_request_state
from .._storage import dberrors
from .._storage.schema import COMPLETED, IN_PROGRESS, Record
from .._storage.store import (
    Store,
    new_fencing_token,
    operation_values,
)
from ..config import Settings
from ..errors import (
    ClaimWaitExceeded,
    ConflictError,
    FailedAfterCommitError,
    KeyReusedError,
    LeaseLostError,
    MissingKeyError,
    NothingToRecoverError,
    PayloadTooLargeError,
    RecordGone,
    TooLargeToStore,
)
from ..keys import key_from_request
from ..scope import resolve_scope
from .claim_guard import Claim, ClaimGuard, Reassert, lost_error
from .fingerprint import load_payload, request_fingerprint, stored_request_body
from .optimistic import run_optimistic
from .responses import capture, replay
from .route import RouteOptions
from .session_guard import NoCommitGuard
from .steps import RECOVERY_ENVIRON_KEY, RecoveryRun

logger = logging.getLogger("flask_idempotency")

# A claim attempt only repeats when another request changed the row between
# our insert and our read (deleted, replaced, reclaimed); a few rounds suffice.
_CLAIM_ROUNDS = 5
# A claim that waited longer than this on another request re-stamps its times.
_RESTAMP_AFTER = dt.timedelta(seconds=1)
Clock = t.Callable[[], dt.datetime]


@dataclasses.dataclass(frozen=True)
class Claimed:
    token: int
    recovery_points: dict[str, t.Any]
    #: Repeats the claim in a later transaction, if the view rolls this one back.
    reassert: Reassert
    #: The operation's creation time (kept by a reclaim, new for a new operation).
    created_at: dt.datetime
    #: The time the claim's lease (and, for a new operation, its retention) counts from.
    stamped_at: dt.datetime
    new_operation: bool


def _commit_in_doubt(exc: BaseException) -> bool:
    """The view's ``COMMIT`` went out (``commit_sent``) and the interruption ``exc``
    hides whether it happened: anything but the database's own refusal of it (an
    error it answered with, on a connection that still works) leaves the commit
    in doubt."""
    if isinstance(exc, sa_exc.DBAPIError) and not exc.connection_invalidated:
        # The database answered the COMMIT with an error: it did not happen,
        # unless the answer says the connection itself failed.
        return dberrors.classify(exc) is dberrors.UNAVAILABLE
    return True


def _request_target() -> str:
    """The path and query as the client sent them, still percent-encoded, so the
    recovery job's re-run reaches the same route with the same arguments
    (``%2F``, ``%3F`` and ``%23`` decoded would change both)."""
    path = urllib.parse.quote(request.path, safe="/:@!$&'()*+,;=-._~")
    query = request.query_string.decode("latin-1")
    return f"{path}?{query}" if query else path


class Flow:
    """Runs one protected view call. Built per request; holds no app state."""

    def __init__(
        self,
        *,
        scoped: scoped_session[t.Any],
        store: Store,
        settings: Settings,
        clock: Clock,
        route: RouteOptions,
    ) -> None:
        self.scoped = scoped
        self.store = store
        self.settings = settings
        self.clock = clock
        self.route = route

    @property
    def session(self) -> Session:
        """The session the view uses now: a view may close and replace it
        (``db.session.remove()``), and the record must end where its writes are."""
        return t.cast(Session, self.scoped())

    def now(self) -> dt.datetime:
        # The app's clock, already read in UTC and checked (extension.in_utc).
        return self.clock()

    def run(self, view: t.Callable[..., t.Any], kwargs: dict[str, t.Any]) -> Response:
        settings, route = self.settings, self.route
        if not settings.protects(request.method):
            # GET, HEAD, OPTIONS, TRACE (and any method not configured): no key
            # is read, no body parsed, nothing recorded.
            set_request_state(RequestState(payload=None, key=None, scope=None, flow=self))
            return self._run_unprotected(view, kwargs)
        if settings.skip is not None and settings.skip():
            set_request_state(
                RequestState(payload=load_payload(route.schema), key=None, scope=None, flow=self)
            )
            return self._run_unprotected(view, kwargs)
        key = key_from_request(
            settings.header, max_length=settings.key_max_length, key_format=settings.key_format
        )
        if key is None:
            if settings.required:
                raise MissingKeyError(f"This endpoint requires an {settings.header} header.")
            set_request_state(
                RequestState(payload=load_payload(route.schema), key=None, scope=None, flow=self)
            )
            return self._run_unprotected(view, kwargs)

        recovery = request.environ.get(RECOVERY_ENVIRON_KEY)
        if not isinstance(recovery, RecoveryRun):
            recovery = None
        scope = recovery.scope if recovery else resolve_scope(route.scope or settings.scope)
        payload, fingerprint = request_fingerprint(route.schema, route.exclude)
        state = RequestState(
            payload=payload, key=key, scope=scope, flow=self, optimistic=route.optimistic
        )
        set_request_state(state)
        if route.optimistic and recovery is None:
            return run_optimistic(self, view, kwargs, state, fingerprint)

        try:
            outcome = self._claim(scope, key, fingerprint, allow_new=recovery is None)
        except RecordGone:
            raise NothingToRecoverError(
                "No abandoned record to resume for this key; another request finished it."
            ) from None
        if isinstance(outcome, Response):
            return outcome
        if isinstance(outcome, Record):
            state.previous = outcome
            # Derived keys in manual mode name the completed operation.
            state.operation = outcome.created_at.isoformat()
            return self._run_manual(view, kwargs)
        outcome = self._restamp_if_waited(scope, key, outcome)
        state.fencing_token = outcome.token
        state.recovery_points = dict(outcome.recovery_points)
        state.operation = outcome.created_at.isoformat()
        app = resolve_app()
        logger.debug("claimed %r in scope %r (token %d)", key, scope, outcome.token)
        signals.key_claimed.send(app, scope=scope, key=key, fencing_token=outcome.token)
        if route.commit_claim:
            self.session.commit()
        state.guard = ClaimGuard(
            store=self.store,
            scope=scope,
            key=key,
            token=outcome.token,
            reassert=outcome.reassert,
            wait=settings.wait,
            lease=settings.lease,
            clock=self.now,
            durable=route.commit_claim,
            # What the record holds as committed: nothing yet, unless the
            # claim commits before the view (a leased route).
            lease_end=outcome.stamped_at + settings.lease if route.commit_claim else None,
        )
        return self._run_claimed(view, kwargs, state, app, recovery=recovery is not None)

    # -- claim -------------------------------------------------------------------

    def _claim_values(self, fingerprint: str, now: dt.datetime) -> dict[str, t.Any]:
        settings = self.settings
        values = operation_values(
            request_hash=fingerprint,
            status=IN_PROGRESS,
            locked_until=now + settings.lease,
            created_at=now,
            expires_at=now + settings.ttl,
        )
        if self.route.recover:
            # The body as sent, or, if a hook parsed the form first, a faithful
            # re-encoding of it (with the content type that goes with it).
            body, content_type = stored_request_body()
            values.update(
                request_method=request.method,
                request_path=_request_target(),
                request_content_type=content_type,
                request_body=body,
            )
        return values

    def _claim(
        self, scope: str, key: str, fingerprint: str, *, allow_new: bool
    ) -> Claimed | Response | Record:
        """Claim (scope, key), or answer for the record that already holds it
        (a completed record itself, on a route in manual mode).

        ``allow_new=False`` (a recovery run) only resumes an abandoned record:
        it never starts an operation no client asked for.
        """
        store, session, wait = self.store, self.session, self.settings.wait
        try:
            for _ in range(_CLAIM_ROUNDS):
                now = self.now()
                values = self._claim_values(fingerprint, now)
                if allow_new:
                    token = new_fencing_token()
                    fresh = {"scope": scope, "key": key, "fencing_token": token, **values}
                    inserted, record = store.claim(session, fresh, wait)
                    if inserted:
                        insert = functools.partial(store.try_insert, values=fresh)
                        return Claimed(token, {}, insert, now, now, True)
                else:
                    with store.bounded_wait(session, wait):
                        record = store.load(session, scope, key, stored_request=False)
                expired = record is not None and record.is_expired(now)
                if not allow_new and (record is None or expired):
                    raise RecordGone(f"{scope!r} {key!r}")
                if record is None:
                    continue  # deleted since our insert; insert again
                if not expired:
                    answer = self.answer_existing(record, fingerprint, now)
                    if answer is not None:
                        if not allow_new:
                            raise RecordGone(f"{scope!r} {key!r}")
                        return answer
                # Replace the expired record (a new operation, starting
                # clean), or reclaim one whose lease ended (the same
                # operation, resuming from its recovery points).
                token = new_fencing_token(record.fencing_token)
                take: Reassert = functools.partial(
                    store.take_over,
                    record=record,
                    values=values,
                    now=now,
                    expired=expired,
                    token=token,
                )
                with store.bounded_wait(session, wait):
                    taken = take(session)
                if taken:
                    if not expired:
                        logger.info("reclaimed %r in scope %r after its lease ended", key, scope)
                    if expired:  # a new operation
                        return Claimed(token, {}, take, now, now, True)
                    points = record.recovery_points
                    return Claimed(token, points, take, record.created_at, now, False)
        except TooLargeToStore as exc:
            session.rollback()
            raise PayloadTooLargeError(
                "The request is larger than the database accepts to keep for the recovery "
                f"job ({exc}); nothing was stored. Send a smaller body."
            ) from None
        except ClaimWaitExceeded:
            session.rollback()
            self._signal_conflict(scope, key, None)
            raise ConflictError(
                "Another request with this idempotency key is still running; "
                "retry after it finishes.",
                retry_after=dt.timedelta(seconds=1),
            ) from None
        self._signal_conflict(scope, key, None)
        raise ConflictError(
            "The record for this idempotency key kept changing; retry.",
            retry_after=dt.timedelta(seconds=1),
        )

    def _restamp_if_waited(self, scope: str, key: str, claimed: Claimed) -> Claimed:
        """The claim's times were taken before it waited on another request's
        transaction (the unique index, a row lock). When that wait was long, count the
        lease (and a new operation's retention) from now, or a duplicate that waited
        past a lease would hold a lease already over."""
        now = self.now()
        if now - claimed.stamped_at <= _RESTAMP_AFTER:
            return claimed
        settings = self.settings
        created_at = now if claimed.new_operation else claimed.created_at
        self.store.restamp(
            self.session,
            scope,
            key,
            claimed.token,
            locked_until=now + settings.lease,
            created_at=now if claimed.new_operation else None,
            expires_at=now + settings.ttl if claimed.new_operation else None,
        )
        return dataclasses.replace(claimed, created_at=created_at, stamped_at=now)

    def _signal_conflict(self, scope: str, key: str, record: Record | None) -> None:
        app = resolve_app()
        signals.request_conflict.send(app, scope=scope, key=key, record=record)

    def answer_existing(
        self, record: Record, fingerprint: str, now: dt.datetime
    ) -> Response | Record | None:
        """Replay (or, in manual mode, the record for the view), 422 or 409 for an
        unexpired record; ``None`` means "reclaim it"."""
        app = resolve_app()
        if record.request_hash != fingerprint:
            signals.payload_mismatch.send(app, scope=record.scope, key=record.key, record=record)
            raise KeyReusedError(
                "This idempotency key was already used with a different request payload. "
                "Use a new key for a new operation."
            )
        if record.status == COMPLETED:
            logger.debug("replaying %r in scope %r", record.key, record.scope)
            signals.response_replayed.send(app, scope=record.scope, key=record.key, record=record)
            return record if self.route.manual else replay(record)
        if record.lease_live(now):
            assert record.locked_until is not None
            self._signal_conflict(record.scope, record.key, record)
            raise ConflictError(
                "A request with this idempotency key is in progress; retry later.",
                retry_after=record.locked_until - now,
            )
        return None

    # -- run and finish ------------------------------------------------------------

    def _run_claimed(
        self,
        view: t.Callable[..., t.Any],
        kwargs: dict[str, t.Any],
        state: RequestState,
        app: t.Any,
        *,
        recovery: bool,
    ) -> Response:
        guard = state.guard
        assert guard is not None
        guard.watch(self.session, self.scoped)
        try:
            response = current_app.make_response(view(**kwargs))
        except BaseException as exc:
            guard.stop()
            if guard.claim is Claim.LOST:
                self.session.rollback()
                if isinstance(exc, LeaseLostError):
                    raise
                # Whatever the view made of it, the cause is the lost key.
                raise lost_error() from exc
            if not guard.view_committed and guard.commit_sent:
                if _commit_in_doubt(exc):
                    self._settle_commit(state)
                else:  # the database answered the COMMIT with a refusal: it did not happen
                    guard.commit_sent = False
            if guard.view_committed:
                # The view committed work of its own, then failed: that work
                # stays, so the operation must not run again. Retries get the
                # failure; the app's error handling sees the exception now.
                # Every BaseException too: gunicorn's worker timeout raises
                # SystemExit inside the view, a killed green thread
                # GreenletExit, Ctrl-C KeyboardInterrupt.
                logger.warning(
                    "%r in scope %r failed (%s) after the view committed; recording the failure",
                    state.key,
                    state.scope,
                    type(exc).__name__,
                )
                self._record_failure_after_commit(state, app)
                raise
            self._release(state)
            raise
        guard.stop()
        if guard.commit_sent and not guard.view_committed:
            # The view caught the failure of its own COMMIT and answered: did
            # that commit land? If so its work stays, and this answer is kept.
            self._settle_commit(state)
        if guard.claim is Claim.LOST:
            self.session.rollback()
            raise lost_error()
        code = response.status_code
        storable = self.settings.storable(code)
        commits = self.settings.commits(code)
        if recovery:
            # Without the client, only success is worth keeping: a 4xx here may
            # come from missing credentials, not from the request itself.
            storable = storable and code < 400
            commits = commits and code < 400
        if storable:
            self._complete(state, app, response, rollback_first=False)
        elif guard.view_committed:
            # Not an answer to keep, but the view committed work of its own
            # before giving it: the operation happened and may not run again.
            self._complete(state, app, response)
        elif commits:
            # An answer IDEMPOTENCY_STORED_STATUSES leaves out, of a kind whose
            # work stays (a success): never answered with that work rolled back.
            self._release(state, commit=True)
        else:
            self._release(state)
        return response

    def _settle_commit(self, state: RequestState) -> None:
        """Roll the session back and settle the view's commit whose outcome a
        failure hid (:meth:`ClaimGuard.settle_commit`)."""
        assert state.guard is not None
        try:
            self.session.rollback()
        except Exception:  # the connection is gone: the judgement uses another
            logger.debug("rollback before judging a commit failed", exc_info=True)
        state.guard.settle_commit()

    def _record_failure_after_commit(self, state: RequestState, app: t.Any) -> None:
        """Record a 500 ``failed-after-commit`` for an operation whose view
        committed work of its own and then did not finish: what the view had not
        committed is rolled back, and every retry gets this answer (the
        operation may not run again). If even that cannot be stored (the
        database is gone too), the record stays in progress under its lease."""
        failure = FailedAfterCommitError()
        self._complete(state, app, t.cast(Response, failure.get_response()), failure=True)

    def _complete(
        self,
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
        session = self.session
        try:
            if rollback_first:
                session.rollback()
            if guard.claim is Claim.ROLLED_BACK and not guard.reclaim(session):
                # The view rolled its transaction back and left it at that; a
                # duplicate took the key in between.
                session.rollback()
                raise lost_error()
            captured = capture(
                response, self.settings.replayed_header_names, self.settings.max_body
            )
            completed = self.store.complete(
                session,
                scope,
                key,
                token,
                response_code=captured.status,
                response_headers=captured.headers,
                response_body=captured.body,
                body_omitted=captured.body_omitted,
                now=self.now(),
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
                    self._record_failure_after_commit(state, app)
                except BaseException as second:
                    if second is not exc and not isinstance(second, Exception):
                        raise  # a second interruption: it goes on, not the first
                raise
            self._release(state)
            raise
        signals.record_completed.send(
            app, scope=scope, key=key, fencing_token=token, response=response
        )

    def _run_unprotected(self, view: t.Callable[..., t.Any], kwargs: dict[str, t.Any]) -> Response:
        """No key: run the view with the same transaction rules, but keep no record.

        The view's contract does not change with the header: the extension
        commits what a storable answer wrote and rolls back the rest.
        """
        try:
            response = current_app.make_response(view(**kwargs))
            if self.settings.commits(response.status_code):
                self.session.commit()
            else:
                self.session.rollback()
        except BaseException:
            self.session.rollback()
            raise
        return response

    def _run_manual(self, view: t.Callable[..., t.Any], kwargs: dict[str, t.Any]) -> Response:
        """Manual mode, on a retry of a completed operation: the view sees the
        record (``idem.previous``) and answers; anything it writes is rolled
        back, since the operation already happened."""
        watcher = NoCommitGuard()
        watcher.watch(self.session, self.scoped)
        try:
            return current_app.make_response(view(**kwargs))
        finally:
            watcher.stop()
            self.session.rollback()

    def _release(self, state: RequestState, *, commit: bool = False) -> None:
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
        (see :meth:`_keep_operation`), whatever the route.
        """
        assert state.scope is not None
        assert state.key is not None
        assert state.fencing_token is not None
        assert state.guard is not None
        session = self.session
        guard = state.guard
        durable = guard.claim is Claim.DURABLE
        if commit:
            self._commit_without_record(state)
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
                released = self._keep_operation(state)
            else:
                released = self.store.release(
                    session,
                    state.scope,
                    state.key,
                    state.fencing_token,
                    keep_recovery_points=bool(state.recovery_points),
                )
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

    def _commit_without_record(self, state: RequestState) -> None:
        """Commit the view's pending writes and free the key in the same
        transaction: no answer is kept, so a retry runs the view again. (With a
        derived key handed out, the operation is kept for the retry instead, as
        :meth:`_release` does, so the downstream sees the same key again.)"""
        assert state.scope is not None
        assert state.key is not None
        assert state.fencing_token is not None
        assert state.guard is not None
        session = self.session
        claim = state.guard.claim
        try:
            if claim is Claim.DURABLE and state.keys_handed_out:
                self._keep_operation(state)
            elif claim in (Claim.DURABLE, Claim.IN_TRANSACTION):
                # Our own row, committed or still in this transaction: fenced.
                self.store.release(
                    session,
                    state.scope,
                    state.key,
                    state.fencing_token,
                    keep_recovery_points=bool(state.recovery_points),
                )
            session.commit()
        except BaseException:
            with contextlib.suppress(Exception):
                session.rollback()
            raise
        logger.debug(
            "%r in scope %r: answer not stored; the view's work committed", state.key, state.scope
        )

    def _keep_operation(self, state: RequestState) -> bool:
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
        return self.store.keep_for_retry(
            self.session,
            state.scope,
            state.key,
            state.fencing_token,
            recovery_points=state.recovery_points,
        )
