"""Re-sealing with the current key (``flask idempotency reseal``, :mod:`.._cli_keys`):
the statements, and the walk over a table in primary-key order.

A batch is one short transaction of its own over a window: the next positions,
read without locks, of which it takes only the rows no other transaction holds
(``FOR UPDATE SKIP LOCKED`` where the engine has it; SQLite has one writer); the
window less the rows taken was held (a request's claim holds its record's row
for the view's whole transaction, and re-sealing never waits on it). Each row's
update is a compare-and-swap on every sealed value it read (null-safe equality:
``IS NOT DISTINCT FROM``, ``<=>``, ``IS``), so a completion, a step saved, a
relay's update or an erasure that got there first is never overwritten; such a
row, and one that was held, is remembered and tried once more at the end of the
run. A value that does not open is counted, logged and never rewritten.
:func:`left_behind` then counts, over the whole table, what is still not sealed
with the current key (whatever this run or a cut-off one left).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import typing as t

import sqlalchemy as sa

from .._failures import SealBroken
from . import outbox as outbox_sql
from . import seal
from .dialects import dialect_for
from .schema import ERASED_PAYLOAD, _text

logger = logging.getLogger("flask_idempotency")

#: The most rows that changed under a run it remembers to try once more.
_RETRY_LIMIT = 100_000


@dataclasses.dataclass
class Tally:
    """What a run of ``reseal`` did to one table."""

    read: int = 0  #: rows read
    resealed: int = 0  #: rows re-sealed with the current key
    changed: int = 0  #: rows that changed (or were held) under the run, left as they are
    unreadable: int = 0  #: rows with a value that does not open, left as they are


class Walk:
    """One table's rows in primary-key order: what to read, how to name a
    position, how to open and seal a row, and the compare-and-swap update."""

    def __init__(self, name: str, table: sa.Table, ring: seal.Keyring) -> None:
        self.name, self.table, self.ring = name, table, ring
        if name == "records":
            self.key = [table.c.scope, table.c.key]
            self.sealed = [*seal.RECORD_TEXT, *seal.RECORD_BINARY]
        else:
            self.key = [table.c.id]
            self.sealed = list(seal.OUTBOX_TEXT)
        self.identity = ["event_id"] if name == "outbox" else []

    def position(self, row: t.Any) -> list[t.Any]:
        if self.name == "records":
            return [_text(row.scope), _text(row.key)]
        return [int(row.id)]

    def after(self, position: list[t.Any] | None) -> sa.ColumnElement[bool]:
        if position is None:
            return sa.true()
        if self.name == "outbox":
            return t.cast("sa.ColumnElement[bool]", self.table.c.id > position[0])
        scope, key = self.table.c.scope, self.table.c.key
        s, k = (sa.bindparam(None, v, type_=sa.String()) for v in position)
        return sa.or_(scope > s, sa.and_(scope == s, key > k))

    def at(self, position: list[t.Any]) -> sa.ColumnElement[bool]:
        if self.name == "outbox":
            return t.cast("sa.ColumnElement[bool]", self.table.c.id == position[0])
        s, k = (sa.bindparam(None, v, type_=sa.String()) for v in position)
        return sa.and_(self.table.c.scope == s, self.table.c.key == k)

    def columns(self) -> list[t.Any]:
        return [*self.key, *(self.table.c[n] for n in self.identity + self.sealed)]

    def current(self, values: dict[str, t.Any]) -> bool:
        """Whether every value is absent or sealed with the current key; an
        erased event's placeholder stays as it is (erasure and ``outbox-retry``
        recognise the event by it: sealed, it would be published again)."""
        if self.name == "outbox" and values.get("payload") == ERASED_PAYLOAD:
            return True
        return all(
            v is None or seal.key_id_of(v) == self.ring.current
            for v in (values[c] for c in self.sealed)
        )

    def resealed(self, row: t.Any) -> dict[str, t.Any]:
        """The row's sealed values opened and sealed again with the current key
        (:class:`SealBroken` when one does not open)."""
        m = row._mapping
        values = {c: m[c] for c in self.sealed}
        if self.name == "records":
            scope, key = t.cast(str, _text(m["scope"])), t.cast(str, _text(m["key"]))
            opened = seal.open_record(self.ring, self.table.name, scope, key, values)
            return seal.seal_record(self.ring, self.table.name, scope, key, opened)
        event_id = t.cast(str, _text(m["event_id"]))
        clear = {
            c: outbox_sql.open_event_text(self.ring, event_id, c, v) for c, v in values.items()
        }
        return outbox_sql.seal_event(self.ring, event_id, clear)

    def swap(self, conn: sa.Connection, row: t.Any, new: dict[str, t.Any]) -> bool:
        """Write ``new`` where the row still holds every sealed value read."""
        m = row._mapping
        unchanged = [self.table.c[c].is_not_distinct_from(m[c]) for c in self.sealed]
        stmt = sa.update(self.table).where(self.at(self.position(row)), *unchanged).values(new)
        return bool(conn.execute(stmt).rowcount == 1)


def _batch(
    engine: sa.Engine, walk: Walk, where: sa.ColumnElement[bool], limit: int, tally: Tally
) -> tuple[list[t.Any] | None, list[list[t.Any]]]:
    """One batch in a short transaction of its own: the last position read
    (``None``: nothing left), and the positions of rows that changed under it."""
    dialect = dialect_for(engine.dialect.name)
    changed: list[list[t.Any]] = []
    with engine.connect() as conn:
        if dialect.take_isolation is not None:  # no gap locks an insert would wait on
            conn = conn.execution_options(isolation_level=dialect.take_isolation)
        with conn.begin():
            # SQLite: its write lock first, so no writer commits between this
            # batch's read and its updates (a WAL reader could not upgrade then).
            dialect.lock_writers(conn, walk.table, walk.sealed[0])
            # The window: the next ``limit`` positions, read without locks;
            # then the unheld rows within it, locked until this batch commits
            # (SQLite: one writer). The window less the rows taken was held.
            keys = sa.select(*walk.key).where(where).order_by(*walk.key).limit(limit)
            window = [walk.position(r) for r in conn.execute(keys)]
            if not window:
                return None, changed
            within = sa.not_(walk.after(window[-1]))
            query = sa.select(*walk.columns()).where(where, within).order_by(*walk.key)
            rows = list(conn.execute(dialect.skip_locked_take(query)))
            taken = {json.dumps(walk.position(r)) for r in rows}
            held = [p for p in window if json.dumps(p) not in taken]
            tally.changed += len(held)
            changed.extend(held)
            for row in rows:
                tally.read += 1
                if walk.current(dict(row._mapping)):
                    continue
                try:
                    new = walk.resealed(row)
                except SealBroken as exc:
                    tally.unreadable += 1
                    logger.warning("reseal: skipped (left as it is): %s", exc)
                    continue
                if walk.swap(conn, row, new):
                    tally.resealed += 1
                else:
                    tally.changed += 1
                    changed.append(walk.position(row))
    return window[-1], changed


def reseal_table(
    engine: sa.Engine,
    walk: Walk,
    start: list[t.Any] | None,
    batch: int,
    progress: t.Callable[[Tally, list[t.Any]], None],
) -> Tally:
    """Re-seal ``walk``'s table after the position ``start`` (from its first row
    when ``None``), ``batch`` rows per transaction; what it did. ``progress``
    is called after each batch with the tally and the position reached."""
    tally, position = Tally(), start
    again: list[list[t.Any]] = []
    while True:
        last, changed = _batch(engine, walk, walk.after(position), batch, tally)
        if last is None:
            break
        again.extend(changed[: max(0, _RETRY_LIMIT - len(again))])
        position = last
        progress(tally, position)
    tally.changed -= len(again)
    retried = Tally()
    for pos in again:  # once more, each in its own transaction
        _batch(engine, walk, walk.at(pos), 1, retried)
    tally.resealed += retried.resealed
    tally.changed += retried.changed
    tally.unreadable += retried.unreadable
    return tally


def left_behind(engine: sa.Engine, walk: Walk) -> int:
    """How many rows of the whole table still hold a value that is not NULL
    and not sealed with the current key (an erased event's placeholder
    aside): whatever this run or an earlier one, cut off, left behind. One
    read, comparing each value's first bytes (the key id it names) in SQL."""
    kid = walk.ring.current
    binary = seal.RECORD_BINARY if walk.name == "records" else ()
    stale = []
    for name in walk.sealed:
        column = walk.table.c[name]
        raw_id = kid.encode("ascii")
        prefix: str | bytes
        if name in binary:
            prefix = seal.MAGIC + bytes([len(raw_id)]) + raw_id
        else:
            prefix = f"{seal.TEXT_PREFIX}{kid}:"
        head = sa.func.substr(column, 1, len(prefix), type_=column.type)
        stale.append(sa.and_(column.is_not(None), head != sa.bindparam(None, prefix, column.type)))
    where = sa.or_(*stale)
    if walk.name == "outbox":
        where = sa.and_(where, walk.table.c.payload.is_distinct_from(ERASED_PAYLOAD))
    query = sa.select(sa.func.count()).select_from(walk.table).where(where)
    with engine.connect() as conn:
        return int(conn.execute(query).scalar_one())
