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
