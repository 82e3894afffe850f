"""The claim: take (scope, key) for this request, or answer for the record
that holds it (replay it, 422 for another payload, 409 while it runs), or
take over a record whose lease ended (the same operation, resuming) or that
expired (a new one).

The claim is an insert in the view's session, fenced by a new fencing token;
a duplicate waits on it at most ``IDEMPOTENCY_WAIT``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import logging
import typing as t
import urllib.parse

from flask import Response, request
from marshmallow import Schema

from .. import signals
from .._context import app_state, resolve_app
from .._storage import (
    COMPLETED,
    ERASED,
    IN_PROGRESS,
    Record,
    dberrors,
    new_fencing_token,
    operation_values,
)
from ..errors import (
    ClaimWaitExceeded,
    ConflictError,
    KeyReusedError,
    PayloadTooLargeError,
    ProblemError,
    RecordGone,
    TooLargeToStore,
)
from .claim_guard import Reassert
from .fingerprint import NormalizedRequest, exclude_paths
from .formkeys import form_ignored_fields
from .reconcile import FAILED_AFTER_COMMIT, LEASE_ENDED, at_retry
from .redact import kept_request
from .replay_guard import check_replay
from .responses import erased_error, replay_answer, stored_failure
from .route import RouteOptions
from .rules import judge, rules_changed_error, rules_version

if t.TYPE_CHECKING:
    from .flow import Flow

logger = logging.getLogger("flask_idempotency")

# A claim attempt only repeats when another request changed the row between
# our insert and our read (deleted, replaced, reclaimed); a few rounds suffice.
_CLAIM_ROUNDS = 5
# A claim that waited longer than this on another request re-stamps its times.
_RESTAMP_AFTER = dt.timedelta(seconds=1)


@dataclasses.dataclass(frozen=True)
class Claimed:
    """A claim won: the key is this request's, under ``token``."""

    token: int
    recovery_points: dict[str, t.Any]
    #: Repeats the claim in a later transaction, if the view rolls this one back.
    reassert: Reassert
    #: The operation's creation time (kept by a reclaim, new for a new operation).
    created_at: dt.datetime
    #: The time the claim's lease (and, for a new operation, its retention) counts from.
    stamped_at: dt.datetime
    new_operation: bool


def request_target() -> str:
    """The path and query as the client sent them, still percent-encoded, so the
    recovery job's re-run reaches the same route with the same arguments
    (``%2F``, ``%3F`` and ``%23`` decoded would change both)."""
    path = urllib.parse.quote(request.path, safe="/:@!$&'()*+,;=-._~")
    query = request.query_string.decode("latin-1")
    return f"{path}?{query}" if query else path


def claim_values(flow: Flow, fingerprint: str, now: dt.datetime) -> dict[str, t.Any]:
    """The claimed record's columns (in progress, leased from ``now``), with the
    request itself on a route the recovery job may finish."""
    settings = flow.settings
    values = operation_values(
        request_hash=fingerprint,
        rules_version=flow.rules_version,
        request_digest=flow.request_digest,
        status=IN_PROGRESS,
        locked_until=now + settings.lease,
        created_at=now,
        expires_at=now + settings.ttl,
    )
    if flow.route.recover:
        # The body as sent, or, if a hook parsed the form first, a faithful
        # re-encoding of it (with the content type that goes with it); without
        # the fields the route redacts.
        body, content_type = kept_request(flow.route.schema, flow.route.redact)
        values.update(
            request_method=request.method,
            request_path=request_target(),
            request_content_type=content_type,
            request_body=body,
        )
    elif flow.route.function:
        # No request: the function's name, which tells its record apart.
        values.update(request_path=flow.route.view_name)
    return values


