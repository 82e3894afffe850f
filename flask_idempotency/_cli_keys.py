"""Key and re-sealing commands of the `flask idempotency` group (cli.py registers them).

``generate-key`` prints a fresh key line for ``IDEMPOTENCY_ENCRYPTION_KEYS``;
``reseal`` re-seals, with the current key (the first configured), every record
and outbox value sealed with another key or written in clear, so that the old
keys can then be removed.

``reseal`` runs while traffic runs. It walks a table in primary-key order, a
batch per short transaction of its own, taking only rows no one holds (``FOR
UPDATE SKIP LOCKED`` where the engine has it: a request's claim holds its
record's row for the view's whole transaction, and a relay its leased events
only for a moment). Each row's update is a compare-and-swap on every sealed
value it read (null-safe equality), so a completion, a step saved or an erasure
that got there first is never overwritten: the row is counted, tried once more
at the end of the run, and left to the next run if it still changed (what the
app wrote meanwhile is sealed with the current key anyway). A value that does
not open is reported and counted, never rewritten.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import typing as t

import click
import sqlalchemy as sa

from . import _cli
from ._context import AppState
from ._failures import SealBroken
from ._messaging.outbox import keyring
from ._storage import outbox as outbox_sql
from ._storage import seal
from ._storage.dialects import dialect_for
from ._storage.schema import _text, outbox_table

logger = logging.getLogger("flask_idempotency")

#: The most rows ``reseal`` reads per transaction.
MAX_RESEAL_BATCH = 10_000
#: The most rows that changed under a run it remembers to try once more.
_RETRY_LIMIT = 100_000
TABLES = ("records", "outbox")


def _check_id(ctx: click.Context, param: click.Parameter, value: str | None) -> str:
    if value is None:
        return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    if not seal.KEY_ID.fullmatch(value):
        raise click.BadParameter("1 to 32 letters, digits, '.', '_' or '-'")
    return value


@click.option(
    "--id",
    "key_id",
    callback=_check_id,
    help="The key's id (default: today's date, e.g. 2026-12-06).",
)
def generate_key(key_id: str) -> None:
    """Print a fresh random key as IDEMPOTENCY_ENCRYPTION_KEYS takes it: id:base64.

    Put it FIRST in the list to seal new values with it, keep the old keys
    after it until ``flask idempotency reseal`` has run, then remove them.
    Prints the key on stdout only (keep it out of shell history and logs)."""
    click.echo(f"{key_id}:{seal.new_key_text()}")


# -- reseal --------------------------------------------------------------------------


@dataclasses.dataclass
class Tally:
    """What a run of ``reseal`` did to one table."""

    read: int = 0  #: rows read
    resealed: int = 0  #: rows re-sealed with the current key
    changed: int = 0  #: rows that changed (or were held) under the run, left as they are
    unreadable: int = 0  #: rows with a value that does not open, left as they are


class _Walk:
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
        """Whether every value is absent or sealed with the current key."""
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
    state: AppState, walk: _Walk, where: sa.ColumnElement[bool], limit: int, tally: Tally
) -> tuple[list[t.Any] | None, list[list[t.Any]]]:
    """One batch in a short transaction of its own: the last position read
    (``None``: nothing left), and the positions of rows that changed under it."""
    dialect = dialect_for(state.db.engine.dialect.name)
    changed: list[list[t.Any]] = []
    with state.db.engine.connect() as conn:
        if dialect.take_isolation is not None:  # no gap locks an insert would wait on
            conn = conn.execution_options(isolation_level=dialect.take_isolation)
        with conn.begin():
            query = sa.select(*walk.columns()).where(where).order_by(*walk.key).limit(limit)
            # The unheld rows, locked until this batch commits (SQLite: one writer).
            rows = list(conn.execute(dialect.skip_locked_take(query)))
            held = _held(conn, walk, where, rows, limit)
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
    if rows:
        return walk.position(rows[-1]), changed
    return (held[-1] if held else None), changed


def _held(
    conn: sa.Connection, walk: _Walk, where: sa.ColumnElement[bool], rows: list[t.Any], limit: int
) -> list[list[t.Any]]:
    """The positions, up to the last row taken (all of the batch's when none
    was), that another transaction held (skipped by SKIP LOCKED): read without
    locks, to be tried again at the end of the run."""
    bound = sa.not_(walk.after(walk.position(rows[-1]))) if rows else sa.true()
    query = sa.select(*walk.key).where(where, bound).order_by(*walk.key).limit(limit)
    taken = {json.dumps(walk.position(r)) for r in rows}
    every = [walk.position(r) for r in conn.execute(query)]
    return [p for p in every if json.dumps(p) not in taken]


def reseal_table(
    state: AppState,
    walk: _Walk,
    start: list[t.Any] | None,
    batch: int,
    progress: t.Callable[[str], None],
) -> Tally:
    """Re-seal ``walk``'s table from after ``start``; what it did."""
    tally, position = Tally(), start
    again: list[list[t.Any]] = []
    while True:
        last, changed = _batch(state, walk, walk.after(position), batch, tally)
        if last is None:
            break
        again.extend(changed[: max(0, _RETRY_LIMIT - len(again))])
        position = last
        progress(
            f"reseal {walk.name}: {tally.read} read, {tally.resealed} re-sealed, "
            f"{tally.changed} changed meanwhile, {tally.unreadable} unreadable; "
            f"position {format_position(walk.name, position)}"
        )
    tally.changed -= len(again)
    retried = Tally()
    for pos in again:  # once more, each in its own transaction
        _batch(state, walk, walk.at(pos), 1, retried)
    tally.resealed += retried.resealed
    tally.changed += retried.changed
    tally.unreadable += retried.unreadable
    return tally


