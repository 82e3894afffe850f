"""The per-app state the extension keeps in ``app.extensions["idempotency"]``,
and the one way the rest of the package reaches it."""

from __future__ import annotations

import dataclasses
import datetime as dt
import typing as t

from flask import Flask, current_app

if t.TYPE_CHECKING:
    import sqlalchemy as sa
    from flask_sqlalchemy import SQLAlchemy

    from .config import Settings
    from .store import Store

EXTENSION_KEY = "idempotency"


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
    #: it then also drives the job locks, which otherwise read the database's.
    custom_clock: bool = False
    #: Each route's settings (the app's, with the route's overrides), built once.
    route_settings: dict[t.Any, Settings] = dataclasses.field(default_factory=dict)


def resolve_app(app: Flask | None = None) -> Flask:
    """``app``, or the app of the current context."""
    if app is not None:
        return app
    return t.cast(Flask, current_app._get_current_object())  # type: ignore[attr-defined]


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
