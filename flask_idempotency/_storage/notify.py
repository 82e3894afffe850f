"""The outbox's wake-up channel on PostgreSQL: NOTIFY on emit, LISTEN for the relay.

A transaction that emitted runs ``pg_notify('idempotency_outbox', '')`` once;
PostgreSQL delivers it at the commit (and drops it with a rollback). A relay
LISTENs on a connection of its own with psycopg2 or psycopg 3, whose socket it
waits on with :mod:`selectors`; other engines and drivers have no channel, and
the relay polls.

A LISTEN is session state: through a pooler in transaction mode the server
connection goes back to the pool once the ``LISTEN`` ends, and the relay hears
nothing (other clients of that connection get its notifications). There the
relay LISTENs on :func:`listen_engine` of ``IDEMPOTENCY_RELAY_LISTEN_URL``, a
direct connection, or polls. ``pg_notify`` itself is safe anywhere: it is
transactional, delivered at the commit of the transaction that ran it.
"""

from __future__ import annotations

import contextlib
import typing as t

import sqlalchemy as sa

from .dialects import dialect_of

#: The PostgreSQL channel a transaction that emitted notifies.
CHANNEL = "idempotency_outbox"

#: Run once per transaction that emitted (PostgreSQL only).
NOTIFY = sa.text(f"SELECT pg_notify('{CHANNEL}', '')")


_listen_engines: dict[str, sa.Engine] = {}


def listen_engine(url: str) -> sa.Engine:
    """An engine for LISTEN connections to ``url`` (one per URL per process),
    pooling nothing: each LISTEN connection is its own and closed by its owner."""
    engine = _listen_engines.get(url)
    if engine is None:
        engine = _listen_engines[url] = sa.create_engine(url, poolclass=sa.NullPool)
    return engine


def can_listen(engine: sa.Engine) -> bool:
    """Whether a relay on ``engine`` can LISTEN (PostgreSQL with psycopg2 or psycopg 3)."""
    return dialect_of(engine).can_listen(engine.dialect.driver)


class ListenConnection:
    """A connection of its own (autocommit, detached from the pool) that LISTENs
    on :data:`CHANNEL`. Raises from the constructor when the LISTEN fails (the
    connection it opened is closed then)."""

    def __init__(self, engine: sa.Engine) -> None:
        self._driver = engine.dialect.driver
        raw: t.Any = None
        try:
            raw = engine.raw_connection()
            conn: t.Any = raw.driver_connection
            raw.detach()  # its own: never back to the pool LISTENing
            conn.rollback()  # out of any transaction the pool left open
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(f"LISTEN {CHANNEL}")
            self._fd: int = conn.fileno()
        except Exception:
            if raw is not None:
                with contextlib.suppress(Exception):
                    raw.driver_connection.close()
            raise
        self._raw, self._conn = raw, conn

    def fileno(self) -> int:
        """The socket to wait on: readable when the server sent something."""
        return self._fd

    def drain(self) -> None:
        """Read what the server sent and forget the notifications (one is as
        good as many: the relay reads the outbox). Raises when the connection
        is gone, so a closed socket never reads as endless wake-ups."""
        conn = self._conn
        if self._driver == "psycopg2":
            conn.poll()
            conn.notifies.clear()
        else:
            # psycopg 3: libpq's own calls, which never block; Connection.notifies()
            # with a timeout of 0 returns nothing, not an error, once the server
            # has closed the connection.
            pgconn = conn.pgconn
            pgconn.consume_input()
            while pgconn.notifies() is not None:
                pass

    def close(self) -> None:
        """Close the connection; errors (a connection already broken) are ignored."""
        # The driver's connection itself: it is detached, and closing the
        # pool's proxy would first try a rollback on a connection that may
        # be broken, logged as an error.
        with contextlib.suppress(Exception):
            self._conn.close()
