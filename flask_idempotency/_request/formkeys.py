"""Keys for HTML forms: one per rendered form, signed, bound to the caller and the form.

A browser sends no ``Idempotency-Key`` header, so a page renders one into its
form instead: ``idempotency_field()`` writes a hidden input whose value is a
*form token*, ``fk1.<payload>.<signature>``, signed with the app's
``SECRET_KEY`` (itsdangerous, as Flask signs its session; ``SECRET_KEY_FALLBACKS``
still verify). The payload holds:

* a fresh random key, a UUID4 (which every ``IDEMPOTENCY_KEY_FORMAT`` but a
  regular expression accepts: the recovery job re-sends it as the header): the
  record's key, so every submission of one rendered form (a double click, a
  reload of the result, back and submit again) is one operation, and two
  renderings (two tabs) are two;
* the endpoint the form posts to: a token is refused on another form;
* a digest of the caller's scope, computed as the target route computes it:
  a token is refused for another user or session;
* the time it was issued, by the app's clock: a token older than
  ``IDEMPOTENCY_FORM_KEY_MAX_AGE`` (at most the route's ``ttl``) is refused,
  so a resubmission can never outlive the record that fences it.

The extension reads the token from the form field ``IDEMPOTENCY_FORM_FIELD``
when no header is sent, and from the header too when a page sends the rendered
token there (``fetch()``): whatever carries it, a token is verified, and a
refused one answers :class:`~flask_idempotency.errors.FormKeyError`.

Anonymous callers (no login, no ``Authorization``) are told apart by a random
*owner* the first rendering stores in the Flask session
(:data:`OWNER_SESSION_KEY`); the default scope prefers it to a digest of the
session cookie, which changes whenever the session is saved (a ``flash()``
after the POST would otherwise make the reload a new operation).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import re
import secrets
import typing as t
import uuid
from datetime import timedelta

from flask import current_app, request, session
from itsdangerous import BadSignature, URLSafeSerializer
from markupsafe import Markup, escape
from werkzeug.exceptions import RequestEntityTooLarge

from .. import _pages
from .. import scope as scope_module
from .._context import app_state
from ..errors import (
    FormKeyError,
    FormKeyExpiredError,
    PayloadTooLargeError,
    ServerMisconfiguredError,
)
from ..keys import MAX_KEY_LENGTH, key_from_values
from .body import read_body
from .forms import consumed, is_form
from .route import RouteOptions
from .steps import RECOVERY_ENVIRON_KEY
from .wsgi import request_header_values

if t.TYPE_CHECKING:
    from .._config import Settings

#: What every form token starts with: a header value that starts with it is a
#: form token too (a page's ``fetch()`` sends the rendered one), verified as such.
TOKEN_PREFIX = "fk1."
#: The session key of an anonymous caller's owner id (see the module's doc).
OWNER_SESSION_KEY = scope_module.FORM_OWNER_SESSION_KEY
_SALT = "flask-idempotency.form-key"
# Longer than any token this module writes (a 512-character endpoint included);
# nothing longer is decoded.
_MAX_TOKEN_LENGTH = 2048
#: How far in the future a token's issue time may be (another host's clock
#: running ahead) before the token is refused as not ours.
CLOCK_TOLERANCE = timedelta(minutes=5)


@dataclasses.dataclass(frozen=True)
class FormToken:
    """A verified form token's content."""

    key: str
    endpoint: str
    scope_digest: str
    issued: int
    #: Older than the max age: it may still replay its record, never start one.
    expired: bool = False


def _serializer(keys: list[str | bytes]) -> URLSafeSerializer:
    # A list of str and bytes, as Flask's session passes it (itsdangerous's
    # annotation wants one kind).
    return URLSafeSerializer(keys, salt=_SALT)  # type: ignore[arg-type]


def _secrets() -> list[str | bytes]:
    """The app's signing keys, oldest to newest (itsdangerous's order)."""
    app = current_app
    secret = app.secret_key
    if not secret:
        raise RuntimeError(
            "Flask-Idempotency's form keys are signed with the app's SECRET_KEY: set "
            "app.config['SECRET_KEY'] (as Flask's session needs too)."
        )
    return [*(app.config.get("SECRET_KEY_FALLBACKS") or ()), secret]


