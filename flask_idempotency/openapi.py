"""The protected operations in the app's OpenAPI document: an apispec plugin.

The IETF draft (``draft-ietf-httpapi-idempotency-key-header``) asks each
resource to publish its idempotency specification, expiry included. With
:class:`IdempotencyPlugin` among the spec's plugins, every operation
``@idem.idempotent`` protects (and no other: not a ``GET`` on the same path, not
an undecorated view) shows:

* the key's header parameter (``IDEMPOTENCY_HEADER``), ``required`` as the
  route is, with its format (``format: uuid`` and a ``pattern``, or the
  ``key_format`` regular expression as a ``pattern``) and ``maxLength``;
* the ``400``, ``409``, ``422`` and ``503`` ``application/problem+json``
  responses, each listing its problem types (``type`` as an ``enum``, an
  example per type, and ``x-problem-types``) over one shared schema,
  ``IdempotencyProblem`` (or the app's own envelope: see below); a response
  the app documented itself for one of those statuses is kept, with the
  problem+json content beside its own (a shared response it refers to, such as
  flask-smorest's ``422``, becomes this operation's copy of it);
* the ``Idempotent-Replayed`` header on its success (``2xx``) responses, and
  the echoed key (``Idempotency-Key``) on those and on its problems;
* ``x-idempotency``: the header, whether it is required, the key's format and
  length, the retention (``ttl_seconds``), a leased route's ``lease_seconds``,
  and the expiry policy in words (``expiry``).

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

import copy
import dataclasses
import typing as t

from apispec import APISpec, BasePlugin
from flask import Flask, current_app, has_app_context

from ._contract import REPLAYED_HEADER
from ._request.protected import Protection, protection, view_at
from .errors import (
    PROBLEM_JSON,
    PROBLEM_TYPE_BASE,
    ConflictError,
    DatabaseUnavailableError,
    InvalidKeyError,
    KeyReusedError,
    LeaseLostError,
    MalformedBodyError,
    MissingKeyError,
    ProblemError,
    ServerMisconfiguredError,
    TransactionConflictError,
    ValidationProblem,
)

__all__ = ["IdempotencyPlugin"]

#: The shared problem document schema's name under ``components/schemas``.
PROBLEM_SCHEMA = "IdempotencyProblem"
#: The operation's extension that states the route's idempotency specification.
EXTENSION = "x-idempotency"
#: The problem responses' extension that lists their problem type URIs.
PROBLEM_TYPES = "x-problem-types"

_RESPONSES = "#/components/responses/"
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
    ``media_type`` and ``schema`` (a schema component's name, or a schema); each
    problem response then lists its type URIs in ``x-problem-types`` alone.
    """

    def __init__(
        self,
        app: Flask | None = None,
        *,
        media_type: str = PROBLEM_JSON,
        schema: str | dict[str, t.Any] | None = None,
    ) -> None:
        super().__init__()
        self._app = app
        self._media_type = media_type
        self._schema = schema
        self._spec: APISpec | None = None

    def init_spec(self, spec: APISpec) -> None:
        if spec.openapi_version.major < 3:
            raise ValueError(
                "IdempotencyPlugin documents OpenAPI 3.0 and 3.1, not "
                f"{spec.openapi_version}: its problems are application/problem+json content"
            )
        self._spec = spec
        if PROBLEM_SCHEMA not in spec.components.schemas:
            # Lazy: the document carries it only once an operation refers to it.
            spec.components.schema(PROBLEM_SCHEMA, _problem_schema(), lazy=True)

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
        if not operations:
            return
        app = self._resolve_app(kwargs.get("app"))
        rule = kwargs.get("rule")
        view = kwargs.get("view")
        if rule is not None:
            view = app.view_functions.get(rule.endpoint)
        for method, operation in operations.items():
            if method not in _METHODS or not isinstance(operation, dict):
                continue
            target = view if view is not None else view_at(app, path or "", method)
            found = None if target is None else protection(app, target, method)
            if found is not None:
                _document(operation, found, self._answers())

    def _answers(self) -> _Answers:
        return _Answers(self._media_type, self._schema, self._shared_response)

    def _shared_response(self, reference: t.Any) -> dict[str, t.Any] | None:
        """A copy of the response component ``reference`` names (its name, or a
        ``$ref`` to it), as registered (lazily too); ``None``: not one of ours to read."""
        if isinstance(reference, dict):
            reference = reference.get("$ref")
        if not isinstance(reference, str) or self._spec is None:
            return None
        name = reference.removeprefix(_RESPONSES)
        components = self._spec.components
        found = components.responses.get(name) or components.responses_lazy.get(name)
        return copy.deepcopy(found) if isinstance(found, dict) else None

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


