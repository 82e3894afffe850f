"""Idempotent functions of the test app for tests/unit/functions: a leased job
whose steps call a fake downstream (a file, one line per call), which a
subprocess runs and can kill itself in (SIGKILL) between its steps.

Run :func:`main` from ``python -c`` (imported: run as ``__main__``, the
function's module would be ``__main__``, and its fingerprint another).
"""

from __future__ import annotations

import os
import signal
import typing as t

from tests.support import testapp
from tests.support.testapp import Ledger, db, idem


def downstream(log: str, name: str) -> dict[str, str]:
    """The fake downstream's call: one line in ``log``; its answer names the
    derived key it was sent."""
    key = idem.derived_key(name)
    with open(log, "a", encoding="utf-8") as file:
        file.write(f"{name} {key}\n")
    return {"done": name, "key": key}


@idem.function(scope="jobs.ship", key="order", lease=60, exclude=("log", "crash_after"))
def ship(order: str, log: str, crash_after: str | None = None) -> dict[str, t.Any]:
    """Charge, then email, each a recovery point; one ledger row and one event
    commit with the record."""
    charged = idem.step("charge", lambda: downstream(log, "charge"))
    if crash_after == "charge":
        os.kill(os.getpid(), signal.SIGKILL)
    emailed = idem.step("email", lambda: downstream(log, "email"))
    event = idem.emit("orders.shipped", {"order": order})
    db.session.add(Ledger(route="ship", key=order, amount=1))
    return {"charge": charged, "email": emailed, "event": event}


@idem.function(scope="jobs.book", key="order", exclude=("crash_after",))
def book(order: str, crash_after: str | None = None) -> str:
    """Not leased: commits a ledger row of its own, then goes on."""
    db.session.add(Ledger(route="book", key=order, amount=1))
    db.session.commit()
    if crash_after == "commit":
        os.kill(os.getpid(), signal.SIGKILL)
    return "booked"


def main(url: str, job: str, order: str, log: str, crash_after: str | None = None) -> None:
    app = testapp.create_app(url)
    with app.app_context():
        print(ship(order, log, crash_after) if job == "ship" else book(order, crash_after))
