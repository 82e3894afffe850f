"""What ``@idem.idempotent(...)`` fixed for one view, and its settings per app."""

from __future__ import annotations

import dataclasses
import typing as t

from marshmallow import Schema

from .._config import Settings, check_retention
from .._secrets import MAKE_ONE


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
    #: The decorated view (module and name), for errors about this route.
    view_name: str = "a view"
    #: Fields never kept in the stored request (``redact=``), as written.
    redact: tuple[str, ...] = ()
    #: An idempotent function's settings (``idem.function``), not a route's: its
    #: records keep ``view_name`` as their path, without a method, which tells
    #: them apart (``Record.function_call``).
    function: bool = False

    def settings_for(self, app_settings: Settings) -> Settings:
        """The app's settings with this route's overrides; validated.

        Only a leased route (``lease=``) is bound to a ttl longer than its lease:
        its record must outlive the lease, so that the retry after a crash (or the
        recovery job) resumes the operation instead of starting a new one. A
        route without ``lease=`` commits its record with the view's writes; the
        lease only counts after the view commits in the middle of its run, and a
        record held under a live lease never counts as expired (whatever its
        ttl, ``Record.is_expired``), so no retry starts beside it either way.
        A route with ``redact=`` needs ``IDEMPOTENCY_FINGERPRINT_KEY``: the
        redacted fields count in the fingerprint, which must not be guessable.
        """
        if self.redact and app_settings.fingerprint_key is None:
            raise ValueError(
                f"@idem.idempotent on {self.view_name}: redact= needs IDEMPOTENCY_FINGERPRINT_KEY."
                " The redacted fields still count in the request's fingerprint, and an unkeyed"
                " SHA-256 of them could be confirmed by guessing; make a key with: "
                f"{MAKE_ONE}"
            )
        if not self.overrides:
            return app_settings
        settings = dataclasses.replace(app_settings, **self.overrides)
        if self.commit_claim and ("ttl" in self.overrides or "lease" in self.overrides):
            check_retention(
                settings.ttl,
                settings.lease,
                self.view_name if self.function else f"@idem.idempotent on {self.view_name}",
                names=(
                    "ttl=" if "ttl" in self.overrides else "ttl (IDEMPOTENCY_TTL)",
                    "lease="
                    if "lease" in self.overrides
                    else "lease (lease=True: IDEMPOTENCY_LEASE)",
                ),
            )
        return settings


def view_name(view: t.Callable[..., t.Any]) -> str:
    """``module.qualname`` of a view function (its endpoint is chosen later)."""
    module = getattr(view, "__module__", None)
    name = getattr(view, "__qualname__", None) or getattr(view, "__name__", repr(view))
    return f"{module}.{name}" if module else str(name)
