"""Keys for HTML forms: a double click, a reload or back-and-submit is one operation.

A browser sends no ``Idempotency-Key`` header; a page renders one into its form.
``init_app`` registers two Jinja globals:

* ``{{ idempotency_field() }}``: a hidden ``<input>`` (named by
  ``IDEMPOTENCY_FORM_FIELD``) holding a fresh signed key for the form;
* ``{{ idempotency_form_key() }}``: the same token alone, for a page that
  submits with ``fetch()`` and sends it as the ``Idempotency-Key`` header.

Both take the endpoint the form posts to, by default the current request's
(a page whose GET and POST share one view). Each call mints a new key: every
rendering of a form is one intent (two tabs, two orders), every submission of
one rendering is the same operation. The key is signed with ``SECRET_KEY``,
bound to the caller's scope and the endpoint, and expires after
``IDEMPOTENCY_FORM_KEY_MAX_AGE`` (at most the route's ``ttl``); a refused one
answers :class:`~flask_idempotency.errors.FormKeyError`. See docs/forms.md.

For Flask-WTF, :class:`IdempotencyKeyField` renders the same hidden input as
part of a ``FlaskForm`` (``form.hidden_tag()`` included). It needs WTForms
(``pip install flask-wtf``); the rest of this module does not.
"""

from __future__ import annotations

import importlib
import typing as t

from ._request.formkeys import form_field, form_key

# IdempotencyKeyField comes from __getattr__ below (built on first use).
__all__ = ["IdempotencyKeyField", "form_field", "form_key"]  # noqa: F822


def _field_class() -> type:
    try:
        # Imported by name: WTForms is optional and ships no type information.
        hidden_field: t.Any = importlib.import_module("wtforms.fields").HiddenField
    except ImportError as exc:  # pragma: no cover - depends on what is installed
        raise ImportError(
            "flask_idempotency.forms.IdempotencyKeyField needs WTForms: "
            "pip install flask-wtf (or wtforms)"
        ) from exc

    class IdempotencyKeyField(hidden_field):  # type: ignore[misc]
        """A hidden field that renders a fresh form key each time it is rendered.

        Declare it on a ``FlaskForm`` under any name; it renders the input the
        extension reads (named by ``IDEMPOTENCY_FORM_FIELD``). ``endpoint`` is
        the view the form posts to, by default the current request's. A form
        re-rendered after a failed validation gets a new key, so the corrected
        submission is a new operation, never a false mismatch. The field takes
        no part in ``populate_obj``; the extension has verified its key before
        the view runs.
        """

        def __init__(
            self, label: str | None = None, *, endpoint: str | None = None, **kwargs: t.Any
        ) -> None:
            super().__init__(label, **kwargs)
            self.endpoint = endpoint

        def __call__(self, **kwargs: t.Any) -> t.Any:
            return form_field(self.endpoint)

        def _value(self) -> str:
            return form_key(self.endpoint)

        def populate_obj(self, obj: t.Any, name: str) -> None:
            return None

    IdempotencyKeyField.__module__ = __name__
    return IdempotencyKeyField


_cache: dict[str, type] = {}


def __getattr__(name: str) -> t.Any:
    # The field class is built on first use, so that importing this module (and
    # the package) never needs WTForms.
    if name == "IdempotencyKeyField":
        if name not in _cache:
            _cache[name] = _field_class()
        return _cache[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