def claim_key(
    flow: Flow,
    scope: str,
    key: str,
    fingerprint: str,
    *,
    allow_new: bool,
    replay: bool = False,
) -> Claimed | Response | Record:
    """Claim (scope, key), or answer for the record that already holds it
    (a completed record itself, on a route in manual mode).

    ``allow_new=False`` only resumes an abandoned record: it never starts an
    operation. Without ``replay`` (a recovery run) any other record raises
    :class:`RecordGone`; with it (an expired form key) a record's answer is
    given as to any retry. No record, or an expired one, raises
    :class:`RecordGone` either way.
    """
    store, session, wait = flow.store, flow.session, flow.settings.wait
    try:
        for _ in range(_CLAIM_ROUNDS):
            now = flow.now()
            flow.telemetry.began(now)
            values = claim_values(flow, fingerprint, now)
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
                # An expired record is replaced unopened (a key dropped since it
                # was sealed stops no new operation); any other must open.
                record = store.readable(session, record)
                if record.status == ERASED and not allow_new and not replay:
                    raise RecordGone(f"{scope!r} {key!r} (erased)")  # a recovery run
                answer = answer_existing(flow, record, fingerprint, now)
                if answer is not None:
                    if not allow_new and not replay:
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
    except ClaimWaitExceeded as exc:
        flow.telemetry.wait_exceeded()
        session.rollback()
        raise wait_answer(flow, scope, key, exc) from None
    signal_conflict(scope, key, None)
    raise ConflictError(
        "The record for this idempotency key kept changing; retry.",
        retry_after=dt.timedelta(seconds=1),
    )


def wait_answer(flow: Flow, scope: str, key: str, exc: ClaimWaitExceeded) -> ProblemError:
    """The answer when the database gave up on a claim's wait (its transaction
    rolled back): 409 ``request-in-progress`` only for a running duplicate;
    a wait on anything else (an unrelated writer's lock, SQLite's one lock for
    the whole database) is the database's 409 ``transaction-conflict``."""
    if flow.store.waited_on_duplicate(flow.session, scope, key, exc, flow.now()):
        signal_conflict(scope, key, None)
        return ConflictError(
            "Another request with this idempotency key is still running; retry after it finishes.",
            retry_after=dt.timedelta(seconds=1),
        )
    logger.info("the claim of %r in scope %r waited on a busy database: %s", key, scope, exc)
    return dberrors.problem_for(dberrors.CONFLICT)


def restamp_if_waited(flow: Flow, scope: str, key: str, claimed: Claimed) -> Claimed:
    """The claim's times were taken before it waited on another request's
    transaction (the unique index, a row lock). When that wait was long, count the
    lease (and a new operation's retention) from now, or a duplicate that waited
    past a lease would hold a lease already over."""
    now = flow.now()
    if now - claimed.stamped_at <= _RESTAMP_AFTER:
        return claimed
    settings = flow.settings
    created_at = now if claimed.new_operation else claimed.created_at
    flow.store.restamp(
        flow.session,
        scope,
        key,
        claimed.token,
        locked_until=now + settings.lease,
        created_at=now if claimed.new_operation else None,
        expires_at=now + settings.ttl if claimed.new_operation else None,
    )
    return dataclasses.replace(claimed, created_at=created_at, stamped_at=now)


def signal_conflict(scope: str, key: str, record: Record | None) -> None:
    """Send ``request_conflict``: a duplicate is answered 409."""
    app = resolve_app()
    signals.request_conflict.send(app, scope=scope, key=key, record=record)


