"""What ``@idem.idempotent`` builds: the route's options, each checked when the
view is decorated; the wrapper that runs the request's flow; the check, at the
app's first request, of the methods the decorated views serve; and the
problem a database failure answers.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import re
import threading
import time
import typing as t
import weakref

import sqlalchemy as sa
from flask import Flask, Response, current_app, request

from .. import _config
from .. import _telemetry as telemetry
from .._context import app_state
from .._failures import SealBroken
from .._storage import dberrors
from .._storage.schema import INBOX_TABLE_NAME, OUTBOX_TABLE_NAME
from ..errors import ProblemError, RecordUnreadableError, ServerMisconfiguredError
from ..keys import resolve_key_format, resolve_key_max_length
from . import answer
from .fingerprint import SchemaArg, exclude_paths, resolve_schema
from .flow import Flow
from .route import RouteOptions

F = t.TypeVar("F", bound=t.Callable[..., t.Any])

LeaseArg = dt.timedelta | float | int | bool | None


class Unset:
    """The default of options where ``None`` is itself a setting (``wait``)."""

    def __repr__(self) -> str:
        return "<app setting>"


UNSET = Unset()

logger = logging.getLogger("flask_idempotency")


def route_options(
    *,
    schema: SchemaArg,
    exclude: t.Sequence[str],
    redact: t.Sequence[str],
    required: bool | None,
    ttl: dt.timedelta | float | None,
    scope: t.Callable[[], str] | None,
    lease: LeaseArg,
    recover: bool,
    key_format: str | re.Pattern[str] | None,
    key_max_length: int | None,
    methods: t.Iterable[str] | None,
    stored_statuses: t.Iterable[int] | None,
    skip: t.Callable[[], bool] | None,
    replay_guard: t.Callable[[t.Any], t.Any] | None,
    replay_headers: t.Iterable[str] | t.Literal["*"] | None,
    manual: bool,
    wait: dt.timedelta | float | Unset | None,
    optimistic: bool,
    reconcile: t.Callable[[t.Any], t.Any] | None = None,
) -> RouteOptions:
    """The options of one decorated route, as ``@idem.idempotent`` documents
    them (its defaults too); a wrong one raises here, when the view is decorated, not at its
    first request."""
    loaded_schema = resolve_schema(schema)
    if isinstance(exclude, str):
        raise TypeError(f"exclude must be a list of field names, not the string {exclude!r}")
    excluded = tuple(exclude)
    exclude_paths(excluded)  # a wrong name is an error here, not at the first request
    if isinstance(redact, str):
        raise TypeError(f"redact must be a list of field names, not the string {redact!r}")
    redacted = tuple(redact)
    exclude_paths(redacted, "redact")
    overrides: dict[str, t.Any] = {}
    if required is not None:
        overrides["required"] = _config.as_bool(required, "required")
    if ttl is not None:
        overrides["ttl"] = _config.as_timedelta(ttl, "ttl")
    commit_claim = lease is not None and lease is not False
    if commit_claim and lease is not True:
        overrides["lease"] = _config.as_timedelta(t.cast(float, lease), "lease")
    if "ttl" in overrides and "lease" in overrides:
        _config.check_retention(
            overrides["ttl"], overrides["lease"], "@idem.idempotent", names=("ttl=", "lease=")
        )
    if key_format is not None:
        overrides["key_format"] = resolve_key_format(key_format, "key_format")
    if key_max_length is not None:
        overrides["key_max_length"] = resolve_key_max_length(key_max_length, "key_max_length")
    if methods is not None:
        overrides["methods"] = _config.resolve_methods(methods, "methods")
    if stored_statuses is not None:
        overrides["stored_statuses"] = _config.resolve_stored_statuses(
            stored_statuses, "stored_statuses"
        )
    if skip is not None:
        overrides["skip"] = _config.optional_callable(skip, "skip")
    if replay_guard is not None:
        overrides["replay_guard"] = _config.optional_callable(replay_guard, "replay_guard")
    if reconcile is not None:
        overrides["reconcile"] = _config.optional_callable(reconcile, "reconcile")
    if not isinstance(wait, Unset):
        overrides["wait"] = None if wait is None else _config.engine_timeout(wait, "wait")
    if replay_headers is not None:
        overrides["replay_headers"] = _config.resolve_replay_headers(
            replay_headers, "replay_headers"
        )
    if optimistic:
        refused = [
            name
            for name, value in (
                ("lease", commit_claim),
                ("recover", recover),
                ("manual", manual),
            )
            if value
        ]
        if refused:
            raise ValueError(
                f"optimistic=True cannot be combined with {', '.join(refused)}: they need "
                "a record before the view runs, and an optimistic route writes it after"
            )
    if reconcile is not None and (manual or optimistic):
        # Never asked there: a hook the route names would be dead code, unseen.
        raise ValueError(
            "reconcile= is never asked on a route with manual=True (its view decides with "
            "idem.previous)"
            if manual
            else "reconcile= is never asked on a route with optimistic=True (its view cannot "
            "commit on its own, so no answer is lost after a commit of its own)"
        )
    route = RouteOptions(
        schema=loaded_schema,
        exclude=excluded,
        scope=scope,
        commit_claim=commit_claim,
        recover=bool(recover),
        manual=bool(manual),
        optimistic=bool(optimistic),
        overrides=overrides,
        redact=redacted,
    )
    return route


def protect(view: F, route: RouteOptions) -> F:
    """``view``, wrapped: each call runs the request's flow with the route's
    settings for the current app; a database failure anywhere in it answers a
    retryable problem."""

    @functools.wraps(view)
    def wrapper(*args: t.Any, **kwargs: t.Any) -> Response:
        # ``args``: the instance, where the view is a method of a MethodView.
        app = current_app._get_current_object()  # type: ignore[attr-defined]
        state = app_state(app)
        settings = state.route_settings.get(route)
        if settings is None:  # an app this Idempotency object did not register
            settings = state.route_settings[route] = route.settings_for(state.settings)
        call = state.route_views.get(route)
        if call is None:  # the app's first request to this view
            call = state.route_views[route] = app.ensure_sync(view)
        req = request._get_current_object()  # type: ignore[attr-defined]
        rule = req.url_rule
        observed = telemetry.request(rule.rule if rule is not None else "", req.method)
        flow = Flow(
            scoped=state.db.session,
            store=state.store,
            settings=settings,
            clock=state.clock,
            route=route,
            telemetry=observed,
        )
        try:
            response = flow.run(functools.partial(call, *args) if args else call, kwargs)
            response = answer.render_stored(response)
        except ProblemError as refused:
            answer.raised(refused)
            observed.fail(refused)
            raise
        except SealBroken as broken:
            unopened = unreadable(state.db.session, broken)
            observed.fail(unopened)
            answer.raised(unopened)
            raise unopened from None
        except Exception as exc:
            # Wraps the whole flow (claim, view, completion, replay, the
            # no-key path): a database outage or a lock conflict anywhere
            # answers a retryable problem, never an HTML 500.
            problem = database_problem(
                exc, state.db.session, state.store.table.name, OUTBOX_TABLE_NAME, INBOX_TABLE_NAME
            )
            if problem is None:
                observed.fail(exc)
                raise
            observed.fail(problem)
            answer.raised(problem)
            raise problem from exc
        except BaseException as exc:
            observed.fail(exc)
            raise
        # Each request's outcome is counted here, once, whatever the path.
        observed.finish()
        if _reported_missing:  # an outage was reported: is a table back?
            _forget_tables_back(state.db.session)
        return response

    wrapper._idempotency_route = route  # type: ignore[attr-defined]
    _WRAPPED_VIEWS.add(view)
    return t.cast(F, wrapper)


def unreadable(session: t.Any, broken: SealBroken) -> RecordUnreadableError:
    """The answer for a record whose sealed data does not open (encryption at
    rest): the session rolls back (nothing of this request changes), and one
    ERROR line names the record, the column and the key id, never a body."""
    try:
        session.rollback()
    except Exception:  # the answer stands; the connection goes back to the pool
        logger.debug("rollback after an unreadable record failed", exc_info=True)
    logger.error("answered 500 record-unreadable: %s", broken)
    return RecordUnreadableError(
        "The stored record of this idempotency key cannot be opened (its encryption key "
        "is not configured, or its data was not sealed for it); nothing was changed. "
        "Retry later with the same key."
    )


# Every view function @idem.idempotent wrapped: registered as a view itself, the
# decorator sat above the route's (Flask registers what its decorator is given).
_WRAPPED_VIEWS: weakref.WeakSet[t.Callable[..., t.Any]] = weakref.WeakSet()


def unwrapped_endpoints(app: Flask) -> list[str]:
    """``endpoint (rule)`` of each view registered without the protection that
    was put on it (``@idem.idempotent`` written above ``@app.route``)."""
    found = []
    for rule in app.url_map.iter_rules():
        view = app.view_functions.get(rule.endpoint)
        try:
            unwrapped = view is not None and view in _WRAPPED_VIEWS
        except TypeError:  # not weakly referenceable: no function of ours
            unwrapped = False
        if unwrapped:
            found.append(f"{rule.endpoint} ({rule.rule})")
    return found


class RouteCheck:
    """Refuses, at the app's first request (every route is registered by then), a
    view registered unwrapped (``@idem.idempotent`` above ``@app.route``), and
    a decorated view that serves an unsafe method the app's
    ``IDEMPOTENCY_METHODS`` leaves unprotected: it would run on every retry and
    without a key, unseen. A route's own ``methods=`` is a choice for that view."""

    def __init__(self, app: Flask) -> None:
        self._app = weakref.ref(app)
        self._done = False

    def __call__(self) -> None:
        if self._done:
            return
        app = self._app()
        if app is None:
            return
        answer.cover_blueprints(app)
        unwrapped = unwrapped_endpoints(app)
        if unwrapped:
            raise RuntimeError(
                "Flask-Idempotency: these routes serve their view WITHOUT the protection "
                f"put on it: {'; '.join(unwrapped)}. @idem.idempotent is written above the "
                "route's decorator, which registered the view before it was wrapped; write "
                "@idem.idempotent below @app.route (or @bp.post, ...)."
            )
        unprotected = unprotected_methods(app)
        if unprotected:
            raise RuntimeError(
                "Flask-Idempotency: decorated views serve methods that IDEMPOTENCY_METHODS "
                f"leaves unprotected: {'; '.join(unprotected)}. Each would run on every "
                "retry and without a key. Add the methods to IDEMPOTENCY_METHODS (or leave "
                "it None: every method but GET, HEAD, OPTIONS and TRACE), or pass "
                "methods=[...] to @idem.idempotent on the view to choose for it."
            )
        self._done = True


