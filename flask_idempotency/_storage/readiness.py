"""The readiness probe's statements: read the record's table, and check that the
database would accept the claim's write.

The write check differs per engine (one function each, found by
:func:`_write_check`): on PostgreSQL a lock-free read of the server's state and
the role's privileges; on MySQL/MariaDB and SQLite a write that touches no row,
which the server refuses exactly as it would refuse the claim.
"""

from __future__ import annotations

import datetime as dt
import math
import typing as t

import sqlalchemy as sa

from .store import idle_bound


class Verdict(t.NamedTuple):
    """What the probe found: ready when both are ``None``."""

    #: Why the database refuses writes (fixed words naming the setting).
    read_only: str | None = None
    #: What the app's role may not do that the claim needs (PostgreSQL).
    forbidden: str | None = None


READY = Verdict()


def probe(engine: sa.Engine, table: sa.Table, timeout: dt.timedelta) -> Verdict:
    """Check the database is ready for claims on ``table``, through ``engine``'s
    pool. Raises the database's own error when a statement fails (the write
    check's refusal included). ``timeout`` is how long the probe may take;
    nothing is left held once it returns."""
    stmt: sa.Select[t.Any] = sa.select(sa.literal_column("1")).select_from(table).limit(1)
    with engine.connect() as conn:
        verdict = _write_check(conn.dialect.name)(conn, table, timeout)
        if verdict.forbidden is not None:
            return verdict  # no read: the connection goes back, rolled back
        conn.execute(stmt).all()
        conn.rollback()
    return verdict


WriteCheck = t.Callable[[sa.Connection, sa.Table, dt.timedelta], Verdict]


def _postgresql(conn: sa.Connection, table: sa.Table, timeout: dt.timedelta) -> Verdict:
    # Lock-free: a standby, or transactions read-only by default (for the
    # server, the database or the role), which the new transaction shows.
    # The probe's transaction then reads the record's table, whose lock a
    # probe stranded by a partition would hold, and make an operator's
    # ALTER TABLE (and every claim queued behind it) wait: the server ends
    # it once it sits idle as long as the probe may take.
    # Also whether the app's role may INSERT and UPDATE the table, as a
    # claim does (a GRANT missing answers every claim 503; a catalog
    # lookup, no lock either), granted on the table or on its columns.
    standby, read_only, may_write, _ = conn.execute(
        sa.text(
            "SELECT pg_is_in_recovery(), current_setting('transaction_read_only'), "
            "has_any_column_privilege(CAST(:table AS text), 'INSERT') "
            "AND has_any_column_privilege(CAST(:table AS text), 'UPDATE'), " + idle_bound(":idle")
        ),
        {
            "idle": f"{max(1, math.ceil(timeout.total_seconds()))}s",
            "table": conn.dialect.identifier_preparer.format_table(table),
        },
    ).one()
    if standby:
        return Verdict(read_only="the server is a standby (pg_is_in_recovery())")
    if read_only == "on":
        return Verdict(read_only="transactions are read-only (default_transaction_read_only)")
    if not may_write:
        return Verdict(forbidden=f"the app's role may not INSERT and UPDATE {table.name}")
    return READY


def _write_nothing(conn: sa.Connection, table: sa.Table, timeout: dt.timedelta) -> Verdict:
    # The server's own verdict: it refuses this write exactly as it would
    # refuse the claim (so a user allowed to write on a read_only server
    # passes); the refusal is raised, and the caller says why. "scope IS
    # NULL" matches no row (the column is NOT NULL: MySQL plans an
    # "Impossible WHERE", locking nothing), and names a key column, as
    # sql_safe_updates wants (it refuses WHERE false). An UPDATE, not a
    # DELETE: a claim needs INSERT and UPDATE, never DELETE (cleanup may run
    # as another role), so an app user without DELETE stays ready.
    conn.execute(sa.update(table).where(table.c.scope.is_(None)).values(status=table.c.status))
    return READY


def _no_check(conn: sa.Connection, table: sa.Table, timeout: dt.timedelta) -> Verdict:
    return READY


_WRITE_CHECKS: dict[str, WriteCheck] = {
    "postgresql": _postgresql,
    "mysql": _write_nothing,
    "mariadb": _write_nothing,
    "sqlite": _write_nothing,
}


def _write_check(name: str) -> WriteCheck:
    """The check of whether the database would accept the claim's write: a
    verdict (:data:`READY` where the engine has no check here), or the refusal
    itself raised where the check is a write. The first statement of the
    connection's transaction, which the caller rolls back."""
    return _WRITE_CHECKS.get(name, _no_check)
