"""What keeps a record from being released: the one rule the jobs, the
command line and any other entry point that deletes a record follow.

A record that is not expired may be released (deleted, so the client's next
retry runs the operation again) only when nothing holds it. Five things do,
each stated here twice, once on a record as read (:meth:`Hold.applies`) and
once in SQL (:meth:`Hold.condition`), side by side so that the two cannot
drift apart:

* a **completed** record: its answer is the operation's outcome;
* a **view that committed** work of its own (in progress with an answer
  stored): the operation happened, and is settled with that answer;
* a **live lease**: the operation is running now;
* **recovery points** (finished steps, or derived keys handed out): the
  client's retry resumes the operation where it stopped;
* an **erased** record (a tombstone): it is the fence that keeps an erased
  operation from running again until it expires.

The first two and the last are never overridden; the other two
may be, by an operator who names them (:data:`OVERRIDABLE`). An expired
record (:func:`.sql.expired`) already counts as absent, so nothing holds it.
:func:`release_verdict` judges a record read; :func:`releasable` is the same
rule as the ``WHERE`` of the ``DELETE`` that acts on it, so a record that
changed since it was read is left alone.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import typing as t

import sqlalchemy as sa

from .schema import COMPLETED, ERASED, IN_PROGRESS, Record
from .sql import expired


class Hold(enum.Enum):
    """One reason a record may not be released (its value names it in the CLI)."""

    COMPLETED = "completed"
    VIEW_COMMITTED = "view-committed"
    LIVE_LEASE = "live-lease"
    RECOVERY_POINTS = "recovery-points"
    ERASED = "erased"

    def applies(self, record: Record, now: dt.datetime) -> bool:
        """Whether this holds ``record`` (as read) at ``now``."""
        if self is Hold.COMPLETED:
            return record.status == COMPLETED
        if self is Hold.VIEW_COMMITTED:
            return record.view_committed
        if self is Hold.LIVE_LEASE:
            return record.lease_live(now)
        if self is Hold.ERASED:
            return record.status == ERASED
        return record.status == IN_PROGRESS and record.holds_recovery_points

    def condition(self, c: t.Any, now: t.Any) -> t.Any:
        """SQL: this holds the row (``c`` the table's columns) at ``now``."""
        if self is Hold.COMPLETED:
            return c.status == COMPLETED
        if self is Hold.VIEW_COMMITTED:
            return sa.and_(c.status == IN_PROGRESS, c.response_code.is_not(None))
        if self is Hold.LIVE_LEASE:
            return sa.and_(
                c.status == IN_PROGRESS, c.locked_until.is_not(None), c.locked_until > now
            )
        if self is Hold.ERASED:
            return c.status == ERASED
        return sa.and_(c.status == IN_PROGRESS, c.recovery_points.is_not(None))

    @property
    def overridable(self) -> bool:
        """An operator may release the record anyway, by naming this hold."""
        return self in OVERRIDABLE

    def reason(self, record: Record) -> str:
        """Why this holds ``record``, in one clause, with what to do instead."""
        if self is Hold.COMPLETED:
            return (
                f"it is completed ({record.response_code}): its answer is the operation's "
                "outcome and replays to every retry; releasing it would run the operation "
                f"a second time. It expires at {_iso(record.expires_at)} and is purged "
                "after; a client that needs the operation done again sends a new key"
            )
        if self is Hold.VIEW_COMMITTED:
            return (
                "its view committed work of its own (the stored "
                f"{record.response_code} answer is its outcome): releasing it would run "
                "the view a second time. The recovery job settles it with that answer "
                "('flask idempotency recover')"
            )
        if self is Hold.LIVE_LEASE:
            return (
                f"its lease is live until {_iso(record.locked_until)}: the operation is "
                "running now, and a retry would start a second one beside it. Wait for "
                "the lease to end (--override live-lease releases it anyway)"
            )
        if self is Hold.ERASED:
            return (
                "it is an erased tombstone: it keeps the erased operation from running "
                "again with this key (a retry is answered 410 key-erased); releasing it "
                f"would run it a second time. It expires at {_iso(record.expires_at)} and "
                "is purged after"
            )
        return (
            "it holds recovery points (finished steps, or derived keys handed out): the "
            "client's retry resumes the operation after them, and after a release it "
            "would start afresh and repeat them (--override recovery-points releases "
            "it anyway)"
        )

    def overriding(self, record: Record) -> str:
        """What releasing ``record`` despite this (overridable) hold gives up."""
        if self is Hold.LIVE_LEASE:
            return (
                f"live-lease (until {_iso(record.locked_until)}): its holder can no "
                "longer store its answer or steps (it is answered lease-lost), and the "
                "next retry runs the operation again"
            )
        steps = ", ".join(sorted(record.recovery_points)) or "none, derived keys handed out"
        held = f"{len(record.recovery_points)} step(s) {steps}"
        if record.unreadable is not None:  # sealed, and they do not open here
            held = "sealed, unreadable"
        given_up = (
            f"recovery-points ({held}): the next retry starts the operation afresh with "
            "new derived keys"
        )
        unstored = record.unstored_steps
        if not unstored:
            return given_up
        # A step-not-stored record: the way out re-runs a step that did its work.
        names = ", ".join(repr(name) for name in unstored)
        if len(unstored) == 1:
            ran = (
                f"step {names} ran but its result was not stored: the retry runs it again, "
                "though its effect already happened"
            )
        else:
            ran = (
                f"steps {names} ran but their results were not stored: the retry runs them "
                "again, though their effects already happened"
            )
        return f"{given_up}; {ran} (a downstream sees a new derived key): check downstream first"


#: The holds an operator may override by naming them; a committed outcome
#: (a completed record, a view that committed) and a tombstone never.
OVERRIDABLE = frozenset({Hold.LIVE_LEASE, Hold.RECOVERY_POINTS})


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether a record may be released, and why (see :func:`release_verdict`)."""

    #: The record may be released (with the overrides given).
    allowed: bool
    #: Every hold on the record, overridden or not.
    holds: tuple[Hold, ...]
    #: The holds the overrides given set aside.
    overridden: tuple[Hold, ...]
    #: One line: why it may not be released, or what releasing it overrides.
    reason: str


def release_verdict(
    record: Record, now: dt.datetime, overrides: t.Collection[Hold] = ()
) -> Verdict:
    """Whether ``record`` may be released at ``now``, overriding only ``overrides``.

    An expired record may always be (a request already treats it as absent).
    Otherwise every hold must be absent or overridden, and a committed outcome
    cannot be overridden (``ValueError`` if asked to).
    """
    refused = [hold for hold in overrides if not hold.overridable]
    if refused:
        raise ValueError(f"{refused[0].value} cannot be overridden: it is a committed outcome")
    if record.is_expired(now):
        return Verdict(True, (), (), "it has expired: requests already treat it as absent")
    holds = tuple(hold for hold in Hold if hold.applies(record, now))
    blocking = [hold for hold in holds if hold not in overrides]
    overridden = tuple(hold for hold in holds if hold in overrides)
    if blocking:
        return Verdict(False, holds, overridden, blocking[0].reason(record))
    if overridden:
        named = "; ".join(hold.overriding(record) for hold in overridden)
        return Verdict(True, holds, overridden, f"overriding {named}")
    return Verdict(True, holds, (), "nothing holds it")


def releasable(c: t.Any, now: t.Any, overrides: t.Collection[Hold] = ()) -> t.Any:
    """SQL, as :func:`release_verdict`: the row may be released at ``now``."""
    free = [sa.not_(hold.condition(c, now)) for hold in Hold if hold not in overrides]
    return sa.or_(sa.and_(*expired(c, now)), sa.and_(*free))


def _iso(value: dt.datetime | None) -> str:
    return value.isoformat() if value is not None else "-"