def _keyed(secret: str | bytes, purpose: bytes, message: bytes) -> str:
    """HMAC-SHA256 (hex) of ``message`` under ``secret``, for one ``purpose``."""
    key = secret.encode("utf-8") if isinstance(secret, str) else secret
    return hmac.new(key, purpose + b"\x00" + message, hashlib.sha256).hexdigest()


def _caller_digest(scope: str, owner: str, secret: str | bytes) -> str:
    """Who a form was rendered for: the scope and the session's owner, keyed
    with the secret, so that the page's source reveals neither (a user id can
    not be guessed back from it)."""
    message = f"{scope}\x00{owner}".encode("utf-8", "surrogatepass")
    return _keyed(secret, b"form-caller", message)[:32]


def _owner(create: bool) -> str:
    """The session's owner id; made (in the session, so the page's answer carries
    it in its cookie) when ``create`` and missing.

    Made from the session cookie the request brought (keyed with the secret),
    so that pages rendered at once from one session (two tabs opened together,
    the first pages after a sign-in) agree on it, whichever answer's cookie the
    browser keeps; random for a request that brought none (a first visit).
    """
    owner = scope_module._form_owner()  # the default scope's reading of it
    if owner is not None:
        return owner
    if not create:
        return ""
    _, cookie = scope_module._session_cookie()
    if cookie is None:
        owner = secrets.token_urlsafe(16)
    else:
        owner = _keyed(_secrets()[-1], b"form-owner", cookie.encode("latin-1", "replace"))[:22]
    session[OWNER_SESSION_KEY] = owner
    request.environ[scope_module._FORM_OWNER_SET] = True
    return owner


def _target(endpoint: str | None) -> tuple[str, RouteOptions]:
    """The endpoint a form posts to and its route; a clear error for a view that
    is not protected (a developer's mistake, raised while the page renders)."""
    if endpoint is None:
        target = request.endpoint
        if target is None:
            raise RuntimeError(
                "idempotency_field() outside a routed request: pass the endpoint the form "
                "posts to, e.g. idempotency_field('checkout')"
            )
    elif endpoint.startswith(".") and request.blueprint:
        target = f"{request.blueprint}{endpoint}"
    else:
        target = endpoint.lstrip(".")
    view = current_app.view_functions.get(target)
    route = getattr(view, "_idempotency_route", None)
    if not isinstance(route, RouteOptions):
        raise ValueError(
            f"idempotency_field(): the endpoint {target!r} is not a view decorated with "
            "@idem.idempotent; pass the endpoint the form posts to, e.g. "
            "idempotency_field('orders.create')"
        )
    return target, route


def _route_settings(route: RouteOptions) -> Settings:
    state = app_state()
    settings = state.route_settings.get(route)
    if settings is None:
        settings = state.route_settings[route] = route.settings_for(state.settings)
    return settings


def _scope_for(target: str, route: RouteOptions, settings: Settings) -> str:
    """The scope a request to ``target`` from this caller would have: the route's
    (or the app's) scope callable, run with the request's endpoint set to the
    target's, so the default scope and callables that read it agree with the POST."""
    scope_func = route.scope or settings.scope
    rule = next(iter(current_app.url_map.iter_rules(target)), None)
    saved = request.url_rule
    if rule is not None:
        request.url_rule = rule
    try:
        return scope_module.resolve_scope(scope_func)
    finally:
        request.url_rule = saved


def form_key(endpoint: str | None = None) -> str:
    """A fresh form token for a form that posts to ``endpoint`` (default: the
    current request's endpoint, for a page whose GET and POST share a view).

    Each call mints a new key: render it once per form. Send it as the form's
    ``IDEMPOTENCY_FORM_FIELD`` field (:func:`form_field` does), or as the
    ``Idempotency-Key`` header of a ``fetch()``.
    """
    keys = _secrets()
    target, route = _target(endpoint)
    settings = _route_settings(route)
    if not settings.form_field:
        raise RuntimeError(
            "idempotency_field(): IDEMPOTENCY_FORM_FIELD is None, so forms carry no key; "
            "set it to the field's name (default 'idempotency_key')"
        )
    # Before the scope: the default scope of an anonymous caller is this owner.
    owner = _owner(create=True)
    scope = _scope_for(target, route, settings)
    issued = int(app_state().clock().timestamp())
    payload = [str(uuid.uuid4()), target, _caller_digest(scope, owner, keys[-1]), issued]
    return TOKEN_PREFIX + _serializer(keys).dumps(payload)


