"""One request's state machine, top to bottom: key, scope, fingerprint, claim,
then run the view and finish, or replay, or refuse.

The claim is an insert in the app's session; the view runs in the same session
and transaction; the completed record commits with the business rows, once.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import typing as t

from flask import Response, current_app, g
from sqlalchemy.orm import Session

from . import signals
from .config import Settings
from .errors import ConflictError, KeyReusedError, LeaseLostError, MissingKeyError
from .fingerprint import load_payload, request_fingerprint
from .keys import default_scope, key_from_request
from .models import COMPLETED, IN_PROGRESS, Record
from .responses import capture, is_storable, replay
from .store import ClaimWaitExceeded, Store

logger = logging.getLogger("flask_idempotency")

MAX_SCOPE_LENGTH = 512
# A claim attempt only repeats when another request changed the row between
# our insert and our read (deleted, replaced, reclaimed); a few rounds suffice.
_CLAIM_ROUNDS = 5

Clock = t.Callable[[], dt.datetime]


@dataclasses.dataclass
class RequestState:
    """What the view may read about the current idempotent request (on ``g``)."""

    payload: t.Any
    key: str | None
    scope: str | None
    fencing_token: int | None = None


@dataclasses.dataclass(frozen=True)
class Claimed:
    token: int
    reclaimed: bool


def _now(clock: Clock) -> dt.datetime:
    now = clock()
    if now.tzinfo is None:
        raise ValueError("the idempotency clock must return timezone-aware datetimes")
    return now


def resolve_scope(settings: Settings, route_scope: t.Callable[[], str] | None) -> str:
    func = route_scope or settings.scope or default_scope
    scope = func()
    if not isinstance(scope, str) or not scope:
        raise TypeError(
            f"the idempotency scope callable must return a non-empty str, got {scope!r}"
        )
    if len(scope) > MAX_SCOPE_LENGTH:
        raise ValueError(f"an idempotency scope must be at most {MAX_SCOPE_LENGTH} characters")
    return scope


class Flow:
    """Runs one protected view call. Built per request; holds no app state."""

    def __init__(
        self,
        *,
        session: Session,
        store: Store,
        settings: Settings,
        clock: Clock,
        commit_claim: bool,
    ) -> None:
        self.session = session
        self.store = store
        self.settings = settings
        self.clock = clock
        self.commit_claim = commit_claim

    def run(
        self,
        view: t.Callable[..., t.Any],
        kwargs: dict[str, t.Any],
        *,
        schema: t.Any,
        exclude: t.Sequence[str],
        route_scope: t.Callable[[], str] | None,
    ) -> Response:
        settings = self.settings
        key = key_from_request(settings.header)
        if key is None:
            if settings.required:
                raise MissingKeyError(f"This endpoint requires an {settings.header} header.")
            g._idempotency = RequestState(payload=load_payload(schema), key=None, scope=None)
            return self._run_unprotected(view, kwargs)

        scope = resolve_scope(settings, route_scope)
        payload, fingerprint = request_fingerprint(schema, exclude)
        state = RequestState(payload=payload, key=key, scope=scope)
        g._idempotency = state

        outcome = self._claim(scope, key, fingerprint)
        if isinstance(outcome, Response):
            return outcome
        state.fencing_token = outcome.token
        app = current_app._get_current_object()  # type: ignore[attr-defined]
        logger.debug("claimed %r in scope %r (token %d)", key, scope, outcome.token)
        signals.key_claimed.send(app, scope=scope, key=key, fencing_token=outcome.token)
        if self.commit_claim:
            self.session.commit()
        return self._run_claimed(view, kwargs, scope, key, outcome.token, app)

    # -- claim -------------------------------------------------------------------

    def _claim_values(self, fingerprint: str, now: dt.datetime) -> dict[str, t.Any]:
        settings = self.settings
        return {
            "request_hash": fingerprint,
            "status": IN_PROGRESS,
            "response_code": None,
            "response_headers": None,
            "response_body": None,
            "body_omitted": False,
            "locked_until": now + settings.lease,
            "created_at": now,
            "completed_at": None,
            "expires_at": now + settings.ttl,
        }

    def _claim(self, scope: str, key: str, fingerprint: str) -> Claimed | Response:
        """Claim (scope, key), or answer for the record that already holds it."""
        store, session = self.store, self.session
        try:
            with store.bounded_wait(session, self.settings.wait):
                for _ in range(_CLAIM_ROUNDS):
                    now = _now(self.clock)
                    values = self._claim_values(fingerprint, now)
                    if store.try_insert(
                        session, {"scope": scope, "key": key, "fencing_token": 1, **values}
                    ):
                        return Claimed(token=1, reclaimed=False)
                    record = store.load(session, scope, key)
                    if record is None:
                        continue  # deleted since our insert; insert again
                    if record.is_expired(now):
                        if store.take_over(session, record, values, now, expired=True):
                            return Claimed(token=record.fencing_token + 1, reclaimed=False)
                        continue
                    answer = self._answer_existing(record, fingerprint, now)
                    if answer is not None:
                        return answer
                    if store.take_over(session, record, values, now, expired=False):
                        logger.info("reclaimed %r in scope %r after its lease ended", key, scope)
                        return Claimed(token=record.fencing_token + 1, reclaimed=True)
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

    def _signal_conflict(self, scope: str, key: str, record: Record | None) -> None:
        app = current_app._get_current_object()  # type: ignore[attr-defined]
        signals.request_conflict.send(app, scope=scope, key=key, record=record)

    def _answer_existing(
        self, record: Record, fingerprint: str, now: dt.datetime
    ) -> Response | None:
        """Replay, 422 or 409 for an unexpired record; ``None`` means "reclaim it"."""
        app = current_app._get_current_object()  # type: ignore[attr-defined]
        if record.request_hash != fingerprint:
            signals.payload_mismatch.send(app, scope=record.scope, key=record.key, record=record)
            raise KeyReusedError(
                "This idempotency key was already used with a different request payload. "
                "Use a new key for a new operation."
            )
        if record.status == COMPLETED:
            logger.debug("replaying %r in scope %r", record.key, record.scope)
            signals.response_replayed.send(app, scope=record.scope, key=record.key, record=record)
            return replay(record)
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
        scope: str,
        key: str,
        token: int,
        app: t.Any,
    ) -> Response:
        session = self.session
        try:
            response = current_app.make_response(view(**kwargs))
        except BaseException:
            self._release(scope, key, token)
            raise
        if not is_storable(response.status_code):
            self._release(scope, key, token)
            return response
        try:
            captured = capture(
                response, self.settings.replayed_header_names(), self.settings.max_body
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
                now=_now(self.clock),
            )
            if not completed:
                session.rollback()
                logger.warning("lost the lease on %r in scope %r; rolled back", key, scope)
                raise LeaseLostError(
                    "This request took longer than its lease and another request took "
                    "the idempotency key over; this request's work was rolled back.",
                    retry_after=dt.timedelta(seconds=1),
                )
            session.commit()
        except LeaseLostError:
            raise
        except BaseException:
            self._release(scope, key, token)
            raise
        signals.record_completed.send(
            app, scope=scope, key=key, fencing_token=token, response=response
        )
        return response

    def _run_unprotected(self, view: t.Callable[..., t.Any], kwargs: dict[str, t.Any]) -> Response:
        """No key: run the view with the same transaction rules, but keep no record.

        The view's contract does not change with the header: the extension
        commits what a storable answer wrote and rolls back the rest.
        """
        try:
            response = current_app.make_response(view(**kwargs))
            if is_storable(response.status_code):
                self.session.commit()
            else:
                self.session.rollback()
        except BaseException:
            self.session.rollback()
            raise
        return response

    def _release(self, scope: str, key: str, token: int) -> None:
        """Roll back the view's work and free the key so a retry runs again.

        When the view committed on its own, the in-progress record is durable;
        it is deleted here, fenced by the token so a record another request has
        taken over is left alone.
        """
        session = self.session
        session.rollback()
        try:
            if self.store.release(session, scope, key, token):
                logger.debug("released %r in scope %r", key, scope)
            session.commit()
        except Exception:  # the original failure matters more; the lease still frees the key
            logger.exception("could not release %r in scope %r", key, scope)
            session.rollback()
