"""How a relay waits between runs: :class:`Listener`, and :class:`RelistenBackoff`
for a LISTEN connection that keeps failing."""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import time
import weakref

import sqlalchemy as sa
from flask import Flask

from .._context import app_state
from .._storage import notify
from .outbox import on_commit, remove_on_commit

logger = logging.getLogger("flask_idempotency")


class RelistenBackoff:
    """How long to wait before listening again after a :meth:`Listener.wait`
    failed: 0.25 s, doubling up to 5 s while each new LISTEN connection fails
    within :attr:`STEADY` seconds of being opened, and 0.25 s again after one
    that lasted longer. A LISTEN connection that fails at once every time (a
    proxy or a server that ends it, a driver that cannot wait on it) then costs
    a few connections a minute instead of one every few milliseconds."""

    FIRST = 0.25
    MOST = 5.0
    STEADY = 10.0

    def __init__(self) -> None:
        self._failures = 0

    def delay(self, failed: Listener) -> float:
        """Seconds to wait before replacing ``failed``, whose wait just raised."""
        if failed.age > self.STEADY:
            self._failures = 0
        self._failures += 1
        return float(min(self.MOST, self.FIRST * 2 ** min(self._failures - 1, 8)))


# The apps whose relay was told, once, that it polls behind a transaction pooler.
_told_polling: weakref.WeakSet[Flask] = weakref.WeakSet()


def listen_engine(app: Flask) -> sa.Engine | None:
    """The engine a relay of ``app`` LISTENs through: ``IDEMPOTENCY_RELAY_LISTEN_URL``'s
    where set, else the app's own, or ``None`` where the app's goes through a
    transaction pooler (``IDEMPOTENCY_DATABASE_POOLER``), on which a LISTEN hears
    nothing: the relay polls then, and says so once, when it first starts."""
    with app.app_context():
        state = app_state(app)
        engine: sa.Engine = state.db.engine
    settings = state.settings
    if settings.relay_listen_url is not None:
        return notify.listen_engine(settings.relay_listen_url)
    if not settings.transaction_pooled:
        return engine
    if notify.can_listen(engine) and app not in _told_polling:
        _told_polling.add(app)
        logger.warning(
            "outbox relay: IDEMPOTENCY_DATABASE_POOLER is %r, through which LISTEN cannot "
            "work: polling every IDEMPOTENCY_RELAY_EVERY (%s) for events committed in other "
            "processes. Set IDEMPOTENCY_RELAY_LISTEN_URL to a direct connection to LISTEN on.",
            settings.database_pooler,
            settings.relay_every,
        )
    return None


class Listener:
    """How a relay waits between runs: at most ``timeout``, less when there is work.

    On PostgreSQL with psycopg2 or psycopg 3 it LISTENs on
    ``idempotency_outbox`` on a connection of its own (autocommit, detached from
    the pool; to ``IDEMPOTENCY_RELAY_LISTEN_URL`` where set), so commits in any
    process wake it; with another driver, or behind a transaction pooler without
    that URL (:func:`listen_engine`), it polls.
    A commit that carried events in this process wakes it too
    (:func:`~flask_idempotency.outbox.on_commit`), on every engine. A LISTEN
    that fails leaves it polling (:attr:`listening` false, :attr:`can_listen`
    true): its owner makes a new one now and then (``retrying=True`` logs
    the failures of those at DEBUG). With
    ``wake=False`` it does neither and only waits out the timeout (polling
    alone). :meth:`interrupt` (safe in a signal handler) ends a wait at once.
    It waits with :mod:`selectors` (epoll on Linux), so any number of files
    open in the process is fine.
    """

    def __init__(self, app: Flask, *, wake: bool = True, retrying: bool = False) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._read, selectors.EVENT_READ)
        self._conn: notify.ListenConnection | None = None
        self._conn_fd = -1
        self._born = time.monotonic()
        self._can_listen = False
        if not wake:
            return
        on_commit(self.interrupt)
        engine = listen_engine(app)
        if engine is not None and notify.can_listen(engine):
            self._can_listen = True
            conn: notify.ListenConnection | None = None
            try:
                conn = notify.ListenConnection(engine)
                fd = conn.fileno()
                self._selector.register(fd, selectors.EVENT_READ)
                self._conn, self._conn_fd = conn, fd
            except Exception:
                if retrying:  # said when it first failed; one line a try now
                    logger.debug("outbox relay: LISTEN failed again", exc_info=True)
                else:
                    logger.warning(
                        "outbox relay: LISTEN failed; polling, and trying again", exc_info=True
                    )
                if conn is not None:
                    conn.close()

    @property
    def listening(self) -> bool:
        """Whether it LISTENs on PostgreSQL (commits in other processes wake it)."""
        return self._conn is not None

    @property
    def can_listen(self) -> bool:
        """Whether it is meant to LISTEN (wake-ups on, PostgreSQL with psycopg2 or
        psycopg 3), whether or not its LISTEN succeeded: one that failed (the
        database away at the time) is worth trying again, one that cannot
        LISTEN (another engine or driver, ``wake=False``) is not."""
        return self._can_listen

    @property
    def age(self) -> float:
        """Seconds since it was made."""
        return time.monotonic() - self._born

    def wait(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds (``None``: until woken); ``True`` when
        woken by a notification, a commit here or :meth:`interrupt`.

        Raises when the LISTEN connection fails (the caller may make a new
        Listener, after :meth:`RelistenBackoff.delay`)."""
        woken = False
        for key, _ in self._selector.select(timeout):
            woken = True
            if key.fd == self._read:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._read, 4096):
                        pass
            elif key.fd == self._conn_fd and self._conn is not None:
                self._conn.drain()
        return woken

    def interrupt(self) -> None:
        """End the current or next :meth:`wait` now."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._write, b"x")

    def close(self) -> None:
        """Stop listening (the LISTEN connection is closed) and free the pipe."""
        remove_on_commit(self.interrupt)
        with contextlib.suppress(Exception):
            self._selector.close()
        if self._conn is not None:
            self._conn.close()
        self._conn = None
        self._conn_fd = -1
        if self._read >= 0:
            # -1 first: a late interrupt() then writes nowhere, not into a
            # file that reuses the number.
            read, write, self._read, self._write = self._read, self._write, -1, -1
            os.close(read)
            os.close(write)