@dataclasses.dataclass(frozen=True)
class _Answers:
    """How the app answers the problems: their media type and body schema
    (``None``: the problem document), and a reader of shared responses."""

    media_type: str
    schema: str | dict[str, t.Any] | None
    shared: t.Callable[[t.Any], dict[str, t.Any] | None]


def _document(operation: dict[str, t.Any], found: Protection, answers: _Answers) -> None:
    settings = found.settings
    parameters = operation.setdefault("parameters", [])
    if not any(_names_header(p, settings.header) for p in parameters):
        parameters.append(_key_parameter(found))
    responses = operation.setdefault("responses", {})
    problems = _problems(found)
    for code, kinds in problems.items():
        _add_problems(responses, code, kinds, answers)
    problem_codes = {str(code) for code in problems}
    for code, response in responses.items():
        if not isinstance(response, dict) or "$ref" in response:
            continue
        if str(code).startswith("2"):
            headers = response.setdefault("headers", {})
            headers.setdefault(REPLAYED_HEADER, _replayed_header())
            headers.setdefault(settings.header, _echo_header())
        elif str(code) in problem_codes:  # a problem answers a keyed request too
            response.setdefault("headers", {}).setdefault(settings.header, _echo_header())
    operation[EXTENSION] = _specification(found)


def _names_header(parameter: t.Any, name: str) -> bool:
    return (
        isinstance(parameter, dict)
        and parameter.get("in") == "header"
        and str(parameter.get("name", "")).lower() == name.lower()
    )


def _key_schema(found: Protection) -> dict[str, t.Any]:
    settings = found.settings
    schema: dict[str, t.Any] = {
        "type": "string",
        "minLength": 1,
        "maxLength": settings.key_max_length,
    }
    key_format = settings.key_format
    if key_format is not None:
        if key_format.kind.startswith("uuid"):
            schema["format"] = "uuid"
        # OpenAPI patterns search; the key must match as a whole (fullmatch).
        schema["pattern"] = f"^(?:{key_format.pattern.pattern})$"
    return schema


def _key_parameter(found: Protection) -> dict[str, t.Any]:
    settings = found.settings
    if settings.required:
        when = "Required: a request without it is refused (`missing-key`)."
    else:
        when = "Optional: a request without it runs unprotected."
    return {
        "name": settings.header,
        "in": "header",
        "required": settings.required,
        "description": (
            "Names one operation: a retry with the same key and payload gets the first "
            "answer replayed instead of running again. Printable ASCII, bare or as a "
            f'quoted string ("..."). {when}'
        ),
        "schema": _key_schema(found),
    }


def _problems(found: Protection) -> dict[int, list[type[ProblemError]]]:
    """The problem types a protected operation may answer, by status."""
    bad_request: list[type[ProblemError]] = [InvalidKeyError, MalformedBodyError]
    if found.settings.required:
        bad_request.insert(0, MissingKeyError)
    unprocessable: list[type[ProblemError]] = [KeyReusedError]
    if found.route.schema is not None:  # its fingerprint loads the body with it
        unprocessable.append(ValidationProblem)
    kinds: list[type[ProblemError]] = [
        *bad_request,
        ConflictError,
        TransactionConflictError,
        LeaseLostError,
        *unprocessable,
        DatabaseUnavailableError,
        ServerMisconfiguredError,
    ]
    by_code: dict[int, list[type[ProblemError]]] = {}
    for kind in kinds:
        if kind.code is not None:  # each problem listed has its own status
            by_code.setdefault(kind.code, []).append(kind)
    return by_code


