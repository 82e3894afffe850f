"""psycopg2: a ``;``-joined batch is one simple query, parameters bound on the client."""

from __future__ import annotations

import typing as t

import sqlalchemy as sa

from .base import FastPath


class Psycopg2(FastPath):
    name = "psycopg2"

    def send_batch(
        self, connection: sa.Connection, statements: list[str], params: dict[str, t.Any]
    ) -> dict[str, t.Any] | None:
        # psycopg2 quotes the values into the text and sends it as one query; its
        # cursor holds the last statement's rows.
        row = connection.exec_driver_sql(";\n".join(statements), params).first()
        return dict(row._mapping) if row is not None else None
