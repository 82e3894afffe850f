"""The SQL behind the record: claim, load, take over, complete, release.

Every statement runs in the session (or connection) it is given, so the record
joins the app's transaction. The statements are the same on every engine;
what differs is asked of the engine's dialect object (:mod:`.dialects`):

* the claim is a conflict-tolerant insert (``ON CONFLICT DO NOTHING``,
  ``INSERT IGNORE``); engines without one insert inside a savepoint and treat
  a unique violation as "exists";
* a duplicate waits for the first request's transaction, bounded by
  ``IDEMPOTENCY_WAIT`` (:meth:`Store.bounded_wait`), and on PostgreSQL, with
  ``IDEMPOTENCY_CLAIM_IDLE_TIMEOUT``, the claim's transaction may sit idle no
  longer than that;
* where the engine's locking reads are needed (MySQL), the record is read with
  one, so that a REPEATABLE READ snapshot cannot hide the winner's row.

On psycopg2 and psycopg 3 (:mod:`.drivers`) the claim is one round trip and
every statement is compiled once.

Nothing here checks and then inserts: the insert decides, and every later
change is a conditional ``UPDATE``/``DELETE`` on the fencing token that only one
contender can win. Fencing tokens are random 63-bit numbers drawn anew by every
claim and reclaim, so a token never repeats for a key, even after the record is
deleted (release, purge, recovery, the CLI) and the key claimed again.

:class:`Store` holds the statements of a request's claim; those of the record's
holder come from :class:`.held.HeldRecord`, those of the jobs and the CLI from
:class:`.admin.OperatorQueries`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import typing as t

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from .._failures import SealBroken
from ..errors import ClaimWaitExceeded
from . import dberrors, drivers
from .admin import OperatorQueries
from .dialects import Executor, dialect_for, dialect_of
from .held import HeldRecord
from .schema import IN_PROGRESS, Record
from .seal import Keyring
from .sql import (
    RECLAIM_KEEPS,
    STORED_REQUEST,
    expired,
    lease_over,
    refuse_autocommit,
    refuse_changed_rows,
    text_param,
)

__all__ = ["Store"]


class _Loads(t.NamedTuple):
    """The reads of one record: whole, without the stored request, and each
    as a locking read."""

    whole: t.Any
    head: t.Any
    whole_locking: t.Any
    head_locking: t.Any


class Store(HeldRecord, OperatorQueries):
    """Statements on one ``idempotency_keys`` table.

    The statements of the common path are built once: constructing SQLAlchemy
    statements per request costs more than the round trips on a local database.
    Parameters named ``w_*`` are the WHERE clause; the others are column values.
    """

    def __init__(
        self,
        table: sa.Table,
        *,
        claim_idle: dt.timedelta | None = None,
        keyring: Keyring | None = None,
    ) -> None:
        super().__init__(table)
        #: ``IDEMPOTENCY_ENCRYPTION_KEYS``: every write of a record's sealed
        #: columns seals them, every read opens them (:mod:`.seal`).
        self.keyring = keyring
        #: ``IDEMPOTENCY_CLAIM_IDLE_TIMEOUT``: on PostgreSQL, how long the server lets a
        #: transaction that holds a claim sit idle before it ends it.
        self.claim_idle = claim_idle
        c = table.c
        this_key = (c.scope == text_param("w_scope"), c.key == text_param("w_key"))
        this_record = {"scope": text_param("scope"), "key": text_param("key")}
        self._inserts: dict[str, t.Any] = {}  # the conflict-tolerant insert, per engine
        self._this_record = this_record
        self._portable_insert = sa.insert(table).values(this_record)
        self._this_key = this_key
        # The reads of a record, per set of added columns the table lacks.
        self._loads: dict[frozenset[str], _Loads] = {}
        token_read = (*this_key, c.fencing_token == sa.bindparam("w_token"))
        self._replace_expired = sa.update(table).where(
            *token_read, *expired(c, sa.bindparam("w_now"))
        )
        self._reclaim = sa.update(table).where(
            *token_read,
            c.status == IN_PROGRESS,
            c.request_hash == sa.bindparam("w_request_hash"),
            lease_over(c, sa.bindparam("w_now")),
            # Never the operation of a view that committed work of its own: it
            # happened, and is settled with its stored answer instead.
            c.response_code.is_(None),
        )

    def _loads_for(self, executor: Executor) -> _Loads:
        """The reads of one record on ``executor``'s engine, built once per set
        of absent columns (:mod:`.added`)."""
        absent = self._absent(executor)
        loads = self._loads.get(absent)
        if loads is None:
            whole = sa.select(*self._read_columns(executor)).where(*self._this_key)
            # What a request needs of an existing record: all but the stored
            # request, which only the recovery job reads (and which may be large).
            # A plain primary-key lookup: PostgreSQL plans it in a fraction of
            # the time a join (or a CASE per column) takes, and planning is
            # most of its cost.
            head = self._read_columns(executor, STORED_REQUEST)
            head_read = sa.select(*head).where(*self._this_key)
            loads = self._loads[absent] = _Loads(
                whole,
                head_read,
                # A locking read sees the latest committed row whatever the
                # isolation level.
                whole.with_for_update(read=True),
                head_read.with_for_update(read=True),
            )
        return loads

    def _insert_for(self, name: str) -> t.Any | None:
        """The engine's conflict-tolerant insert of a record, built once per engine."""
        if name not in self._inserts:
            dialect = dialect_for(name)
            self._inserts[name] = dialect.conflict_tolerant_insert(
                self.table, self._this_record, ["scope", "key"]
            )
        return self._inserts[name]

    @contextlib.contextmanager
    def bounded_wait(self, executor: Executor, wait: dt.timedelta | None) -> t.Iterator[None]:
        """Bound how long the statements inside wait on another transaction's locks.

        Raises :class:`ClaimWaitExceeded` when the database gives up on the
        wait: the bound is hit, or this transaction is chosen as a deadlock or
        serialization victim. The engine's own setting is restored afterwards,
        so the view runs unaffected. ``wait=None`` sets no bound of ours (the
        connection's own settings apply).

        Every claim that is not one batch goes through here (the claim on other
        drivers, a take-over, a claim made again after the view rolled back),
        so on PostgreSQL it also bounds, with :attr:`claim_idle`, how long the
        rest of the transaction may sit idle (see :func:`.dialects.idle_bound`);
        that bound stays until the transaction ends.
        """
        dialect = dialect_of(executor)
        previous: t.Any = None
        if self.claim_idle is not None:
            dialect.bound_idle(executor, self.claim_idle)
        if wait is not None:
            previous = dialect.set_wait(executor, wait)
        failed = interrupted = False
        try:
            yield
        except sa_exc.DBAPIError as exc:
            failed = True
            if dberrors.stopped_waiting(exc):
                raise self._wait_exceeded(exc) from exc
            raise
        except BaseException as exc:
            # KeyboardInterrupt, SystemExit, GreenletExit: SQLAlchemy discarded
            # the connection if a statement was running, so putting the bound
            # back fails there; the interruption is what goes on.
            interrupted = not isinstance(exc, Exception)
            raise
        finally:
            if wait is not None:
                try:
                    dialect.restore_wait(executor, previous, failed=failed)
                except Exception as exc:
                    known = isinstance(exc, sa_exc.DBAPIError | sa_exc.PendingRollbackError)
                    if not (interrupted or (failed and known)):
                        raise
                    # The failure took the connection with it: the pool discards
                    # it, and the original error is the one to report (a
                    # session whose connection was lost refuses every statement
                    # until rolled back: PendingRollbackError, no DBAPIError).

    def _wait_exceeded(self, exc: sa_exc.DBAPIError) -> ClaimWaitExceeded:
        on_record = dberrors.waited_on_row(exc, self.table.name)
        return ClaimWaitExceeded(str(exc.orig), on_record=on_record)

    def waited_on_duplicate(
        self, session: Session, scope: str, key: str, exc: ClaimWaitExceeded, now: dt.datetime
    ) -> bool:
        """After the database gave up on a claim's wait (``exc``, the claim's
        transaction rolled back): whether the wait was on another request with
        this key, so that "in progress" is answered only for a running
        duplicate, never for a busy database.

        The database's own word where it gives one (PostgreSQL's error
        context); otherwise, on a connection of its own, whether the key's
        record is locked now (the engine's no-wait probe, MySQL/MariaDB) or
        committed in progress under a live lease. SQLite's lock is the whole
        database's: a wait on it is a busy database unless the key's record
        says otherwise. A probe that fails says "not a duplicate"."""
        if exc.on_record is not None:
            return exc.on_record
        bind = session.get_bind(clause=self.table)
        engine = bind.engine if isinstance(bind, sa.Connection) else bind
        params = {"w_scope": scope, "w_key": key}
        try:
            with engine.connect() as conn:
                head = self._loads_for(conn).head
                locked = dialect_of(conn).record_locked(conn, head, params)
                if locked:
                    return True
                row = conn.execute(head, params).first()
                conn.rollback()
        except sa_exc.DBAPIError:
            return False
        return row is not None and self._record_or_unreadable(row._mapping).lease_live(now)

    def try_insert(self, executor: Executor, values: dict[str, t.Any]) -> bool:
        """Insert a new record; ``False`` when one with the same scope and key exists.

        Raises :class:`TooLargeToStore` when a stored request would exceed what the
        engine takes in one statement (MySQL answers such a statement by dropping
        the connection).
        """
        values = self._sealed(values["scope"], values["key"], self._present(executor, values))
        self.check_size(executor, values)
        return self._insert(executor, values)[0]

    def _insert(self, executor: Executor, values: dict[str, t.Any]) -> tuple[bool, Record | None]:
        """Insert ``values`` unless (scope, key) exists: ``(won, record)``.

        Whether the insert won is what the statement returned (``RETURNING``
        where the engine has it with a conflict-tolerant insert) or, elsewhere,
        the fencing token read back: only the insert that wrote the row has its
        token. ``record`` is the record read back when the insert lost on an
        engine that needed the read (so the caller need not read it again);
        ``None`` otherwise.
        """
        dialect = dialect_of(executor)
        conflict_tolerant = self._insert_for(dialect.name)
        if conflict_tolerant is None:
            try:
                with executor.begin_nested():
                    executor.execute(self._portable_insert, values)
            except sa_exc.IntegrityError:
                return False, None
            return True, None
        connection = self._connection(executor)
        if dialect.returns_rows(connection.dialect, conflict_tolerant):
            return self._changed_one(connection, conflict_tolerant, values), None
        connection.execute(conflict_tolerant, values)
        record = self.load(
            connection, values["scope"], values["key"], stored_request=False, unreadable_ok=True
        )
        if record is not None and record.fencing_token == values["fencing_token"]:
            return True, None
        return False, record

    def check_size(self, executor: Executor, values: dict[str, t.Any]) -> None:
        """Refuse a stored request larger than the engine takes in one statement
        (MySQL's ``max_allowed_packet``)."""
        body = values.get("request_body")
        if body:
            self.refuse_oversized(executor, len(body))

    def load(
        self,
        executor: Executor,
        scope: str,
        key: str,
        *,
        stored_request: bool = True,
        unreadable_ok: bool = False,
    ) -> Record | None:
        """The record for (scope, key), or ``None``: the latest committed version.

        ``stored_request=False`` leaves out the request kept for the recovery
        job (its fields read ``None``): what a request needs, at less cost.
        A record whose sealed columns do not open raises :class:`SealBroken`;
        with ``unreadable_ok`` (the operator's reads) it is returned with
        :attr:`Record.unreadable` set instead.
        """
        locking = dialect_of(executor).locking_reads
        loads = self._loads_for(executor)
        if stored_request:
            stmt = loads.whole_locking if locking else loads.whole
        else:
            stmt = loads.head_locking if locking else loads.head
        params = {"w_scope": scope, "w_key": key}
        read = self._record_or_unreadable if unreadable_ok else self._record
        ran = drivers.direct(self._connection(executor), stmt, params)
        if ran is not None:
            return read(ran[0][0]) if ran[0] else None
        row = executor.execute(stmt, params).first()
        if row is None:
            return None
        return read(row._mapping)

    def claim(
        self, session: Session, values: dict[str, t.Any], wait: dt.timedelta | None
    ) -> tuple[bool, Record | None]:
        """Insert a new record unless one exists; ``(inserted, record)``.

        ``record`` is the one that holds (scope, key) after the insert, without
        its stored request, when it is not ours (``None``: it was deleted in
        between); after our insert it is ``None``. Waiting on another
        transaction is bounded by ``wait`` (:meth:`bounded_wait`). Whether the
        insert won is read from the fencing token of the row read back (or the
        row the insert returned), never from a row count.

        On psycopg2 and psycopg 3 this is one round trip: setting the bounds, the
        insert, restoring the wait's bound and reading the record travel as one
        batch of statements, parameters bound on the client (PostgreSQL runs
        them in order, in the transaction; :mod:`.drivers.psycopg` says why not
        psycopg 3's pipeline mode). So it is on PyMySQL with multi-statement
        strings, and on MariaDB without them one for a new key and two for a taken
        one (:mod:`.drivers.pymysql`).
        Elsewhere it is the same statements one by one.

        A ``record`` whose sealed columns do not open comes with
        :attr:`.Record.unreadable` set, never raising: the caller judges it by
        its clear columns (an expired one is replaced without being opened),
        and calls :meth:`readable` before it uses one.
        """
        values = self._sealed(values["scope"], values["key"], self._present(session, values))
        self.check_size(session, values)
        connection = session.connection(bind_arguments={"clause": self.table})
        refuse_autocommit(connection)
        refuse_changed_rows(connection)
        path = drivers.fast_path(connection, claim=True)
        if path is None:
            with self.bounded_wait(session, wait):
                won, record = self._insert(session, values)
                if won:
                    return True, None
                if record is not None:
                    return False, record
                return False, self.load(
                    session,
                    values["scope"],
                    values["key"],
                    stored_request=False,
                    unreadable_ok=True,
                )
        idle, name = self.claim_idle, connection.dialect.name
        loads = self._loads_for(connection)
        statements = self._compiled.claim(
            connection.dialect,
            self._insert_for(name),
            loads.head_locking if dialect_for(name).locking_reads else loads.head,
            bounded=wait is not None,
            idle_bounded=idle is not None,
            values=values,
        )
        params = drivers.claim_params(values, wait=wait, idle=idle, dialect=name)
        try:
            found = path.send_batch(connection, statements, params)
        except sa_exc.DBAPIError as exc:
            if dberrors.stopped_waiting(exc):
                raise self._wait_exceeded(exc) from exc
            raise
        if found is None:
            return False, None  # deleted since it blocked our insert
        if found["fencing_token"] == values["fencing_token"]:
            return True, None  # ours
        return False, self._record_or_unreadable(found)

    def readable(self, executor: Executor, record: Record) -> Record:
        """``record`` (from :meth:`claim`) if its sealed columns opened; else
        :class:`SealBroken`, read again for what did not open."""
        if record.unreadable is None:
            return record
        self.load(executor, record.scope, record.key, stored_request=False)  # raises
        raise SealBroken(record.scope, "?", record.unreadable)  # pragma: no cover - changed

    def load_committed(
        self, executor: sa.Engine | sa.Connection, scope: str, key: str
    ) -> Record | None:
        """The committed record for (scope, key): read on a connection of its own
        (an engine), or in the caller's transaction on ``executor`` (a
        connection: the latest committed row on every engine, the read on MySQL
        locking)."""
        if isinstance(executor, sa.Connection):
            return self.load(executor, scope, key)
        with executor.connect() as conn:
            return self.load(conn, scope, key)

    def take_over(
        self,
        executor: Executor,
        record: Record,
        values: dict[str, t.Any],
        now: dt.datetime,
        *,
        expired: bool,
        token: int,
    ) -> bool:
        """Claim an existing record with the fresh fencing ``token``.

        An expired record is replaced: ``values`` must set every column of an
        operation, so nothing of the old operation (recovery points, stored
        request, response) survives into the new one. A record whose lease ended
        is reclaimed: the same operation goes on, keeping its recovery points,
        stored request, creation and retention times. One conditional ``UPDATE``
        on the fencing token read: exactly one contender can win.
        """
        values = self._sealed(record.scope, record.key, self._present(executor, values))
        self.check_size(executor, values)
        params = {
            **values,
            "fencing_token": token,
            "w_scope": record.scope,
            "w_key": record.key,
            "w_token": record.fencing_token,
            "w_now": now,
        }
        if expired:
            return self._changed_one(executor, self._replace_expired, params)
        for kept in RECLAIM_KEEPS:
            params.pop(kept, None)
        # The record's own fingerprint: a retry judged the same request by its
        # bytes (the route's fingerprint rules changed) writes its new one.
        params["w_request_hash"] = record.request_hash
        return self._changed_one(executor, self._reclaim, params)
