"""One request's state machine, top to bottom: key, scope, fingerprint, claim
(:mod:`.claim`), then run the view and finish (:mod:`.finish`), or replay, or
refuse.

The claim is an insert in the app's session; the view runs in the same session
and transaction; the completed record commits with the business rows, once.
On a leased route the claim commits first, and the completion is a second step
fenced by the fencing token.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
import typing as t

from flask import Response, current_app, request
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session, scoped_session

from .. import signals
from .._config import Settings
from .._context import RequestState, resolve_app, set_request_state
from .._storage import Record, Store, dberrors
from .._telemetry import RequestTelemetry
from ..errors import (
    ConflictError,
    LeaseLostError,
    MissingKeyError,
    NothingToRecoverError,
    RecordGone,
)
from ..scope import resolve_scope
from . import answer
from .claim import Claimed, answer_existing, claim_key, restamp_if_waited
from .claim_guard import Claim, ClaimGuard, lost_error
from .fingerprint import NormalizedRequest, bound_to, load_payload, normalize_request
from .finish import (
    complete,
    failure_answer,
    record_failure_after_commit,
    release,
    settle_commit,
)
from .formkeys import check_binding, expired_error, form_ignored_fields, request_key
from .optimistic import run_optimistic
from .route import RouteOptions
from .rules import request_digest, rules_version
from .session_guard import NoCommitGuard
from .steps import RECOVERY_ENVIRON_KEY, RecoveryRun
from .wsgi import request_header_values

logger = logging.getLogger("flask_idempotency")

Clock = t.Callable[[], dt.datetime]

# How often a browser's duplicate looks again at a record still in progress on
# a committed claim: soon at first (most views are quick), then every half second.
_FIRST_POLL = 0.05
_LAST_POLL = 0.5


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
        telemetry: RequestTelemetry,
    ) -> None:
        self.scoped = scoped
        self.store = store
        self.settings = settings
        self.clock = clock
        self.route = route
        #: What the request's outcome, phases and log line are made of.
        self.telemetry = telemetry
        #: The request as its fingerprint counts it (set once the key is read):
        #: a 422 re-hashes it for other paths without parsing the body again.
        self.normalized: NormalizedRequest | None = None
        #: The route's fingerprint rules version and the request's digest, as
        #: a claim writes them and a retry is judged by them (:mod:`.rules`).
        self.rules_version: str | None = None
        self.request_digest: str | None = None
        #: The record's scope and key, as a keyed digest counts them.
        self.bound = b""

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
        # The request proxy resolved once: each attribute read through it
        # costs a context lookup.
        req = request._get_current_object()  # type: ignore[attr-defined]
        if not settings.protects(req.method):
            # GET, HEAD, OPTIONS, TRACE (and any method not configured): no key
            # is read, no body parsed, nothing recorded (nor counted).
            self.telemetry.ignore()
            set_request_state(RequestState(payload=None, key=None, scope=None, flow=self))
            return self._run_unprotected(view, kwargs)
        if settings.skip is not None and settings.skip():
            self.telemetry.passed_through()
            set_request_state(
                RequestState(payload=load_payload(route.schema), key=None, scope=None, flow=self)
            )
            return self._run_unprotected(view, kwargs)
        key, form_token = request_key(settings)
        if key is None:
            if settings.required:
                raise MissingKeyError(f"This endpoint requires an {settings.header} header.")
            self.telemetry.passed_through()
            set_request_state(
                RequestState(payload=load_payload(route.schema), key=None, scope=None, flow=self)
            )
            return self._run_unprotected(view, kwargs)
        environ = req.environ
        sent = request_header_values(req, settings.header)
        if sent:  # every answer echoes a key the header brought
            answer.keyed(settings.header, sent[0])

        recovery = environ.get(RECOVERY_ENVIRON_KEY)
        if not isinstance(recovery, RecoveryRun):
            recovery = None
        else:  # the recovery job's re-run, not a client's request: the job counts it
            self.telemetry.ignore()
        scope = recovery.scope if recovery else resolve_scope(route.scope or settings.scope)
        if form_token is not None and recovery is None:
            check_binding(form_token, scope)
        self.bound = bound_to(scope, key)
        payload, self.normalized = normalize_request(
            route.schema,
            route.exclude,
            form_ignored_fields(settings),
            settings.fingerprint_key,
            self.bound,
        )
        fingerprint = self.normalized.fingerprint(req.path)
        if recovery is not None and recovery.request_hash is not None:
            # The record's own request (kept without the redacted fields, or
            # fingerprinted under the rules of an earlier deploy): judged as its own.
            fingerprint = recovery.request_hash
            self.rules_version, self.request_digest = recovery.rules_version, recovery.digest
        else:
            self.rules_version = rules_version(route, settings.fingerprint_key, settings.form_field)
            self.request_digest = request_digest(settings.fingerprint_key, self.bound)
        state = RequestState(
            payload=payload, key=key, scope=scope, flow=self, optimistic=route.optimistic
        )
        set_request_state(state)
        # A rendered form past its max age may still find its record (a reload of
        # the order it placed): it replays or resumes that, never starts one.
        expired_form = form_token is not None and form_token.expired
        if route.optimistic and recovery is None and not expired_form:
            return run_optimistic(self, view, kwargs, state, fingerprint)

        try:
            with self.telemetry.claim():
                outcome = self._claim(
                    scope,
                    key,
                    fingerprint,
                    allow_new=recovery is None and not expired_form,
                    replay=expired_form,
                    patient=form_token is not None,
                )
        except RecordGone:
            if expired_form:
                raise expired_error(settings) from None
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
        app = self.hold(state, scope, key, outcome)
        return self.run_claimed(view, kwargs, state, app, recovery=recovery is not None)

    def hold(self, state: RequestState, scope: str, key: str, claimed: Claimed) -> t.Any:
        """Make the claim won ``claimed`` this call's: its token and recovery
        points on ``state``, the claim committed first on a leased route, and the
        :class:`.ClaimGuard` that keeps it in every transaction the view (or an
        idempotent function, :mod:`.._function`) commits. The current app."""
        route, settings = self.route, self.settings
        outcome = restamp_if_waited(self, scope, key, claimed)
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
            # A view's commit on a route whose claim rides in its transaction makes
            # the operation happened: it stores the failure that settles the record
            # should the request never finish. A leased route's view is written to
            # resume after a crash (steps), so its record is reclaimed instead.
            failure_answer=None if route.commit_claim else (lambda: failure_answer(self)),
        )
        return app

    def _claim(
        self,
        scope: str,
        key: str,
        fingerprint: str,
        *,
        allow_new: bool,
        replay: bool,
        patient: bool,
    ) -> t.Any:
        """:func:`.claim.claim_key`; ``patient`` (a browser's form) waits out a
        duplicate still running on a committed claim (a leased route, where no
        row lock makes it wait) for up to ``IDEMPOTENCY_WAIT``, polling, and
        answers what it ends with: the second click of a double click gets the
        first's answer, not a 409 page the browser would show instead."""
        budget = self.settings.wait or self.settings.lease
        deadline = time.monotonic() + budget.total_seconds()
        pause = _FIRST_POLL
        while True:
            try:
                return claim_key(self, scope, key, fingerprint, allow_new=allow_new, replay=replay)
            except ConflictError as exc:
                # Only "in progress" (not a busy database, nor a lost lease).
                if not patient or type(exc) is not ConflictError:
                    raise
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                self.session.rollback()
                time.sleep(min(pause, left))
                pause = min(pause * 2, _LAST_POLL)

    def answer_existing(
        self, record: Record, fingerprint: str, now: dt.datetime
    ) -> Response | Record | None:
        """Replay (or, in manual mode, the record for the view), 422 or 409 for an
        unexpired record; ``None`` means "reclaim it" (:func:`.claim.answer_existing`)."""
        return answer_existing(self, record, fingerprint, now)

    # -- run and finish ------------------------------------------------------------

    def run_claimed(
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
                    settle_commit(self, state)
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
                record_failure_after_commit(self, state, app)
                raise
            release(self, state)
            raise
        guard.stop()
        if guard.commit_sent and not guard.view_committed:
            # The view caught the failure of its own COMMIT and answered: did
            # that commit land? If so its work stays, and this answer is kept.
            settle_commit(self, state)
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
            complete(self, state, app, response, rollback_first=False)
        elif guard.view_committed:
            # Not an answer to keep, but the view committed work of its own
            # before giving it: the operation happened and may not run again.
            complete(self, state, app, response)
        elif commits:
            # An answer IDEMPOTENCY_STORED_STATUSES leaves out, of a kind whose
            # work stays (a success): never answered with that work rolled back.
            release(self, state, commit=True)
        else:
            release(self, state)
        return response

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
