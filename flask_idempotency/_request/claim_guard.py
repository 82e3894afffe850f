"""The claim guard: every commit that carries the view's business rows carries
the claimed record, whatever the view does with the session.

The claim is a row written in the session's transaction. A view may manage that
transaction itself: roll it back (the get-or-create pattern: insert, catch the
``IntegrityError``, roll back, query), commit it halfway, use savepoints, close
the session. Session events follow it while the view runs:

* the transaction holding the claim **commits**: the record is now durable (in
  progress, under a lease counted from that commit), and stays so whatever the
  view does next; the view has committed work of its own, so the flow records
  its answer even if it fails (the operation may not run twice);
* it **rolls back** before that: the claim is gone with it. The key is claimed
  again at once, in a new transaction, on the same fencing token (after
  ``close()`` or ``remove()``, at the view's next statement, on whichever session
  the view then uses: the watcher follows the scoped session). If another
  request took the key meanwhile, ``rollback()`` (or that statement) raises
  :class:`LeaseLostError` and nothing the view writes afterwards can commit;
* every **commit** renews the lease in the committing transaction, fenced by the
  token and locking the row until the commit: a holder that lost the key cannot
  commit business rows (it gets :class:`LeaseLostError` from ``commit()``). It
  also stores, the record staying in progress, the answer that is the
  operation's outcome should this request never finish (500
  ``failed-after-commit``): a worker killed after the view's commit, or a
  completion lost with the database, leaves a record that says the view
  committed, which the next claim after its lease (or the recovery job)
  completes with that answer instead of running the view again.

Savepoints need nothing: the claim was made before them, in the transaction
they belong to. The session events come from :mod:`.session_guard`.
"""

from __future__ import annotations

import datetime as dt
import enum
import logging
import typing as t

import sqlalchemy as sa
from sqlalchemy.orm import Session

from .._storage import Executor, Store, refuse_autocommit
from ..errors import ClaimWaitExceeded, LeaseLostError
from .session_guard import SessionWatcher

logger = logging.getLogger("flask_idempotency")

# How long a request waits for PostgreSQL to settle a COMMIT whose answer it
# never got. Short: gunicorn follows a worker timeout's SystemExit with SIGKILL
# about a second later; past it the outcome is unknown (counted as landed).
COMMIT_OUTCOME_WAIT = dt.timedelta(seconds=1)

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
    """The error of a request whose key another request took over."""
    return LeaseLostError(
        "Another request took this idempotency key over while this one ran; what this "
        "request had not committed was rolled back.",
        retry_after=dt.timedelta(seconds=1),
    )


