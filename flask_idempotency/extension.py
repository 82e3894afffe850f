"""The ``Idempotency`` extension object: registration, config, the decorator."""

from __future__ import annotations

import datetime as dt
import functools
import logging
import re
import typing as t
import weakref

from flask import Flask, Response, current_app, jsonify, request

from . import config
from ._context import (
    OPTIMISTIC_WHY,
    AppState,
    RequestState,
    app_state,
    check_unregistered,
    current_derived_key,
    current_request_state,
    downstream_state,
    end_request,
    find_app_state,
    register,
    resolve_app,
)
from ._maintenance import health
from ._maintenance.scheduler import InProcessScheduler
from ._messaging import outbox
from ._request import session_guard
from ._request.fingerprint import SchemaArg, exclude_paths, resolve_schema
from ._request.flow import Clock, Flow
from ._request.responses import replay
from ._request.route import RouteOptions
from ._request.steps import run_step
from ._storage import dberrors
from ._storage.schema import Record, inbox_table, job_lock_table, outbox_table, record_table
from ._storage.store import Store
from .cli import idempotency_cli
from .errors import ProblemError
from .keys import quote_key, resolve_key_format, resolve_key_max_length

if t.TYPE_CHECKING:
    from flask_sqlalchemy import SQLAlchemy

F = t.TypeVar("F", bound=t.Callable[..., t.Any])
T = t.TypeVar("T")

LeaseArg = dt.timedelta | float | int | bool | None


class _Unset:
    """The default of options where ``None`` is itself a setting (``wait``)."""

    def __repr__(self) -> str:
        return "<app setting>"


_UNSET = _Unset()

logger = logging.getLogger("flask_idempotency")

#: What a client is told to wait before retrying after a database failure.


def utc_now() -> dt.datetime:
    """The default clock: the app server's time, in UTC."""
    return dt.datetime.now(dt.timezone.utc)


def in_utc(clock: Clock) -> Clock:
    """``clock``, read in UTC: every engine compares the stored UTC times with it
    (SQLite and MySQL keep no zone), requests and jobs alike."""

    def now() -> dt.datetime:
        value = clock()
        if value.tzinfo is None:
            raise ValueError("the idempotency clock must return timezone-aware datetimes")
        return value.astimezone(dt.timezone.utc)

    return now


