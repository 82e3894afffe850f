"""Optimistic routes (``@idem.idempotent(optimistic=True)``): the record is written
once, completed, at the end of the view's transaction.

No claim before the view: the view runs, then the completed record is inserted
in the same transaction and committed with the business rows. A duplicate that
ran at the same time (or a retry of a completed operation) finds the record at
that insert; its own writes roll back, and it replays the winner's response. A
new key costs one statement fewer than a claim made first: on PostgreSQL the
view's writes, one batched insert of the record, and the commit.

What that trades, and why only some views qualify: a retry runs the view
before it learns that the operation happened, so the view must have no effect
but its writes to the same database in the same transaction. Everything a
view could do beyond that is refused:

* committing (the guard raises): a commit without the record would let a
  duplicate run the operation again;
* ``idem.step`` and ``idem.derived_key``: they exist for work outside the
  transaction (downstream calls), which a duplicate's rollback cannot undo;
* ``lease=``, ``recover=`` and ``manual=True`` at decoration: they need a record
  before the view runs.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import typing as t

from flask import Response, current_app
from sqlalchemy.orm import Session

from .. import signals
from .._context import OPTIMISTIC_WHY as WHY
from .._context import resolve_app
from .._failures import SealBroken
from .._storage import COMPLETED, Record, new_fencing_token, open_transaction, operation_values
from ..errors import ClaimWaitExceeded, ConflictError
from .claim import wait_answer
from .responses import capture
from .session_guard import SessionWatcher

if t.TYPE_CHECKING:
    from .._context import RequestState
    from .flow import Flow

logger = logging.getLogger("flask_idempotency")

# Columns a replacement keeps: the record's identity (its token is drawn anew).
_IDENTITY = ("scope", "key", "fencing_token")
# The record insert only repeats when the record it met was deleted in between.
_ROUNDS = 3


class NoCommitInView(SessionWatcher):
    """Refuses the view's own commits: the record must commit with them."""

    def _before_commit(self, session: Session) -> None:
        raise RuntimeError(f"the view must not commit: {WHY}")


def run_optimistic(
    flow: Flow,
    view: t.Callable[..., t.Any],
    kwargs: dict[str, t.Any],
    state: RequestState,
    fingerprint: str,
) -> Response:
    """Run the view, then insert the completed record and commit both; or, when
    the key is taken, roll the view's writes back and answer for the winner."""
    _begin(flow.session)
    flow.telemetry.began(flow.now())
    watcher = NoCommitInView()
    watcher.watch(flow.session, flow.scoped)
    try:
        response = current_app.make_response(view(**kwargs))
    except Exception:
        watcher.stop()
        flow.session.rollback()
        # A retry of a completed operation (or a duplicate that won while this
        # one ran, when the view failed on its rows) gets the recorded answer,
        # or 422 for another payload: never this attempt's failure.
        existing = _answer_for_record(flow, state, fingerprint)
        if existing is not None:
            return existing
        raise
    except BaseException:
        watcher.stop()
        flow.session.rollback()
        raise
    watcher.stop()
    code = response.status_code
    if not flow.settings.storable(code):
        # Not an answer to keep: no record. A retry of an operation another
        # request completed gets that one's answer, and this run's writes roll
        # back; otherwise they commit when the answer is one the default rule
        # keeps (never a success whose work was rolled back).
        existing = _answer_for_record(flow, state, fingerprint, commit=flow.settings.commits(code))
        return existing if existing is not None else response
    with flow.telemetry.complete():
        return _record(flow, state, fingerprint, response)


def _begin(session: Session) -> None:
    """Open the database transaction before the view runs.

    Python's sqlite3 opens one only before a write: a view whose first
    statement is a savepoint would commit at its release, before the record.
    Elsewhere (and when the app's own settings begin it) there is nothing to do.
    """
    open_transaction(session.connection())


