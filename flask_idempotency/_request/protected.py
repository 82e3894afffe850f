"""Which operations of an app ``@idem.idempotent`` protects, and with what
settings: what the OpenAPI plugin (:mod:`flask_idempotency.openapi`) documents.

An operation is a view and an HTTP method. The view is the function the app
registered for a URL rule: a decorated function, or a ``MethodView`` whose class
``decorators`` hold the decorator (the registered function carries the route's
options then), or whose method handler is decorated itself (looked up on the
view's ``view_class``; it wins over the class's ``decorators``).
"""

from __future__ import annotations

import dataclasses
import re
import typing as t

from flask import Flask

from .._config import Settings
from .._context import app_state
from .route import RouteOptions

# A Flask rule's variable part (``<int:order_id>``), as OpenAPI writes it
# (``{order_id}``): how apispec's Flask plugins and APIFlask spell a path.
_VARIABLE = re.compile(r"<(?:[^:<>]+:)?([^<>]+)>")


@dataclasses.dataclass(frozen=True)
class Protection:
    """One protected operation: its route's options and its effective settings."""

    route: RouteOptions
    settings: Settings


def openapi_path(rule: str) -> str:
    """``rule`` (``/orders/<int:order_id>``) as an OpenAPI path (``/orders/{order_id}``)."""
    return _VARIABLE.sub(r"{\1}", rule)


def route_of(view: t.Callable[..., t.Any], method: str) -> RouteOptions | None:
    """The options ``@idem.idempotent`` put on ``view`` for ``method``, if any:
    a ``MethodView`` handler's own first, then the registered function's."""
    view_class = getattr(view, "view_class", None)
    if view_class is not None:
        handler = getattr(view_class, method.lower(), None)
        route = getattr(handler, "_idempotency_route", None)
        if isinstance(route, RouteOptions):
            return route
    route = getattr(view, "_idempotency_route", None)
    return route if isinstance(route, RouteOptions) else None


def protection(app: Flask, view: t.Callable[..., t.Any], method: str) -> Protection | None:
    """How ``view`` protects a ``method`` request on ``app``; ``None``: it does not
    (undecorated, or a method its settings leave alone, such as ``GET``).

    Raises :class:`RuntimeError` for a decorated view of an app ``init_app``
    has not run on: its settings are the app's.
    """
    method = method.upper()
    route = route_of(view, method)
    if route is None:
        return None
    state = app_state(app)
    settings = state.route_settings.get(route) or route.settings_for(state.settings)
    if not settings.protects(method):
        return None
    return Protection(route, settings)


def view_at(app: Flask, path: str, method: str) -> t.Callable[..., t.Any] | None:
    """The view ``app`` dispatches a ``method`` request on the OpenAPI ``path`` to
    (two rules may share a path, one per method, as APIFlask's ``@app.get`` and
    ``@app.post`` register them)."""
    method = method.upper()
    for rule in app.url_map.iter_rules():
        if method in (rule.methods or ()) and openapi_path(rule.rule) == path:
            return app.view_functions.get(rule.endpoint)
    return None
