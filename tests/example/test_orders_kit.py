"""The example's order service (example_app/orders.py) under the testing kit: its
charge goes to the kit's fake downstream (``PAYMENTS_URL``), and a crash right
after the charge's answer arrived, or right after the charge's recovery point
was saved, still ends with one order, one charge and one event."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from example_app.orders import Order
from flask_idempotency.testing import (
    Database,
    Downstream,
    Fault,
    KitConfig,
    Response,
    ServedApp,
    assert_exactly_one,
)
from tests.conftest import postgres_url
from tests.support import pgbouncer

pytestmark = pytest.mark.slow

ORDER = {"customer_id": "c1", "amount": 1250, "currency": "EUR"}
HEADERS = {"X-Tenant": "acme"}


@pytest.fixture(params=["psycopg2", "psycopg", "sqlite"])
def idempotency_config(request: pytest.FixtureRequest, tmp_path: Path) -> KitConfig:
    database = "sqlite://" if request.param == "sqlite" else postgres_url(request.param)
    return KitConfig(
        app="example_app.orders:create_app",
        database=database,
        downstream_config="PAYMENTS_URL",
        app_config={
            # A crashed attempt's lease ends soon, so the retry resumes it in seconds.
            "IDEMPOTENCY_LEASE": 2,
            "IDEMPOTENCY_WAIT": 1,
            "EXAMPLE_BROKER_FOLDER": str(tmp_path / "broker"),
            # Behind the suite's PgBouncer: declared, as the example's docs say.
            **pgbouncer.declared(database),
        },
    )


@pytest.fixture
def payments(downstream: Downstream) -> Downstream:
    """The fake payments service answers as the real one: 201 and a charge id."""
    downstream.answer("/payments", lambda effect: {"charge_id": effect.number}, status=201)
    return downstream


def order(api: ServedApp, key: str) -> Response:
    return api.post("/orders", json=ORDER, key=key, headers=HEADERS)


def until_done(api: ServedApp, key: str) -> Response:
    """Retry as a client does: 409 while the crashed attempt's lease runs (bounded)."""
    for _ in range(60):
        answer = order(api, key)
        if answer.status_code != 409:
            return answer
        assert answer.is_problem
        time.sleep(0.5)
    return answer


def test_crash_after_the_charge_answered_then_retry(
    api: ServedApp, db: Database, fault: Fault, payments: Downstream
) -> None:
    key = str(uuid.uuid4())
    fault.kill_after_call()  # the charge happened; the order service dies reading its answer
    with pytest.raises(ConnectionError):
        order(api, key)
    assert fault.fired("kill_after_call")
    assert db.count(Order) == 0
    api.restart()
    done = until_done(api, key)
    assert done.status_code == 201, done
    # The resumed attempt charged again with the same derived key: one effect.
    calls = payments.calls("/payments", origin=key)
    assert len(calls) == 2
    assert len({c.key for c in calls}) == 1
    assert len(payments.effects(key)) == 1
    assert_exactly_one(db, payments, key, events={"order-created": 1})
    assert done.json()["charge_id"] == 1


def test_crash_after_the_charge_step_was_saved_then_retry(
    api: ServedApp, db: Database, fault: Fault, payments: Downstream
) -> None:
    key = str(uuid.uuid4())
    fault.kill_after_step("charge")
    with pytest.raises(ConnectionError):
        order(api, key)
    assert fault.fired("kill_after_step")
    api.restart()
    done = until_done(api, key)
    assert done.status_code == 201, done
    # The saved recovery point answered: the payments service was called once.
    assert len(payments.calls("/payments", origin=key)) == 1
    assert_exactly_one(db, payments, key, events={"order-created": 1})
    assert db.count(Order, tenant="acme") == 1