def _record(flow: Flow, state: RequestState, fingerprint: str, response: Response) -> Response:
    assert state.scope is not None
    assert state.key is not None
    scope, key, store, session = state.scope, state.key, flow.store, flow.session
    settings = flow.settings
    captured = capture(response, settings.replayed_header_names, settings.max_body)
    try:
        for _ in range(_ROUNDS):
            now = flow.now()
            token = new_fencing_token()
            values = operation_values(
                scope=scope,
                key=key,
                fencing_token=token,
                request_hash=fingerprint,
                rules_version=flow.rules_version,
                request_digest=flow.request_digest,
                status=COMPLETED,
                response_code=captured.status,
                response_headers=json.dumps(captured.headers),
                response_body=captured.body,
                body_omitted=captured.body_omitted,
                created_at=now,
                completed_at=now,
                expires_at=now + settings.ttl,
            )
            inserted, record = store.claim(session, values, settings.wait)
            if not inserted and record is not None and record.is_expired(now):
                # An earlier operation's record, past its retention: replace it,
                # in this transaction, with the view's writes.
                columns = {k: v for k, v in values.items() if k not in _IDENTITY}
                token = new_fencing_token(record.fencing_token)
                inserted = store.take_over(session, record, columns, now, expired=True, token=token)
                if not inserted:
                    session.rollback()
                    _signal_conflict(scope, key, record)
                    raise _changed()
            if inserted:
                session.commit()
                flow.telemetry.stored(len(captured.body or b""))
                signals.record_completed.send(
                    resolve_app(), scope=scope, key=key, fencing_token=token, response=response
                )
                return response
            if record is None:
                continue  # deleted since it blocked our insert: insert again
            session.rollback()
            logger.debug("%r in scope %r was completed by another request", key, scope)
            record = store.readable(session, record)  # an expired one was replaced unopened
            answer = flow.answer_existing(record, fingerprint, now)
            if isinstance(answer, Response):
                return answer
            # In progress, its lease over: a leased request of another route
            # sharing this scope died. Its retry, not this one, takes it over.
            _signal_conflict(scope, key, record)
            raise ConflictError(
                "Another request with this idempotency key did not finish; retry later.",
                retry_after=dt.timedelta(seconds=1),
            )
    except ClaimWaitExceeded as exc:
        session.rollback()
        raise wait_answer(flow, scope, key, exc) from None
    session.rollback()
    _signal_conflict(scope, key, None)
    raise _changed()


def _signal_conflict(scope: str, key: str, record: Record | None) -> None:
    signals.request_conflict.send(resolve_app(), scope=scope, key=key, record=record)


def _changed() -> ConflictError:
    return ConflictError(
        "The record for this idempotency key kept changing; retry.",
        retry_after=dt.timedelta(seconds=1),
    )


def _answer_for_record(
    flow: Flow, state: RequestState, fingerprint: str, *, commit: bool = False
) -> Response | None:
    """After the view failed or gave an answer that is not kept: the answer the
    record of this key commands, if another request committed one (its replay,
    422 for another payload, 409 while it runs); ``None`` when there is none,
    or it cannot be read (the view's own answer stands).

    The session's writes roll back, unless ``commit`` and no record commands
    an answer: then they commit (an answer not stored, whose work stays).
    """
    assert state.scope is not None
    assert state.key is not None
    session = flow.session
    try:
        record = flow.store.load(session, state.scope, state.key, stored_request=False)
    except SealBroken:  # the record's answer, unreadable: 500 record-unreadable
        raise
    except Exception:  # the view's own failure is the one to report
        session.rollback()
        logger.debug("could not read the record of %r", state.key, exc_info=True)
        return None
    now = flow.now()
    if record is None or record.is_expired(now):
        if commit:
            session.commit()
        else:
            session.rollback()
        return None
    session.rollback()
    answer = flow.answer_existing(record, fingerprint, now)
    return answer if isinstance(answer, Response) else None
