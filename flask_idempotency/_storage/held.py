"""A holder's statements on the record it holds, each fenced by its token.

Every one is a conditional ``UPDATE``/``DELETE`` on (scope, key, fencing token,
in progress): a holder that lost the record (taken over, released, purged)
changes nothing, and is told so (``False``).
"""

from __future__ import annotations

import datetime as dt
import json
import typing as t

import sqlalchemy as sa

from ..errors import TooLargeToStore
from . import dberrors
from .dialects import Executor, dialect_for, dialect_of
from .execute import Statements
from .schema import COMPLETED, IN_PROGRESS
from .sql import lease_over, text_param


def answer_values(
    response_code: int,
    response_headers: list[tuple[str, str]],
    response_body: bytes | None,
    body_omitted: bool,
) -> dict[str, t.Any]:
    """The columns of a stored answer, as :meth:`HeldRecord.complete` writes them."""
    return {
        "response_code": response_code,
        "response_headers": json.dumps(response_headers),
        "response_body": response_body,
        "body_omitted": body_omitted,
    }


class HeldRecord(Statements):
    """The statements of a record's holder (see the module's documentation)."""

    def __init__(self, table: sa.Table) -> None:
        super().__init__(table)
        c = table.c
        still_held = (
            c.scope == text_param("w_scope"),
            c.key == text_param("w_key"),
            c.fencing_token == sa.bindparam("w_token"),
            c.status == IN_PROGRESS,
        )
        # A completed answer is kept for its retention counted from its
        # completion: the expiry moves to ``e_expires`` unless it is later
        # already (a view that ran past its ttl would otherwise store an answer
        # that had expired, and a duplicate waiting on it would run it again).
        kept_until = sa.bindparam("e_expires", type_=c.expires_at.type)
        completed = {
            "status": COMPLETED,
            "locked_until": None,
            "expires_at": sa.case(
                (c.expires_at > kept_until, c.expires_at),
                else_=sa.func.coalesce(kept_until, c.expires_at),
            ),
        }
        self._complete = sa.update(table).where(*still_held).values(**completed)
        self._release = sa.delete(table).where(*still_held)
        # An UPDATE of a held record; the SET clause comes from the parameters.
        self._update_held = sa.update(table).where(*still_held)
        # The same, naming the transaction it runs in, per engine that can.
        self._update_held_naming: dict[str, t.Any] = {}
        # The completion of a record whose view committed and whose holder never
        # finished: the answer stored at the view's commit becomes its outcome.
        self._settle_committed = (
            sa.update(table)
            .where(
                c.scope == text_param("w_scope"),
                c.key == text_param("w_key"),
                c.fencing_token == sa.bindparam("w_token"),
                c.status == IN_PROGRESS,
                c.response_code.is_not(None),
                lease_over(c, sa.bindparam("w_now")),
            )
            .values(**completed)
        )

        # An answer the app's reconcile hook rebuilt from committed state, in
        # place of the recorded failure (a completed record) or of the outcome
        # of an operation whose holder went away (in progress, its lease over).
        self._reconcile = (
            sa.update(table)
            .where(
                c.scope == text_param("w_scope"),
                c.key == text_param("w_key"),
                c.fencing_token == sa.bindparam("w_token"),
                c.status == sa.bindparam("w_status", type_=c.status.type),
                sa.or_(c.status == COMPLETED, lease_over(c, sa.bindparam("w_now"))),
            )
            .values(**completed)
        )

    def complete(
        self,
        executor: Executor,
        scope: str,
        key: str,
        token: int,
        *,
        response_code: int,
        response_headers: list[tuple[str, str]],
        response_body: bytes | None,
        body_omitted: bool,
        now: dt.datetime,
        expires_at: dt.datetime | None = None,
    ) -> bool:
        """Mark the record completed with its response, fenced by ``token``.

        ``expires_at``: the answer is kept until then (``now`` plus the route's
        ttl), or until the record's expiry if that is later; ``None`` leaves
        the expiry as it is.

        ``False`` means another request took the record over: the caller must
        roll back.
        """
        answer = answer_values(response_code, response_headers, response_body, body_omitted)
        params = {
            "w_scope": scope,
            "w_key": key,
            "w_token": token,
            **self._sealed(scope, key, answer),
            "completed_at": now,
            "e_expires": expires_at,
        }
        return self._changed_one(executor, self._complete, params)

    def settle_committed(
        self,
        executor: Executor,
        scope: str,
        key: str,
        token: int,
        now: dt.datetime,
        *,
        retention: dt.timedelta,
    ) -> bool:
        """Complete, with the answer it already holds, an in-progress record whose
        view committed work of its own (:attr:`.Record.view_committed`) and
        whose lease ended with its holder gone: that answer (500
        ``failed-after-commit``, stored with the view's commit) is the
        operation's outcome, since it happened and may not run again. Fenced
        by the ``token`` read; ``False``: the record changed meanwhile (its
        holder completed or renewed it, someone else settled it). The answer
        is kept for ``retention`` (the record's own, :attr:`.Record.retention`)
        from now, or until its expiry if that is later."""
        params = {"w_scope": scope, "w_key": key, "w_token": token, "w_now": now}
        params.update(completed_at=now, e_expires=now + retention)
        return self._changed_one(executor, self._settle_committed, params)

    def reconcile(
        self,
        executor: Executor,
        scope: str,
        key: str,
        token: int,
        *,
        status: str,
        new_token: int,
        answer: t.Mapping[str, t.Any],
        now: dt.datetime,
        retention: dt.timedelta,
    ) -> bool:
        """Store ``answer`` (columns from :func:`answer_values`, in clear) on a
        record as read, completed, in place of what it held: a record completed
        with the extension's failure (``status`` completed), or one in progress
        whose lease is over (``status`` in progress). Fenced by the ``token``
        read and that ``status``; the record takes ``new_token``, so of two
        callers that read the same record, one wins. ``False``: the record
        changed meanwhile. The answer is kept for ``retention`` from now, or
        until the record's expiry if that is later."""
        params = {
            "w_scope": scope,
            "w_key": key,
            "w_token": token,
            "w_status": status,
            "w_now": now,
            **self._sealed(scope, key, answer),
            "fencing_token": new_token,
            "completed_at": now,
            "e_expires": now + retention,
        }
        return self._changed_one(executor, self._reconcile, params)

    def release(
        self,
        executor: Executor,
        scope: str,
        key: str,
        token: int,
        *,
        keep_recovery_points: bool = False,
    ) -> bool:
        """Free a record this holder (``token``) still owns, so a retry runs at once.

        The record is deleted, unless it has recovery points to keep: then its
        lease is ended instead, and the retry reclaims it and resumes.
        """
        if keep_recovery_points:
            return self._set_held(executor, scope, key, token, {"locked_until": None})
        params = {"w_scope": scope, "w_key": key, "w_token": token}
        return self._changed_one(executor, self._release, params)

    def keep_for_retry(
        self,
        executor: Executor,
        scope: str,
        key: str,
        token: int,
        *,
        recovery_points: t.Mapping[str, t.Any],
    ) -> bool:
        """End the lease of a record this holder (``token``) still owns, and keep
        it for the client's retry.

        Its recovery points are written (an empty set included) and its stored
        request dropped, so neither a release nor the recovery job (which
        re-runs stored requests and deletes records without points) takes it:
        the client's retry reclaims the same operation.
        """
        values: dict[str, t.Any] = {
            "locked_until": None,
            "recovery_points": json.dumps(
                dict(recovery_points), sort_keys=True, separators=(",", ":")
            ),
            "request_method": None,
            "request_path": None,
            "request_content_type": None,
            "request_body": None,
        }
        return self._set_held(executor, scope, key, token, values)

    def renew_lease(
        self, executor: Executor, scope: str, key: str, token: int, locked_until: dt.datetime
    ) -> bool:
        """Extend the lease of a record this holder (``token``) still owns.

        Run inside a transaction that commits business rows, it also locks the
        record until that commit, so nobody can take the key over in between.
        ``False``: the record was taken over or deleted.
        """
        return self._set_held(executor, scope, key, token, {"locked_until": locked_until})

    def renew_lease_before_commit(
        self,
        executor: Executor,
        scope: str,
        key: str,
        token: int,
        locked_until: dt.datetime,
        answer: t.Mapping[str, t.Any] | None = None,
    ) -> tuple[bool, int | None]:
        """:meth:`renew_lease` in a transaction about to commit, and, on
        PostgreSQL, that transaction's id: should the ``COMMIT`` be interrupted
        with no answer, :meth:`commit_outcome` tells from the id whether it
        landed (``None`` elsewhere).

        ``answer`` (columns from :func:`answer_values`) is stored with it, the
        record staying in progress: the outcome of an operation whose view
        commits work of its own, should its holder never complete it
        (:meth:`settle_committed`)."""
        connection = self._connection(executor)
        dialect = dialect_for(connection.dialect.name)
        naming = dialect.transaction_id()
        if naming is None:
            values = {"locked_until": locked_until, **(answer or {})}
            return self._set_held(connection, scope, key, token, values), None
        stmt = self._update_held_naming.get(dialect.name)
        if stmt is None:
            stmt = self._update_held.returning(self.table.c.fencing_token, naming)
            self._update_held_naming[dialect.name] = stmt
        params = {
            "w_scope": scope,
            "w_key": key,
            "w_token": token,
            "locked_until": locked_until,
            **self._sealed(scope, key, answer or {}),
        }
        row: t.Any = self._execute(connection, stmt, params).first()
        if row is None:
            return False, None
        return True, int(row[1])

    def commit_outcome(
        self, executor: sa.Engine | sa.Connection, transaction: int, wait: dt.timedelta
    ) -> bool | None:
        """Whether transaction ``transaction`` (from
        :meth:`renew_lease_before_commit`) committed: ``True`` or ``False``,
        or ``None`` when that cannot be known within ``wait`` (see
        :meth:`.dialects.PostgreSQL.commit_outcome`).

        ``executor``: an engine (read on a connection of its own), or a
        connection in a transaction of the caller's, which is left usable
        (where a second connection may not be had: a pool of one).
        """
        return dialect_of(executor).commit_outcome(executor, transaction, wait)

    def restamp(
        self,
        executor: Executor,
        scope: str,
        key: str,
        token: int,
        *,
        locked_until: dt.datetime,
        created_at: dt.datetime | None = None,
        expires_at: dt.datetime | None = None,
    ) -> bool:
        """Set a held record's lease end (and creation and expiry, for a new
        operation), fenced by ``token``."""
        values: dict[str, t.Any] = {"locked_until": locked_until}
        if created_at is not None:
            values["created_at"] = created_at
        if expires_at is not None:
            values["expires_at"] = expires_at
        return self._set_held(executor, scope, key, token, values)

    def save_recovery_points(
        self,
        executor: Executor,
        scope: str,
        key: str,
        token: int,
        points: dict[str, t.Any],
        locked_until: dt.datetime,
    ) -> bool:
        """Store the recovery points and renew the lease, fenced by ``token``;
        ``False``: the lease was lost.

        Raises :class:`TooLargeToStore` when the points are larger than the
        database takes (checked before sending where the engine drops the
        connection instead of answering; else the database's refusal,
        :func:`.dberrors.too_large`): nothing was saved, the lease unchanged.
        """
        saved = json.dumps(points, sort_keys=True, separators=(",", ":"))
        values = self._sealed(scope, key, {"recovery_points": saved})
        self.refuse_oversized(executor, len(values["recovery_points"].encode()))
        values["locked_until"] = locked_until
        try:
            return self._set_held(executor, scope, key, token, values, sealed=True)
        except sa.exc.DBAPIError as exc:
            if dberrors.too_large(exc):
                raise TooLargeToStore(dberrors.summary(exc)) from exc
            raise

    def _set_held(
        self,
        executor: Executor,
        scope: str,
        key: str,
        token: int,
        values: dict[str, t.Any],
        *,
        sealed: bool = False,
    ) -> bool:
        """Set ``values`` (in clear, or ``sealed`` already) on a record this
        holder (``token``) still has in progress."""
        if not sealed:
            values = self._sealed(scope, key, values)
        params = {"w_scope": scope, "w_key": key, "w_token": token, **values}
        return self._changed_one(executor, self._update_held, params)
