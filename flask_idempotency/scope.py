"""The scope of a key: the endpoint plus the caller's identity, by default.

A key only ever names an operation within its scope, so that one caller's key
never replays another caller's response. See :func:`default_scope` for the order
in which identities are looked for, and README "Scope" for the formats.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import hmac
import importlib
import logging
import typing as t
import weakref

from flask import Flask, Request, current_app, g, request, session
from werkzeug.datastructures import EnvironHeaders
from werkzeug.wrappers import Request as WerkzeugRequest

from ._context import resolve_app
from .keys import printable, sha256_hex

__all__ = [
    "FORM_OWNER_SESSION_KEY",
    "MAX_SCOPE_LENGTH",
    "ReconcileAttempt",
    "ReplayAttempt",
    "default_scope",
]

#: The Flask session key where a page that rendered ``idempotency_field()`` keeps
#: an anonymous caller's random owner id (the ``form-session`` identity).
FORM_OWNER_SESSION_KEY = "_idempotency_owner"
# Set in the environ of a request that rendered a form key: its session holds an
# owner although the request brought no cookie (its answer will).
_FORM_OWNER_SET = "flask_idempotency.form_owner"

#: The most characters a scope may have: the size of the record's scope column.
MAX_SCOPE_LENGTH = 512
# An identity (user id, Basic user name) longer than this, or not printable
# ASCII, is stored as a digest: the scope stays readable for operators where it
# can, and always fits its column whatever the endpoint's name.
_MAX_VERBATIM_IDENTITY = 128
# Hex digits of the Basic credential's HMAC kept in the scope: 128 bits, far
# beyond guessing, short enough to read.
_BASIC_PROOF_HEX = 32
_BASIC_PROOF_CONTEXT = b"flask-idempotency basic scope\x00"
# Schemes whose header is the same on every request of a caller: Basic and
# Bearer have rows of their own; a DPoP header carries only its access token
# (RFC 9449 sends the per-request proof in the separate DPoP header).
_STABLE_SCHEMES = frozenset({"basic", "bearer", "dpop"})

logger = logging.getLogger("flask_idempotency")


@dataclasses.dataclass(frozen=True)
class ReplayAttempt:
    """What a replay guard (``replay_guard=``, ``IDEMPOTENCY_REPLAY_GUARD``) is
    shown of the completed operation a retry is about to get: its metadata, never
    its body or headers. ``endpoint`` is the current request's (the record's
    fingerprint holds its path, so a replay only ever happens on that route)."""

    endpoint: str | None
    scope: str
    key: str
    #: When the operation started and when its answer was stored (the app's clock, UTC).
    created_at: dt.datetime
    completed_at: dt.datetime | None
    #: The stored answer's HTTP status.
    status: int | None


@dataclasses.dataclass(frozen=True)
class ReconcileAttempt:
    """What a reconcile hook (``reconcile=``, ``IDEMPOTENCY_RECONCILE``) is given
    to rebuild the answer of an operation whose outcome the extension could not
    keep: never a body or headers, only what names the operation.

    ``why`` is ``"failed-after-commit"`` (the view committed work of its own and
    its request never answered: the record holds, or is about to hold, the 500
    ``failed-after-commit``) or ``"lease-ended"`` (a leased route's record whose
    holder went away: the view may or may not have committed).
    """

    #: The endpoint of the route the operation ran on (the retry's, or the one
    #: found from the stored request; ``None`` where neither is known).
    endpoint: str | None
    scope: str
    key: str
    #: When the operation started (the app's clock, UTC).
    created_at: dt.datetime
    why: t.Literal["failed-after-commit", "lease-ended"]
    #: The answer's HTTP status as stored (500 for ``failed-after-commit``),
    #: ``None`` when none is stored (``lease-ended``).
    status: int | None
    #: The results of the operation's finished steps (``idem.step``), by name.
    recovery_points: t.Mapping[str, t.Any] = dataclasses.field(default_factory=dict)
    #: ``True`` in a client's retry (``flask.request`` is that retry); ``False``
    #: when the lease recovery job or ``flask idempotency reconcile`` asks.
    from_client: bool = True


def _identity(kind: str, value: str) -> str:
    """``kind:value``, or ``kind-sha256:<hex>`` when ``value`` is long or not printable ASCII.

    The digest form has its own kind, so a verbatim value can never look like
    another value's digest.
    """
    if len(value) <= _MAX_VERBATIM_IDENTITY and printable(value):
        return f"{kind}:{value}"
    return f"{kind}-sha256:{sha256_hex(value)}"


def _flask_login_user(app: Flask | None = None) -> str | None:
    """The authenticated Flask-Login user's id, when the app (default: the
    current one) uses Flask-Login."""
    # Flask-Login is optional: it is imported only for an app that has a
    # LoginManager (LoginManager.init_app sets app.login_manager), so the
    # package never needs it installed.
    if getattr(app or current_app, "login_manager", None) is None:
        return None
    flask_login = importlib.import_module("flask_login")
    user = flask_login.current_user
    if user is None or not user.is_authenticated:
        return None
    user_id = user.get_id()
    return None if user_id is None or str(user_id) == "" else str(user_id)


def _httpauth_user() -> str | None:
    """The user Flask-HTTPAuth authenticated for this request, when it is a str or int.

    Its ``login_required`` stores ``auth.current_user()`` on ``g`` once the
    credentials were checked (for Digest and ``verify_password`` returning
    ``True``: the user name), so it is set only when that decorator runs before
    the idempotency layer. Any other object is not used: its ``str()`` is no
    identity (a repr with an address, or one text for every user).
    """
    user = g.get("flask_httpauth_user")
    if isinstance(user, bool) or not isinstance(user, (str, int)):
        return None
    return str(user) or None


def _basic_proof(credential: str) -> str:
    """HMAC-SHA256 of a Basic ``user:password``, keyed with the app's ``SECRET_KEY``.

    Keyed, so that the scope (in the table, the logs, the CLI's output) holds
    nothing a weak password could be guessed against; without a ``SECRET_KEY``
    the key is empty and the digest only proves the password, as a plain hash.
    """
    secret = current_app.secret_key or b""
    key = secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)
    message = _BASIC_PROOF_CONTEXT + credential.encode("utf-8", "surrogateescape")
    return hmac.new(key, message, hashlib.sha256).hexdigest()[:_BASIC_PROOF_HEX]


def _credential_identity(header: str) -> tuple[str, str]:
    """The identity an ``Authorization`` header carries, and its scheme as sent.

    See :func:`default_scope`.
    """
    sent_scheme, _, credential = header.strip().partition(" ")
    scheme = sent_scheme.lower()
    credential = credential.strip()
    if scheme == "basic":
        auth = request.authorization
        if auth is not None and auth.type == "basic" and auth.username:
            # The user name alone is no proof: anyone can send it. With a
            # digest of the whole credential, nobody gets a user's scope
            # without the password (a user name has no colon, so this parses).
            proof = _basic_proof(f"{auth.username}:{auth.password or ''}")
            return f"{_identity('basic', auth.username)}:{proof}", sent_scheme
    elif scheme == "bearer" and credential:
        return f"bearer:{sha256_hex(credential)}", sent_scheme
    return f"auth:{sha256_hex(header.strip())}", sent_scheme


# Endpoints already warned about, per app, so each warning is logged once per
# process. Weak keys: apps (many in a test run) are not kept alive by this.
_warned: weakref.WeakKeyDictionary[Flask, set[tuple[str, str]]] = weakref.WeakKeyDictionary()


def _warn_once(endpoint: str, reason: str, message: str, *args: object) -> None:
    """Log ``message`` for ``endpoint`` and ``reason`` once per app and process.

    ``message`` takes the endpoint as its first ``%r``, then ``args``.
    """
    app = resolve_app()
    seen = _warned.get(app)
    if seen is None:
        seen = _warned.setdefault(app, set())
    elif (endpoint, reason) in seen:  # every later request of such a caller
        return
    seen.add((endpoint, reason))
    logger.warning(message + " Logged once per endpoint.", endpoint, *args)


_SET_SCOPE = (
    "Set IDEMPOTENCY_SCOPE (or scope= on the route) to the authenticated caller, "
    'e.g. lambda: f"{request.endpoint}|user:{g.user.id}".'
)


def _header_identity(endpoint: str, header: str) -> str:
    """The identity of the ``Authorization`` header, warning where it is not one."""
    identity, scheme = _credential_identity(header)
    if scheme.lower() not in _STABLE_SCHEMES:
        # Digest, AWS SigV4, HMAC and HTTP Signatures sign each request: the
        # header's digest keeps callers apart, but no retry ever shares it.
        _warn_once(
            endpoint,
            "unstable",
            "Idempotency scope of endpoint %r: no stable identity found, only an "
            "Authorization header of scheme %r, so the scope follows a digest of the "
            "whole header. Digest, AWS SigV4, HMAC and HTTP Signatures headers change "
            "on every request: each retry of such a caller runs again (callers are "
            "never merged). Harmless if this header is the same on every request (an "
            "API key). " + _SET_SCOPE,
            scheme[:40],
        )
    elif identity.startswith(("basic:", "basic-sha256:")):
        cookie_name, cookie = _session_cookie()
        if cookie is not None:
            # A Basic gate in front of a cookie-session app: the gate's shared
            # credential would put all of the app's users in one scope.
            _warn_once(
                endpoint,
                "basic-and-session",
                "Idempotency scope of endpoint %r: the request carries both a Basic "
                "credential and the %r cookie; the scope follows the Basic credential. "
                "If the app tells its users apart by the session instead (a Basic gate "
                "in front of the app, its credential shared), those users share one "
                "scope. " + _SET_SCOPE,
                cookie_name,
            )
    return identity


def _session_cookie(app: Flask | None = None) -> tuple[str, str | None]:
    """The session cookie's name (``SESSION_COOKIE_NAME``) and value, if sent;
    ``app``: the current one, where the caller has it already."""
    name = (app or current_app).config.get("SESSION_COOKIE_NAME") or "session"
    req = request._get_current_object()  # type: ignore[attr-defined]
    if "HTTP_COOKIE" not in req.environ and _werkzeug_cookies(req):
        return name, None  # no cookie at all: nothing to parse
    return name, req.cookies.get(name) or None


def _werkzeug_cookies(req: Request) -> bool:
    """Whether ``req.cookies`` is werkzeug's parse of the Cookie header: no hook
    assigned it and no request class replaced it (their cookies count, as they
    always did: a changed scope would make a retry miss its record)."""
    return "cookies" not in vars(req) and type(req).cookies is WerkzeugRequest.cookies


def _form_owner(cookie: tuple[str, str | None] | None = None) -> str | None:
    """The owner id a rendered form stored in the session: read only when the
    request sent the session cookie (or this very request rendered a form), so
    that no other request touches the session (which would add ``Vary: Cookie``).
    ``cookie``: :func:`_session_cookie`, when the caller read it already."""
    _, value = cookie or _session_cookie()
    if value is None and not request.environ.get(_FORM_OWNER_SET):
        return None
    owner = session.get(FORM_OWNER_SESSION_KEY)
    return owner if isinstance(owner, str) and owner else None


def default_scope() -> str:
    """The scope used when neither the route nor ``IDEMPOTENCY_SCOPE`` gives one.

    The endpoint, then ``|`` and the best identity of the caller found, in order:

    ========================================  ===========================================
    caller                                    scope
    ========================================  ===========================================
    Flask-Login user (the app has a           ``<endpoint>|user:<get_id()>``
    ``LoginManager``, user authenticated)
    Flask-HTTPAuth user (its                  ``<endpoint>|httpauth:<current_user()>``
    ``login_required`` ran first; a str
    or int user)
    ``Authorization: Basic``                  ``<endpoint>|basic:<user name>:<proof>``
    ``Authorization: Bearer <token>``         ``<endpoint>|bearer:<sha256 hex of token>``
    any other ``Authorization`` scheme        ``<endpoint>|auth:<sha256 hex of the header>``
    a session holding a form owner (a page    ``<endpoint>|form-session:<owner id>``
    rendered ``idempotency_field()``)
    the session cookie only                   ``<endpoint>|session:<sha256 hex of its value>``
    (``SESSION_COOKIE_NAME``)
    none of these                             ``<endpoint>``
    ========================================  ===========================================

    The first two are identities the app verified. The Basic ``<proof>`` is the
    first 32 hex digits of HMAC-SHA256 of ``user:password``, keyed with the
    app's ``SECRET_KEY``: a user name alone is no proof of identity, so nobody
    gets a user's scope without the password, and a changed password (or
    ``SECRET_KEY``) starts a new scope. A user id or user name longer than 128
    characters, or not printable ASCII, appears as ``user-sha256:<hex>`` /
    ``httpauth-sha256:<hex>`` / ``basic-sha256:<hex>:<proof>`` (SHA-256 of its
    UTF-8); a whole scope that would still exceed 512 characters (only an
    absurdly long endpoint name can do that) becomes ``sha256:<hex>`` of it.
    The scope names the caller, it does not authenticate them: authenticate
    before the idempotency layer runs.

    Logged as a warning on the ``flask_idempotency`` logger, once per endpoint
    and process: a scheme other than Basic, Bearer and DPoP (Digest and signed
    requests change on every request, so each retry runs again; callers are
    never merged); a Basic credential beside the session cookie (a shared gate
    credential would merge the app's users); the last two rows, which are not
    an identity (a cookie scope changes with the cookie, and callers without
    either share one scope).
    """
    req = request._get_current_object()  # type: ignore[attr-defined]
    app = resolve_app()
    endpoint = req.endpoint or req.path
    user_id = _flask_login_user(app)
    headers = req.headers
    if type(headers) is EnvironHeaders and headers.environ is req.environ:
        authorization = req.environ.get("HTTP_AUTHORIZATION", "")
    else:  # headers a hook or a request class gave: theirs count, as they always did
        authorization = headers.get("Authorization", "")
    if user_id is not None:
        identity = _identity("user", user_id)
    elif (httpauth_user := _httpauth_user()) is not None:
        identity = _identity("httpauth", httpauth_user)
    elif authorization.strip():
        identity = _header_identity(endpoint, authorization)
    elif (owner := _form_owner(sent := _session_cookie(app))) is not None:
        # A random id the signed session holds (forms): unlike the cookie's own
        # value, it stays the same when the session is saved again.
        identity = _identity("form-session", owner)
    else:
        cookie_name, cookie = sent
        if cookie is None:
            _warn_once(
                endpoint,
                "anonymous",
                "Idempotency scope of endpoint %r: the request carries no identity (no "
                "IDEMPOTENCY_SCOPE, no Flask-Login or Flask-HTTPAuth user, no "
                "Authorization header, no session cookie), so all such callers share one "
                "scope and one caller's key can replay another's response. " + _SET_SCOPE,
            )
            return _fit(endpoint)
        _warn_once(
            endpoint,
            "cookie",
            "Idempotency scope of endpoint %r: the request carries no identity, only "
            "the %r cookie; the scope follows a digest of its value, which keeps "
            "callers apart, but a retry sent with a changed cookie runs again. Use "
            "Flask-Login or set IDEMPOTENCY_SCOPE to the user's id, e.g. "
            'lambda: f"{request.endpoint}|user:{g.user.id}".',
            cookie_name,
        )
        identity = f"session:{sha256_hex(cookie)}"
    return _fit(f"{endpoint}|{identity}")


def _fit(scope: str) -> str:
    # Only an absurdly long endpoint name can get here; a digest of the whole
    # scope still keeps every caller and endpoint apart.
    if len(scope) <= MAX_SCOPE_LENGTH:
        return scope
    return f"sha256:{sha256_hex(scope)}"


def resolve_scope(func: t.Callable[[], str] | None) -> str:
    """The scope of the current request: ``func()`` (the route's or the app's scope
    callable), else :func:`default_scope`; checked to be a non-empty str of at
    most :data:`MAX_SCOPE_LENGTH` characters, without NUL."""
    scope = (func or default_scope)()
    if not isinstance(scope, str) or not scope:
        raise TypeError(
            f"the idempotency scope callable must return a non-empty str, got {scope!r}"
        )
    if "\x00" in scope:
        raise ValueError("an idempotency scope must not contain NUL")
    if len(scope) > MAX_SCOPE_LENGTH:
        raise ValueError(f"an idempotency scope must be at most {MAX_SCOPE_LENGTH} characters")
    return scope
