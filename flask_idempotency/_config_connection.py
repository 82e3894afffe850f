"""The checks of the settings about the app's connection to its database (a
pooler in front of it, the relay's LISTEN URL) and of the form field's name:
moved out of :mod:`._config`, which imports them, to keep it under its bound."""

from __future__ import annotations

import typing as t

import sqlalchemy as sa

#: The poolers ``IDEMPOTENCY_DATABASE_POOLER`` names.
POOLERS = ("session", "transaction", "transaction+prepared")
#: Those that give a client a server connection for one transaction at a time.
TRANSACTION_POOLERS = frozenset({"transaction", "transaction+prepared"})


def resolve_form_field(value: t.Any) -> str | None:
    """``IDEMPOTENCY_FORM_FIELD``: a field name, or ``None``/``""`` for none."""
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not value.strip() or value != value.strip():
        raise ValueError(
            f"IDEMPOTENCY_FORM_FIELD must be a form field's name (or None), got {value!r}"
        )
    return value


def resolve_pooler(value: t.Any, name: str) -> str | None:
    """``None`` (or ``""``/``"none"``, as read from an environment variable) or
    one of :data:`POOLERS` (any case, spaces around ignored).
    Statement pooling is refused: a claim commits with the view's writes, in a
    transaction of several statements, which it forbids."""
    if value is None:
        return None
    if isinstance(value, str):
        mode = value.strip().lower()
        if mode in ("", "none"):
            return None
        if mode in POOLERS:
            return mode
        if mode == "statement":
            raise ValueError(
                f"{name}: statement pooling allows no transaction of several statements, and a"
                " claim commits in one with the view's writes; use transaction pooling"
            )
    choices = ", ".join(repr(mode) for mode in POOLERS)
    raise ValueError(f"{name} must be None or one of {choices}, got {value!r}")


def resolve_listen_url(value: t.Any, name: str) -> str | None:
    """``None`` or a PostgreSQL URL (a string or a SQLAlchemy ``URL``), kept as text."""
    if value is None:
        return None
    try:
        url = sa.make_url(value)
    except Exception:  # ArgumentError, or a type make_url cannot read
        # Not echoed: the text may hold a password.
        raise ValueError(f"{name} must be a database URL (text or sqlalchemy.URL)") from None
    if url.get_backend_name() != "postgresql":
        raise ValueError(f"{name}: LISTEN is PostgreSQL's; got a {url.get_backend_name()} URL")
    return url.render_as_string(hide_password=False)
