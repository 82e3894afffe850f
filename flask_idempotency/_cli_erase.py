"""Erasure commands of the `flask idempotency` group (cli.py registers them)."""

from __future__ import annotations

import click

from . import _cli
from ._cli import CommandError, key_argument, scope_argument
from ._context import resolve_app
from ._maintenance.erasure import MAX_ERASE_BATCH, reclaim
from ._maintenance.erasure import erase as erase_scope


@click.option("--scope", required=True, callback=scope_argument, help="The caller's scope.")
@click.option("--key", default=None, callback=key_argument, help="Only this key (quoted or bare).")
@click.option(
    "--batch",
    type=click.IntRange(min=1, max=MAX_ERASE_BATCH),
    default=None,
    help="Rows per transaction (default IDEMPOTENCY_PURGE_BATCH).",
)
@click.option(
    "--settle",
    type=click.FloatRange(min=0),
    default=None,
    metavar="SECONDS",
    help="Wait this long after the first pass, then erase again what requests already "
    "running at the start stored (default: no second pass).",
)
@click.option(
    "--vacuum",
    is_flag=True,
    help="Then rewrite the tables so no erased row version stays in the database's files "
    "(SQLite VACUUM, PostgreSQL VACUUM FULL: locks the table meanwhile, MariaDB OPTIMIZE TABLE).",
)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def erase(
    scope: str, key: str | None, batch: int | None, settle: float | None, vacuum: bool, yes: bool
) -> None:
    """Erase what is kept of a caller's operations: the scope's records (or one
    key's) become tombstones until they expire, so a retry is answered 410
    key-erased and never runs again; their published or parked outbox events
    lose payload and headers. Bounded batches, safe while traffic runs, and
    idempotent: run it again to finish what it skipped.

    Revoke the caller's access first, and wait out the requests already
    running (or give --settle the longest a request takes): a request running
    when the erasure starts is invisible to it until it commits.

    Exit 1 when something was skipped: a record in progress under a live lease
    (running now), or an outbox event still pending (the relay must publish it
    first); and when nothing matched: no record and no tombstone of the scope
    (or key), usually a typo.
    """
    state = _cli.current_state()
    _cli.require_tables(state.store.table)
    if not yes:
        which = f"the record of key {key!r}" if key is not None else "every record"
        click.confirm(
            f"Erase {which} in scope {scope!r} and its outbox events? Their stored data "
            "cannot be restored",
            abort=True,
        )
    report = erase_scope(resolve_app(), scope, key, batch=batch, settle=settle)
    _cli.report(str(report))
    if vacuum:
        _cli.report("rewrote " + ", ".join(reclaim(resolve_app())))
    if report.matched == 0 and report.events_erased == 0:
        which = f"key {key!r} in scope {scope!r}" if key is not None else f"scope {scope!r}"
        raise CommandError(
            f"no record of {which}; check the exact scope with `flask idempotency list`"
        )
    if not report.complete:
        raise CommandError(
            f"not all erased: {report.skipped} record(s) in progress under a live lease, "
            f"{report.events_skipped} outbox event(s) still pending; run it again later"
        )
