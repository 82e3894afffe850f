"""The ``Idempotency-Key`` header (parsing, validation, formats) and the default scope.

A key may be sent as an RFC 8941 Structured Field string (``"abc"``, the form the
IETF draft specifies) or bare (``abc``); both name the same key. Keys are 1 to
255 characters of printable ASCII (space to ``~``); a bare key may not contain a
comma, since servers join repeated headers with commas. An app may ask for less:
a shorter maximum (``IDEMPOTENCY_KEY_MAX_LENGTH``) and a format the whole key
must match (``IDEMPOTENCY_KEY_FORMAT``: ``"uuid"`` or a regular expression).

The default scope is the endpoint plus the caller's identity, see
:func:`default_scope`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import importlib
import logging
import re
import typing as t
import weakref

from flask import Flask, current_app, g, request

from .errors import InvalidKeyError
from .state import resolve_app

#: The most characters a key may have: the size of the record's key column.
MAX_KEY_LENGTH = 255
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


def _printable(text: str) -> bool:
    return all(" " <= ch <= "~" for ch in text)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


# -- the key ------------------------------------------------------------------------


def _unquote_sf_string(value: str) -> str:
    """Decode an RFC 8941 sf-string (``"..."`` with ``\\"`` and ``\\\\`` escapes)."""
    out: list[str] = []
    i = 1
    while i < len(value):
        ch = value[i]
        if ch == "\\":
            if i + 1 >= len(value) or value[i + 1] not in '"\\':
                raise InvalidKeyError(
                    "The Idempotency-Key is a malformed quoted string: "
                    'only \\" and \\\\ may be escaped.'
                )
            out.append(value[i + 1])
            i += 2
            continue
        if ch == '"':
            if i != len(value) - 1:
                raise InvalidKeyError(
                    "The Idempotency-Key is a malformed quoted string: "
                    "text follows the closing quote."
                )
            return "".join(out)
        out.append(ch)
        i += 1
    raise InvalidKeyError("The Idempotency-Key is a malformed quoted string: no closing quote.")


def parse_key(raw: str, *, max_length: int = MAX_KEY_LENGTH) -> str:
    """Return the key named by one header value, or raise :class:`InvalidKeyError`.

    ``"abc"`` and ``abc`` both return ``abc``. Surrounding whitespace is ignored.
    A key longer than ``max_length`` characters (after unquoting) is refused.
    """
    value = raw.strip(" \t")
    if not _printable(value):
        raise InvalidKeyError("The Idempotency-Key must be printable ASCII.")
    if value.startswith('"'):
        key = _unquote_sf_string(value)
    elif "," in value:
        # WSGI servers join repeated headers with ", ": a bare key with a comma
        # may be two keys. Quote it ("a,b") to send a comma.
        raise InvalidKeyError(
            "Send exactly one Idempotency-Key; a bare key must not contain a comma "
            '(quote it as a string, "a,b", if it really does).'
        )
    else:
        key = value
    if not key:
        raise InvalidKeyError("The Idempotency-Key must not be empty.")
    if len(key) > max_length:
        raise InvalidKeyError(
            f"The Idempotency-Key must be at most {max_length} characters, got {len(key)}."
        )
    return key


@dataclasses.dataclass(frozen=True)
class KeyFormat:
    """A format the whole key must match (``IDEMPOTENCY_KEY_FORMAT``, ``key_format=``)."""

    #: Matched with ``fullmatch`` against the unquoted key.
    pattern: re.Pattern[str]
    #: ``"uuid"`` or ``"regex"``: what the problem document's ``expected_format`` says.
    kind: str

    def check(self, key: str) -> None:
        """Raise :class:`InvalidKeyError` (400) naming the format when ``key`` does not match."""
        if self.pattern.fullmatch(key) is not None:
            return
        if self.kind == "uuid":
            raise InvalidKeyError(
                "The Idempotency-Key must be a UUID: 32 hexadecimal digits in groups "
                "8-4-4-4-12 separated by hyphens, such as "
                f'"{_UUID_EXAMPLE}".',
                extra={"expected_format": "uuid"},
            )
        raise InvalidKeyError(
            "The Idempotency-Key must match the regular expression "
            f"{self.pattern.pattern!r} (the whole key).",
            extra={"expected_format": "regex", "pattern": self.pattern.pattern},
        )


_UUID_EXAMPLE = "8e03978e-40d5-43e8-bc93-6894a57f9324"
# The canonical textual form (RFC 9562): hex digits of either case, with hyphens;
# no braces, no "urn:uuid:" prefix, no hyphen-less form.
_UUID = KeyFormat(
    re.compile(
        "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
        re.ASCII,
    ),
    "uuid",
)


def resolve_key_format(value: t.Any, name: str) -> KeyFormat | None:
    """Check a key format setting at start-up; raise ``TypeError``/``ValueError`` if wrong.

    ``None``: any key (printable ASCII). ``"uuid"``: a canonical UUID. Any other
    string, or a compiled :class:`re.Pattern` of ``str``: a regular expression
    the whole key must match. ``name`` is the setting, for the messages.
    """
    if value is None:
        return None
    if isinstance(value, KeyFormat):
        return value
    if value == "uuid":
        return _UUID
    if isinstance(value, re.Pattern):
        if not isinstance(value.pattern, str):
            raise TypeError(f"{name} must be a str pattern, not a bytes pattern")
        return KeyFormat(value, "regex")
    if isinstance(value, str):
        if not value:
            raise ValueError(f'{name} must not be empty (None accepts any key, "uuid" a UUID)')
        try:
            return KeyFormat(re.compile(value), "regex")
        except re.error as exc:
            raise ValueError(
                f"{name} is not a valid regular expression: {value!r}: {exc}"
            ) from None
    raise TypeError(
        f'{name} must be None, "uuid", a regular expression (str) or a compiled '
        f"re.Pattern, not {value!r}"
    )


def resolve_key_max_length(value: t.Any, name: str) -> int:
    """Check a maximum key length setting at start-up: an int from 1 to 255."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if value > MAX_KEY_LENGTH:
        raise ValueError(
            f"{name} must be at most {MAX_KEY_LENGTH}, the size of the idempotency "
            f"key column; got {value}"
        )
    return value


def key_from_request(
    header: str,
    *,
    max_length: int = MAX_KEY_LENGTH,
    key_format: KeyFormat | None = None,
) -> str | None:
    """The key of the current request, ``None`` when the header is absent.

    More than one header of that name is ambiguous and rejected (WSGI joins them
    with a comma, which :func:`parse_key` refuses outside a quoted string). A key
    longer than ``max_length``, or not matching ``key_format``, raises
    :class:`InvalidKeyError` (400). The length is checked before the format, so a
    pattern never runs on more than ``max_length`` characters.
    """
    values = request.headers.getlist(header)
    if not values:
        return None
    if len(values) > 1:
        raise InvalidKeyError(f"Send exactly one {header} header, got {len(values)}.")
    key = parse_key(values[0], max_length=max_length)
    if key_format is not None:
        key_format.check(key)
    return key


# -- the default scope ----------------------------------------------------------------


def _identity(kind: str, value: str) -> str:
    """``kind:value``, or ``kind-sha256:<hex>`` when ``value`` is long or not printable ASCII.

    The digest form has its own kind, so a verbatim value can never look like
    another value's digest.
    """
    if len(value) <= _MAX_VERBATIM_IDENTITY and _printable(value):
        return f"{kind}:{value}"
    return f"{kind}-sha256:{_sha256(value)}"


def _flask_login_user() -> str | None:
    """The authenticated Flask-Login user's id, when the app uses Flask-Login."""
    # Flask-Login is optional: it is imported only for an app that has a
    # LoginManager (LoginManager.init_app sets app.login_manager), so the
    # package never needs it installed.
    if getattr(current_app, "login_manager", None) is None:
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
        return f"bearer:{_sha256(credential)}", sent_scheme
    return f"auth:{_sha256(header.strip())}", sent_scheme


# Endpoints already warned about, per app, so each warning is logged once per
# process. Weak keys: apps (many in a test run) are not kept alive by this.
_warned: weakref.WeakKeyDictionary[Flask, set[tuple[str, str]]] = weakref.WeakKeyDictionary()


def _warn_once(endpoint: str, reason: str, message: str, *args: object) -> None:
    """Log ``message`` for ``endpoint`` and ``reason`` once per app and process.

    ``message`` takes the endpoint as its first ``%r``, then ``args``.
    """
    seen = _warned.setdefault(resolve_app(), set())
    if (endpoint, reason) in seen:
        return
    seen.add((endpoint, reason))
    logger.warning(message + " Logged once per endpoint.", endpoint, *args)


_SET_SCOPE = (
    "Set IDEMPOTENCY_SCOPE (or scope= on the route) to the authenticated caller, "
    'e.g. lambda: f"user:{g.user.id}".'
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


def _session_cookie() -> tuple[str, str | None]:
    """The session cookie's name (``SESSION_COOKIE_NAME``) and value, if sent."""
    name = current_app.config.get("SESSION_COOKIE_NAME") or "session"
    return name, request.cookies.get(name) or None


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
    endpoint = request.endpoint or request.path
    user_id = _flask_login_user()
    if user_id is not None:
        identity = _identity("user", user_id)
    elif (httpauth_user := _httpauth_user()) is not None:
        identity = _identity("httpauth", httpauth_user)
    elif request.headers.get("Authorization", "").strip():
        identity = _header_identity(endpoint, request.headers["Authorization"])
    else:
        cookie_name, cookie = _session_cookie()
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
            'lambda: f"user:{g.user.id}".',
            cookie_name,
        )
        identity = f"session:{_sha256(cookie)}"
    return _fit(f"{endpoint}|{identity}")


def _fit(scope: str) -> str:
    # Only an absurdly long endpoint name can get here; a digest of the whole
    # scope still keeps every caller and endpoint apart.
    if len(scope) <= MAX_SCOPE_LENGTH:
        return scope
    return f"sha256:{_sha256(scope)}"


def derive_key(scope: str, key: str, step: str, *, operation: str = "") -> str:
    """The key for one downstream call of the operation (scope, key): SHA-256, hex.

    Stable on every retry and resume of the same operation, different for each
    ``step``, and different across scopes, so two tenants that chose the same
    key never collide downstream; ``operation`` (when the operation began) sets
    apart two operations that used the same key one after the other, across an
    expiry. Minting a fresh random key per attempt instead would let the
    downstream run the call once per attempt.
    """
    if not step:
        raise ValueError("a derived key needs a non-empty step name")
    # NUL separates the parts; keys are printable ASCII, so refusing it in the
    # scope, step and operation keeps every (scope, key, operation, step) apart.
    if "\x00" in scope or "\x00" in step or "\x00" in operation:
        raise ValueError("a scope, step or operation must not contain NUL")
    parent = f"{scope}\x00{key}".encode("utf-8", "surrogateescape")
    if operation:
        parent += b"\x00" + operation.encode("utf-8")
    digest = hashlib.sha256(parent + b"\x00" + step.encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


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
