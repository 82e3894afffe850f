"""The operator's and the maintenance jobs' statements on the record table.

Cleanup (:meth:`OperatorQueries.purge_batch`), the lease recovery job's
(:meth:`~OperatorQueries.find_abandoned`,
:meth:`~OperatorQueries.delete_releasable`), and what the CLI shows and
deletes: a record is deleted only as :mod:`.holds` allows. Each runs on a
connection of its caller's, in its transaction; none holds locks longer than
its one statement's batch.
"""

from __future__ import annotations

import datetime as dt
import itertools
import typing as t

import sqlalchemy as sa

from .dialects import Deleted, dialect_for
from .execute import Statements
from .holds import Hold, releasable
from .schema import COMPLETED, IN_PROGRESS, Record, as_utc
from .sql import changed_one, expired, lease_over, returning, text_param, unexpired


class OperatorQueries(Statements):
    """The statements of the jobs and the CLI (see the module's documentation)."""

    def _deleted_one(self, conn: sa.Connection, stmt: t.Any) -> bool:
        """Run a ``DELETE`` of one record whose values are bound in ``stmt``;
        whether it deleted it (see :func:`.sql.changed_one`)."""
        return changed_one(conn, returning(stmt, conn.dialect, self.table.c.fencing_token), {})

    def find_abandoned(self, conn: sa.Connection, now: dt.datetime, limit: int) -> list[Record]:
        """In-progress, unexpired records whose lease has ended, oldest lease first,
        that the recovery job can act on: those it can re-run (a stored request),
        and those with no recovery points (released). A record that keeps
        finished steps for the client's retry to resume from is left alone.

        A record whose sealed columns do not open (:attr:`.Record.unreadable`)
        and that the job can only leave alone is returned besides, not counted
        in ``limit``: any number of them never keeps the others from the job
        (one whose view committed counts: it is settled without being opened)."""
        c = self.table.c
        stmt = (
            sa.select(*self._read_columns(conn))
            .where(
                c.status == IN_PROGRESS,
                lease_over(c, now),
                # A view that committed is found past its ttl too: it never
                # expires, and waits for this job (or a retry) to settle it.
                unexpired(c, now),
                sa.or_(c.recovery_points.is_(None), c.request_method.is_not(None)),
            )
            .order_by(c.locked_until, c.scope, c.key)
            .limit(limit)
        )
        found: list[Record] = []
        taken = 0
        for offset in itertools.count(0, limit):
            page = [
                self._record_or_unreadable(r._mapping) for r in conn.execute(stmt.offset(offset))
            ]
            for record in page:
                found.append(record)
                taken += record.unreadable is None or record.view_committed
                if taken == limit:
                    return found
            if len(page) < limit:
                break
        return found

    def failed_after_commit(
        self,
        conn: sa.Connection,
        *,
        scope: str | None = None,
        key: str | None = None,
        limit: int = 1000,
        after: Record | None = None,
    ) -> list[Record]:
        """Records holding a 500 answer, completed or in progress, oldest first
        (of ``scope``, and ``key``, where given; only those after ``after`` in
        that order, to read page by page): those whose view committed and
        whose request never answered are among them, which the caller tells
        apart by their answer (``reconcile``). Unreadable ones are returned
        with :attr:`.Record.unreadable` set."""
        c = self.table.c
        stmt = sa.select(self.table).where(
            c.status.in_((COMPLETED, IN_PROGRESS)), c.response_code == 500
        )
        if scope is not None:
            stmt = stmt.where(c.scope == text_param("w_scope", scope))
        if key is not None:
            stmt = stmt.where(c.key == text_param("w_key", key))
        if after is not None:
            # (created_at, scope, key) > the last one read, spelled out: row
            # value comparison is not on every engine SQLAlchemy supports.
            at = sa.bindparam("a_created", after.created_at, type_=c.created_at.type)
            a_scope, a_key = text_param("a_scope", after.scope), text_param("a_key", after.key)
            stmt = stmt.where(
                sa.or_(
                    c.created_at > at,
                    sa.and_(
                        c.created_at == at,
                        sa.or_(c.scope > a_scope, sa.and_(c.scope == a_scope, c.key > a_key)),
                    ),
                )
            )
        stmt = stmt.order_by(c.created_at, c.scope, c.key).limit(limit)
        return [self._record_or_unreadable(r._mapping) for r in conn.execute(stmt)]

    def delete_releasable(
        self,
        conn: sa.Connection,
        record: Record,
        now: dt.datetime,
        overrides: t.Collection[Hold] = (),
    ) -> bool:
        """Delete ``record`` (as read: its fencing token) if it may still be
        released at ``now`` (:func:`.holds.releasable`, overriding only
        ``overrides``); whether it did. A record that a request reclaimed or
        replaced since it was read (a new token), or that a hold took since
        (it completed, its view committed, a lease was renewed, a step was
        saved), is left alone: the statement re-checks the rule itself."""
        c = self.table.c
        stmt = sa.delete(self.table).where(
            c.scope == text_param("w_scope", record.scope),
            c.key == text_param("w_key", record.key),
            c.fencing_token == record.fencing_token,
            releasable(c, now, overrides),
        )
        return self._deleted_one(conn, stmt)

    def purge_batch(
        self,
        conn: sa.Connection,
        now: dt.datetime,
        limit: int,
        *,
        after: dt.datetime | None = None,
    ) -> Deleted:
        """Delete up to ``limit`` expired records in one statement, oldest
        ``expires_at`` first; the number deleted and the latest ``expires_at``
        among them (``None`` where the engine cannot say, see
        :meth:`.Dialect.delete_batch`).

        ``after``: only records expiring at or after it, the previous batch's
        latest (``>=``: records sharing that time, left over by the batch's
        limit, are still found). The batch's index scan then starts where the
        previous one ended instead of walking, on PostgreSQL, the index
        entries of every record the run's earlier batches deleted (they stay
        until vacuum) from the oldest on.

        Where the engine has it (PostgreSQL, MySQL 8, MariaDB 10.6), the batch is
        chosen ``FOR UPDATE SKIP LOCKED``: rows another cleaner (or a request
        replacing an expired record) holds are skipped, so cleaners never wait
        on each other and cannot deadlock. The delete re-checks ``expires_at``,
        so a record replaced meanwhile stays.
        """
        c = self.table.c
        dialect = dialect_for(conn.dialect.name)
        # A record past its retention whose holder's lease still runs is not
        # expired yet: cleanup waits for the lease to end.
        gone = expired(c, now)
        key = [c.scope, c.key]
        batch = sa.select(*key).where(*gone).order_by(c.expires_at).limit(limit)
        if after is not None:
            batch = batch.where(c.expires_at >= after)
        return dialect.delete_batch(conn, self.table, key, batch, *gone, last=c.expires_at)

    def count_expired(self, conn: sa.Connection, now: dt.datetime) -> int:
        """How many records are past their retention and await cleanup."""
        c = self.table.c
        stmt = sa.select(sa.func.count()).select_from(self.table).where(*expired(c, now))
        return int(conn.execute(stmt).scalar_one())

    def stats(self, conn: sa.Connection, now: dt.datetime) -> dict[str, t.Any]:
        """Counts by status (unexpired), expired awaiting cleanup, oldest in progress,
        and the table's size in bytes where the database tells it."""
        c = self.table.c
        live = unexpired(c, now)
        by_status = {
            status: int(n)
            for status, n in conn.execute(
                sa.select(c.status, sa.func.count()).where(live).group_by(c.status)
            )
        }
        return {
            "by_status": by_status,
            "expired_awaiting_cleanup": self.count_expired(conn, now),
            "oldest_in_progress": self.oldest_in_progress(conn, now),
            "table_bytes": dialect_for(conn.dialect.name).table_bytes(conn, self.table),
        }

    def oldest_in_progress(self, conn: sa.Connection, now: dt.datetime) -> dt.datetime | None:
        """When the oldest record in progress within its retention was created."""
        c = self.table.c
        oldest = conn.execute(
            sa.select(sa.func.min(c.created_at)).where(unexpired(c, now), c.status == IN_PROGRESS)
        ).scalar_one()
        return as_utc(oldest)

    def live_counts(self, conn: sa.Connection, now: dt.datetime) -> tuple[int, int, int]:
        """In one query: records within their retention, of those the ones in
        progress, and of those the ones whose lease has ended (abandoned: what
        the lease recovery job and the retries are for). The metrics' gauges."""
        c = self.table.c
        in_progress = c.status == IN_PROGRESS

        def count(condition: t.Any) -> t.Any:
            # COUNT(CASE ...) rather than FILTER, which MySQL/MariaDB lack.
            return sa.func.count(sa.case((condition, 1)))

        row = conn.execute(
            sa.select(
                sa.func.count(),
                count(in_progress),
                count(sa.and_(in_progress, lease_over(c, now))),
            ).where(unexpired(c, now))
        ).one()
        return int(row[0]), int(row[1]), int(row[2])

    def find(
        self,
        conn: sa.Connection,
        *,
        key: str | None = None,
        scope_prefix: str | None = None,
        status: str | None = None,
        limit: int = 20,
    ) -> list[Record]:
        """Records matching all the given filters, newest first (an operator query)."""
        c = self.table.c
        stmt = sa.select(*self._read_columns(conn))
        if key is not None:
            stmt = stmt.where(c.key == text_param("w_key", key))
        if scope_prefix:
            # substr/= rather than LIKE, which folds case on SQLite; MySQL's
            # binary column counts bytes.
            length = dialect_for(conn.dialect.name).text_length(scope_prefix)
            prefix = text_param("w_prefix", scope_prefix)
            stmt = stmt.where(sa.func.substr(c.scope, 1, length) == prefix)
        if status is not None:
            stmt = stmt.where(c.status == status)
        stmt = stmt.order_by(c.created_at.desc(), c.scope, c.key).limit(limit)
        return [self._record_or_unreadable(row._mapping) for row in conn.execute(stmt)]
