"""The interface of a driver fast path."""

from __future__ import annotations

import typing as t

import sqlalchemy as sa


class FastPath:
    """A driver that takes SQL compiled once and sent as it is, and that can send
    the claim's statements as one batch: one round trip.

    Both psycopg drivers bind ``%(name)s`` parameters themselves and adapt every
    value the record holds (str, int, bool, bytes, aware datetimes), so
    SQLAlchemy's per-execution compilation and parameter processing, which
    cost more than the statement on a local database, are skipped.
    """

    #: SQLAlchemy's name of the driver (``dialect.driver``).
    name = ""

    def applies(self, connection: sa.Connection) -> bool:
        """Whether statements compiled once may be sent on ``connection``: not
        where SQLAlchemy rewrites them per connection (``schema_translate_map``)."""
        return not connection.get_execution_options().get("schema_translate_map")

    def prepares(self, dbapi_connection: t.Any) -> bool:
        """Whether the driver's connection prepares statements on the server by
        itself, under names a transaction pooler that does not track them
        would hand to another client."""
        return False

    def send_batch(
        self, connection: sa.Connection, statements: list[str], params: dict[str, t.Any]
    ) -> dict[str, t.Any] | None:
        """Run ``statements`` in order, in the connection's transaction, in one
        round trip; the last one's first row as a dict (``None`` when it has
        none). A driver error is raised as SQLAlchemy raises it (a
        ``DBAPIError``), so callers and :mod:`..dberrors` see one kind of error
        on every path."""
        raise NotImplementedError
