"""The protected operations in the app's OpenAPI document: an apispec plugin.

The IETF draft (``draft-ietf-httpapi-idempotency-key-header``) asks each
resource to publish its idempotency specification, expiry included. With
:class:`IdempotencyPlugin` among the spec's plugins, every operation
``@idem.idempotent`` protects (and no other: not a ``GET`` on the same path, not
an undecorated view) shows:

* the key's header parameter (``IDEMPOTENCY_HEADER``), ``required`` as the
  route is, with its format (``format: uuid`` and a ``pattern``, or the
  ``key_format`` regular expression as an ECMA-262 ``pattern`` where one says
  exactly what Python's does) and ``maxLength``; a parameter of the app's for
  that header (its own, or a shared one it refers to) is kept instead;
* the ``400``, ``409``, ``422`` and ``503`` ``application/problem+json``
  responses (or the statuses the app answers them with: ``statuses``), each
  listing its problem types (``type`` as an ``enum``, an example per type, and
  ``x-problem-types``) over one shared schema, ``IdempotencyProblem`` (or the
  app's own envelope: see below); a response the app documented itself for one
  of those statuses is kept, with the problem+json content beside its own;
* the echoed key (``Idempotency-Key``) on every response, and
  ``Idempotent-Replayed`` on each whose status the route stores (so replays);
  a shared response the operation refers to (flask-smorest's ``422`` and
  ``default``) becomes this operation's copy of it, even one registered after
  the operation (when the spec is rendered);
* ``x-idempotency``: the header, whether it is required, the key's format,
  pattern (Python's) and length, the retention (``ttl_seconds``), a leased
  route's ``lease_seconds``, and the expiry policy in words (``expiry``).

One line turns it on (OpenAPI 3.0 or 3.1), after ``idem.init_app(app, db)``::

    # flask-smorest
    api = Api(app, spec_kwargs={"extra_plugins": [IdempotencyPlugin(app)]})
    # APIFlask (the plugin documents the app it is built for)
    app = APIFlask(__name__, spec_plugins=[IdempotencyPlugin()])
    # apispec's FlaskPlugin: spec.path(view=..., app=app) as usual
    spec = APISpec(..., plugins=[FlaskPlugin(), IdempotencyPlugin(app)])

It needs apispec (``pip install "path/to/flask-idempotency[openapi]"``); the rest of the
package does not. See docs/openapi.md.
"""

from __future__ import annotations

import typing as t

from apispec import APISpec, BasePlugin
from flask import Flask, current_app, has_app_context

from ._openapi_parts import (
    PROBLEM_SCHEMA,
    Answers,
    Components,
    Later,
    document,
    problem_schema,
)
from ._request.protected import protection, view_at
from .errors import PROBLEM_JSON

__all__ = ["IdempotencyPlugin"]

_METHODS = frozenset({"get", "put", "post", "delete", "options", "head", "patch", "trace"})


