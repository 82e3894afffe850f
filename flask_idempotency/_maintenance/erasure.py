"""Erasure (``idem.erase``, ``flask idempotency erase``): a scope's records,
or one key's, made tombstones, and their outbox events emptied, in bounded
batches, each its own short transaction (:mod:`.._storage.erasure` has the
statements and what they re-check)."""

from __future__ import annotations

import dataclasses
import logging
import typing as t

import sqlalchemy as sa
from flask import Flask

from .._context import AppState, app_state, resolve_app
from .._storage import outbox as outbox_sql
from .._storage import outbox_table
from .._storage.erasure import Batch, erase_events, erase_records
from .jobs import positive

logger = logging.getLogger("flask_idempotency")

#: The most rows one batch takes (``batch=``, ``--batch``).
MAX_ERASE_BATCH = 10_000


@dataclasses.dataclass(frozen=True)
class ErasureReport:
    """What one erasure did (:meth:`Idempotency.erase <flask_idempotency.Idempotency.erase>`).

    Counts of this run only: a second run over the same scope erases nothing
    new and reports 0 (tombstones are not counted again)."""

    #: Records made tombstones.
    erased: int = 0
    #: Records left as they were: in progress under a live lease (running now),
    #: or changed between the batch's read and its update. Run it again later.
    skipped: int = 0
    #: Outbox events (published or parked) whose payload and headers were erased.
    events_erased: int = 0
    #: Outbox events left as they were: pending (the relay must publish them
    #: first), or changed meanwhile. Run it again once the relay has sent them.
    events_skipped: int = 0
    #: Transactions used, records' and events' together.
    batches: int = 0

    @property
    def complete(self) -> bool:
        """Nothing was skipped: everything found was erased."""
        return self.skipped == 0 and self.events_skipped == 0

    def __str__(self) -> str:
        return (
            f"erased {self.erased} record(s), skipped {self.skipped} (in progress); erased "
            f"{self.events_erased} outbox event(s), skipped {self.events_skipped} (pending); "
            f"in {self.batches} batch(es)"
        )


def _checked_text(name: str, value: t.Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, not {value!r}")
    return value


def erase(
    app: Flask | None, scope: str, key: str | None = None, *, batch: int | None = None
) -> ErasureReport:
    """Erase the records of ``scope`` (only ``key``'s, when given) and the outbox
    events they own; see :meth:`Idempotency.erase <flask_idempotency.Idempotency.erase>`.
    An empty scope or key, or a batch below 1 or above :data:`MAX_ERASE_BATCH`,
    raises :class:`ValueError` before anything is erased."""
    _checked_text("scope", scope)
    if key is not None:
        _checked_text("key", key)
    if batch is not None:
        positive("batch", batch)
        if batch > MAX_ERASE_BATCH:
            raise ValueError(f"batch must be at most {MAX_ERASE_BATCH}, not {batch!r}")
    app = resolve_app(app)
    with app.app_context():
        state = app_state(app)
        size = batch or state.settings.purge_batch
        erased, skipped, batches = _records(state, scope, key, size)
        events_erased, events_skipped, event_batches = _events(state, scope, key, size)
    report = ErasureReport(erased, skipped, events_erased, events_skipped, batches + event_batches)
    logger.info("erasure of scope %r%s: %s", scope, "" if key is None else f" key {key!r}", report)
    return report


def _records(state: AppState, scope: str, key: str | None, size: int) -> tuple[int, int, int]:
    """The records' batches, each in its own transaction, judged by the database's clock."""
    erased = skipped = batches = 0
    after: str | None = None
    while True:
        with state.db.engine.begin() as conn:
            done = erase_records(conn, state.store.table, scope, key, state.now(conn), size, after)
        batches += 1
        erased, skipped = erased + done.erased, skipped + done.skipped
        if done.last is None:
            return erased, skipped, batches
        after = done.last


def _events(state: AppState, scope: str, key: str | None, size: int) -> tuple[int, int, int]:
    """The outbox's batches, when the table exists; an outbox without the owner
    columns (an earlier release's) cannot say which events an operation owns:
    a WARNING says so, and none is erased."""
    table = outbox_table(state.db.metadata)
    engine = state.db.engine
    with engine.connect() as conn:
        if not sa.inspect(conn).has_table(table.name, schema=table.schema):
            return 0, 0, 0
        absent = outbox_sql.absent_columns(conn, table)
    if absent.intersection(outbox_sql.OWNER):
        logger.warning(
            "erasure: %s has no owner columns (an earlier release's table): its events "
            "were not erased; add the columns (see the changelog) and erase again",
            table.name,
        )
        return 0, 0, 0
    erased = skipped = batches = 0
    after: int | None = None
    trace = outbox_sql.TRACE_CONTEXT not in absent
    while True:
        with engine.begin() as conn:
            done: Batch = erase_events(conn, table, scope, key, size, after, trace_context=trace)
        batches += 1
        erased, skipped = erased + done.erased, skipped + done.skipped
        if done.last is None:
            return erased, skipped, batches
        after = done.last