def form_field(endpoint: str | None = None) -> Markup:
    """The hidden ``<input>`` holding a fresh :func:`form_key` (the Jinja global
    ``idempotency_field()``)."""
    token = form_key(endpoint)
    name = app_state().settings.form_field
    return Markup('<input type="hidden" name="{}" value="{}">').format(escape(name), escape(token))


# -- reading a request's token ------------------------------------------------------


# What this module writes: the prefix, itsdangerous's URL-safe payload (a leading
# "." when compressed) and its 27-character signature; quoted or not.
_TOKEN_SHAPE = re.compile(r'"?fk1\.\.?[A-Za-z0-9_-]+\.[A-Za-z0-9_-]{27}"?')


def looks_like_token(value: str) -> bool:
    """Whether a header value has the shape of a form token: a client's own key
    that merely starts with ``fk1.`` stays a plain key."""
    # The prefix first: every header-keyed request asks, and almost none is a token.
    value = value.strip()
    if not value.startswith((TOKEN_PREFIX, '"' + TOKEN_PREFIX)):
        return False
    return len(value) <= _MAX_TOKEN_LENGTH and _TOKEN_SHAPE.fullmatch(value) is not None


def field_value(settings: Settings) -> str | None:
    """The form field's token, ``None`` when the body is no form or lacks it;
    several values are refused (one form, one key)."""
    if not settings.form_field or not is_form():
        return None
    try:
        if not consumed():
            # Keep the bytes as sent for the view (a signature over the raw
            # body): werkzeug parses a form from a cached body without
            # consuming it. (A keyed request reads them whole anyway, for
            # its fingerprint; MAX_CONTENT_LENGTH bounds both.)
            read_body()
        values = request.form.getlist(settings.form_field)
    except RequestEntityTooLarge:
        raise PayloadTooLargeError(
            "The form is larger than this server accepts (MAX_FORM_MEMORY_SIZE, MAX_FORM_PARTS)."
        ) from None
    if not values:
        return None
    if len(values) > 1 and len(set(values)) > 1:
        raise FormKeyError(
            f"The form sent {len(values)} different {settings.form_field} fields: a form "
            "carries one key. Reload the page and submit it again.",
            reason="forged",
        )
    return values[0]


def decode(value: str, settings: Settings) -> FormToken:
    """Verify a token's signature and shape, and mark it expired when older than
    :func:`max_age` (the app's clock); its binding to the caller and the form is
    :func:`check_binding`'s, once the scope is known."""
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]
    if not value.startswith(TOKEN_PREFIX) or len(value) > _MAX_TOKEN_LENGTH:
        raise FormKeyError(_FORGED, reason="forged")
    try:
        keys = _secrets()
    except RuntimeError as exc:
        raise ServerMisconfiguredError(
            "The server cannot verify form keys (it has no SECRET_KEY); nothing was stored."
        ) from exc
    try:
        payload = _serializer(keys).loads(value[len(TOKEN_PREFIX) :])
    except BadSignature:
        raise FormKeyError(_FORGED, reason="forged") from None
    if not _well_formed(payload):
        # Signed with our key but not written by this module: another use of the
        # same SECRET_KEY and salt, or an old format.
        raise FormKeyError(_FORGED, reason="forged")
    token = FormToken(*payload)
    now = app_state().clock().timestamp()
    tolerance = clock_tolerance(settings)
    if token.issued - now > tolerance.total_seconds():
        raise FormKeyError(
            "This form's key was issued in the future by this server's clock (the "
            "servers' clocks disagree). Reload the page and submit it again; nothing "
            "was done.",
            reason="forged",
        )
    if now - token.issued > max_age(settings).total_seconds():
        token = dataclasses.replace(token, expired=True)
    return token


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
_DIGEST = re.compile(r"[0-9a-f]{32}")
# Issue times this module can have written: after 2001, before the year 6000.
_ISSUED = range(1_000_000_000, 127_000_000_000)


def _well_formed(payload: t.Any) -> bool:
    return (
        isinstance(payload, list)
        and len(payload) == 4
        and isinstance(payload[0], str)
        and _UUID.fullmatch(payload[0]) is not None
        and isinstance(payload[1], str)
        and 0 < len(payload[1]) <= _MAX_TOKEN_LENGTH
        and isinstance(payload[2], str)
        and _DIGEST.fullmatch(payload[2]) is not None
        and type(payload[3]) is int
        and payload[3] in _ISSUED
    )


