"""The ``Idempotency`` extension object: registration, config, the decorator;
what a view calls on it comes from :class:`._view.ViewAPI`, what an operator
calls (readiness, figures, erasure) from :class:`._operator.OperatorAPI`,
``idem.function`` from :class:`._function.FunctionAPI`."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import typing as t
import weakref

from flask import Flask

from . import _config, config
from ._context import (
    AppState,
    check_drivers,
    check_unregistered,
    end_request,
    register,
    watch_pooled_engines,
)
from ._function import FunctionAPI
from ._maintenance import gauges
from ._maintenance.scheduler import InProcessScheduler
from ._messaging import outbox
from ._operator import OperatorAPI
from ._request import answer, formkeys, session_guard
from ._request.decorator import UNSET, LeaseArg, RouteCheck, Unset, protect, route_options
from ._request.fingerprint import SchemaArg
from ._request.flow import Clock
from ._request.route import RouteOptions, view_name
from ._storage import Store, inbox_table, job_lock_table, outbox_table, record_table
from ._storage.seal import keyring_of
from ._view import ViewAPI
from .cli import idempotency_cli
from .scope import ReconcileAttempt, ReplayAttempt

if t.TYPE_CHECKING:
    from flask_sqlalchemy import SQLAlchemy

__all__ = ["Idempotency"]

F = t.TypeVar("F", bound=t.Callable[..., t.Any])


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


class Idempotency(ViewAPI, OperatorAPI, FunctionAPI):
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
        check_drivers(app)
        if db is None:
            db = app.extensions.get("sqlalchemy")
            if db is None:
                raise RuntimeError(
                    "Idempotency needs Flask-SQLAlchemy: call db.init_app(app) first, "
                    "or pass db to Idempotency(app, db) / init_app(app, db)."
                )
        merged = {**self._options, **self._check_options(options)}
        _config.check_known(app.config)
        for name, default in config.DEFAULTS.items():
            app.config.setdefault(config.PREFIX + name, merged.get(name.lower(), default))
        settings = _config.Settings.from_mapping(
            {name: app.config[config.PREFIX + name] for name in config.DEFAULTS}
        )
        table = record_table(db.metadata)
        inbox_table(db.metadata)
        keyring = keyring_of(settings.encryption_keys, app.config)  # once, not per request
        state = AppState(
            db=db,
            store=Store(table, claim_idle=settings.claim_idle_timeout, keyring=keyring),
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
        # The form helpers (docs/forms.md), for every template of the app.
        app.add_template_global(formkeys.form_field, "idempotency_field")
        app.add_template_global(formkeys.form_key, "idempotency_form_key")
        gauges.watch(app)
        if settings.database_pooler == "transaction":
            watch_pooled_engines(app, db)
        self._states.add(state)
        app.before_request(RouteCheck(app))
        answer.install(app)
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
        redact: t.Sequence[str] = (),
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
        replay_guard: t.Callable[[ReplayAttempt], t.Any] | None = None,
        replay_headers: t.Iterable[str] | t.Literal["*"] | None = None,
        manual: bool = False,
        wait: dt.timedelta | float | Unset | None = UNSET,
        optimistic: bool = False,
        reconcile: t.Callable[[ReconcileAttempt], t.Any] | None = None,
    ) -> t.Callable[[F], F]: ...

    def idempotent(
        self,
        view: F | None = None,
        /,
        *,
        schema: SchemaArg = None,
        exclude: t.Sequence[str] = (),
        redact: t.Sequence[str] = (),
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
        replay_guard: t.Callable[[ReplayAttempt], t.Any] | None = None,
        replay_headers: t.Iterable[str] | t.Literal["*"] | None = None,
        manual: bool = False,
        wait: dt.timedelta | float | Unset | None = UNSET,
        optimistic: bool = False,
        reconcile: t.Callable[[ReconcileAttempt], t.Any] | None = None,
    ) -> F | t.Callable[[F], F]:
        """Protect a view: at most one execution per (scope, key), retries replayed.

        Used as ``@idem.idempotent(...)`` with options, or bare as
        ``@idem.idempotent`` for the app's settings.

        :param schema: marshmallow schema (instance or class) the JSON body must
            pass; its loaded data is what the fingerprint and ``idem.payload`` see.
        :param exclude: field names left out of the fingerprint; dotted for nested
            fields, ``\\.`` for a dot inside a name (``r"client\\.sent_at"``).
        :param redact: fields never kept in the stored request (``recover=True``),
            as ``exclude`` names them, and masked by ``show --reveal``; they still
            count in the fingerprint, which needs ``IDEMPOTENCY_FINGERPRINT_KEY``.
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
        :param replay_guard: callable run before a replay with a
            :class:`~flask_idempotency.scope.ReplayAttempt`; a false value refuses
            it (403 ``replay-refused``), or it raises the app's own error (default
            ``IDEMPOTENCY_REPLAY_GUARD``).
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
            refused with it. See "Optimistic routes" in the guide to work that spans
            transactions.
        :param reconcile: callable that rebuilds, from the committed state, the
            answer of an operation whose view committed and whose request never
            answered (500 ``failed-after-commit``; on a leased route, a holder
            gone), given a :class:`~flask_idempotency.scope.ReconcileAttempt`:
            what a view returns, or ``None`` when it cannot tell (default
            ``IDEMPOTENCY_RECONCILE``; see the reconcile guide). Refused with
            ``manual`` or ``optimistic``, where it is never asked.
        """
        route = route_options(
            schema=schema,
            exclude=exclude,
            redact=redact,
            required=required,
            ttl=ttl,
            scope=scope,
            lease=lease,
            recover=recover,
            key_format=key_format,
            key_max_length=key_max_length,
            methods=methods,
            stored_statuses=stored_statuses,
            skip=skip,
            replay_guard=replay_guard,
            replay_headers=replay_headers,
            manual=manual,
            wait=wait,
            optimistic=optimistic,
            reconcile=reconcile,
        )

        def decorator(view: F) -> F:
            # Named after the view, so an error about its settings names it.
            named = dataclasses.replace(route, view_name=view_name(view))
            self._routes.append(named)
            for known in list(self._states):
                known.route_settings[named] = named.settings_for(known.settings)
            return protect(view, named)

        if view is not None:
            if not callable(view):
                raise TypeError(
                    "@idem.idempotent takes its options as keywords: "
                    f"@idem.idempotent(required=True), not @idem.idempotent({view!r})"
                )
            return decorator(view)
        return decorator