class Idempotency:
    """Makes decorated POST routes idempotent per (scope, ``Idempotency-Key``).

    Guarantee: the view runs at most once per (scope, key) within the retention
    window (``IDEMPOTENCY_TTL``); retries get the stored response replayed. The
    record is claimed in the app's SQLAlchemy session and commits in the same
    transaction as the view's writes.

    ``options`` are the settings of :mod:`flask_idempotency.config`, lower-case
    and without the prefix (``ttl=``, ``header=``...); ``app.config`` wins over
    them. ``clock`` returns the current time (timezone-aware); tests may pass a
    controllable one.
    """

    def __init__(
        self,
        app: Flask | None = None,
        db: SQLAlchemy | None = None,
        *,
        clock: Clock | None = None,
        **options: t.Any,
    ) -> None:
        self._clock = clock
        self._options = self._check_options(options)
        # Routes decorated so far and the apps registered so far: each route's
        # settings are checked against each app's as soon as both are known.
        self._routes: list[RouteOptions] = []
        self._states: weakref.WeakSet[AppState] = weakref.WeakSet()
        if app is not None:
            self.init_app(app, db)

    @staticmethod
    def _check_options(options: dict[str, t.Any]) -> dict[str, t.Any]:
        known = {name.lower() for name in config.DEFAULTS}
        unknown = set(options) - known
        if unknown:
            raise TypeError(f"unknown Idempotency option(s): {', '.join(sorted(unknown))}")
        return options

    def init_app(
        self,
        app: Flask,
        db: SQLAlchemy | None = None,
        *,
        clock: Clock | None = None,
        **options: t.Any,
    ) -> None:
        """Register on ``app``, with the Flask-SQLAlchemy ``db`` that holds the records.

        Adds the ``idempotency_keys`` table to ``db.metadata`` (so
        ``db.create_all()`` and Alembic autogenerate see it), the
        ``idempotency_job_locks`` table, and the ``flask idempotency`` command
        group. With ``IDEMPOTENCY_SCHEDULER`` on, each serving process starts the
        maintenance jobs on its first request.
        """
        check_unregistered(app)
        if db is None:
            db = app.extensions.get("sqlalchemy")
            if db is None:
                raise RuntimeError(
                    "Idempotency needs Flask-SQLAlchemy: call db.init_app(app) first, "
                    "or pass db to Idempotency(app, db) / init_app(app, db)."
                )
        merged = {**self._options, **self._check_options(options)}
        config.check_known(app.config)
        for name, default in config.DEFAULTS.items():
            app.config.setdefault(config.PREFIX + name, merged.get(name.lower(), default))
        settings = config.Settings.from_mapping(
            {name: app.config[config.PREFIX + name] for name in config.DEFAULTS}
        )
        table = record_table(db.metadata)
        inbox_table(db.metadata)
        state = AppState(
            db=db,
            store=Store(table, claim_idle=settings.claim_idle_timeout),
            settings=settings,
            clock=in_utc(clock or self._clock or utc_now),
            job_lock_table=job_lock_table(db.metadata),
            in_process=InProcessScheduler(),
            custom_clock=(clock or self._clock) is not None,
        )
        for route in self._routes:
            state.route_settings[route] = route.settings_for(settings)
        session_guard.listen(db.session.session_factory)
        outbox_table(db.metadata)
        outbox.listen(db.session.session_factory)
        register(app, state)
        self._states.add(state)
        app.before_request(_RouteCheck(app))
        app.teardown_request(end_request)
        app.cli.add_command(idempotency_cli)
        if settings.scheduler:
            # Started by the first request a process serves: never at import, not
            # in the reloader's watcher, once per worker after a fork.
            app.before_request(lambda: state.in_process.ensure_started(app))

    @t.overload
    def idempotent(self, view: F, /) -> F: ...

    @t.overload
    def idempotent(
        self,
        view: None = None,
        /,
        *,
        schema: SchemaArg = None,
        exclude: t.Sequence[str] = (),
        required: bool | None = None,
        ttl: dt.timedelta | float | None = None,
        scope: t.Callable[[], str] | None = None,
        lease: LeaseArg = None,
        recover: bool = False,
        key_format: str | re.Pattern[str] | None = None,
        key_max_length: int | None = None,
        methods: t.Iterable[str] | None = None,
        stored_statuses: t.Iterable[int] | None = None,
        skip: t.Callable[[], bool] | None = None,
        replay_headers: t.Iterable[str] | t.Literal["*"] | None = None,
        manual: bool = False,
        wait: dt.timedelta | float | _Unset | None = _UNSET,
        optimistic: bool = False,
    ) -> t.Callable[[F], F]: ...

    def idempotent(
        self,
        view: F | None = None,
        /,
        *,
        schema: SchemaArg = None,
        exclude: t.Sequence[str] = (),
        required: bool | None = None,
        ttl: dt.timedelta | float | None = None,
        scope: t.Callable[[], str] | None = None,
        lease: LeaseArg = None,
        recover: bool = False,
        key_format: str | re.Pattern[str] | None = None,
        key_max_length: int | None = None,
        methods: t.Iterable[str] | None = None,
        stored_statuses: t.Iterable[int] | None = None,
        skip: t.Callable[[], bool] | None = None,
        replay_headers: t.Iterable[str] | t.Literal["*"] | None = None,
        manual: bool = False,
        wait: dt.timedelta | float | _Unset | None = _UNSET,
        optimistic: bool = False,
    ) -> F | t.Callable[[F], F]:
        """Protect a view: at most one execution per (scope, key), retries replayed.

        Used as ``@idem.idempotent(...)`` with options, or bare as
        ``@idem.idempotent`` for the app's settings.

        :param schema: marshmallow schema (instance or class) the JSON body must
            pass; its loaded data is what the fingerprint and ``idem.payload`` see.
        :param exclude: field names left out of the fingerprint; dotted for nested
            fields, ``\\.`` for a dot inside a name (``r"client\\.sent_at"``).
        :param required: a request without a key answers 400 (default
            ``IDEMPOTENCY_REQUIRED``).
        :param ttl: retention of this route's records (default ``IDEMPOTENCY_TTL``).
        :param scope: callable returning the scope string (default
            ``IDEMPOTENCY_SCOPE``, else the endpoint plus the caller's identity:
            see :func:`~flask_idempotency.scope.default_scope`).
        :param lease: commit the in-progress record before the view runs, leased
            for this long (``True``: ``IDEMPOTENCY_LEASE``). Use it for views whose
            work cannot fit one transaction. Without it the record is claimed in
            the view's transaction.
        :param recover: keep the request (method, path, body) on the record so
            the lease recovery job can finish an abandoned request without the
            client. The view must then work without the client's credentials.
        :param key_format: ``"uuid"``, ``"uuid4"``, ``"uuid7"`` or a regular
            expression the whole key must match, else 400 (default
            ``IDEMPOTENCY_KEY_FORMAT``; see :mod:`flask_idempotency.config`).
        :param key_max_length: longest key accepted, at most 255 (default
            ``IDEMPOTENCY_KEY_MAX_LENGTH``).
        :param methods: the methods protected (default ``IDEMPOTENCY_METHODS``:
            every method the view serves but GET, HEAD, OPTIONS and TRACE);
            other methods run as a request without a key. Given here, it is a
            choice for this view; a view serving an unsafe method the app's
            setting leaves out is refused at the first request instead.
        :param stored_statuses: the statuses stored and replayed (default
            ``IDEMPOTENCY_STORED_STATUSES``: 2xx, 3xx, deterministic 4xx). An
            answer not stored leaves no record (a retry runs the view again);
            its writes commit with a 2xx or 3xx, and roll back otherwise.
        :param skip: callable; ``True`` runs this request unprotected (default
            ``IDEMPOTENCY_SKIP``).
        :param replay_headers: headers replayed besides Content-Type and
            Location, or ``"*"`` for all but the never-replayed ones (default
            ``IDEMPOTENCY_REPLAY_HEADERS``).
        :param manual: on a retry of a completed operation, run the view instead
            of replaying: it reads ``idem.previous`` and decides the answer
            (``idem.replay()`` gives the usual replay); whatever it writes then
            is rolled back.
        :param wait: how long a duplicate waits for the first request's
            transaction before answering 409 (default ``IDEMPOTENCY_WAIT``);
            ``None``: no bound of ours, the engine's own applies.
        :param optimistic: write the record once, completed, at the end of the
            view's transaction, instead of claiming it before the view: one
            statement fewer per new key. A duplicate runs the view too, and its
            writes roll back when it meets the winner's record, so only views
            whose every effect is a write to this database, in this
            transaction, qualify: the view may not commit, call ``idem.step``
            or ``idem.derived_key``; ``lease``, ``recover`` and ``manual`` are
            refused with it. See :mod:`flask_idempotency.optimistic`.
        """
        loaded_schema = resolve_schema(schema)
        if isinstance(exclude, str):
            raise TypeError(f"exclude must be a list of field names, not the string {exclude!r}")
        excluded = tuple(exclude)
        exclude_paths(excluded)  # a wrong name is an error here, not at the first request
        overrides: dict[str, t.Any] = {}
        if required is not None:
            overrides["required"] = config.as_bool(required, "required")
        if ttl is not None:
            overrides["ttl"] = config.as_timedelta(ttl, "ttl")
        commit_claim = lease is not None and lease is not False
        if commit_claim and lease is not True:
            overrides["lease"] = config.as_timedelta(t.cast(float, lease), "lease")
        if "ttl" in overrides and "lease" in overrides:
            config.check_retention(overrides["ttl"], overrides["lease"], "@idempotent")
        if key_format is not None:
            overrides["key_format"] = resolve_key_format(key_format, "key_format")
        if key_max_length is not None:
            overrides["key_max_length"] = resolve_key_max_length(key_max_length, "key_max_length")
        if methods is not None:
            overrides["methods"] = config.resolve_methods(methods, "methods")
        if stored_statuses is not None:
            overrides["stored_statuses"] = config.resolve_stored_statuses(
                stored_statuses, "stored_statuses"
            )
        if skip is not None:
            overrides["skip"] = config.optional_callable(skip, "skip")
        if not isinstance(wait, _Unset):
            overrides["wait"] = None if wait is None else config.engine_timeout(wait, "wait")
        if replay_headers is not None:
            overrides["replay_headers"] = config.resolve_replay_headers(
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
        route = RouteOptions(
            schema=loaded_schema,
            exclude=excluded,
            scope=scope,
            commit_claim=commit_claim,
            recover=bool(recover),
            manual=bool(manual),
            optimistic=bool(optimistic),
            overrides=overrides,
        )
        self._routes.append(route)
        for known in list(self._states):
            known.route_settings[route] = route.settings_for(known.settings)

        def decorator(view: F) -> F:
            @functools.wraps(view)
            def wrapper(**kwargs: t.Any) -> Response:
                state = app_state()
                settings = state.route_settings.get(route)
                if settings is None:  # an app this Idempotency object did not register
                    settings = state.route_settings[route] = route.settings_for(state.settings)
                flow = Flow(
                    scoped=state.db.session,
                    store=state.store,
                    settings=settings,
                    clock=state.clock,
                    route=route,
                )
                try:
                    return flow.run(current_app.ensure_sync(view), kwargs)
                except Exception as exc:
                    # Wraps the whole flow (claim, view, completion, replay, the
                    # no-key path): a database outage or a lock conflict anywhere
                    # answers a retryable problem, never an HTML 500.
                    problem = _database_problem(exc, state.db.session, state.store.table.name)
                    if problem is None:
                        raise
                    raise problem from exc

            wrapper._idempotency_route = route  # type: ignore[attr-defined]
            return t.cast(F, wrapper)

        if view is not None:
            if not callable(view):
                raise TypeError(
                    "@idem.idempotent takes its options as keywords: "
                    f"@idem.idempotent(required=True), not @idem.idempotent({view!r})"
                )
            return decorator(view)
        return decorator

    # -- readiness ----------------------------------------------------------------

    def readiness(
        self, *, timeout: dt.timedelta | float | None = None
    ) -> tuple[bool, dict[str, t.Any]]:
        """Whether this process can use the record's database now, and why not.

        Runs ``SELECT 1 FROM idempotency_keys LIMIT 1`` through the app's engine,
        then checks that the database accepts writes (see
        :mod:`flask_idempotency.health`), in a background thread, and waits for
        it at most ``timeout`` (default ``IDEMPOTENCY_READY_TIMEOUT``, 2 s) from
        the probe's start, so it answers in time even when the database hangs.
        At most one probe per app and process is in flight: while one hangs,
        every call answers ``(False, ...)`` without starting another, until it
        returns.

        ``details`` is JSON-ready: ``ready``, ``database`` (``"ok"``,
        ``"timeout"``, ``"unavailable"``, ``"read_only"``, ``"forbidden"``
        (the app's role may not write the table: a GRANT missing),
        ``"conflict"`` or ``"error"``), ``table``, ``timeout_ms``, ``probe_id``, and
        ``duration_ms`` (or ``running_ms`` while the probe is still running),
        ``error`` (the exception's class name) when it failed and ``reason``
        (fixed words naming the setting) when the database is read-only. Call
        it in an app context.
        """
        state = app_state()
        limit = (
            state.settings.ready_timeout
            if timeout is None
            else config.positive_duration(timeout, "timeout", maximum=config.MAX_ENGINE_TIMEOUT)
        )
        probe = health.probe_for(resolve_app())
        return probe.check(state.db.engine, state.store.table, limit)

    def readiness_view(self) -> Response:
        """A readiness endpoint: ``app.add_url_rule("/readyz", view_func=idem.readiness_view)``.

        200 ``application/json`` with :meth:`readiness`'s details when the
        record's table answers in time and the database accepts writes;
        otherwise 503 problem+json (type
        ``.../database-unavailable``, ``Retry-After``) with the same details.
        Never cached. Keep a liveness check that does not touch the database
        apart from it, so an orchestrator takes the host out of rotation
        instead of restarting it.
        """
        ready, details = self.readiness()
        if not ready:
            raise health.not_ready_error(details)
        response = jsonify(details)
        response.headers["Cache-Control"] = "no-store"
        return response

    def serve_readiness(
        self, app: Flask, *, port: int, host: str = "0.0.0.0", path: str = "/readyz"
    ) -> health.ReadinessServer:
        """Answer readiness on ``host:port`` from a thread of this process, so the
        answer does not wait for a free worker.

        When the database hangs, every worker of a host waits on it, and a
        readiness view on the app's own port waits in the queue with the
        requests: the load balancer learns only from its own timeout. This
        server answers from a thread of its own, within
        ``IDEMPOTENCY_READY_TIMEOUT``, whatever the workers are doing. ``GET
        path`` answers as :meth:`readiness_view` does (200 JSON, or 503
        problem+json with ``Retry-After``), from the same probe.

        Call it in each serving process, after the fork: with gunicorn, from the
        ``post_worker_init`` hook (``idem.serve_readiness(worker.wsgi,
        port=8081)`` in ``gunicorn.conf.py``). Every worker binds the same port
        (``SO_REUSEPORT``, Linux and the BSDs) and the kernel spreads checks
        over them. A second call in the same process returns the running
        server; a forked child closes the parent's socket and starts its own
        when it calls. ``port=0`` picks a free port (``.port`` says which).
        Threads of their own need a worker class that lets them run while a
        request waits on the database: gunicorn's sync and gthread workers do;
        under gevent or eventlet, the database driver must cooperate (psycopg
        3, or psycopg2 with psycogreen).
        """
        if not isinstance(app, Flask):
            raise TypeError(
                f"serve_readiness needs the Flask app, not {type(app).__name__} (pass the app "
                "your middleware wraps)"
            )
        if find_app_state(app) is None:
            raise RuntimeError("serve_readiness: call idem.init_app(app, db) first")

        def check() -> tuple[bool, dict[str, t.Any]]:
            with app.app_context():
                return self.readiness()

        return health.serve(app, check, host=host, port=port, path=path)

    # -- what a view may read ---------------------------------------------------

    @staticmethod
    def _request_state() -> RequestState | None:
        return current_request_state()

    @property
    def payload(self) -> t.Any:
        """The current request's payload: the schema's loaded data, parsed JSON or bytes."""
        state = self._request_state()
        return state.payload if state is not None else None

    @property
    def key(self) -> str | None:
        """The current request's idempotency key (unquoted), or ``None``."""
        state = self._request_state()
        return state.key if state is not None else None

    @property
    def scope(self) -> str | None:
        """The current request's scope, or ``None`` when it carries no key."""
        state = self._request_state()
        return state.scope if state is not None else None

    @property
    def previous(self) -> Record | None:
        """In manual mode, the completed record of this operation (status, body,
        headers, times) when the request is a retry; ``None`` otherwise."""
        state = self._request_state()
        return state.previous if state is not None else None

    def replay(self) -> Response:
        """In manual mode, the answer the extension would have given: the stored
        response, with ``Idempotent-Replayed: true``."""
        previous = self.previous
        if previous is None:
            raise RuntimeError("idem.replay() needs a retry of a completed operation (manual mode)")
        return replay(previous)

    def step(self, name: str, fn: t.Callable[[], T]) -> T:
        """Run ``fn`` once per operation as the recovery point ``name``.

        On a leased route, the first attempt calls ``fn`` and saves its
        (JSON-serializable) result on the record in a short transaction of its
        own; an attempt that resumes the record after a crash or a released
        failure gets the saved result without calling ``fn``. Raises
        :class:`~flask_idempotency.LeaseLostError` when another request has taken
        the record over. Keep database writes out of ``fn``. In a request without
        a key (a route that does not require one) there is nothing to resume:
        ``fn`` simply runs.
        """
        state = self._request_state()
        if state is None:
            raise RuntimeError("idem.step() can only be called inside an idempotent view")
        if state.optimistic:
            raise RuntimeError(f"idem.step() is refused: {OPTIMISTIC_WHY}")
        return run_step(state, name, fn)

    def derived_key(self, step: str) -> str:
        """The idempotency key to send downstream for ``step`` of this operation.

        SHA-256 of the scope, the key, the operation's start and ``step``: the
        same on every retry and resume of this operation, unique per step, per
        scope, and per operation (a new operation on a key whose record expired
        gets new downstream keys, so a downstream that remembers keys longer
        than we do never answers it with the old operation's result). It is
        :func:`flask_idempotency.derive_key` of the scoped parent key
        (:func:`flask_idempotency.keys.scoped_parent_key`) and ``step``.
        """
        return current_derived_key(step)

    def emit(
        self,
        topic: str,
        payload: t.Any,
        headers: t.Mapping[str, str] | None = None,
        *,
        name: str | None = None,
    ) -> str:
        """Add an event to the outbox in the current transaction; its event id.

        The row is inserted through the app's session, so it commits with the
        view's writes and the record, or rolls back with them; the relay
        publishes it after the commit, at least once. The id names the logical
        event: ``derived_key("event:" + name)`` with a ``name``, else derived
        from the topic and the payload (and how many identical events this
        attempt emitted before it). So a retried or resumed operation gives each
        event the id it had, whatever it emits first; re-emitting an event
        already committed adds nothing, and an id already used by another topic
        or payload raises :class:`~flask_idempotency.errors.EventIdConflictError`.
        Allowed on optimistic routes (random ids there, as without a key). See
        :mod:`flask_idempotency.outbox`.
        """
        return outbox.emit(topic, payload, headers, name=name)

    def forward_headers(self, step: str | None = None) -> dict[str, str]:
        """The headers that carry this operation's key to an outgoing call.

        Without ``step``: the client's key, unchanged, for a downstream that shares
        this service's key space (``{"Idempotency-Key": '"<key>"'}``, the header
        named by ``IDEMPOTENCY_HEADER``). With ``step``: :meth:`derived_key` of
        it, for one call among several. The value is always an RFC 8941 string
        (quoted), the form the IETF draft specifies and this extension reads
        back as the same key, whatever characters the key holds. Refused like
        :meth:`derived_key`: outside an idempotent view, on optimistic routes,
        and (400 ``missing-key``) in a request without a key.
        """
        state = downstream_state("idem.forward_headers()")
        header = state.flow.settings.header if state.flow is not None else "Idempotency-Key"
        assert state.key is not None
        if step is None:
            return {header: quote_key(state.key)}
        return {header: quote_key(current_derived_key(step))}


class _RouteCheck:
    """Refuses, at the app's first request (every route is registered by then),
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
        unprotected = _unprotected_methods(app)
        if unprotected:
            raise RuntimeError(
                "Flask-Idempotency: decorated views serve methods that IDEMPOTENCY_METHODS "
                f"leaves unprotected: {'; '.join(unprotected)}. Each would run on every "
                "retry and without a key. Add the methods to IDEMPOTENCY_METHODS (or leave "
                "it None: every method but GET, HEAD, OPTIONS and TRACE), or pass "
                "methods=[...] to @idem.idempotent on the view to choose for it."
            )
        self._done = True


def _unprotected_methods(app: Flask) -> list[str]:
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
            if m not in config.SAFE_METHODS and not settings.protects(m)
        )
        if left:
            found.append(f"{rule.endpoint} ({rule.rule}): {', '.join(left)}")
    return found


def _database_problem(exc: Exception, session: t.Any, records: str) -> ProblemError | None:
    """The problem to answer for a database failure, or ``None`` for any other error.

    A privilege refused on the record's table (``records``: a GRANT missing for
    the claim, the lease renewal, the completion) is this host's outage, as
    readiness says ("forbidden"); refused on a table of the app's, the app's
    own error. Rolls ``session`` back first (a failure of that rollback is
    expected when the connection is gone, and ignored) and logs ``exc`` once.
    """
    failure = dberrors.classify(exc)
    if failure is None and dberrors.privilege_refused(exc) and dberrors.names_table(exc, records):
        failure = dberrors.UNAVAILABLE
    if failure is None:
        return None
    problem = dberrors.problem_for(failure, exc)
    try:
        session.rollback()
    except Exception:  # the connection is already broken; the original error matters
        logger.debug("rollback after a database failure failed too", exc_info=True)
    logger.warning(
        "%s %s answered %d: database %s: %s",
        request.method,
        request.path,
        problem.code,
        "read-only" if dberrors.read_only(exc) else failure.value,
        dberrors.summary(exc),
    )
    return problem