def clock_tolerance(settings: Settings) -> timedelta:
    """How far the hosts' clocks may disagree: 5 minutes, or a tenth of a ttl
    shorter than 50 minutes. A token issued further in the future is refused,
    and :func:`max_age` leaves this much of the ttl as a margin."""
    return min(CLOCK_TOLERANCE, settings.ttl / 10)


def expired_error(settings: Settings) -> FormKeyExpiredError:
    """The refusal of an expired token that found no record to replay."""
    return FormKeyExpiredError(
        "This form has expired: it was rendered more than "
        f"{_human(max_age(settings))} ago. Reload the page and submit it again; this "
        "request did nothing."
    )


def max_age(settings: Settings) -> timedelta:
    """How long a rendered form may start an operation: the setting, at most the
    ttl less the :func:`clock_tolerance` (a submission after its record expired
    would run again, and the host that rendered the form may run ahead of the
    one that stores the record)."""
    cap = settings.ttl - clock_tolerance(settings)
    configured = settings.form_key_max_age
    return cap if configured is None else min(configured, cap)


def check_binding(token: FormToken, scope: str) -> None:
    """Refuse a token rendered for another form or another caller."""
    if token.endpoint != request.endpoint:
        raise FormKeyError(
            f"This form's key was rendered for the endpoint {token.endpoint!r}, not "
            f"{request.endpoint!r}, the one it was sent to. (For a page rendered by another "
            f"view, render idempotency_field({request.endpoint!r}).)",
            reason="other_form",
        )
    owner = _owner(create=False)
    if not any(
        hmac.compare_digest(token.scope_digest, _caller_digest(scope, owner, secret))
        for secret in _secrets()
    ):
        raise FormKeyError(
            "This form was rendered for another user or session than the one submitting "
            "it (signed in or out since, or a new browser session?). This request did "
            "nothing: if the form was sent before, check whether that went through before "
            "sending it again from a reloaded page.",
            reason="other_caller",
        )


_FORGED = (
    "This form's key is not one this site issued, or was altered. Reload the page and "
    "submit it again; this request did nothing."
)


def _human(limit: timedelta) -> str:
    seconds = int(limit.total_seconds())
    if seconds % 3600 == 0:
        hours = seconds // 3600
        return f"{hours} hour{'s' if hours != 1 else ''}"
    if seconds % 60 == 0:
        minutes = seconds // 60
        return f"{minutes} minute{'s' if minutes != 1 else ''}"
    return f"{seconds} second{'s' if seconds != 1 else ''}"


def request_key(settings: Settings) -> tuple[str | None, FormToken | None]:
    """The current request's key and, when a rendered form's token carried it,
    the verified token (its binding is checked once the scope is known).

    The header wins over the form field; a header holding a form token (a
    page's ``fetch()``) is verified as one. ``(None, None)``: no key.
    """
    req = request._get_current_object()  # type: ignore[attr-defined]
    environ = req.environ
    values = request_header_values(req, settings.header)
    raw: str | None
    if len(values) == 1 and looks_like_token(values[0]):
        raw = values[0]
    elif values:
        # The recovery job re-sends a record's key, which its first request may
        # have brought in a form token (never checked against the key format).
        recovery = RECOVERY_ENVIRON_KEY in environ
        key = key_from_values(
            values,
            settings.header,
            max_length=MAX_KEY_LENGTH if recovery else settings.key_max_length,
            key_format=None if recovery else settings.key_format,
        )
        return key, None
    else:
        raw = field_value(settings)
    if raw is None:
        return None, None
    # Problems of this request answer a browser with a page (errors.ProblemError).
    environ[_pages.FORM_REQUEST] = True
    token = decode(raw, settings)
    return token.key, token


def form_ignored_fields(settings: Settings) -> tuple[str, ...]:
    """The form fields that never count in the fingerprint: the key's own, and
    Flask-WTF's CSRF token (both new with each rendering of the same form)."""
    if not is_form():
        return ()
    csrf = current_app.config.get("WTF_CSRF_FIELD_NAME") or "csrf_token"
    return (settings.form_field, csrf) if settings.form_field else (csrf,)