def answer_existing(
    flow: Flow, record: Record, fingerprint: str, now: dt.datetime
) -> Response | Record | None:
    """Replay (or, in manual mode, the record for the view), 422 or 409 for an
    unexpired record; ``None`` means "reclaim it". A record whose view
    committed is never reclaimed: it is settled (:func:`settle_view_committed`).
    The app's reconcile hook (:mod:`.reconcile`) is asked first for the answer
    of a record holding the extension's ``failed-after-commit`` and, on a
    leased route, of one whose holder went away; what it rebuilds is replayed.
    A tombstone is answered 410 ``key-erased`` whatever the payload (its
    fingerprint is gone): never replayed, never run."""
    if record.status == ERASED:
        logger.debug("%r in scope %r was erased", record.key, record.scope)
        raise erased_error()
    app = resolve_app()
    judged = judge(record, fingerprint, flow.rules_version, flow.request_digest, flow.bound)
    if not judged.same:
        signals.payload_mismatch.send(app, scope=record.scope, key=record.key, record=record)
        if judged.rules_changed:
            raise rules_changed_error()
        other = route_of_same_request(flow, record)
        if other is not None:
            raise KeyReusedError(
                f"This idempotency key was already used on another route ({other}) with the "
                "same request payload: only the route differs. The key's scope is shared by "
                "both routes; use a new key for a new operation (or a scope that includes the "
                "endpoint, as the default scope does)."
            )
        raise KeyReusedError(
            "This idempotency key was already used with a different request payload. "
            "Use a new key for a new operation."
        )
    if record.status == COMPLETED:
        if not flow.route.manual:  # in manual mode the view decides
            check_replay(flow, record)
        reconciled = None
        if stored_failure(record):  # the app's hook may rebuild its answer
            rebuilt = at_retry(flow, record, FAILED_AFTER_COMMIT, now)
            if rebuilt is not None:
                reconciled = rebuilt.record is not None
                record = rebuilt.record or record
        logger.debug("replaying %r in scope %r", record.key, record.scope)
        flow.telemetry.found_completed(record.completed_at)
        signals.response_replayed.send(app, scope=record.scope, key=record.key, record=record)
        if flow.route.manual:
            return record
        with flow.telemetry.replay():
            return replay_answer(record, reconciled=reconciled)
    if record.lease_live(now):
        assert record.locked_until is not None
        signal_conflict(record.scope, record.key, record)
        raise ConflictError(
            "A request with this idempotency key is in progress; retry later.",
            retry_after=record.locked_until - now,
        )
    if record.view_committed:
        return settle_view_committed(flow, record, now)
    if flow.route.commit_claim:
        # A leased route's holder went away, its view perhaps committed: the
        # app's hook may tell the answer from what is committed, else resume.
        rebuilt = at_retry(flow, record, LEASE_ENDED, now)
        if rebuilt is not None and rebuilt.record is not None:
            return answer_existing(flow, rebuilt.record, fingerprint, now)
    return None


# At most this many other routes are hashed for a 422's "only the route
# differs" hint, and at most _ROUTE_HINT_RULES of them with excluded fields of
# their own (each such set normalizes the body again): a mismatch is any
# client's to send, and an app with many look-alike routes must not make it
# cost more than a few requests. Past a cap the 422 says the usual thing.
_ROUTE_HINT_CANDIDATES = 20
_ROUTE_HINT_RULES = 2


