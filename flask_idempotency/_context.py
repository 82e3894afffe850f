"""The extension's context: the per-app state it keeps in
``app.extensions["idempotency"]``, and the current request's state on ``g``.

This module is the one owner of both: every other module reaches them through
the accessors here (:func:`app_state`, :func:`current_request_state`,
:func:`set_request_state`, :func:`end_request`), never through ``g`` or
``app.extensions`` itself."""

from __future__ import annotations

import dataclasses
import datetime as dt
import typing as t

from flask import Flask, appcontext_pushed, current_app, g, has_app_context

from ._storage import configured_urls, database_now, missing_driver, pooler
from .errors import MissingKeyError
from .keys import derive_scoped_key

if t.TYPE_CHECKING:
    import sqlalchemy as sa
    from flask_sqlalchemy import SQLAlchemy

    from ._config import Settings
    from ._request.claim_guard import ClaimGuard
    from ._request.flow import Flow
    from ._storage.schema import Record
    from ._storage.store import Store

EXTENSION_KEY = "idempotency"
# Where the current request's state lives on ``g`` (Flask's advice for an
# extension's per-request data); read and written here only.
_REQUEST_STATE = "_idempotency"
_ANSWER_NOTES = "_idempotency_answer"

#: Why an optimistic route refuses what it refuses, for the errors a view sees.
OPTIMISTIC_WHY = (
    "an optimistic route (@idem.idempotent(optimistic=True)) writes its record at the end "
    "of the view's transaction, and a duplicate runs the view before it learns the "
    "operation happened: only writes to the same database, in that transaction, are "
    "undone for it"
)


class ProcessJobs(t.Protocol):
    """The maintenance jobs of one serving process (``scheduler.InProcessScheduler``),
    as the state needs them: held here by this small protocol so that the state,
    read by every request, does not import the scheduler."""

    def ensure_started(self, app: Flask) -> None: ...

    def shutdown(self) -> None: ...


@dataclasses.dataclass(frozen=True, eq=False)
class AppState:
    """What ``init_app`` resolved for one app; read-only afterwards (the route
    settings cache only fills)."""

    db: SQLAlchemy
    store: Store
    settings: Settings
    clock: t.Callable[[], dt.datetime]
    job_lock_table: sa.Table
    in_process: ProcessJobs
    #: The app was given its own clock (``Idempotency(clock=...)``, as tests do):
    #: it then also drives the job locks, the jobs and the operator's commands,
    #: which otherwise read the database's.
    custom_clock: bool = False
    #: Each route's settings (the app's, with the route's overrides), built once.
    route_settings: dict[t.Any, Settings] = dataclasses.field(default_factory=dict)
    #: Each route's view as this app calls it (``app.ensure_sync``), made once.
    route_views: dict[t.Any, t.Callable[..., t.Any]] = dataclasses.field(default_factory=dict)

    def now(self, conn: sa.Connection) -> dt.datetime:
        """The time that coordinates processes, as the jobs and the operator's
        commands judge leases and retention by it: the database's clock, read on
        ``conn``, which every host shares (a host whose clock runs ahead cannot
        see a live lease as over, or a record in its window as expired); the
        app's own clock where it was given one (tests)."""
        return self.clock() if self.custom_clock else database_now(conn)


def resolve_app(app: Flask | None = None) -> Flask:
    """``app``, or the app of the current context."""
    if app is not None:
        return app
    return t.cast(Flask, current_app._get_current_object())  # type: ignore[attr-defined]


def check_unregistered(app: Flask) -> None:
    """Raise :class:`RuntimeError` when ``init_app`` has already run on ``app``."""
    if EXTENSION_KEY in app.extensions:
        raise RuntimeError(
            "Idempotency is already registered on this Flask app; "
            "create one Idempotency() and call init_app once per app."
        )


def register(app: Flask, state: AppState) -> None:
    """Keep ``state`` as ``app``'s (``init_app``, once it has resolved it)."""
    check_unregistered(app)
    app.extensions[EXTENSION_KEY] = state


def find_app_state(app: Flask | None = None) -> AppState | None:
    """The extension's state on ``app`` (default: the current app, if there is
    one), or ``None`` where ``init_app`` has not run."""
    if app is None and not has_app_context():
        return None
    return t.cast("AppState | None", resolve_app(app).extensions.get(EXTENSION_KEY))


def app_state(app: Flask | None = None) -> AppState:
    """The extension's state on ``app`` (default: the current app).

    Raises :class:`RuntimeError` when ``init_app`` has not run on it.
    """
    try:
        return t.cast(AppState, resolve_app(app).extensions[EXTENSION_KEY])
    except KeyError:
        raise RuntimeError(
            "Idempotency is not registered on this app; call init_app(app, db)."
        ) from None


@dataclasses.dataclass
class RequestState:
    """What the view may read about the current idempotent request (on ``g``)."""

    payload: t.Any
    key: str | None
    scope: str | None
    fencing_token: int | None = None
    recovery_points: dict[str, t.Any] = dataclasses.field(default_factory=dict)
    guard: ClaimGuard | None = None
    flow: Flow | None = None
    #: Manual mode: the completed record of this operation, for the view.
    previous: Record | None = None
    #: An optimistic route: no record exists while the view runs.
    optimistic: bool = False
    #: When this operation began (its record's creation time): with scope and key,
    #: what derived keys are made from, so that a new operation on a key that
    #: expired never reuses the downstream keys of the one before.
    operation: str = ""
    #: The view handed a derived key out (``idem.derived_key``, ``forward_headers``
    #: with a step, the client's ``step=``): a downstream may have acted under it,
    #: so a failed attempt keeps the operation for the retry instead of freeing it.
    keys_handed_out: bool = False

    #: ``idem.emit`` without a name: how many events of each content this request
    #: emitted, which numbers the next one's id.
    event_counts: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def claim_committed(self) -> bool:
        """The claimed record is committed (leased route, or the view committed)."""
        return self.guard is not None and self.guard.durable


