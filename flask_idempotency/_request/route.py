"""What ``@idem.idempotent(...)`` fixed for one view, and its settings per app."""

from __future__ import annotations

import dataclasses
import typing as t

from marshmallow import Schema

from .._config import Settings


@dataclasses.dataclass(frozen=True, eq=False)
class RouteOptions:
    """What ``@idem.idempotent(...)`` fixed for one view (hashed by identity)."""

    schema: Schema | None
    exclude: tuple[str, ...]
    scope: t.Callable[[], str] | None
    commit_claim: bool
    recover: bool
    manual: bool = False
    #: The completed record is inserted at the end of the view's transaction.
    optimistic: bool = False
    #: Settings this route overrides (lower-case ``Settings`` field names).
    overrides: t.Mapping[str, t.Any] = dataclasses.field(default_factory=dict)

    def settings_for(self, app_settings: Settings) -> Settings:
        """The app's settings with this route's overrides; validated."""
        if not self.overrides:
            return app_settings
        return dataclasses.replace(app_settings, **self.overrides)