def unprotected_methods(app: Flask) -> list[str]:
    """``endpoint (rule): METHODS`` for each decorated view serving unsafe methods
    its settings leave out, unless the route chose its methods itself."""
    state = app_state(app)
    found: list[str] = []
    for rule in app.url_map.iter_rules():
        route = getattr(app.view_functions.get(rule.endpoint), "_idempotency_route", None)
        if not isinstance(route, RouteOptions) or "methods" in route.overrides:
            continue
        settings = state.route_settings.get(route) or route.settings_for(state.settings)
        left = sorted(
            m
            for m in rule.methods or ()
            if m not in _config.SAFE_METHODS and not settings.protects(m)
        )
        if left:
            found.append(f"{rule.endpoint} ({rule.rule}): {', '.join(left)}")
    return found


def database_problem(
    exc: Exception, session: t.Any, records: str, *others: str
) -> ProblemError | None:
    """The problem to answer for a database failure, or ``None`` for any other error.

    A privilege refused on the record's table (``records``: a GRANT missing for
    the claim, the lease renewal, the completion) is this host's outage, as
    readiness says ("forbidden"); refused on a table of the app's, the app's
    own error. The record's table, or one of ``others`` (the extension's other
    tables a request writes: the outbox), missing answers 503
    ``server-misconfigured`` with ``Retry-After``, logged at ERROR with the
    command that creates it once per process, database and table (then at
    DEBUG: a host taking traffic without its tables would otherwise log a line per
    request); a table of the app's missing is the app's own error. Rolls
    ``session`` back first (a failure of that rollback is expected when the
    connection is gone, and ignored) and logs ``exc`` once.
    """
    missing = dberrors.missing_table(exc, (records, *others))
    if missing is not None:
        _roll_back(session)
        first = _first_report(session, missing)
        logger.log(
            logging.ERROR if first else logging.DEBUG,
            "%s %s answered 503: the table %s is missing from the database: run "
            "'flask idempotency create-tables' or the app's migrations (logged once "
            "per process and table; readiness reports missing_table meanwhile)",
            request.method,
            request.path,
            missing,
        )
        return ServerMisconfiguredError(
            "The server is not set up to store this request's outcome (a table is "
            "missing): its transaction was rolled back, so nothing it wrote to the "
            "database was kept (work outside the database, if the view did any before "
            "the failure, is not undone). Retry with the same Idempotency-Key once the "
            "service's operators have fixed it."
        )
    failure = dberrors.classify(exc)
    if failure is None and dberrors.privilege_refused(exc) and dberrors.names_table(exc, records):
        failure = dberrors.UNAVAILABLE
    if failure is None:
        return None
    problem = dberrors.problem_for(failure, exc)
    _roll_back(session)
    logger.warning(
        "%s %s answered %d: database %s: %s",
        request.method,
        request.path,
        problem.code,
        "read-only" if dberrors.read_only(exc) else failure.value,
        dberrors.summary(exc),
    )
    return problem


