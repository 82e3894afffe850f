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

Times are the database's clock (:func:`~flask_idempotency._storage.sql.database_now`),
read in the transaction of each statement, not the hosts' own: every host
compares the row with the same clock, so a host whose clock runs behind
cannot run a job twice as often, and one whose clock runs ahead cannot start a
run while another still holds the lock. (An app given its own clock,
``Idempotency(clock=...)``, as tests do, uses that one instead.) The caller
may pass its own clock's reading: a difference of more than
:data:`SKEW_WARNING` from the database's is logged once per holder, since
requests judge the records' leases and retention by the app's clock. A
``last_started_at`` more than ``every`` ahead of the database's clock (a
failover to a server whose clock is behind) is ignored, so it cannot stop the
job for longer than ``every``.

The holder renews while it works and frees the row when done. Whether a
conditional ``UPDATE`` won is read from the row it returns where the engine
has ``RETURNING`` (:func:`~flask_idempotency._storage.sql.changed_one`).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import typing as t
import uuid

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from .schema import as_utc
from .sql import changed_one, database_now, returning

logger = logging.getLogger("flask_idempotency")

#: The slack is this fraction of the interval ...
SLACK_FRACTION = 0.1
#: ... and never more than this.
MAX_SLACK = dt.timedelta(seconds=1)
#: A host clock this far from the database's is logged (once per holder).
SKEW_WARNING = dt.timedelta(seconds=1)


def interval_slack(every: dt.timedelta) -> dt.timedelta:
    """How much earlier than ``every`` after the last start a tick may still run."""
    return min(every * SLACK_FRACTION, MAX_SLACK)


def new_holder_id() -> str:
    """host:pid:random, unique per scheduler instance."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class JobLocks:
    """The job locks of one ``idempotency_job_locks`` table.

    ``clock`` (tests): the time the locks compare, instead of the database's.
    """

    def __init__(self, table: sa.Table, clock: t.Callable[[], dt.datetime] | None = None) -> None:
        self.table = table
        self._clock = clock
        self._skew_told: set[str] = set()
        c = table.c
        self._renew = sa.update(table).where(
            c.name == sa.bindparam("w_name"),
            c.holder == sa.bindparam("w_holder"),
            c.locked_until > sa.bindparam("w_now"),
        )

    def _now(self, conn: sa.Connection, holder: str, host_now: dt.datetime | None) -> dt.datetime:
        """The time the lock compares: the database's clock (or the given one)."""
        if self._clock is not None:
            return self._clock()
        now = database_now(conn)
        if host_now is not None and holder not in self._skew_told:
            skew = host_now - now
            if abs(skew) > SKEW_WARNING:
                self._skew_told.add(holder)
                logger.warning(
                    "this host's clock is %.1f s %s the database's: the jobs and job "
                    "locks use the database's, but requests judge record leases and "
                    "retention by this host's; sync the clocks (NTP)",
                    abs(skew.total_seconds()),
                    "ahead of" if skew > dt.timedelta(0) else "behind",
                )
        return now

    def runs(self, conn: sa.Connection) -> dict[str, tuple[t.Any, t.Any, t.Any]]:
        """For each job that ever took its lock, by name: when its last run
        (in any process) started, when the last one finished, and until when
        its lock is held (``None``: free); the database's times."""
        c = self.table.c
        rows = conn.execute(
            sa.select(c.name, c.last_started_at, c.last_finished_at, c.locked_until)
        )
        return {
            str(name): (as_utc(started), as_utc(finished), as_utc(until))
            for name, started, finished, until in rows
        }

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
        host_now: dt.datetime | None = None,
        every: dt.timedelta | None = None,
    ) -> bool:
        """Take the lock on ``name`` for ``ttl`` and record the run's start.

        ``False`` if another run holds it, or (with ``every``) if the last run
        anywhere started less than ``every`` minus :func:`interval_slack` ago.
        ``every=None`` is a run asked for by hand: no interval rule. Times are
        the database's clock; ``host_now``, this host's clock, is only compared
        with it to warn of skew.
        """
        c = self.table.c
        for _ in range(2):
            with engine.begin() as conn:
                now = self._now(conn, holder, host_now)
                conditions = [
                    c.name == name,
                    sa.or_(c.locked_until.is_(None), c.locked_until <= now),
                ]
                if every is not None:
                    conditions.append(
                        sa.or_(
                            c.last_started_at.is_(None),
                            c.last_started_at <= now - every + interval_slack(every),
                            c.last_started_at > now + every,  # a clock that stepped back
                        )
                    )
                stmt = (
                    sa.update(self.table)
                    .where(*conditions)
                    .values(holder=holder, locked_until=now + ttl, last_started_at=now)
                )
                if changed_one(conn, returning(stmt, conn.dialect, c.name), {}):
                    return True
                exists = conn.execute(sa.select(c.name).where(c.name == name)).first()
            if exists is not None:
                return False
            self._ensure_row(engine, name)
        return False

    def renew(
        self,
        engine: sa.Engine,
        name: str,
        holder: str,
        ttl: dt.timedelta,
        host_now: dt.datetime | None = None,
    ) -> bool:
        """Extend a lock this holder still has; ``False`` if it was lost."""
        with engine.begin() as conn:
            now = self._now(conn, holder, host_now)
            stmt = self._renew.values(locked_until=now + ttl)
            stmt = returning(stmt, conn.dialect, self.table.c.name)
            return changed_one(conn, stmt, {"w_name": name, "w_holder": holder, "w_now": now})

    def release(
        self, engine: sa.Engine, name: str, holder: str, host_now: dt.datetime | None = None
    ) -> None:
        """Free the lock if this holder still has it."""
        c = self.table.c
        with engine.begin() as conn:
            now = self._now(conn, holder, host_now)
            conn.execute(
                sa.update(self.table)
                .where(c.name == name, c.holder == holder)
                .values(holder=None, locked_until=None, last_finished_at=now)
            )
