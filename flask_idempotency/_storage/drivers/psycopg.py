"""psycopg 3: the batch through a client-side-binding cursor, as psycopg2 sends it."""

from __future__ import annotations

import typing as t

import sqlalchemy as sa

from .base import FastPath, as_sqlalchemy_error, row_of

__all__ = ["Psycopg", "as_sqlalchemy_error"]


class Psycopg(FastPath):
    name = "psycopg"

    def prepares(self, dbapi_connection: t.Any) -> bool:
        """psycopg 3 prepares a statement run more than ``prepare_threshold``
        times on a connection (5 by default), as ``_pg3_0``, ``_pg3_1``...;
        ``None`` turns it off. (The claim's batch never is: a client-side
        binding cursor sends it as a simple query.)"""
        return getattr(dbapi_connection, "prepare_threshold", None) is not None

    def send_batch(
        self, connection: sa.Connection, statements: list[str], params: dict[str, t.Any]
    ) -> dict[str, t.Any] | None:
        """The statements as one batch, as psycopg2 sends it: parameters bound on
        the client (:class:`psycopg.ClientCursor`), every statement in one
        simple query, one round trip.

        Not psycopg's pipeline mode, also one round trip: PostgreSQL arms
        ``idle_in_transaction_session_timeout`` when it sends ReadyForQuery, and a
        pipeline's Sync is followed by a Flush whose arrival disarms the timer until
        the next statement. A host cut off right after a pipelined claim sends no
        next statement, so its claim would be held, past the app's bound and the
        server's own setting, for as long as TCP keeps the session. A simple query
        ends with ReadyForQuery, and the timer runs.

        The statements go to the driver's connection, inside the transaction
        SQLAlchemy opened on it.
        """
        dbapi = connection.dialect.loaded_dbapi
        raw = connection.connection.driver_connection
        assert raw is not None
        try:
            with dbapi.ClientCursor(raw) as cursor:
                cursor.execute(";\n".join(statements), params)
                while cursor.nextset():  # the read is the last statement
                    pass
                return row_of(cursor)
        except dbapi.Error as exc:
            raise as_sqlalchemy_error(connection, statements, params, exc) from exc