#: The missing tables already reported at ERROR, per database (the engine's URL,
#: as text without its password): a process reports each once.
_reported_missing: set[tuple[str, str]] = set()
_reported_lock = threading.Lock()


def _first_report(session: t.Any, table: str) -> bool:
    """Whether ``table`` missing is this process's first report for the session's database."""
    try:
        database = str(session.get_bind().url)  # rendered with the password hidden
    except Exception:  # no bind to name: one report per table
        database = ""
    with _reported_lock:
        if (database, table) in _reported_missing:
            return False
        _reported_missing.add((database, table))
        return True


# How often, at most, a successful request looks whether the tables reported
# missing are back (one catalog query per database while a report stands).
_RECHECK_EVERY = 10.0
_rechecked: dict[str, float] = {}


def _forget_tables_back(session: t.Any) -> None:
    """Forget the reports of this database's tables that exist again, so that a
    second outage logs its ERROR line too. At most every ``_RECHECK_EVERY``
    seconds per database, and only while a table is reported missing."""
    try:
        bind = session.get_bind()
        database = str(bind.url)
    except Exception:  # no bind to look at
        return
    with _reported_lock:
        pending = [table for db, table in _reported_missing if db == database]
        now = time.monotonic()
        if not pending or now - _rechecked.get(database, -_RECHECK_EVERY) < _RECHECK_EVERY:
            return
        _rechecked[database] = now
    try:
        with bind.connect() as conn:
            inspector = sa.inspect(conn)
            back = [table for table in pending if inspector.has_table(table)]
    except Exception:  # a report stays; the next check may tell
        logger.debug("could not look for the missing tables", exc_info=True)
        return
    with _reported_lock:
        _reported_missing.difference_update((database, table) for table in back)


def _roll_back(session: t.Any) -> None:
    try:
        session.rollback()
    except Exception:  # the connection is already broken; the original error matters
        logger.debug("rollback after a database failure failed too", exc_info=True)
