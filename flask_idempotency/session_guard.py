"""The claim guard: every commit that carries the view's business rows carries
the claimed record, whatever the view does with the session.

The claim is a row written in the session's transaction. A view may manage that
transaction itself: roll it back (the get-or-create pattern: insert, catch the
``IntegrityError``, roll back, query), commit it halfway, use savepoints, close
the session. Session events follow it while the view runs:

* the transaction holding the claim **commits**: the record is now durable (in
  progress, under its lease), and stays so whatever the view does next;
* it **rolls back** (or the session closes) before that: the claim is gone with
  it. The next transaction claims the key again, first thing, on the same
  fencing token, before the view's next statement; if another request took the
  key meanwhile, the view's statement raises :class:`LeaseLostError` and nothing
  the view writes afterwards can commit;
* a **commit** while the record is durable renews its lease in the committing
  transaction, fenced by the token and locking the row until the commit: a
  holder that lost the key cannot commit business rows (it gets
  :class:`LeaseLostError` from ``commit()``).

Savepoints need nothing: the claim was made before them, in the transaction
they belong to. Listeners are registered once per session factory and do
nothing for sessions without a guard, so requests without a key pay a dict
lookup per transaction event.
"""

from __future__ import annotations

import datetime as dt
import enum
import logging
import typing as t
import weakref

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import Session, SessionTransaction

from .errors import LeaseLostError
from .store import ClaimWaitExceeded, Executor, Store

logger = logging.getLogger("flask_idempotency")

GUARD_KEY = "flask_idempotency.claim_guard"

#: Claims the key again in a new transaction, as the original claim did; ``True``
#: when it won.
Reassert = t.Callable[[Executor], bool]


class Claim(enum.Enum):
    """Where the claimed record is, as far as this request knows."""

    #: Written in the session's open transaction; commits or rolls back with it.
    IN_TRANSACTION = "in-transaction"
    #: Committed (in progress under its lease); fenced updates keep it ours.
    DURABLE = "durable"
    #: Rolled back with the view's transaction before it was ever committed.
    ROLLED_BACK = "rolled-back"
    #: Another request holds the key: this one must not commit or complete.
    LOST = "lost"


def lost_error() -> LeaseLostError:
    return LeaseLostError(
        "Another request took this idempotency key over while this one ran; "
        "this request's work was rolled back.",
        retry_after=dt.timedelta(seconds=1),
    )


class ClaimGuard:
    """Follows one request's session while its view runs.

    The flow creates it after the claim, :meth:`watch` es the session before the
    view and :meth:`stop` s right after; between the two, the session events
    below keep the claim in every transaction the view commits.
    """

    def __init__(
        self,
        *,
        store: Store,
        scope: str,
        key: str,
        token: int,
        reassert: Reassert,
        wait: dt.timedelta | None,
        lease: dt.timedelta,
        clock: t.Callable[[], dt.datetime],
        durable: bool = False,
    ) -> None:
        self.store = store
        self.scope = scope
        self.key = key
        self.token = token
        self._reassert = reassert
        self._wait = wait
        self._lease = lease
        self._clock = clock
        self.claim = Claim.DURABLE if durable else Claim.IN_TRANSACTION
        self._committed = False
        self._session: Session | None = None

    # -- lifecycle -----------------------------------------------------------------

    def watch(self, session: Session) -> None:
        session.info[GUARD_KEY] = self
        self._session = session

    def stop(self) -> None:
        if self._session is not None:
            self._session.info.pop(GUARD_KEY, None)
            self._session = None

    # -- what the flow asks ----------------------------------------------------------

    def reclaim(self, executor: Executor) -> bool:
        """Claim the key again after a rollback, on the same token; ``True`` if won."""
        try:
            with self.store.bounded_wait(executor, self._wait):
                won = self._reassert(executor)
        except ClaimWaitExceeded:
            won = False
        self.claim = Claim.IN_TRANSACTION if won else Claim.LOST
        if won:
            logger.debug("claimed %r in scope %r again after a rollback", self.key, self.scope)
        else:
            logger.warning(
                "%r in scope %r was taken by another request after this view rolled back",
                self.key,
                self.scope,
            )
        return won

    # -- session events ----------------------------------------------------------------

    def _transaction_began(self, connection: sa.Connection) -> None:
        if self.claim is Claim.ROLLED_BACK and not self.reclaim(connection):
            raise lost_error()

    def _before_commit(self, session: Session) -> None:
        if self.claim is Claim.LOST:
            raise lost_error()
        if self.claim is Claim.DURABLE:
            locked_until = self._clock() + self._lease
            if not self.store.renew_lease(session, self.scope, self.key, self.token, locked_until):
                self.claim = Claim.LOST
                raise lost_error()

    def _transaction_ended(self) -> None:
        committed, self._committed = self._committed, False
        if self.claim is Claim.IN_TRANSACTION:
            self.claim = Claim.DURABLE if committed else Claim.ROLLED_BACK


def _guard(session: Session) -> ClaimGuard | None:
    return t.cast("ClaimGuard | None", session.info.get(GUARD_KEY))


def _after_begin(session: Session, transaction: SessionTransaction, connection: t.Any) -> None:
    guard = _guard(session)
    if guard is not None and transaction.parent is None:
        guard._transaction_began(connection)


def _before_commit(session: Session) -> None:
    guard = _guard(session)
    # Commits of savepoints (RELEASE) are not commits of business rows.
    if guard is not None and not session.in_nested_transaction():
        guard._before_commit(session)


def _after_commit(session: Session) -> None:
    guard = _guard(session)
    if guard is not None and not session.in_nested_transaction():
        guard._committed = True


def _after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    guard = _guard(session)
    if guard is not None and transaction.parent is None:
        guard._transaction_ended()


_watched: weakref.WeakSet[t.Any] = weakref.WeakSet()


def listen(session_factory: t.Any) -> None:
    """Register the guard's listeners on a session factory (once per factory)."""
    if session_factory in _watched:
        return
    event.listen(session_factory, "after_begin", _after_begin)
    event.listen(session_factory, "before_commit", _before_commit)
    event.listen(session_factory, "after_commit", _after_commit)
    event.listen(session_factory, "after_transaction_end", _after_transaction_end)
    _watched.add(session_factory)
