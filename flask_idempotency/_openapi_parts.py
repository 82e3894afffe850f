"""What :mod:`flask_idempotency.openapi` writes into one protected operation: the
key's parameter, the problem responses, the replay headers and ``x-idempotency``.

The spec's components are read through :class:`Components` (a response or
parameter the operation refers to); one registered only after the operation
was documented is read when the spec is rendered (:class:`Later`).
"""

from __future__ import annotations

import copy
import dataclasses
import re
import typing as t

from ._contract import REPLAYED_HEADER
from ._ecma import ecma_pattern
from ._request.protected import Protection
from .errors import (
    PROBLEM_TYPE_BASE,
    ConflictError,
    DatabaseUnavailableError,
    FormKeyError,
    FormKeyExpiredError,
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

if t.TYPE_CHECKING:
    from apispec.core import Components as SpecComponents

#: The shared problem document schema's name under ``components/schemas``.
PROBLEM_SCHEMA = "IdempotencyProblem"
#: The operation's extension that states the route's idempotency specification.
EXTENSION = "x-idempotency"
#: The problem responses' extension that lists their problem type URIs.
PROBLEM_TYPES = "x-problem-types"

# Problems whose answer carries Retry-After (the same request may succeed later).
_RETRIED = (409, 503)
# Stored whatever the route's stored statuses: the failed-after-commit answer
# of a view whose work committed, replayed to each retry.
_ALWAYS_STORED = 500


class Components:
    """The spec's components, as the plugin reads them: a response or a parameter
    an operation refers to (by name, or by ``$ref``), registered or lazily
    registered; and the reference to a schema (registering a lazy one)."""

    def __init__(self, components: SpecComponents) -> None:
        self._components = components

    def response(self, reference: t.Any) -> dict[str, t.Any] | None:
        """A copy of the response ``reference`` names; ``None``: none registered (yet)."""
        return self._read(reference, "responses", self._components.responses_lazy)

    def parameter(self, reference: t.Any) -> dict[str, t.Any] | None:
        """The parameter ``reference`` names; ``None``: none registered (yet)."""
        return self._read(reference, "parameters", self._components.parameters_lazy)

    def schema(self, schema: str | dict[str, t.Any]) -> dict[str, t.Any]:
        """``schema``, or the ``$ref`` to the component it names."""
        return t.cast(dict[str, t.Any], self._components.get_ref("schema", copy.deepcopy(schema)))

    def _read(
        self, reference: t.Any, section: str, lazy: dict[str, t.Any]
    ) -> dict[str, t.Any] | None:
        if isinstance(reference, dict):
            reference = reference.get("$ref")
        if not isinstance(reference, str):
            return None
        name = reference.removeprefix(f"#/components/{section}/")
        found = getattr(self._components, section).get(name) or lazy.get(name)
        return copy.deepcopy(found) if isinstance(found, dict) else None


def is_reference(node: t.Any) -> bool:
    """Whether ``node`` names a component instead of describing a thing itself."""
    return isinstance(node, str) or (isinstance(node, dict) and "$ref" in node)


@dataclasses.dataclass(frozen=True)
class Answers:
    """How the app answers a protected operation's problems: their media type,
    body schema (``None``: the problem document), the status it answers each
    of the extension's with (``statuses``), and the spec's components."""

    media_type: str
    schema: str | dict[str, t.Any] | None
    statuses: t.Mapping[int, int]
    components: Components


class Later:
    """What an operation referred to that was not registered yet when it was
    documented, finished when the spec is rendered (``settle``): a shared
    response becomes the operation's copy with the idempotency added; a shared
    parameter that turns out to be the key's drops the plugin's own."""

    def __init__(self) -> None:
        self._responses: list[tuple[dict[str, t.Any], str, Protection, Answers]] = []
        self._parameters: list[tuple[dict[str, t.Any], dict[str, t.Any], Answers]] = []

    def response(
        self, operation: dict[str, t.Any], code: t.Any, found: Protection, answers: Answers
    ) -> None:
        self._responses.append((operation, _status_key(code), found, answers))

    def parameter(
        self, operation: dict[str, t.Any], ours: dict[str, t.Any], answers: Answers
    ) -> None:
        self._parameters.append((operation, ours, answers))

    def settle(self) -> None:
        responses, self._responses = self._responses, []
        for operation, code, found, answers in responses:
            shared = operation.get("responses", {}).get(code)
            copied = answers.components.response(shared) if is_reference(shared) else None
            if copied is None:
                self._responses.append((operation, code, found, answers))  # still unknown
                continue
            operation["responses"][code] = copied
            _complete(code, copied, found, answers)
        parameters, self._parameters = self._parameters, []
        for operation, ours, answers in parameters:
            header = ours["name"]
            theirs = [p for p in operation.get("parameters", []) if p is not ours]
            known = _has_header(theirs, header, answers.components)
            if known:
                operation["parameters"] = theirs
            elif known is None:
                self._parameters.append((operation, ours, answers))


def document(
    operation: dict[str, t.Any],
    found: Protection,
    answers: Answers,
    later: Later,
    path_parameters: t.Sequence[t.Any] = (),
) -> None:
    """Writes the idempotency of the protected ``operation`` into it
    (``path_parameters``: its path's own, which it inherits)."""
    parameters = operation.setdefault("parameters", [])
    header = found.settings.header
    on_path = _has_header(list(path_parameters), header, answers.components)
    known = True if on_path else _has_header(parameters, header, answers.components)
    if not known:  # a parameter of the app's that names the header stays alone
        ours = key_parameter(found)
        parameters.append(ours)
        if known is None:
            later.parameter(operation, ours, answers)
    responses = operation.setdefault("responses", {})
    for code, kinds in problems(found, answers.statuses).items():
        if code not in responses and str(code) not in responses:
            responses[code] = {
                "description": "; ".join(kind.title for kind in kinds),
                "content": {},
            }
    for code, response in list(responses.items()):
        if is_reference(response):
            # A shared response (flask-smorest's 422 and default): this
            # operation gets its copy, the idempotency added.
            copied = answers.components.response(response)
            if copied is None:
                later.response(operation, code, found, answers)
                continue
            responses[code] = response = copied
        if isinstance(response, dict):
            _complete(_status_key(code), response, found, answers)
    operation[EXTENSION] = specification(found)


def _status_key(code: t.Any) -> str:
    """A response's key as apispec writes it: ``"201"``, ``"default"``, ``"4XX"``."""
    try:
        return str(int(code))
    except (TypeError, ValueError):
        return str(code)


def _complete(code: str, response: dict[str, t.Any], found: Protection, answers: Answers) -> None:
    """One documented response of a protected operation: its problems, if any
    answer with its status; the echoed key (every answer to a keyed request
    carries it); ``Idempotent-Replayed`` where an answer with its status is stored."""
    kinds = problems(found, answers.statuses).get(int(code)) if code.isdigit() else None
    headers = response.setdefault("headers", {})
    if kinds:
        # The app's own answer for this status stays (and its body, where the
        # problems share its media type); ours is told apart by its media type.
        content = response.setdefault("content", {})
        content.setdefault(answers.media_type, _problem_content(int(code), kinds, answers))
        # Which problems, whatever body the app answers them in.
        response.setdefault(PROBLEM_TYPES, []).extend(
            PROBLEM_TYPE_BASE + kind.slug for kind in kinds
        )
        if any(kind.code in _RETRIED for kind in kinds):
            headers.setdefault("Retry-After", _retry_after())
    if _stored(code, found):
        headers.setdefault(REPLAYED_HEADER, _replayed_header())
    headers.setdefault(found.settings.header, _echo_header())


def _stored(code: str, found: Protection) -> bool:
    """Whether an answer under the response key ``code`` (a status, a range such
    as ``4XX``, or ``default``: any status not listed) may be stored, so replayed."""
    if code.isdigit():
        statuses = [int(code)]
    elif len(code) == 3 and code[0].isdigit() and code[1:].upper() == "XX":
        statuses = list(range(int(code[0]) * 100, int(code[0]) * 100 + 100))
    else:
        statuses = list(range(100, 600))
    return any(s == _ALWAYS_STORED or found.settings.storable(s) for s in statuses)


def _has_header(parameters: list[t.Any], header: str, components: Components) -> bool | None:
    """Whether ``parameters`` hold one for the ``header``, its own or a shared
    one's; ``None``: not one, but a reference to a parameter not registered yet."""
    unknown = False
    for parameter in parameters:
        if is_reference(parameter):
            parameter = components.parameter(parameter)
            unknown = unknown or parameter is None
        if (
            isinstance(parameter, dict)
            and parameter.get("in") == "header"
            and str(parameter.get("name", "")).lower() == header.lower()
        ):
            return True
    return None if unknown else False


def key_schema(found: Protection) -> dict[str, t.Any]:
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
        # Only a pattern that says what the server checks: x-idempotency states
        # the server's own (Python's dialect) either way.
        pattern = ecma_pattern(key_format.pattern)
        if pattern is not None:
            schema["pattern"] = pattern
    return schema


def key_parameter(found: Protection) -> dict[str, t.Any]:
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
        "schema": key_schema(found),
    }


