"""An APScheduler job that charges an invoice.

A scheduler runs a job at least once, not exactly once: a misfired run is
caught up after a restart, a job stored in a job store runs again when the
process died before it was marked done, two processes with the same schedule
both run it. The job calls the idempotent function, so every run after the
first returns the first run's charge.

Two ways to run it: ``schedule_charge`` puts one charge on an APScheduler
scheduler of the app's own; ``charge_due`` is a job for the extension's
scheduler (``flask_idempotency.scheduler.JobScheduler.add_job``), which runs it
once at a time across processes, and whose runs may still overlap in their
work (a run that outlives its job lock, a process that died mid-run): the
function keeps each invoice's charge single all the same.
"""

from __future__ import annotations

import datetime as dt
import logging
import typing as t

from flask import Flask

from flask_idempotency import FunctionOutcome

from .app import charge_invoice

logger = logging.getLogger(__name__)


def charge_job(app: Flask, invoice_id: str, amount: int) -> FunctionOutcome:
    """The job: the charge of ``invoice_id``, made or (on a repeat) read back."""
    # A scheduler's thread has no app context of its own.
    with app.app_context():
        outcome = charge_invoice.outcome(invoice_id, amount)
    logger.info(
        "invoice %s: %s charge %s",
        invoice_id,
        "already made" if outcome.replayed else "made",
        outcome.value["charge_id"],
    )
    return outcome


def charge_due(
    due: t.Callable[[], t.Iterable[tuple[str, int]]],
) -> t.Callable[[Flask, t.Callable[[], bool]], None]:
    """A job for ``JobScheduler.add_job(name, charge_due(due), every)``: charge
    every ``(invoice_id, amount)`` that ``due()`` lists, stopping when the job's
    lock is lost (``keep_going()`` says so)."""

    def run(app: Flask, keep_going: t.Callable[[], bool]) -> None:
        for invoice_id, amount in due():
            charge_job(app, invoice_id, amount)
            if not keep_going():
                return

    return run


def schedule_charge(
    scheduler: t.Any, app: Flask, invoice_id: str, amount: int, at: dt.datetime | None = None
) -> t.Any:
    """Schedule the charge of ``invoice_id`` (now, or ``at``) on an APScheduler
    scheduler; a run that misfired by up to an hour still runs."""
    return scheduler.add_job(
        charge_job,
        "date",
        run_date=at or dt.datetime.now(dt.timezone.utc),
        args=(app, invoice_id, amount),
        id=f"charge-{invoice_id}",
        replace_existing=True,
        misfire_grace_time=3600,
    )
