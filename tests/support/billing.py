"""The billing example (docs/examples/billing) as the tests drive it: imported as
a user's project imports it (``docs/examples`` on the path), on fresh tables,
and its ``charges`` read from outside the app.

``python -m tests.support.billing URL FUNCTION CRASH INVOICE AMOUNT [CONFIG]``
calls ``billing.app.<FUNCTION>`` once in a process of its own, as a job runner
or a consumer process would, and prints the outcome as one JSON line
(``{"value", "replayed"}``, or ``{"error", "retry_after"}`` for an exception,
exit code 3). ``CRASH`` arms a real crash (SIGKILL of the process itself) at a
point of the call, from outside the example's code:

- ``none``: no crash;
- ``in_body``: when the function's body flushes its charge row (inside the body,
  before anything of it is committed);
- ``before_commit``: when the session commits the charge row, before the commit;
- ``after_commit``: right after that commit (the charge and the record are in);
- ``after_step:NAME``: right after recovery point ``NAME`` was saved;
- ``hold:PATH``: no crash; when the body flushes its charge row, create
  ``PATH.held`` and wait (up to a minute) until ``PATH`` exists: the call holds
  its claim (uncommitted) while the test starts a second caller.

``python -m tests.support.billing URL consume CRASH BROKER QUEUE`` is a consumer
process instead: it takes one charge request off ``QUEUE`` at ``BROKER`` with the
example's consumer (``billing.consumer.consume``), crashing at ``CRASH`` as above
(``after_commit``: the charge committed, the message not acked yet).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import typing as t
from pathlib import Path
from types import ModuleType

from tests.support.live import ROOT
from tests.support.tables import recreate_tables

EXAMPLES = ROOT / "docs" / "examples"


def example(name: str = "app") -> ModuleType:
    """``billing.<name>`` of the example, imported from docs/examples."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import importlib

    return importlib.import_module(f"billing.{name}")


def fresh_app(url: str, **config: t.Any) -> t.Any:
    """The example's app on ``url``, its tables (charges, the extension's) empty."""
    billing = example()
    app = billing.create_app({"SQLALCHEMY_DATABASE_URI": url, **config})
    recreate_tables(billing.db.metadata, url)
    return app


def charges(url: str) -> list[dict[str, t.Any]]:
    """The rows of ``charges``, read on a connection of the test's own."""
    from tests.conftest import run_sql  # (not in the worker process: it needs none)

    rows = run_sql(url, "SELECT invoice_id, amount, payment_id FROM charges ORDER BY id")
    return [dict(row._mapping) for row in rows]


def _kill() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def hold(gate: Path) -> None:
    """Say so (``gate.held``), then wait until ``gate`` exists."""
    gate.with_suffix(".held").touch()
    deadline = time.monotonic() + 60
    while not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def arm(crash: str, charge_type: type) -> None:
    """Kill this process at ``crash`` (see the module's docstring): SQLAlchemy's
    session events and the extension's signals, never the example's code."""
    from sqlalchemy import event, orm

    from flask_idempotency import signals

    flushed: dict[str, bool] = {"charge": False}

    @event.listens_for(orm.Session, "after_flush")
    def after_flush(session: orm.Session, context: t.Any) -> None:
        if any(isinstance(obj, charge_type) for obj in session.new):
            flushed["charge"] = True
            if crash == "in_body":
                _kill()
            if crash.startswith("hold:"):
                hold(Path(crash.split(":", 1)[1]))

    @event.listens_for(orm.Session, "after_rollback")
    def after_rollback(session: orm.Session) -> None:
        flushed["charge"] = False

    @event.listens_for(orm.Session, "before_commit")
    def before_commit(session: orm.Session) -> None:
        if crash == "before_commit" and flushed["charge"]:
            _kill()

    @event.listens_for(orm.Session, "after_commit")
    def after_commit(session: orm.Session) -> None:
        if crash == "after_commit" and flushed["charge"]:
            _kill()

    if crash.startswith("after_step:"):
        step = crash.split(":", 1)[1]

        def on_step(sender: t.Any, **kw: t.Any) -> None:
            if kw["name"] == step:
                _kill()

        signals.step_saved.connect(on_step, weak=False)


def consume(url: str, crash: str, broker: str, queue: str) -> int:
    import kombu

    billing, consumer = example(), example("consumer")
    app = billing.create_app({"SQLALCHEMY_DATABASE_URI": url})
    arm(crash, billing.Charge)
    with kombu.Connection(broker) as connection:
        [outcome] = consumer.consume(app, connection, consumer.charge_queue(queue), count=1)
    print(json.dumps({"value": outcome.value, "replayed": outcome.replayed}))
    return 0


def main(
    url: str, function: str, crash: str, invoice_id: str, amount: str = "0", config: str = "{}"
) -> int:
    if function == "consume":  # a consumer process: invoice_id is the broker, amount the queue
        return consume(url, crash, broker=invoice_id, queue=amount)
    billing = example()
    app = billing.create_app({"SQLALCHEMY_DATABASE_URI": url, **json.loads(config)})
    arm(crash, billing.Charge)
    with app.app_context():
        try:
            outcome = getattr(billing, function).outcome(invoice_id, int(amount))
        except Exception as exc:
            print(
                json.dumps(
                    {
                        "error": type(exc).__name__,
                        "retry_after": getattr(exc, "retry_after", None),
                        "detail": str(exc),
                    },
                    default=str,
                )
            )
            return 3
    print(json.dumps({"value": outcome.value, "replayed": outcome.replayed}))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
