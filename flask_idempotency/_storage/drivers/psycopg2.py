"""psycopg2: a ``;``-joined batch is one simple query, parameters bound on the client."""

from __future__ import annotations

import typing as t

import sqlalchemy as sa

from .base import FastPath, as_sqlalchemy_error, begun, row_of, unobserved


class Psycopg2(FastPath):
    name = "psycopg2"

    def send_batch(
        self, connection: sa.Connection, statements: list[str], params: dict[str, t.Any]
    ) -> dict[str, t.Any] | None:
        # psycopg2 quotes the values into the text and sends it as one query; its
        # cursor holds the last statement's rows.
        sql = ";\n".join(statements)
        if not unobserved(connection):
            row = connection.exec_driver_sql(sql, params).first()
            return dict(row._mapping) if row is not None else None
        raw = begun(connection)
        try:
            with raw.cursor() as cursor:
                cursor.execute(sql, params)
                return row_of(cursor)
        except connection.dialect.loaded_dbapi.Error as exc:
            raise as_sqlalchemy_error(connection, statements, params, exc) from exc
