"""Key and re-sealing commands of the `flask idempotency` group (cli.py registers them).

``generate-key`` prints a fresh key line for ``IDEMPOTENCY_ENCRYPTION_KEYS``;
``reseal`` re-seals, with the current key (the first configured), every record
and outbox value sealed with another key or written in clear, so that the old
keys can then be removed.

``reseal`` runs while traffic runs: how is :mod:`._storage.reseal`'s.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import typing as t

import click

from . import _cli
from ._messaging.outbox import keyring
from ._storage import seal
from ._storage.reseal import Tally, Walk, left_behind, reseal_table
from ._storage.schema import outbox_table

#: The most rows ``reseal`` reads per transaction.
MAX_RESEAL_BATCH = 10_000
TABLES = ("records", "outbox")
_OUTBOX_ID = re.compile(r"[0-9]{1,19}")
_MAX_ID = 2**63 - 1  # BIGINT


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
    if table == "outbox" and _OUTBOX_ID.fullmatch(rest) and int(rest) <= _MAX_ID:
        return table, [int(rest)]
    try:
        parsed = json.loads(rest) if table == "records" else None
    except ValueError:
        parsed = None
    if isinstance(parsed, list) and len(parsed) == 2 and all(map(_storable, parsed)):
        return table, parsed
    raise click.BadParameter(
        "not a position as reseal prints it: outbox:ID (0 to 2^63-1) or "
        'records:["SCOPE","KEY"] (text without NUL or lone surrogates)'
    )


def _storable(part: t.Any) -> bool:
    """A scope or key a record can have: text, encodable, without NUL."""
    if not isinstance(part, str) or "\x00" in part:
        return False
    try:
        part.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
    altered) is reported and left as it is. Every run ends by counting, over
    each whole table, the rows still not sealed with the current key: exits 0
    only when there are none (then the old keys can go), 1 when some are left
    (run again), 78 when encryption is not configured."""
    state = _cli.current_state()
    ring = keyring(state)
    if ring is None:
        raise _cli.Misconfigured("IDEMPOTENCY_ENCRYPTION_KEYS is not set: no key to seal with")
    tables = list(TABLES) if which == "all" else [which]
    if start is not None and start[0] not in tables:
        raise click.BadParameter(
            f"a position in {start[0]} with --table {which}", param_hint="--from"
        )
    checked = list(tables)
    if start is not None:
        tables = tables[tables.index(start[0]) :]
    own = {"records": state.store.table, "outbox": outbox_table(state.db.metadata)}
    _cli.require_tables(*(own[name] for name in checked))

    for name in tables:

        def progress(tally: Tally, position: list[t.Any], name: str = name) -> None:
            if _cli.verbosity() >= 0:
                click.echo(
                    f"reseal {name}: {tally.read} read, {tally.resealed} re-sealed, "
                    f"{tally.changed} changed meanwhile, {tally.unreadable} unreadable; "
                    f"position {format_position(name, position)}",
                    err=True,
                )

        begin = start[1] if start is not None and start[0] == name else None
        walk = Walk(name, own[name], ring)
        tally = reseal_table(state.db.engine, walk, begin, batch, progress)
        _cli.report(
            f"{name}: {tally.resealed} re-sealed with key {ring.current!r} of {tally.read} read; "
            f"{tally.changed} changed under the run (run again), {tally.unreadable} unreadable"
        )
    # The whole of each table, whatever this run walked: a resumed run (--from)
    # never saw the rows an earlier, cut-off run left behind before its position.
    left = 0
    for name in checked:
        count = left_behind(state.db.engine, Walk(name, own[name], ring))
        left += count
        _cli.report(f"{name}: {count} row(s) not sealed with key {ring.current!r}")
    if left:
        raise _cli.CommandError(
            f"{left} row(s) still not sealed with the current key: see above, and run reseal again"
        )


def register(command: t.Callable[[str], t.Callable[[t.Callable[..., None]], t.Any]]) -> None:
    """Add the commands to the group through ``command`` (cli.py's ``_command``)."""
    command("generate-key")(generate_key)
    command("reseal")(reseal)
