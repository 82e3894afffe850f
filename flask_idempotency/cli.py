"""The ``flask idempotency`` command group."""

from __future__ import annotations

import click
from flask import current_app
from flask.cli import AppGroup

idempotency_cli = AppGroup("idempotency", help="Inspect and maintain idempotency records.")


@idempotency_cli.command("create-tables")
def create_tables() -> None:
    """Create the idempotency tables (only those) if they do not exist."""
    state = current_app.extensions["idempotency"]
    state.store.table.create(state.db.engine, checkfirst=True)
    click.echo(f"created {state.store.table.name} (if it was missing)")


@idempotency_cli.command("recover")
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="Most records to handle in this run.",
)
def recover(limit: int) -> None:
    """Finish or release in-progress records whose lease has ended, once."""
    from .jobs import recover_abandoned

    report = recover_abandoned(current_app._get_current_object(), limit=limit)  # type: ignore[attr-defined]
    click.echo(f"lease recovery: {report}")
