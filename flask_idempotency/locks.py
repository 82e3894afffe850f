"""Job locks: one run of a named job per interval, across processes and hosts.

A row per job in ``idempotency_job_locks``. Acquiring is one conditional
``UPDATE``, so exactly one contender wins on any engine. It succeeds only when

* the lock is free, or held past its expiry (``locked_until``): runs never
  overlap, and a holder that dies simply lets the lock expire after
  ``IDEMPOTENCY_JOB_LOCK``; and
* for a scheduled tick (``every`` given), the job's last run, by whichever
  process or host, started at least ``every`` minus a small slack ago
  (``last_started_at``): every process may tick, but the ticks that come too
  soon after someone else's run are skipped. So the job runs about once per
  ``every`` however many processes schedule it, and the database load of
  maintenance stays flat as workers and hosts are added.

The slack (:func:`interval_slack`: a tenth of ``every``, at most one second)
keeps a tick that fires a few milliseconds early, relative to the previous
run's start, from being skipped into a doubled interval. A run asked for by
hand (``every=None``) skips only while another run holds the lock.

Times are the app's clock (``state.clock``), written in UTC, as everywhere else.
Hosts compare their own clock with a time another host wrote, so clock skew
between hosts shifts the interval by the skew; keep clocks in sync (NTP). A
``last_started_at`` more than ``every`` ahead of this host's clock can only
come from a host whose clock is ahead: it is ignored, so such a host cannot
stop the job elsewhere for longer than ``every``.

The holder renews while it works and frees the row when done.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import uuid

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

#: The slack is this fraction of the interval ...
SLACK_FRACTION = 0.1
#: ... and never more than this.
MAX_SLACK = dt.timedelta(seconds=1)


def interval_slack(every: dt.timedelta) -> dt.timedelta:
    """How much earlier than ``every`` after the last start a tick may still run."""
    return min(every * SLACK_FRACTION, MAX_SLACK)


def new_holder_id() -> str:
    """host:pid:random, unique per scheduler instance."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class JobLocks:
    def __init__(self, table: sa.Table) -> None:
        self.table = table

    def _ensure_row(self, engine: sa.Engine, name: str) -> None:
        try:
            with engine.begin() as conn:
                conn.execute(sa.insert(self.table).values(name=name))
        except sa_exc.IntegrityError:
            pass  # another process made it first

    def acquire(
        self,
        engine: sa.Engine,
        name: str,
        holder: str,
        ttl: dt.timedelta,
        now: dt.datetime,
        every: dt.timedelta | None = None,
    ) -> bool:
        """Take the lock on ``name`` for ``ttl`` and record ``now`` as the run's start.

        ``False`` if another run holds it, or (with ``every``) if the last run
        anywhere started less than ``every`` minus :func:`interval_slack` ago.
        ``every=None`` is a run asked for by hand: no interval rule.
        """
        c = self.table.c
        conditions = [c.name == name, sa.or_(c.locked_until.is_(None), c.locked_until <= now)]
        if every is not None:
            conditions.append(
                sa.or_(
                    c.last_started_at.is_(None),
                    c.last_started_at <= now - every + interval_slack(every),
                    c.last_started_at > now + every,  # written by a clock far ahead
                )
            )
        stmt = (
            sa.update(self.table)
            .where(*conditions)
            .values(holder=holder, locked_until=now + ttl, last_started_at=now)
        )
        for _ in range(2):
            with engine.begin() as conn:
                if conn.execute(stmt).rowcount == 1:
                    return True
                exists = conn.execute(sa.select(c.name).where(c.name == name)).first()
            if exists is not None:
                return False
            self._ensure_row(engine, name)
        return False

    def renew(
        self, engine: sa.Engine, name: str, holder: str, ttl: dt.timedelta, now: dt.datetime
    ) -> bool:
        """Extend a lock this holder still has; ``False`` if it was lost."""
        c = self.table.c
        stmt = (
            sa.update(self.table)
            .where(c.name == name, c.holder == holder, c.locked_until > now)
            .values(locked_until=now + ttl)
        )
        with engine.begin() as conn:
            return bool(conn.execute(stmt).rowcount == 1)

    def release(self, engine: sa.Engine, name: str, holder: str, now: dt.datetime) -> None:
        """Free the lock if this holder still has it."""
        c = self.table.c
        stmt = (
            sa.update(self.table)
            .where(c.name == name, c.holder == holder)
            .values(holder=None, locked_until=None, last_finished_at=now)
        )
        with engine.begin() as conn:
            conn.execute(stmt)
