"""The readiness probe's statements: read the record's table, and check that the
database would accept the claim's write.

The write check differs per engine (its dialect object's
:meth:`~.dialects.Dialect.write_check`): on PostgreSQL a lock-free read of the
server's state and the role's privileges; on MySQL/MariaDB and SQLite a write
that touches no row, which the server refuses exactly as it would refuse the
claim.
"""

from __future__ import annotations

import datetime as dt
import typing as t

import sqlalchemy as sa

from .dialects import READY, Verdict, dialect_of

__all__ = ["READY", "Verdict", "probe"]


def probe(engine: sa.Engine, table: sa.Table, timeout: dt.timedelta) -> Verdict:
    """Check the database is ready for claims on ``table``, through ``engine``'s
    pool. Raises the database's own error when a statement fails (the write
    check's refusal included). ``timeout`` is how long the probe may take;
    nothing is left held once it returns."""
    stmt: sa.Select[t.Any] = sa.select(sa.literal_column("1")).select_from(table).limit(1)
    with engine.connect() as conn:
        verdict = dialect_of(conn).write_check(conn, table, timeout)
        if verdict.forbidden is not None:
            return verdict  # no read: the connection goes back, rolled back
        conn.execute(stmt).all()
        conn.rollback()
    return verdict
