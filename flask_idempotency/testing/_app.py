"""Finding and building the user's app, in the test process and the served one."""

from __future__ import annotations

import importlib
import inspect
import typing as t

import sqlalchemy as sa
from flask import Flask

#: The extension's config keys start so.
_PREFIX = "IDEMPOTENCY_"


def load_app(spec: str, config: t.Mapping[str, t.Any]) -> Flask:
    """The app ``spec`` names (``"package.module:create_app"``), with ``config``.

    A factory is called with ``config`` as its one argument (a ``dict``); a
    factory that takes no argument is called bare and ``config`` applied after.
    A :class:`~flask.Flask` instance gets ``config`` applied, and its default
    Flask-SQLAlchemy engine is pointed at ``SQLALCHEMY_DATABASE_URI``. Applied
    after, ``IDEMPOTENCY_*`` settings would be ignored (the extension read them
    at ``init_app``): ``config`` naming one with another value than the app
    already has is refused (``RuntimeError``).
    Without ``:name``, ``create_app`` then ``app`` are tried, as ``flask --app`` does.

    When ``config`` names ``SQLALCHEMY_DATABASE_URI``, the app built must use
    that database (its config and its default engine), else ``RuntimeError``:
    a factory that ignores its argument would run the tests, and the kit's
    ``create_all``, on the database it names itself.
    """
    module_name, _, name = spec.partition(":")
    if not module_name:
        raise ValueError(f"idempotency_app {spec!r}: name a module, as 'myshop.app:create_app'")
    module = importlib.import_module(module_name)
    names = [name] if name else ["create_app", "app"]
    for attribute in names:
        target = getattr(module, attribute.removesuffix("()"), None)
        if target is not None:
            break
    else:
        raise ValueError(f"idempotency_app {spec!r}: {module_name} has no {' or '.join(names)}")
    if isinstance(target, Flask):
        _refuse_settings_after_init(spec, target, config, "a Flask instance")
        _reconfigure(target, config)
        return target
    if not callable(target):
        raise TypeError(f"idempotency_app {spec!r} is neither a Flask app nor a factory")
    if _takes_an_argument(target):
        app = target(dict(config))
    else:
        app = target()
        if isinstance(app, Flask):
            _refuse_settings_after_init(spec, app, config, "a factory without parameters")
            _reconfigure(app, config)
    if not isinstance(app, Flask):
        raise TypeError(f"idempotency_app {spec!r} returned {type(app).__name__}, not a Flask app")
    _check_database(spec, app, config.get("SQLALCHEMY_DATABASE_URI"))
    return app


def _refuse_settings_after_init(
    spec: str, app: Flask, config: t.Mapping[str, t.Any], what: str
) -> None:
    """``IDEMPOTENCY_*`` in ``config`` that the app built without it has another
    value for: applied now, the app's config would say one thing and the
    extension (which read its settings at ``init_app``) do another."""
    missing = object()
    differ = sorted(
        name
        for name, value in config.items()
        if name.startswith(_PREFIX) and app.config.get(name, missing) != value
    )
    if differ:
        given = ", ".join(f"{name}={config[name]!r}" for name in differ)
        raise RuntimeError(
            f"idempotency_app {spec!r} is {what}: the app is built before the kit's "
            f"config can reach it, and the extension read its IDEMPOTENCY_* settings "
            f"in init_app, so {given} from the kit's app_config would be ignored. "
            "Name a factory that takes a config mapping and applies it before "
            "idem.init_app (myshop.app:create_app(config)), or leave these keys out "
            "of app_config."
        )


def key_header(app: Flask) -> str:
    """The header the app's extension reads the key from: ``IDEMPOTENCY_HEADER``
    (``init_app`` sets its default in the config; the kit refuses to change it
    after)."""
    return str(app.config.get("IDEMPOTENCY_HEADER") or "Idempotency-Key")


def _where(url: t.Any) -> tuple[t.Any, ...]:
    """What names a database in ``url``: backend, host, port, database (the
    query and driver are left out: Flask-SQLAlchemy adds to the query)."""
    parsed = sa.make_url(url)
    return (parsed.get_backend_name(), parsed.host, parsed.port, parsed.database)


def _check_database(spec: str, app: Flask, url: t.Any) -> None:
    if url is None:
        return
    found = [("its SQLALCHEMY_DATABASE_URI", app.config.get("SQLALCHEMY_DATABASE_URI"))]
    ext = app.extensions.get("sqlalchemy")
    if ext is not None:
        with app.app_context():
            engine = ext.engines.get(None)
        if engine is not None:
            found.append(("its Flask-SQLAlchemy engine", engine.url))
    for what, value in found:
        if value is None or _where(value) != _where(url):
            shown = "nothing" if value is None else sa.make_url(value).render_as_string()
            raise RuntimeError(
                f"idempotency_app {spec!r}: the app built with the kit's config uses {shown} "
                f"({what}), not the test database the kit gave it "
                f"({sa.make_url(url).render_as_string()}); the kit stops before it touches "
                "another database. Name a factory that applies its one argument, a config "
                "mapping, before db.init_app (or one without parameters, or the app itself)."
            )


def _takes_an_argument(factory: t.Callable[..., t.Any]) -> bool:
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in parameters
    )


def _reconfigure(app: Flask, config: t.Mapping[str, t.Any]) -> None:
    """Apply ``config`` to an app already built, and give its default engine the
    database ``config`` names (Flask-SQLAlchemy makes engines in ``init_app``)."""
    app.config.update(config)
    url = config.get("SQLALCHEMY_DATABASE_URI")
    ext = app.extensions.get("sqlalchemy")
    if url is None or ext is None:
        return
    engines = getattr(ext, "_app_engines", None)
    make = getattr(ext, "_make_engine", None)
    if engines is None or make is None or app not in engines:
        raise RuntimeError(
            "idempotency_app names a Flask instance whose database the kit cannot "
            "change; name its factory instead (module:create_app)"
        )
    with app.app_context():
        old = engines[app].get(None)
        if old is not None and old.url.render_as_string(hide_password=False) == url:
            return
        options = dict(app.config.get("SQLALCHEMY_ENGINE_OPTIONS") or {})
        options["url"] = url
        ext._apply_driver_defaults(options, app)
        engines[app][None] = make(None, options, app)
        if old is not None:
            old.dispose()


def create_tables(app: Flask) -> None:
    """``create_all`` of the app's Flask-SQLAlchemy (its tables and the
    extension's, which ``init_app`` put on the same metadata)."""
    ext = app.extensions.get("sqlalchemy")
    if ext is None:
        raise RuntimeError("the app has no Flask-SQLAlchemy extension extension")
    with app.app_context():
        ext.create_all()


def dispose(app: Flask) -> None:
    """Close the pooled connections of the app's engines."""
    ext = app.extensions.get("sqlalchemy")
    if ext is None:
        return
    with app.app_context():
        for engine in ext.engines.values():
            engine.dispose()
