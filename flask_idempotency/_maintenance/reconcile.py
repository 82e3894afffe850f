"""Reconcile outside a client's request: the lease recovery job and
``flask idempotency reconcile`` ask the app's hook (:mod:`.._request.reconcile`)
for the answer of a record whose view committed and whose request never
answered, in an app context and a request context rebuilt from the record's
stored request where it kept one (``recover=True``), else a bare one.

Which hook: the route the stored request reaches, else the one of the
endpoint the operator names, else ``IDEMPOTENCY_RECONCILE``. Refused as the
job refuses: a record under a live lease (running), a tombstone, an
unreadable record (its key not configured), an answer of the view's own, an
idempotent function's record; and, as in a request, a record of a route in
manual mode (found from its stored request or the endpoint named: a record
that kept neither cannot tell).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import typing as t
import urllib.parse

from flask import Flask
from sqlalchemy.orm import Session
from werkzeug.exceptions import HTTPException

from .._context import AppState, app_state
from .._request.reconcile import rebuild, why_of
from .._request.route import RouteOptions
from .._storage import Record

if t.TYPE_CHECKING:
    from .._config import Settings


@dataclasses.dataclass(frozen=True)
class Reconciled:
    """What asking the hook for one record came to."""

    record: Record
    rebuilt: bool
    #: Why not, when not rebuilt.
    reason: str = ""


#: How many records :func:`candidates` reads at a time.
PAGE = 1000


def candidates(
    app: Flask, *, scope: str | None = None, key: str | None = None, page: int | None = None
) -> t.Iterator[Record]:
    """Records a hook may rebuild, oldest first, every one of them, read
    ``page`` at a time: completed with the extension's ``failed-after-commit``,
    or in progress holding it, their lease over (unreadable ones too, which
    :func:`reconcile_record` refuses). No connection is held between pages,
    and records rebuilt while this runs do not move the next page."""
    state = app_state(app)
    page = PAGE if page is None else page
    after: Record | None = None
    while True:
        with state.db.engine.connect() as conn:
            now = state.now(conn)
            found = state.store.failed_after_commit(
                conn, scope=scope, key=key, limit=page, after=after
            )
        for record in found:
            if record.function_call:
                continue  # an idempotent function's: no hook of a route answers for it
            if record.unreadable is not None or (why_of(record) and not record.lease_live(now)):
                yield record
        if len(found) < page:
            return
        after = found[-1]


def idempotent_endpoint(app: Flask, endpoint: str) -> None:
    """Raise :class:`ValueError` unless ``endpoint`` names a route declared
    with ``@idem.idempotent`` (whose hook the operator means)."""
    view = app.view_functions.get(endpoint)
    if isinstance(getattr(view, "_idempotency_route", None), RouteOptions):
        return
    known = sorted(
        name
        for name, view in app.view_functions.items()
        if isinstance(getattr(view, "_idempotency_route", None), RouteOptions)
    )
    close = difflib.get_close_matches(endpoint, known, n=1)
    hint = f" (did you mean {close[0]}?)" if close else f" (idempotent routes: {', '.join(known)})"
    what = "is not a route declared with @idem.idempotent" if view else "names no route"
    raise ValueError(f"{endpoint!r} {what}{hint}")


def _route_settings(
    app: Flask, state: AppState, record: Record, endpoint: str | None
) -> tuple[Settings, str | None, RouteOptions | None]:
    """The settings (whose ``reconcile`` is the hook) of the record's route,
    its endpoint and its options: found from its stored request, else
    ``endpoint``'s, else the app's (no route)."""
    if record.request_path is not None and record.request_method is not None:
        adapter = app.url_map.bind("localhost")
        path = urllib.parse.unquote(record.request_path.partition("?")[0])
        with contextlib.suppress(HTTPException):
            endpoint, _ = adapter.match(path, method=record.request_method)
    if endpoint is None:
        return state.settings, None, None
    view = app.view_functions.get(endpoint)
    route = getattr(view, "_idempotency_route", None)
    if not isinstance(route, RouteOptions):
        return state.settings, endpoint, None
    settings = state.route_settings.get(route) or route.settings_for(state.settings)
    return settings, endpoint, route


def reconcile_record(app: Flask, record: Record, *, endpoint: str | None = None) -> Reconciled:
    """Ask the hook for ``record``'s answer and store it (fenced), or say why not."""
    if record.unreadable is not None:
        return Reconciled(record, False, f"unreadable: {record.unreadable}")
    if record.function_call:
        # Its stored value is the function's return value: a hook answers as a
        # route's view would, so its failure stands (docs/functions.md).
        return Reconciled(record, False, "an idempotent function's record")
    why = why_of(record)
    if why is None:
        return Reconciled(record, False, "not a failure after commit")
    state = app_state(app)
    settings, endpoint, route = _route_settings(app, state, record, endpoint)
    if route is not None and route.manual:
        # As in a request: the view decides, with idem.previous.
        return Reconciled(record, False, f"{endpoint} is in manual mode: its view decides")
    hook = settings.reconcile
    if hook is None:
        return Reconciled(record, False, "no reconcile hook (reconcile=, IDEMPOTENCY_RECONCILE)")
    if route is None:
        # The route's retention is the record's own (its claim set it), not
        # the app's: an answer is never kept longer than its route says.
        settings = dataclasses.replace(settings, ttl=record.retention)
    if record.request_path is not None and record.request_method is not None:
        headers = {"Content-Type": record.request_content_type or "application/octet-stream"}
        context = app.test_request_context(
            record.request_path,
            method=record.request_method,
            data=record.request_body or b"",
            headers=headers,
        )
    else:
        context = app.test_request_context()
    with app.app_context(), context:
        session = t.cast(Session, state.db.session())
        try:
            now = state.now(session.connection())
            if record.lease_live(now):
                session.rollback()
                return Reconciled(record, False, "in progress under a live lease")
            rebuilt = rebuild(
                session,
                state.store,
                record,
                why,
                hook=hook,
                settings=settings,
                now=now,
                endpoint=endpoint,
                from_client=False,
            )
        finally:
            state.db.session.remove()
    if rebuilt.record is None:
        return Reconciled(record, False, rebuilt.reason)
    return Reconciled(rebuilt.record, True)