def problems(
    found: Protection, statuses: t.Mapping[int, int]
) -> dict[int, list[type[ProblemError]]]:
    """The problem types a protected operation may answer, by the status the
    app answers each with (the extension's, unless ``statuses`` maps it)."""
    settings = found.settings
    bad_request: list[type[ProblemError]] = [InvalidKeyError]
    if settings.required:
        bad_request.insert(0, MissingKeyError)
    if settings.form_field:  # a form posted with its key field, whatever the route
        bad_request += [FormKeyError, FormKeyExpiredError]
    unprocessable: list[type[ProblemError]] = [KeyReusedError]
    if found.route.schema is not None:  # its fingerprint loads the body with it
        unprocessable.append(ValidationProblem)
    kinds: list[type[ProblemError]] = [
        *bad_request,
        MalformedBodyError,
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
            by_code.setdefault(statuses.get(kind.code, kind.code), []).append(kind)
    return by_code


def _problem_content(
    code: int, problems: list[type[ProblemError]], answers: Answers
) -> dict[str, t.Any]:
    if answers.schema is not None:  # the app's own envelope: its schema alone
        return {"schema": answers.components.schema(answers.schema)}
    types = [PROBLEM_TYPE_BASE + kind.slug for kind in problems]
    return {
        "schema": {
            "allOf": [
                answers.components.schema(PROBLEM_SCHEMA),
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


def problem_schema() -> dict[str, t.Any]:
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


def specification(found: Protection) -> dict[str, t.Any]:
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
        # The server's own check, in its own dialect: exact where the schema's
        # pattern is left out (or when a client wants Python's reading).
        pattern = key_format.pattern
        spec["key_pattern"] = pattern.pattern
        spec["key_pattern_dialect"] = "python"
        try:
            flags = re.compile(pattern.pattern).flags
        except re.error:  # a verbose pattern may need its flag to compile
            flags = 0
        given = re.RegexFlag(pattern.flags & ~flags & ~re.UNICODE)
        if given:
            spec["key_pattern_flags"] = sorted(flag.name or "" for flag in given)
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