def answer_notes(*, take: bool = False) -> dict[str, t.Any]:
    """What the current request's answer must carry, however it is rendered (the
    key to echo, the problem raised: ``_request.answer``), kept on ``g``; with
    ``take``, handed over and forgotten (empty where nothing was noted)."""
    if take:
        return t.cast("dict[str, t.Any]", g.pop(_ANSWER_NOTES, None) or {})
    notes = g.get(_ANSWER_NOTES)
    if notes is None:
        notes = {}
        setattr(g, _ANSWER_NOTES, notes)
    return t.cast("dict[str, t.Any]", notes)


def set_request_state(state: RequestState) -> None:
    """Make ``state`` the current request's (the flow, once it has read the request)."""
    setattr(g, _REQUEST_STATE, state)


def current_request_state() -> RequestState | None:
    """The current request's state, or ``None`` outside a decorated view's request
    (and outside any app context)."""
    if not has_app_context():
        return None
    return t.cast("RequestState | None", g.get(_REQUEST_STATE))


def in_keyed_request() -> bool:
    """Whether the current request is a decorated view's request that carries a key."""
    state = current_request_state()
    return state is not None and state.key is not None


def end_request(exc: BaseException | None = None) -> None:
    """The request's idempotency state ends with it, also where the app context
    outlives the request (a test, a script or a CLI command sending several
    requests in one context shares ``g`` between them): the next request's event
    ids count from 0 again, and code after the request is outside any view."""
    g.pop(_REQUEST_STATE, None)
    g.pop(_ANSWER_NOTES, None)


def downstream_state(caller: str) -> RequestState:
    """The current idempotent request's state, for a call downstream; raises if none."""
    state = current_request_state()
    if state is None:
        raise RuntimeError(f"{caller} can only be called inside an idempotent view")
    if state.optimistic:
        raise RuntimeError(f"{caller} is refused: {OPTIMISTIC_WHY}")
    if state.key is None or state.scope is None:
        # The client sent no key (the route does not require one): there is no
        # operation to derive from, and calling downstream without a stable key
        # would make every retry a new call there. The client must send one.
        header = state.flow.settings.header if state.flow is not None else "Idempotency-Key"
        raise MissingKeyError(
            f"This endpoint calls other services on the client's behalf and needs an "
            f"{header} header to keep those calls idempotent."
        )
    return state


def current_derived_key(step: str, *, handed_out: bool = True) -> str:
    """``idem.derived_key(step)`` of the current request, without the extension object.

    ``handed_out`` (the default): the key leaves the request, so a failed
    attempt keeps the operation for its retry (see ``Flow._keep_operation``).
    The outbox's event ids pass ``False``: they roll back with the view.
    """
    state = downstream_state("idem.derived_key()")
    assert state.key is not None
    assert state.scope is not None
    if handed_out:
        if not state.claim_committed and state.previous is None:
            # An uncommitted claim dies with a crash or a rollback, and the
            # retry would be a new operation with new keys: the downstream
            # would act twice. The key may leave only once the record is durable.
            raise RuntimeError(
                "A derived key (idem.derived_key, forward_headers with a step, the "
                "client's step=) needs a leased route: use @idem.idempotent(lease=...) "
                "so the record is committed before the key leaves the request"
            )
        state.keys_handed_out = True
    return derive_scoped_key(state.scope, state.key, step, operation=state.operation)


def check_drivers(app: Flask) -> None:
    """Refuse, with the extra or URL to use, a database URL whose driver is not
    installed (a plain ``postgresql://`` selects psycopg 3 under SQLAlchemy 2.1,
    which the ``[postgresql]`` extra does not install). Called before
    ``db.init_app(app)``, this comes before Flask-SQLAlchemy's bare
    ``ModuleNotFoundError``; after it, the driver imported already."""
    for setting, url in configured_urls(app.config):
        problem = missing_driver(url, setting)
        if problem is not None:
            raise RuntimeError(f"Flask-Idempotency: {problem}")


def watch_pooled_engines(app: Flask, db: t.Any) -> None:
    """Watch the app's engines under a transaction pooler (:func:`pooler.watch`):
    now when ``db.init_app(app)`` has run, else at the app's first app context
    (``idem.init_app`` may come first, so that it checks the drivers)."""
    try:
        with app.app_context():
            engines = list(db.engines.values())
    except RuntimeError:  # the app is not registered with db yet

        def later(sender: Flask, **_: t.Any) -> None:
            try:
                found = list(db.engines.values())
            except RuntimeError:  # still not registered: the next context
                return
            appcontext_pushed.disconnect(later, sender=app)
            for engine in found:
                pooler.watch(engine)

        appcontext_pushed.connect(later, sender=app, weak=False)
        return
    for engine in engines:
        pooler.watch(engine)
