"""``flask idempotency reconcile`` (cli.py registers it): list the records
whose view committed and whose request never answered, and ask the app's
reconcile hook to rebuild their answers (:mod:`._maintenance.reconcile`)."""

from __future__ import annotations

import click

from . import _cli
from ._cli import CommandError, key_argument
from ._context import resolve_app
from ._maintenance.reconcile import candidates, idempotent_endpoint, reconcile_record
from ._storage import Record


def _line(record: Record) -> str:
    state = "completed" if record.status == "completed" else "in progress"
    line = f"{record.scope}\t{record.key}\t{_cli.iso(record.created_at)}\t{state}"
    return f"{line}\tunreadable" if record.unreadable is not None else line


@click.option("--list", "listing", is_flag=True, help="Only list them (scope, key, created).")
@click.option("--scope", default=None, help="Only this scope.")
@click.option("--key", default=None, callback=key_argument, help="Only this key (quoted or bare).")
@click.option(
    "--endpoint",
    default=None,
    help="The endpoint whose reconcile= hook to ask, for records that kept no request "
    "(default: the route the stored request reaches, else IDEMPOTENCY_RECONCILE).",
)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def reconcile(
    listing: bool, scope: str | None, key: str | None, endpoint: str | None, yes: bool
) -> None:
    """Rebuild the answers of operations whose view committed and whose request
    never answered (stored as 500 failed-after-commit, or in progress holding
    it past their lease) with the app's reconcile hook, which finds what was
    committed. Each record prints "rebuilt" or "not rebuilt" and why. A record
    under a live lease, a tombstone or an unreadable record is never touched.
    Every such record is listed or asked for, however many (read 1000 at a time).

    Exit 0 when every record was rebuilt (or none was found), 1 when some were
    not, 2 when --endpoint names no route declared with @idem.idempotent.
    """
    state = _cli.current_state()
    _cli.require_tables(state.store.table)
    app = resolve_app()
    if endpoint is not None:
        try:
            idempotent_endpoint(app, endpoint)
        except ValueError as exc:  # a typo would silently ask another hook
            raise click.BadParameter(str(exc), param_hint="--endpoint") from None
    if listing:
        listed = 0
        for record in candidates(app, scope=scope, key=key):
            click.echo(_line(record))
            listed += 1
        _cli.report(f"{listed} record(s) failed after commit")
        return
    if not yes:
        total = sum(1 for _ in candidates(app, scope=scope, key=key))
        if not total:
            _cli.report("nothing to reconcile")
            return
        click.confirm(
            f"Ask the reconcile hook to rebuild the answers of {total} record(s)?", abort=True
        )
    seen = missed = 0
    for record in candidates(app, scope=scope, key=key):
        seen += 1
        outcome = reconcile_record(app, record, endpoint=endpoint)
        if outcome.rebuilt:
            answered = outcome.record.response_code
            click.echo(f"rebuilt\t{record.scope}\t{record.key}\t{answered}")
        else:
            missed += 1
            click.echo(f"not rebuilt\t{record.scope}\t{record.key}\t{outcome.reason}")
    if not seen:
        _cli.report("nothing to reconcile")
    elif missed:
        raise CommandError(f"{missed} of {seen} record(s) not rebuilt")
