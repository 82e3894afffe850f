"""What each host of ``python -m bench.partition`` serves: the example's payments
service, with the README's fail-fast engine settings
(:func:`example_app.app.engine_options`), plus ``POST /charge``: the same charge
after ``BENCH_VIEW_WORK`` seconds of work inside the view's transaction (other
reads, a template, a local call), the time during which a claim is held
uncommitted and a partition can strand it.

``EXAMPLE_DATABASE_URL`` names the database; ``BENCH_PARTITION_CONFIG`` (JSON) adds
app config (``IDEMPOTENCY_*`` settings under test).
"""

from __future__ import annotations

import json
import os
import time
import typing as t

from flask import Flask

from example_app import app as example

CONFIG_ENV = "BENCH_PARTITION_CONFIG"
WORK_ENV = "BENCH_VIEW_WORK"


def create_app() -> Flask:
    app = example.create_app(json.loads(os.environ.get(CONFIG_ENV, "{}")))
    work = float(os.environ.get(WORK_ENV, "0"))

    @example.idem.idempotent(
        schema=example.PaymentSchema(), exclude=["client_sent_at"], scope=lambda: "bench"
    )
    def charge() -> tuple[dict[str, t.Any], int]:
        time.sleep(work)  # the claim is in, uncommitted: the view at work
        entry = example.LedgerEntry(
            merchant="bench",
            customer_id=example.idem.payload["customer_id"],
            amount=example.idem.payload["amount"],
            currency=example.idem.payload["currency"],
            description=example.idem.payload["description"],
        )
        example.db.session.add(entry)
        example.db.session.flush()
        return entry.as_dict(), 201

    app.add_url_rule("/charge", view_func=charge, methods=["POST"])
    return app
