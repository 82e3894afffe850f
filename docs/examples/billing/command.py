"""``flask --app billing.app charge-invoice INVOICE AMOUNT``: charge an invoice by hand.

An operator who runs it again (the terminal hung, the first run's output was
lost) gets the first run's charge printed again, marked ``replayed``, and no
second charge.
"""

from __future__ import annotations

import json

import click
from flask.cli import with_appcontext

from flask_idempotency.errors import KeyReusedError

from .app import charge_invoice


@click.command("charge-invoice")
@click.argument("invoice_id")
@click.argument("amount", type=int)
@with_appcontext  # the function needs an app context
def charge_invoice_command(invoice_id: str, amount: int) -> None:
    """Charge AMOUNT for INVOICE_ID, once per invoice."""
    try:
        outcome = charge_invoice.outcome(invoice_id, amount)
    except KeyReusedError as exc:
        raise click.ClickException(
            f"invoice {invoice_id} was charged with other arguments: {exc}"
        ) from exc
    done = "replayed" if outcome.replayed else "charged"
    click.echo(f"{done} {json.dumps(outcome.value, sort_keys=True)}")
