"""Whether the driver a database URL selects is installed, and which extra (or
URL) to use when it is not.

SQLAlchemy picks a driver for a URL that names none (``postgresql://`` is
psycopg 3 under SQLAlchemy 2.1, ``mysql://`` is mysqlclient), which the
extra a user installed may not provide: ``[postgresql]`` installs psycopg2,
``[mysql]`` PyMySQL. Left alone, the first engine ends in a bare
``ModuleNotFoundError`` naming a module the user never chose.
"""

from __future__ import annotations

import importlib.util
import typing as t

import sqlalchemy as sa

#: (backend, driver) -> (what to call it, the extra that installs it, or the
#: package to install when no extra does).
_DRIVERS: dict[tuple[str, str], tuple[str, str]] = {
    ("postgresql", "psycopg"): ("psycopg (psycopg 3)", "flask-idempotency's [psycopg] extra"),
    ("postgresql", "psycopg2"): ("psycopg2", "flask-idempotency's [postgresql] extra"),
    ("mysql", "pymysql"): ("PyMySQL", "flask-idempotency's [mysql] extra"),
    ("mysql", "mysqldb"): ("mysqlclient (MySQLdb)", "the mysqlclient package"),
    ("mariadb", "pymysql"): ("PyMySQL", "flask-idempotency's [mysql] extra"),
    ("mariadb", "mysqldb"): ("mysqlclient (MySQLdb)", "the mysqlclient package"),
}
#: For each backend, the drivers an extra installs, with the module to look for.
_ALTERNATIVES: dict[str, tuple[tuple[str, str], ...]] = {
    "postgresql": (("psycopg2", "psycopg2"), ("psycopg", "psycopg")),
    "mysql": (("pymysql", "pymysql"),),
    "mariadb": (("pymysql", "pymysql"),),
}


def missing_driver(url: str | sa.URL, setting: str) -> str | None:
    """``None`` when the driver ``url`` selects imports (or the URL is not one
    SQLAlchemy reads: its own error follows at ``create_engine``); otherwise a
    message that names the driver, ``setting`` (where the URL came from), the
    extra to install, and, when another driver of that database is installed,
    the URL that names it."""
    try:
        parsed = sa.make_url(url)
    except Exception:  # not a URL: SQLAlchemy says so itself
        return None
    if parsed.drivername.split("+")[0] == "postgres":
        # Heroku and others still hand out postgres://, an alias SQLAlchemy 1.4 dropped.
        rest = parsed.drivername.partition("+")[2]
        spelled = f"postgresql+{rest}://" if rest else "postgresql://"
        return (
            f"{setting}: SQLAlchemy does not know the scheme {parsed.drivername}:// "
            f"(the postgres:// alias was removed in SQLAlchemy 1.4): write {spelled}"
        )
    try:
        dialect = parsed.get_dialect()
    except Exception:  # an unknown dialect: SQLAlchemy says so itself
        return None
    if getattr(dialect, "is_async", False):
        return (
            f"{setting}: the URL names the asyncio driver {dialect.driver}; Flask-SQLAlchemy "
            "needs a synchronous driver (for PostgreSQL postgresql+psycopg:// or "
            "postgresql+psycopg2://, for MySQL/MariaDB mysql+pymysql://, for SQLite "
            "sqlite://)"
        )
    try:
        dialect.import_dbapi()
    except ModuleNotFoundError as exc:
        if parsed.get_backend_name() == "sqlite" and exc.name in ("_sqlite3", "sqlite3"):
            return (
                f"{setting}: this Python was built without SQLite support ({exc}): use a "
                "Python built with sqlite3 (install SQLite's development headers, e.g. "
                "libsqlite3-dev, before building it), or pass a DB-API module such as "
                "pysqlite3's as SQLALCHEMY_ENGINE_OPTIONS={'module': ...}"
            )
        return _message(parsed, dialect, setting, exc)
    except Exception:  # a driver that fails otherwise: its own error is the clearest
        return None
    return None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it: not usable here
        return False


def _message(url: sa.URL, dialect: t.Any, setting: str, exc: ModuleNotFoundError) -> str:
    backend, driver = url.get_backend_name(), dialect.driver
    name, extra = _DRIVERS.get((backend, driver), (driver, f"the {driver} package"))
    chosen = (
        f"the URL names the driver {name},"
        if "+" in url.drivername
        else f"a {backend}:// URL selects SQLAlchemy's default {backend} driver, {name},"
    )
    installed, installable = [], []
    for other, module in _ALTERNATIVES.get(backend, ()):
        if other == driver:
            continue
        url_prefix = f"{backend}+{other}://"
        if _importable(module):
            installed.append(url_prefix)
        else:
            installable.append(f"{_DRIVERS[(backend, other)][1]} and write {url_prefix}")
    instead = ""
    if installed:
        instead += f", or name the installed driver in the URL: {' or '.join(installed)}"
    if installable:
        instead += f", or install {' or '.join(installable)}"
    return f"{setting}: {chosen} which is not installed ({exc}). Install {extra}{instead}."


#: Engine options that hand the engine its DB-API module or its connections:
#: the URL's driver is then not what connects, and need not be installed.
_OWN_DRIVER = ("module", "creator", "async_creator")


def configured_urls(config: t.Mapping[str, t.Any]) -> list[tuple[str, t.Any]]:
    """``(setting, url)`` for each database URL Flask-SQLAlchemy reads from ``config``:
    ``SQLALCHEMY_DATABASE_URI`` and each of ``SQLALCHEMY_BINDS`` (a URL, or a dict
    of engine options holding ``url``), but those whose engine options (the
    bind's over ``SQLALCHEMY_ENGINE_OPTIONS``, as Flask-SQLAlchemy merges them)
    pass ``module=`` or ``creator=``: the app brings its own driver there."""
    shared = config.get("SQLALCHEMY_ENGINE_OPTIONS") or {}
    shared = shared if isinstance(shared, t.Mapping) else {}

    def own_driver(options: t.Mapping[str, t.Any]) -> bool:
        merged = {**shared, **options}
        return any(merged.get(name) is not None for name in _OWN_DRIVER)

    found: list[tuple[str, t.Any]] = []
    if config.get("SQLALCHEMY_DATABASE_URI") and not own_driver({}):
        found.append(("SQLALCHEMY_DATABASE_URI", config["SQLALCHEMY_DATABASE_URI"]))
    binds = config.get("SQLALCHEMY_BINDS") or {}
    if isinstance(binds, t.Mapping):
        for key, value in binds.items():
            options = value if isinstance(value, t.Mapping) else {}
            url = options.get("url") if isinstance(value, t.Mapping) else value
            if url and not own_driver(options):
                found.append((f"SQLALCHEMY_BINDS[{key!r}]", url))
    return found