def _add_problems(
    responses: dict[t.Any, t.Any],
    code: int,
    problems: list[type[ProblemError]],
    answers: _Answers,
) -> None:
    media = _problem_content(code, problems, answers.schema)
    at = code if code in responses else str(code)
    existing = responses.get(at)
    if isinstance(existing, str) or (isinstance(existing, dict) and "$ref" in existing):
        # A shared response (flask-smorest's 422 for a body its arguments
        # refuse): this operation gets a copy of it, ours beside its content.
        copied = answers.shared(existing)
        if copied is None:  # not one we can read: left as the app wrote it
            return
        responses[at] = existing = copied
    if existing is None:
        responses[code] = existing = {
            "description": "; ".join(kind.title for kind in problems),
            "content": {answers.media_type: media},
        }
    elif isinstance(existing, dict):
        # The app's own answer for this status stays (and its body, where the
        # problems share its media type); ours is told apart by its media type.
        existing.setdefault("content", {}).setdefault(answers.media_type, media)
    if isinstance(existing, dict):
        # Which problems, whatever body the app answers them in.
        existing.setdefault(PROBLEM_TYPES, []).extend(
            PROBLEM_TYPE_BASE + kind.slug for kind in problems
        )
        if code in (409, 503):
            existing.setdefault("headers", {}).setdefault("Retry-After", _retry_after())


def _problem_content(
    code: int, problems: list[type[ProblemError]], schema: str | dict[str, t.Any] | None
) -> dict[str, t.Any]:
    if schema is not None:  # the app's own envelope: its schema alone
        return {"schema": copy.deepcopy(schema)}
    types = [PROBLEM_TYPE_BASE + kind.slug for kind in problems]
    return {
        "schema": {
            "allOf": [
                PROBLEM_SCHEMA,
                {"type": "object", "properties": {"type": {"type": "string", "enum": types}}},
            ]
        },
        "examples": {
            kind.slug: {
                "summary": kind.title,
                "value": {
                    "type": PROBLEM_TYPE_BASE + kind.slug,
                    "title": kind.title,
                    "status": code,
                    "detail": kind.title + ".",
                },
            }
            for kind in problems
        },
    }


def _problem_schema() -> dict[str, t.Any]:
    return {
        "type": "object",
        "description": (
            "An RFC 9457 problem document. `type` is a stable URI a client may switch "
            "on; `title` is fixed per type; `detail` is for humans."
        ),
        "required": ["type", "title", "status"],
        "properties": {
            "type": {"type": "string"},
            "title": {"type": "string"},
            "status": {"type": "integer"},
            "detail": {"type": "string"},
        },
        "additionalProperties": True,
    }


def _retry_after() -> dict[str, t.Any]:
    return {
        "description": "Seconds to wait before retrying with the same key.",
        "schema": {"type": "integer", "minimum": 1},
    }


def _replayed_header() -> dict[str, t.Any]:
    return {
        "description": (
            "`true` on a replay: the stored answer of the first request with this key, "
            "not a new one. Absent on the first answer."
        ),
        "schema": {"type": "string", "enum": ["true"]},
    }


def _echo_header() -> dict[str, t.Any]:
    return {
        "description": "The request's idempotency key, echoed on every answer to a keyed request.",
        "schema": {"type": "string"},
    }


def _seconds(value: t.Any) -> int | float:
    seconds = float(value.total_seconds())
    return int(seconds) if seconds.is_integer() else seconds


def _specification(found: Protection) -> dict[str, t.Any]:
    """``x-idempotency``: the route's idempotency specification, expiry included."""
    settings = found.settings
    key_format = settings.key_format
    spec: dict[str, t.Any] = {
        "header": settings.header,
        "required": settings.required,
        "key_format": None if key_format is None else key_format.kind,
        "key_max_length": settings.key_max_length,
        "ttl_seconds": _seconds(settings.ttl),
    }
    if key_format is not None and key_format.kind == "regex":
        spec["key_pattern"] = key_format.pattern.pattern
    expiry = (
        "A key names one operation for ttl_seconds from the answer to its first request; after "
        "that a request with it is a new operation. A record whose operation may have "
        "happened does not expire while it is unsettled: one in progress under a live lease, or "
        "one whose work committed before its answer was stored (settled with that answer "
        "by the retry or the recovery job, then kept ttl_seconds from then)."
    )
    if found.route.commit_claim:
        spec["lease_seconds"] = _seconds(settings.lease)
        expiry += (
            " This route commits its record before the view runs, leased for "
            "lease_seconds (renewed at each step): a retry after the lease ends resumes the "
            "operation; one that stopped with finished steps is kept for its retry until "
            "ttl_seconds."
        )
    spec["expiry"] = expiry
    return spec