def route_of_same_request(flow: Flow, record: Record) -> str | None:
    """``METHOD /path`` of another route of the app that this very request
    (method, query, body) would have hashed to ``record``'s fingerprint on, or
    ``None``. A route whose fingerprint rules are not the record's (a deploy
    changed them since) is no candidate: its hash would tell nothing.

    A record keeps the fingerprint only (the route is in it, not beside it: a
    column would cost every claim), so on a 422 the request's normalized bytes
    (computed once, for the claim) are hashed again with the path of each
    other route that could have made the record: a view decorated by this
    extension, serving this method, without URL variables (``/orders/<id>``:
    its path cannot be guessed), with the same schema as this route. A route
    that excludes other fields normalizes the request as it would have (a
    route that counts a field this one excludes would not have matched this
    payload). At most ``_ROUTE_HINT_CANDIDATES`` routes are tried.
    """
    normalized = flow.normalized
    if normalized is None:
        return None
    stored_hash = record.request_hash
    app = resolve_app()
    state = app_state(app)
    current = request.url_rule.rule if request.url_rule is not None else None
    own_rules = _rules_key(flow.route.exclude, form_ignored_fields(flow.settings))
    by_rules: dict[t.Hashable, NormalizedRequest] = {own_rules: normalized}
    tried = 0
    for rule in app.url_map.iter_rules():
        if rule.arguments or rule.rule == current or request.method not in (rule.methods or ()):
            continue
        route = getattr(app.view_functions.get(rule.endpoint), "_idempotency_route", None)
        if not isinstance(route, RouteOptions) or not same_schema(flow.route.schema, route.schema):
            continue
        if tried == _ROUTE_HINT_CANDIDATES:
            return None
        tried += 1
        try:
            settings = state.route_settings.get(route) or route.settings_for(state.settings)
            if not settings.protects(request.method):
                continue
            if record.rules_version is not None and record.rules_version != rules_version(
                route, settings.fingerprint_key, settings.form_field
            ):
                continue
            ignored = form_ignored_fields(settings)
            rules = _rules_key(route.exclude, ignored)
            theirs = by_rules.get(rules)
            if theirs is None:
                if len(by_rules) > _ROUTE_HINT_RULES:
                    continue
                theirs = by_rules[rules] = normalized.renormalized(route.exclude, ignored)
        except Exception:  # a hint never turns the 422 into another answer
            logger.debug("could not hash the request for %s", rule.rule, exc_info=True)
            continue
        if theirs.fingerprint(rule.rule) == stored_hash:
            return f"{request.method} {rule.rule}"
    return None


def _rules_key(exclude: t.Iterable[str], form_ignored: t.Iterable[str]) -> t.Hashable:
    return frozenset(exclude_paths(exclude)), frozenset(form_ignored)


def same_schema(one: Schema | None, other: Schema | None) -> bool:
    """Whether two routes load a body alike: one schema object, or instances of
    one class with the same load options (another route's schema is never run
    on this request: its hooks are that route's business)."""
    if one is other:
        return True
    if one is None or other is None or type(one) is not type(other):
        return False
    options = ("only", "exclude", "many", "partial", "unknown", "load_only", "dump_only")
    return all(getattr(one, name, None) == getattr(other, name, None) for name in options)


def settle_view_committed(flow: Flow, record: Record, now: dt.datetime) -> Response | Record | None:
    """The record's view committed work of its own and its request never
    finished (its worker died, or the database took the completion and the
    failure's recording with it), and its lease is over: complete it with the
    answer its view's commit stored (500 ``failed-after-commit``) and replay
    that, since the operation happened and may not run again, unless the app's
    reconcile hook rebuilds the real answer first. ``None``: the record
    changed meanwhile (claim again)."""
    rebuilt = at_retry(flow, record, FAILED_AFTER_COMMIT, now)
    if rebuilt is not None and rebuilt.record is not None:
        return answer_existing(flow, rebuilt.record, rebuilt.record.request_hash, now)
    session, token = flow.session, record.fencing_token
    if not flow.store.settle_committed(
        session, record.scope, record.key, token, now, retention=record.retention
    ):
        session.rollback()
        return None
    session.commit()
    logger.warning(
        "%r in scope %r: its view had committed and its request never finished; "
        "completed with the failure its commit stored",
        record.key,
        record.scope,
    )
    settled = dataclasses.replace(
        record,
        status=COMPLETED,
        locked_until=None,
        completed_at=now,
        expires_at=max(record.expires_at, now + record.retention),
    )
    if not flow.route.manual:
        check_replay(flow, settled)  # settled either way: the operation happened
    flow.telemetry.found_completed(None)
    app = resolve_app()
    signals.response_replayed.send(app, scope=record.scope, key=record.key, record=settled)
    if flow.route.manual:
        return settled
    with flow.telemetry.replay():
        return replay_answer(settled, reconciled=None if rebuilt is None else False)