def format_position(table: str, position: list[t.Any]) -> str:
    """A position as ``--from`` takes it: ``records:["scope","key"]`` or ``outbox:42``."""
    if table == "outbox":
        return f"outbox:{position[0]}"
    return "records:" + json.dumps(position, ensure_ascii=False, separators=(",", ":"))


def parse_position(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> tuple[str, list[t.Any]] | None:
    """``--from``: a position as a run printed it."""
    if value is None:
        return None
    table, _, rest = value.partition(":")
    try:
        if table == "outbox":
            return table, [int(rest)]
        parsed = json.loads(rest)
        if table == "records" and isinstance(parsed, list) and len(parsed) == 2:  # noqa: SIM102
            if all(isinstance(p, str) for p in parsed):
                return table, parsed
    except ValueError:
        pass
    raise click.BadParameter(
        f'{value!r} is not a position as reseal prints it: outbox:ID or records:["SCOPE","KEY"]'
    )


@click.option(
    "--batch",
    type=click.IntRange(min=1, max=MAX_RESEAL_BATCH),
    default=500,
    show_default=True,
    help="Rows per transaction.",
)
@click.option(
    "--table",
    "which",
    type=click.Choice(["records", "outbox", "all"]),
    default="all",
    show_default=True,
    help="Which table to re-seal (all: records, then the outbox).",
)
@click.option(
    "--from",
    "start",
    callback=parse_position,
    metavar="POSITION",
    help="Resume after this position (printed by a run: records:[...] or outbox:ID).",
)
def reseal(batch: int, which: str, start: tuple[str, list[t.Any]] | None) -> None:
    """Re-seal records and outbox rows with the current key (the first of
    IDEMPOTENCY_ENCRYPTION_KEYS): those sealed with another key, and those
    written in clear before encryption was on. Safe while traffic runs.

    Progress and the position reached go to stderr after each batch: a run cut
    off resumes with --from POSITION. A row that changed under the run is left
    to the next run; a value that does not open (its key not configured,
    altered) is reported and left as it is. Exits 1 when a row was left (run
    again), 78 when encryption is not configured."""
    state = _cli.current_state()
    ring = keyring(state)
    if ring is None:
        raise _cli.Misconfigured("IDEMPOTENCY_ENCRYPTION_KEYS is not set: no key to seal with")
    tables = list(TABLES) if which == "all" else [which]
    if start is not None and start[0] not in tables:
        raise click.BadParameter(
            f"a position in {start[0]} with --table {which}", param_hint="--from"
        )
    if start is not None:
        tables = tables[tables.index(start[0]) :]
    own = {"records": state.store.table, "outbox": outbox_table(state.db.metadata)}
    _cli.require_tables(*(own[name] for name in tables))

    def progress(line: str) -> None:
        if _cli.verbosity() >= 0:
            click.echo(line, err=True)

    left = 0
    for name in tables:
        begin = start[1] if start is not None and start[0] == name else None
        tally = reseal_table(state, _Walk(name, own[name], ring), begin, batch, progress)
        left += tally.changed + tally.unreadable
        _cli.report(
            f"{name}: {tally.resealed} re-sealed with key {ring.current!r} of {tally.read} read; "
            f"{tally.changed} changed under the run (run again), {tally.unreadable} unreadable"
        )
    if left:
        raise _cli.CommandError(f"{left} row(s) left as they were: see above, and run reseal again")
