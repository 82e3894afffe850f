"""One call of an idempotent function: claim (scope, key) in the app's session,
run the function, store its return value on the record and commit it with the
function's writes; or return the value a finished call stored.

The claim, the claim guard, the completion and the release are the routes'
(:mod:`.._request.claim`, :class:`.._request.flow.Flow`, :mod:`.._request.finish`):
the function is run as a view would be, its return value stored as a 200
answer whose body is the value's JSON. Only what a request has and a call has
not (the key header, the body, the client's answer) stays on the HTTP side.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import typing as t

from flask import Response, has_app_context

from .. import _telemetry as telemetry
from .._context import (
    RequestState,
    app_state,
    current_request_state,
    end_request,
    set_request_state,
)
from .._failures import SealBroken
from .._messaging.inbox import holds_inbox_row
from .._request.claim import claim_key
from .._request.decorator import unreadable
from .._request.flow import Flow
from .._storage import Record
from ..errors import (
    ConflictError,
    FailedAfterCommitError,
    KeyReusedError,
    OperationInProgressError,
)
from .options import FunctionOptions

R = t.TypeVar("R")

#: The status of a stored return value (any other stored answer is the
#: ``failed-after-commit`` one).
_VALUE = 200


@dataclasses.dataclass(frozen=True)
class FunctionOutcome(t.Generic[R]):
    """What a call of an idempotent function gave (``fn.outcome(...)``).

    ``value``: the function's return value on the call that ran it (the very
    object); on a repeat, the stored one read back (JSON data, or what the
    ``schema`` loads). ``replayed``: ``True`` when the function did not run
    because a call with this key had finished. ``scope`` and ``key``: the
    record's.
    """

    value: R
    replayed: bool
    scope: str
    key: str


def call(
    options: FunctionOptions,
    fn: t.Callable[..., R],
    args: tuple[t.Any, ...],
    kwargs: dict[str, t.Any],
) -> FunctionOutcome[R]:
    """Run ``fn(*args, **kwargs)`` at most once per (scope, key) (see ``idem.function``)."""
    name = options.name
    if not has_app_context():
        raise RuntimeError(
            f"@idem.function {name} was called outside an app context: its record lives in "
            "the app's database; call it inside `with app.app_context():` (a CLI command "
            "and a request have one)"
        )
    if current_request_state() is not None:
        # The record is claimed in db.session, whose transaction is the view's (or
        # the outer function's): completing it would commit that work halfway.
        raise RuntimeError(
            f"@idem.function {name} was called inside an idempotent view or another "
            "idempotent function, which share its session's transaction; refused. Call "
            "it from a job, a command or a consumer, or make it a plain function there "
            "(the caller's record already makes it run once)."
        )
    state = app_state()
    settings = state.route_settings.get(options.route)
    if settings is None:
        settings = state.route_settings[options.route] = options.route.settings_for(state.settings)
    arguments = options.bind(args, kwargs)
    scope = options.scope_of(args, kwargs)
    key = options.key_of(args, kwargs, arguments)
    fingerprint = options.fingerprint(arguments, scope, key, settings.fingerprint_key)
    session = state.db.session
    if session.new or session.dirty or session.deleted:
        raise RuntimeError(
            f"@idem.function {name}: the session holds changes not flushed yet; the call "
            "commits (or rolls back) the session's transaction with its record. Commit "
            "them first, or make them inside the function."
        )
    if holds_inbox_row(session()):
        # An inbox's delivery (inbox.process, @inbox.consumer): the call would
        # commit its row before the consumer's work is done, or roll it back.
        raise RuntimeError(
            f"@idem.function {name} was called inside an inbox delivery (inbox.process, "
            "@inbox.consumer, inbox.mark_processed) whose row is not committed yet: the call "
            "commits or rolls back the session's transaction, which would mark the event "
            "processed before the consumer's work is done. Call it outside the delivery's "
            "transaction: its own record already makes it run once per key."
        )
    # Not counted as a request (its metrics are HTTP routes'): see docs/functions.md.
    observed = telemetry.request(name, "CALL")
    observed.ignore()
    flow = Flow(
        scoped=session,
        store=state.store,
        settings=settings,
        clock=state.clock,
        route=options.route,
        telemetry=observed,
    )
    held = RequestState(payload=None, key=key, scope=scope, flow=flow)
    set_request_state(held)  # what idem.step, idem.emit and idem.derived_key read
    try:
        try:
            claimed = claim_key(flow, scope, key, fingerprint, allow_new=True)
        except SealBroken as broken:  # its sealed columns do not open: nothing changes
            raise unreadable(session, broken) from None
        except BaseException as exc:
            session.rollback()
            worded = _function_error(options, scope, key, exc)
            if worded is exc:
                raise
            raise worded from None
        if isinstance(claimed, Record):
            session.rollback()  # ends the claim's read (MySQL's locking read)
            return FunctionOutcome(_stored(options, claimed), True, scope, key)
        assert not isinstance(claimed, Response)  # a manual route's: never an answer
        try:
            app = flow.hold(held, scope, key, claimed)  # commits a leased claim
        except BaseException:
            session.rollback()
            raise
        ran: list[R] = []

        def body() -> Response:
            value = fn(*args, **kwargs)
            stored = options.dump(value)
            if len(stored) > settings.max_body:
                raise TypeError(
                    f"@idem.function {name}: its return value is {len(stored)} bytes as "
                    f"stored, more than IDEMPOTENCY_MAX_BODY ({settings.max_body}), so it "
                    "was not stored (its writes roll back and the key is released, unless it "
                    "committed work of its own: then that failure is stored)"
                )
            ran.append(value)
            return Response(stored, status=_VALUE, mimetype="application/json")

        flow.run_claimed(body, {}, held, app, recovery=False)
        return FunctionOutcome(ran[0], False, scope, key)
    finally:
        end_request()


def _function_error(
    options: FunctionOptions, scope: str, key: str, exc: BaseException
) -> BaseException:
    """The claim's refusal, worded for a function's caller."""
    where = f"@idem.function {options.name} ({scope!r}, key {key!r})"
    if isinstance(exc, KeyReusedError):
        return KeyReusedError(
            f"{where}: this key was already used with other arguments (or by another "
            "function in this scope). Use a new key for a new operation."
        )
    if type(exc) is ConflictError:  # only "in progress", not a lost lease
        return OperationInProgressError(
            f"{where}: a call with this key is still running; retry after it finishes.",
            retry_after=dt.timedelta(seconds=exc.retry_after),
        )
    return exc


def _stored(options: FunctionOptions, record: Record) -> t.Any:
    """The return value a finished call stored; its recorded failure raised."""
    if record.response_code == _VALUE and record.response_body is not None:
        return options.load(record.response_body)
    if record.response_code == _VALUE:  # body not kept: a call checks its size first
        raise RuntimeError(
            f"@idem.function {options.name} ({record.scope!r}, key {record.key!r}) ran, "
            "but its stored value was not kept; it does not run again with this key"
        )
    raise FailedAfterCommitError(
        f"@idem.function {options.name} ({record.scope!r}, key {record.key!r}) failed "
        "after it had committed work of its own, so it does not run again with this key. "
        "Check what it did before you start a new operation with a new key."
    )