class ClaimGuard(SessionWatcher):
    """Keeps the claim in every transaction the view commits.

    The flow creates it after the claim, :meth:`watch` es the session before the
    view and :meth:`stop` s right after; between the two, the session events
    below keep the claim in every transaction the view commits.
    """

    @property
    def durable(self) -> bool:
        """The claimed record is committed (leased route, or the view committed)."""
        return self.claim is Claim.DURABLE

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
        lease_end: dt.datetime | None = None,
        failure_answer: t.Callable[[], t.Mapping[str, t.Any]] | None = None,
    ) -> None:
        super().__init__()
        self.store = store
        self.scope = scope
        self.key = key
        self.token = token
        self._reassert = reassert
        self._wait = wait
        self._lease = lease
        self._clock = clock
        #: The stored answer's columns (``answer_values``) each commit of the
        #: view writes; built at the first commit, when there is one.
        self._failure_answer = failure_answer
        self._answer: t.Mapping[str, t.Any] | None = None
        self.claim = Claim.DURABLE if durable else Claim.IN_TRANSACTION
        #: The view committed a transaction of its own: what it wrote then stays,
        #: whatever happens next, so the operation may not run a second time.
        self.view_committed = False
        self._committed = False
        #: The lease end the record has as last committed by this request (a
        #: leased claim's, then each commit's), and the one the commit under way
        #: writes: a commit whose outcome an interruption hid can be told landed
        #: (the record shows its lease end) or not (:meth:`commit_landed`).
        self._lease_written = lease_end
        self.pending_lease: dt.datetime | None = None
        #: PostgreSQL: the id of the transaction the commit under way ends, by
        #: which the database itself says whether it committed (``None``
        #: elsewhere): a record read back cannot tell a ``COMMIT`` that never
        #: arrives from one still on its way.
        self.pending_transaction: int | None = None
        self._record_engine: sa.Engine | None = None
        self._first_session: Session | None = None

    def watch(self, session: Session, scoped: t.Any = None) -> None:
        super().watch(session, scoped)
        self._first_session = session

    @property
    def record_engine(self) -> sa.Engine | None:
        """The engine holding the record: connections to other binds (a reporting
        database in AUTOCOMMIT) are none of the claim's business. Looked up when
        first needed, which the common request (no transaction of the view's
        own) never does."""
        if self._record_engine is None and self._first_session is not None:
            bind = self._first_session.get_bind(clause=self.store.table)
            self._record_engine = bind.engine if isinstance(bind, sa.Connection) else bind
        return self._record_engine

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
        # Every transaction the view begins, not only the claim's: a view that
        # asks for an AUTOCOMMIT connection would commit rows the record cannot
        # follow (refused before it writes anything).
        record_engine = self.record_engine
        on_record = record_engine is None or connection.engine is record_engine
        if on_record:
            refuse_autocommit(connection)
        if self.commit_sent and self.claim is not Claim.LOST:
            # A new transaction after a COMMIT whose answer never came (the view
            # caught the error and rolled back): settled first, or the reclaim
            # below would find the record that commit published, take the key
            # for lost, and leave it in progress to be run again after its lease.
            # Asked on this connection when it reaches the record's database.
            self.settle_commit(connection if on_record else None)
        if self.claim is Claim.ROLLED_BACK and not self.reclaim(connection):
            raise lost_error()

    def _rolled_back(self, session: Session) -> None:
        # Claim the key again at once, not at the view's next statement: in
        # between, a duplicate could run the whole view.
        if self.claim is Claim.ROLLED_BACK and session.is_active:
            session.connection()  # begins the next transaction: _transaction_began

    def _before_commit(self, session: Session) -> None:
        if self.claim is Claim.LOST:
            raise lost_error()
        if self.claim in (Claim.DURABLE, Claim.IN_TRANSACTION):
            # The lease counts from this commit (the first one publishes the
            # record); fenced, and locking the record until the commit.
            locked_until = self._clock() + self._lease
            self.pending_lease = locked_until
            self.pending_transaction = None  # not an earlier commit's, should this one fail
            if self._answer is None and self._failure_answer is not None:
                self._answer = self._failure_answer()
            renewed, self.pending_transaction = self.store.renew_lease_before_commit(
                session, self.scope, self.key, self.token, locked_until, self._answer
            )
            if not renewed:
                self.claim = Claim.LOST
                raise lost_error()

    def _after_commit(self) -> None:
        self._committed = True
        self.commit_sent = False
        if self.pending_lease is not None:
            self._lease_written = self.pending_lease

    def commit_landed(self, record: t.Any) -> bool:
        """Whether the commit under way when an interruption hid its outcome
        landed, judged from the record as now committed (``None``: no record):
        ours, with the lease end that commit wrote. Where that lease end equals
        the one committed before (a clock that did not move), the two cannot be
        told apart, and a record that is ours counts as landed: the safe side,
        since the operation then never runs twice."""
        if record is None or record.fencing_token != self.token:
            return False
        if self.pending_lease is None:
            return True
        return bool(
            record.locked_until == self.pending_lease or self.pending_lease == self._lease_written
        )

    def settle_commit(self, connection: sa.Connection | None = None) -> bool:
        """The view's last ``COMMIT`` went out and no answer came back (an error
        the view may have caught, an interruption): whether it landed, asked of
        the database (:meth:`~flask_idempotency.store.Store.commit_outcome` on
        PostgreSQL, the record elsewhere, :meth:`commit_landed`). Landed, it is
        confirmed (:meth:`confirm_commit`); not landed, it is forgotten.

        When that cannot be known in time (the database away too), it counts as
        landed: the operation then never runs twice. Had it not landed, the
        record is not there, and completing it answers ``lease-lost``; the
        retry after that runs the operation, once.

        Asked on ``connection`` (to the record's database, in a transaction
        that just began: a second connection may not be had from a pool of
        one), or else on a connection of the record's engine."""
        executor: sa.Engine | sa.Connection | None = connection or self.record_engine
        if executor is None:  # never watched a session: nothing was committed
            return False
        reason = "not knowable in time"
        try:
            if self.pending_transaction is not None:
                landed = self.store.commit_outcome(
                    executor, self.pending_transaction, COMMIT_OUTCOME_WAIT
                )
            else:
                record = self.store.load_committed(executor, self.scope, self.key)
                landed = self.commit_landed(record)
        except Exception as exc:  # the failure that hid the outcome is the one to report
            landed, reason = None, f"could not ask: {type(exc).__name__}"
        if landed is False:
            self.commit_sent = False
            return False
        if landed is None:
            logger.warning(
                "the outcome of the commit of %r in scope %r is unknown (%s); "
                "counting it as landed",
                self.key,
                self.scope,
                reason,
            )
        self.confirm_commit()
        return True

    def confirm_commit(self) -> None:
        """The view's commit whose outcome was hidden did land: the record is
        durable, and the view has committed work of its own."""
        self.view_committed = True
        self.commit_sent = False
        if self.claim in (Claim.IN_TRANSACTION, Claim.ROLLED_BACK):
            self.claim = Claim.DURABLE
        self._lease_written = self.pending_lease

    def _transaction_ended(self) -> None:
        committed, self._committed = self._committed, False
        if committed and self.claim in (Claim.DURABLE, Claim.IN_TRANSACTION):
            self.view_committed = True
        if self.claim is Claim.IN_TRANSACTION:
            self.claim = Claim.DURABLE if committed else Claim.ROLLED_BACK