class IdempotencyPlugin(BasePlugin):
    """Documents each protected operation's key, problems, headers and expiry.

    ``app``: the app whose views the spec describes; ``None``: the current app
    when the spec is built (APIFlask builds it when it serves its spec, or for
    ``flask spec``, both in the app's context); outside one, :class:`RuntimeError`.
    A view ``@idem.idempotent`` decorated needs ``idem.init_app`` to have run on
    that app first: its settings are the app's.
    Only OpenAPI 3 is supported (:class:`ValueError` for 2.0).

    The problems are documented as ``application/problem+json`` documents, as
    the extension answers them. An app that answers them in its own envelope
    (``@app.errorhandler(ProblemError)``, docs/http.md) names that answer's
    ``media_type`` and ``schema`` (a schema component's name, or a schema),
    which then describe every problem answer; each problem response lists its
    type URIs in ``x-problem-types`` alone. ``statuses`` maps the status the
    extension answers a problem with to the one the app's handler answers it
    with (``{422: 400}``: a reused key is a ``400``): the problems of a mapped
    status are listed under the app's, beside its own problems there.
    """

    def __init__(
        self,
        app: Flask | None = None,
        *,
        media_type: str = PROBLEM_JSON,
        schema: str | dict[str, t.Any] | None = None,
        statuses: t.Mapping[int, int] | None = None,
    ) -> None:
        super().__init__()
        self._app = app
        self._media_type = media_type
        self._schema = schema
        self._statuses = _checked_statuses(statuses or {})
        self._spec: APISpec | None = None
        self._later = Later()
        self._path_parameters: list[t.Any] = []

    def init_spec(self, spec: APISpec) -> None:
        if spec.openapi_version.major < 3:
            raise ValueError(
                "IdempotencyPlugin documents OpenAPI 3.0 and 3.1, not "
                f"{spec.openapi_version}: its problems are application/problem+json content"
            )
        self._spec = spec
        self._later = later = Later()
        if PROBLEM_SCHEMA not in spec.components.schemas:
            # Lazy: the document carries it only once an operation refers to it.
            spec.components.schema(PROBLEM_SCHEMA, problem_schema(), lazy=True)
        # A component an operation refers to may be registered after it
        # (flask-smorest documents a blueprint as it is registered): apispec has
        # no hook then, so the spec's rendering finishes those operations first.
        render = spec.to_dict

        def to_dict() -> dict[str, t.Any]:
            later.settle()
            return render()

        spec.to_dict = to_dict  # type: ignore[method-assign]

    def path_helper(
        self,
        path: str | None = None,
        operations: dict[str, t.Any] | None = None,
        parameters: list[t.Any] | None = None,
        **kwargs: t.Any,
    ) -> None:
        """Notes the path's own parameters (apispec calls this just before
        :meth:`operation_helper` for the same path): a key header the app
        documented for the whole path is the operations' too."""
        self._path_parameters = list(parameters or [])

    def operation_helper(
        self,
        path: str | None = None,
        operations: dict[str, t.Any] | None = None,
        **kwargs: t.Any,
    ) -> None:
        """Adds the idempotency of each protected operation on ``path``; apispec
        calls it. ``rule`` (flask-smorest), ``view`` and ``app`` (apispec's
        ``FlaskPlugin``) name the view; without them (APIFlask) it is the one
        the app dispatches the method on ``path`` to."""
        if not operations or self._spec is None:
            return
        app = self._resolve_app(kwargs.get("app"))
        rule = kwargs.get("rule")
        view = kwargs.get("view")
        if rule is not None:
            view = app.view_functions.get(rule.endpoint)
        answers = Answers(
            self._media_type, self._schema, self._statuses, Components(self._spec.components)
        )
        for method, operation in operations.items():
            if method not in _METHODS or not isinstance(operation, dict):
                continue
            target = view if view is not None else view_at(app, path or "", method)
            found = None if target is None else protection(app, target, method)
            if found is not None:
                document(operation, found, answers, self._later, self._path_parameters)
        self._path_parameters = []

    def _resolve_app(self, given: t.Any) -> Flask:
        if isinstance(given, Flask):
            return given
        if self._app is not None:
            return self._app
        if has_app_context():
            return t.cast(Flask, current_app._get_current_object())  # type: ignore[attr-defined]
        raise RuntimeError(
            "IdempotencyPlugin() without an app builds the spec in the app's context: "
            "pass the app (IdempotencyPlugin(app)) or build it inside app.app_context()"
        )


def _checked_statuses(statuses: t.Mapping[int, int]) -> dict[int, int]:
    for given, answered in statuses.items():
        for status in (given, answered):
            if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status < 600:
                raise ValueError(
                    "IdempotencyPlugin(statuses=...) maps the extension's problem status to the "
                    f"one the app answers it with, both 4xx or 5xx: {given!r}: {answered!r}"
                )
    return dict(statuses)
