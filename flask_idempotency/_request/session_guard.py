"""The session watcher: follows the view's session (and any session that
replaces it in the same scoped registry) through SQLAlchemy's session and
engine events while the view runs, and refuses a commit that bypasses the
session (the connection's own ``commit()``, ``COMMIT`` sent as SQL), which
the record could not follow.

Subclasses say what each event means: :class:`~.claim_guard.ClaimGuard`
keeps the claimed record in every transaction the view commits;
:class:`NoCommitGuard` refuses every commit (a manual-mode view answering a
retry); the optimistic route's watcher refuses one too. Listeners are
registered once per session factory and do nothing for sessions without a
watcher, so requests without a key pay a dict lookup per transaction event.
"""

from __future__ import annotations

import contextvars
import typing as t
import weakref

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import Session, SessionTransaction

from .._storage import drivers

GUARD_KEY = "flask_idempotency.claim_guard"


#: The watcher of the view running in this context (thread, task), so that a new
#: session the view opens (``db.session.remove()``, then ``db.session`` again) is
#: followed too.
_watching: contextvars.ContextVar[SessionWatcher | None] = contextvars.ContextVar(
    "flask_idempotency_watcher", default=None
)


class SessionWatcher:
    """Follows the view's session (and any session that replaces it in the same
    scoped registry) between :meth:`watch` and :meth:`stop`."""

    def __init__(self) -> None:
        self._session: Session | None = None
        self._scoped: t.Any = None
        self._context_token: contextvars.Token[SessionWatcher | None] | None = None
        #: Connections the watched sessions' transactions ran on.
        self._connections: weakref.WeakSet[sa.Connection] = weakref.WeakSet()
        #: A commit through the session is under way (its connection commits next).
        self.session_committing = False
        #: ``COMMIT`` went to the database and no answer came back yet: after an
        #: interruption (a connection lost, a BaseException), the commit is in
        #: doubt (it may have happened).
        self.commit_sent = False

    def watch(self, session: Session, scoped: t.Any = None) -> None:
        """Start following ``session``; ``scoped`` is the ``scoped_session`` it came
        from, whose later sessions are followed too."""
        session.info[GUARD_KEY] = self
        self._session, self._scoped = session, scoped
        self._context_token = _watching.set(self)
        if session.in_transaction():  # begun before the watch: by the claim
            self._connections.add(session.connection())

    def stop(self) -> None:
        if self._session is not None:
            self._session.info.pop(GUARD_KEY, None)
            self._session = None
        if self._context_token is not None:
            _watching.reset(self._context_token)
            self._context_token = None

    def follows(self, session: Session) -> bool:
        """``session`` is the one the view now uses: adopt it."""
        scoped = self._scoped
        if scoped is None or not scoped.registry.has() or scoped.registry() is not session:
            return False
        if self._session is not None:
            self._session.info.pop(GUARD_KEY, None)
        session.info[GUARD_KEY] = self
        self._session = session
        return True

    # Session events; the default is to do nothing.

    def _transaction_began(self, connection: sa.Connection) -> None:
        pass

    def _before_commit(self, session: Session) -> None:
        pass

    def _after_commit(self) -> None:
        pass

    def _transaction_ended(self) -> None:
        pass

    def _rolled_back(self, session: Session) -> None:
        pass


class NoCommitGuard(SessionWatcher):
    """For a view answering a retry of a completed operation (manual mode): the
    operation already happened, so nothing the view writes may commit."""

    def _before_commit(self, session: Session) -> None:
        raise RuntimeError(
            "a manual-mode view answering a retry (idem.previous is set) must not "
            "commit: the operation already happened; its writes are rolled back"
        )


def _watcher(session: Session) -> SessionWatcher | None:
    watcher = t.cast("SessionWatcher | None", session.info.get(GUARD_KEY))
    if watcher is not None:
        return watcher
    watcher = _watching.get()
    if watcher is not None and watcher.follows(session):
        return watcher
    return None


def _after_begin(session: Session, transaction: SessionTransaction, connection: t.Any) -> None:
    watcher = _watcher(session)
    if watcher is not None:
        watcher._connections.add(connection)
        if transaction.parent is None:
            watcher._transaction_began(connection)


def _before_commit(session: Session) -> None:
    watcher = _watcher(session)
    # Commits of savepoints (RELEASE) are not commits of business rows.
    if watcher is not None and not session.in_nested_transaction():
        watcher.session_committing = True
        try:
            watcher._before_commit(session)
        except BaseException:
            watcher.session_committing = False
            raise


def _after_commit(session: Session) -> None:
    watcher = _watcher(session)
    if watcher is not None and not session.in_nested_transaction():
        watcher._after_commit()


def _after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    watcher = _watcher(session)
    if watcher is not None and transaction.parent is None:
        watcher.session_committing = False
        watcher._transaction_ended()


def _connection_commit(connection: sa.Connection) -> None:
    """A commit of the watched session's connection: the session's own is noted
    (``COMMIT`` goes out now: until it returns, its outcome is in doubt); one that
    did not come through the session (``db.session.connection().commit()``) is
    refused, since the session's hooks (the fenced lease renewal, or the refusal
    of optimistic and manual routes) would not see it, and business rows would
    commit unguarded."""
    watcher = _watching.get()
    if watcher is None or connection not in watcher._connections:
        return
    if watcher.session_committing:
        watcher.commit_sent = True
        return
    raise RuntimeError(
        "the view committed the session's connection directly; commit through the "
        "session (db.session.commit()) so the idempotency record commits with it"
    )


def _sql_commit(
    connection: sa.Connection, cursor: t.Any, statement: str, parameters: t.Any, *args: t.Any
) -> tuple[str, t.Any]:
    """``COMMIT`` (or PostgreSQL's ``END``) sent as SQL text on the watched session's
    connection: refused, for the same reason as :func:`_connection_commit`.
    (Registered with ``retval=True``, so that SQLAlchemy keeps it as it is and the
    store's direct path knows it: the record's own statements are never a COMMIT.)"""
    watcher = _watching.get()
    if watcher is None or connection not in watcher._connections:
        return statement, parameters
    head = statement.lstrip()[:6].upper()
    if head.startswith(("COMMIT", "END")):
        raise RuntimeError(
            "the view sent COMMIT as SQL; commit through the session "
            "(db.session.commit()) so the idempotency record commits with it"
        )
    return statement, parameters


def _after_soft_rollback(session: Session, previous: SessionTransaction) -> None:
    watcher = _watcher(session)
    if watcher is not None and previous.parent is None:
        watcher._rolled_back(session)


_watched: weakref.WeakSet[t.Any] = weakref.WeakSet()


def listen(session_factory: t.Any) -> None:
    """Register the guard's listeners on a session factory (once per factory)."""
    if session_factory in _watched:
        return
    event.listen(session_factory, "after_begin", _after_begin)
    event.listen(session_factory, "before_commit", _before_commit)
    event.listen(session_factory, "after_commit", _after_commit)
    event.listen(session_factory, "after_transaction_end", _after_transaction_end)
    event.listen(session_factory, "after_soft_rollback", _after_soft_rollback)
    if not event.contains(sa.Engine, "commit", _connection_commit):
        event.listen(sa.Engine, "commit", _connection_commit)
        event.listen(sa.Engine, "before_cursor_execute", _sql_commit, retval=True)
        drivers.quiet(_sql_commit)
    _watched.add(session_factory)
