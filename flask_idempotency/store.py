"""The SQL behind the record: claim, load, take over, complete, release.

Every statement runs in the session it is given, so the record joins the app's
transaction. Dialect differences live here and nowhere else:

* the claim is a conflict-tolerant insert (``ON CONFLICT DO NOTHING`` on
  PostgreSQL and SQLite); other engines insert inside a savepoint and treat a
  unique violation as "exists";
* on PostgreSQL a duplicate waits on the unique index for the first request's
  transaction, bounded by ``lock_timeout``; on SQLite the driver's busy timeout
  bounds the wait for the single writer lock.

Nothing here checks and then inserts: the insert decides, and every later
change is a conditional ``UPDATE``/``DELETE`` on the fencing token that only one
contender can win.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import typing as t

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from .models import COMPLETED, IN_PROGRESS, Record

_PG_LOCK_NOT_AVAILABLE = "55P03"
# set_config(..., true) is SET LOCAL: it ends with the transaction whatever happens.
_SET_LOCK_TIMEOUT = sa.text(
    "SELECT current_setting('lock_timeout'), set_config('lock_timeout', :v, true)"
)
_RESTORE_LOCK_TIMEOUT = sa.text("SELECT set_config('lock_timeout', :v, true)")


class ClaimWaitExceeded(Exception):
    """Waiting for another transaction on the same key took longer than allowed."""


class Store:
    """Statements on one ``idempotency_keys`` table.

    The statements of the common path are built once: constructing SQLAlchemy
    statements per request costs more than the round trips on a local database.
    Parameters named ``w_*`` are the WHERE clause; the others are column values.
    """

    def __init__(self, table: sa.Table) -> None:
        self.table = table
        c = table.c
        this_key = (c.scope == sa.bindparam("w_scope"), c.key == sa.bindparam("w_key"))
        still_held = (
            *this_key,
            c.fencing_token == sa.bindparam("w_token"),
            c.status == IN_PROGRESS,
        )
        self._inserts = {
            "postgresql": postgresql.insert(table).on_conflict_do_nothing(
                index_elements=["scope", "key"]
            ),
            "sqlite": sqlite.insert(table).on_conflict_do_nothing(index_elements=["scope", "key"]),
        }
        self._portable_insert = sa.insert(table)
        self._load = sa.select(table).where(*this_key)
        self._complete = (
            sa.update(table).where(*still_held).values(status=COMPLETED, locked_until=None)
        )
        self._release = sa.delete(table).where(*still_held)
        # An UPDATE of a held record; the SET clause comes from the parameters.
        self._update_held = sa.update(table).where(*still_held)
        token_read = (*this_key, c.fencing_token == sa.bindparam("w_token"))
        self._replace_expired = sa.update(table).where(
            *token_read, c.expires_at <= sa.bindparam("w_now")
        )
        self._reclaim = sa.update(table).where(
            *token_read,
            c.status == IN_PROGRESS,
            c.request_hash == sa.bindparam("w_request_hash"),
            sa.or_(c.locked_until.is_(None), c.locked_until <= sa.bindparam("w_now")),
        )

    @contextlib.contextmanager
    def bounded_wait(self, session: Session, wait: dt.timedelta | None) -> t.Iterator[None]:
        """Bound how long the statements inside wait on another transaction's locks.

        Raises :class:`ClaimWaitExceeded` when the bound is hit (PostgreSQL's
        ``lock_timeout``, or SQLite's busy timeout). On PostgreSQL the app's own
        ``lock_timeout`` is restored afterwards, so the view runs unaffected.
        ``wait=None`` sets no bound of ours (the session's own settings apply).
        """
        bounded = wait is not None and session.get_bind().dialect.name == "postgresql"
        previous = None
        if bounded:
            assert wait is not None
            millis = max(1, int(wait.total_seconds() * 1000))
            previous = session.execute(_SET_LOCK_TIMEOUT, {"v": f"{millis}ms"}).scalar_one()
        try:
            yield
        except sa_exc.DBAPIError as exc:
            # The statement failed, so the transaction is over (PostgreSQL) or
            # will be rolled back: nothing to restore.
            orig = str(exc.orig)
            if getattr(exc.orig, "pgcode", None) == _PG_LOCK_NOT_AVAILABLE or (
                "database is locked" in orig
            ):
                raise ClaimWaitExceeded(orig) from exc
            raise
        except BaseException:
            # An answer decided inside (409, 422): the transaction goes on.
            if bounded:
                session.execute(_RESTORE_LOCK_TIMEOUT, {"v": previous})
            raise
        if bounded:
            session.execute(_RESTORE_LOCK_TIMEOUT, {"v": previous})

    @staticmethod
    def _changed_one(
        session: Session | sa.Connection, stmt: t.Any, params: dict[str, t.Any]
    ) -> bool:
        result = session.execute(stmt, params)
        return bool(result.rowcount == 1)  # type: ignore[attr-defined]

    def try_insert(self, session: Session, values: dict[str, t.Any]) -> bool:
        """Insert a new record; ``False`` when one with the same scope and key exists."""
        conflict_tolerant = self._inserts.get(session.get_bind().dialect.name)
        if conflict_tolerant is not None:
            return self._changed_one(session, conflict_tolerant, values)
        try:
            with session.begin_nested():
                session.execute(self._portable_insert, values)
        except sa_exc.IntegrityError:
            return False
        return True

    def load(self, session: Session | sa.Connection, scope: str, key: str) -> Record | None:
        """The record for (scope, key), or ``None``."""
        row = session.execute(self._load, {"w_scope": scope, "w_key": key}).first()
        return Record.from_row(row) if row is not None else None

    def take_over(
        self,
        session: Session,
        record: Record,
        values: dict[str, t.Any],
        now: dt.datetime,
        *,
        expired: bool,
    ) -> bool:
        """Claim an existing record: replace an expired one, or reclaim an ended lease.

        One conditional ``UPDATE`` on the fencing token read: exactly one
        contender can win, and it gets the token ``record.fencing_token + 1``.
        """
        params = {
            **values,
            "fencing_token": record.fencing_token + 1,
            "w_scope": record.scope,
            "w_key": record.key,
            "w_token": record.fencing_token,
            "w_now": now,
        }
        if expired:
            return self._changed_one(session, self._replace_expired, params)
        # A reclaim continues the same operation: it keeps the original creation
        # and retention times.
        del params["created_at"], params["expires_at"]
        params["w_request_hash"] = values["request_hash"]
        return self._changed_one(session, self._reclaim, params)

    def complete(
        self,
        session: Session,
        scope: str,
        key: str,
        token: int,
        *,
        response_code: int,
        response_headers: list[tuple[str, str]],
        response_body: bytes | None,
        body_omitted: bool,
        now: dt.datetime,
    ) -> bool:
        """Mark the record completed with its response, fenced by ``token``.

        ``False`` means another request took the record over: the caller must
        roll back.
        """
        params = {
            "w_scope": scope,
            "w_key": key,
            "w_token": token,
            "response_code": response_code,
            "response_headers": json.dumps(response_headers),
            "response_body": response_body,
            "body_omitted": body_omitted,
            "completed_at": now,
        }
        return self._changed_one(session, self._complete, params)

    def release(
        self,
        session: Session,
        scope: str,
        key: str,
        token: int,
        *,
        keep_recovery_points: bool = False,
    ) -> bool:
        """Free a record this holder (``token``) still owns, so a retry runs at once.

        The record is deleted, unless it has recovery points to keep: then its
        lease is ended instead, and the retry reclaims it and resumes.
        """
        params: dict[str, t.Any] = {"w_scope": scope, "w_key": key, "w_token": token}
        if keep_recovery_points:
            return self._changed_one(session, self._update_held, {**params, "locked_until": None})
        return self._changed_one(session, self._release, params)

    def save_recovery_points(
        self, conn: sa.Connection, scope: str, key: str, token: int, points: dict[str, t.Any]
    ) -> bool:
        """Store the recovery points, fenced by ``token``; ``False``: the lease was lost."""
        params = {
            "w_scope": scope,
            "w_key": key,
            "w_token": token,
            "recovery_points": json.dumps(points, sort_keys=True, separators=(",", ":")),
        }
        return self._changed_one(conn, self._update_held, params)

    def find_abandoned(self, conn: sa.Connection, now: dt.datetime, limit: int) -> list[Record]:
        """In-progress, unexpired records whose lease has ended, oldest lease first."""
        c = self.table.c
        stmt = (
            sa.select(self.table)
            .where(
                c.status == IN_PROGRESS,
                sa.or_(c.locked_until.is_(None), c.locked_until <= now),
                c.expires_at > now,
            )
            .order_by(c.locked_until)
            .limit(limit)
        )
        return [Record.from_row(row) for row in conn.execute(stmt)]

    def release_abandoned(self, conn: sa.Connection, record: Record, now: dt.datetime) -> bool:
        """Delete an abandoned record, unless someone reclaimed it since it was read."""
        c = self.table.c
        stmt = sa.delete(self.table).where(
            c.scope == record.scope,
            c.key == record.key,
            c.fencing_token == record.fencing_token,
            c.status == IN_PROGRESS,
            sa.or_(c.locked_until.is_(None), c.locked_until <= now),
        )
        return self._changed_one(conn, stmt, {})

    def purge_batch(self, conn: sa.Connection, now: dt.datetime, limit: int) -> int:
        """Delete up to ``limit`` expired records in one statement; the number deleted.

        On PostgreSQL the batch is chosen ``FOR UPDATE SKIP LOCKED``: rows another
        cleaner (or a request replacing an expired record) holds are skipped, so
        cleaners never wait on each other and cannot deadlock. Elsewhere the
        delete re-checks ``expires_at``, so a record replaced meanwhile stays.
        """
        c = self.table.c
        dialect = conn.dialect.name
        batch = (
            sa.select(c.scope, c.key).where(c.expires_at <= now).order_by(c.expires_at).limit(limit)
        )
        if dialect == "postgresql":
            batch = batch.with_for_update(skip_locked=True)
        if dialect in ("postgresql", "sqlite"):
            stmt = sa.delete(self.table).where(
                sa.tuple_(c.scope, c.key).in_(batch),
                c.expires_at <= now,
            )
            return int(conn.execute(stmt).rowcount)
        # Engines that refuse LIMIT in an IN subquery (MySQL): read, then delete.
        keys = [tuple(row) for row in conn.execute(batch)]
        if not keys:
            return 0
        stmt = sa.delete(self.table).where(sa.tuple_(c.scope, c.key).in_(keys), c.expires_at <= now)
        return int(conn.execute(stmt).rowcount)

    def count_expired(self, conn: sa.Connection, now: dt.datetime) -> int:
        """How many records are past their retention and await cleanup."""
        c = self.table.c
        stmt = sa.select(sa.func.count()).select_from(self.table).where(c.expires_at <= now)
        return int(conn.execute(stmt).scalar_one())

    def stats(self, conn: sa.Connection, now: dt.datetime) -> dict[str, t.Any]:
        """Counts by status (unexpired), expired awaiting cleanup, oldest in progress,
        and the table's size in bytes where the database tells it."""
        c = self.table.c
        live = c.expires_at > now
        by_status = {
            status: int(n)
            for status, n in conn.execute(
                sa.select(c.status, sa.func.count()).where(live).group_by(c.status)
            )
        }
        oldest = conn.execute(
            sa.select(sa.func.min(c.created_at)).where(live, c.status == IN_PROGRESS)
        ).scalar_one()
        size = None
        if conn.dialect.name == "postgresql":
            size = conn.execute(
                sa.text("SELECT pg_total_relation_size(CAST(:t AS regclass))"),
                {"t": self.table.name},
            ).scalar_one()
        if oldest is not None and oldest.tzinfo is None:
            oldest = oldest.replace(tzinfo=dt.timezone.utc)
        return {
            "by_status": by_status,
            "expired_awaiting_cleanup": self.count_expired(conn, now),
            "oldest_in_progress": oldest,
            "table_bytes": size,
        }

    def delete_record(self, conn: sa.Connection, scope: str, key: str) -> bool:
        """Delete one record whatever its state (the operator's ``release``)."""
        c = self.table.c
        stmt = sa.delete(self.table).where(c.scope == scope, c.key == key)
        return self._changed_one(conn, stmt, {})
