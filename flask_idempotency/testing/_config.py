"""What the kit runs: the app, the database, the server; read from pytest's
options, ini settings and the environment by the plugin."""

from __future__ import annotations

import dataclasses
import typing as t

#: The environment variable that names the admin database URL.
DATABASE_ENV = "IDEMPOTENCY_KIT_DATABASE_URL"
DEFAULT_DOWNSTREAM_CONFIG = "DOWNSTREAM_URL"


@dataclasses.dataclass
class KitConfig:
    """The kit's settings for one test (the ``idempotency_config`` fixture).

    ``app`` is the import string of the app's factory (or app); ``database`` an
    admin URL of the server the test databases are created on (``None``: the
    server of the app's own ``SQLALCHEMY_DATABASE_URI``); ``downstream_config``
    the config key the fake downstream's URL goes in; ``app_config`` more
    config for the app (JSON-serializable: durations in seconds); ``server``
    ``"gunicorn"``, ``"werkzeug"`` or ``"auto"`` (gunicorn where importable);
    ``workers`` and ``threads`` gunicorn's gthread workers.
    """

    app: str | None = None
    database: str | None = None
    downstream_config: str = DEFAULT_DOWNSTREAM_CONFIG
    app_config: dict[str, t.Any] = dataclasses.field(default_factory=dict)
    server: str = "auto"
    workers: int = 2
    threads: int = 8

    def replace(self, **changes: t.Any) -> KitConfig:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)
