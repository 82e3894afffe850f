"""Job locks: one runner of a named job at a time, across processes and hosts.

A row per job in ``idempotency_job_locks``. Acquiring is one conditional
``UPDATE`` (free, or held past its expiry), so exactly one contender wins on any
engine. The holder renews while it works and frees the row when done; a holder
that dies simply lets the lock expire.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import uuid

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc


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
        self, engine: sa.Engine, name: str, holder: str, ttl: dt.timedelta, now: dt.datetime
    ) -> bool:
        """Take the lock on ``name`` for ``ttl``; ``False`` if someone else holds it."""
        c = self.table.c
        stmt = (
            sa.update(self.table)
            .where(c.name == name, sa.or_(c.locked_until.is_(None), c.locked_until <= now))
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
