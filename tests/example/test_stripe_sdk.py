"""Stripe's own Python SDK (the ``stripe`` package, with its own retries) against
the Stripe-like example (example_app/stripe_like.py), served by gunicorn over
real HTTP, on the suite's PostgreSQL through psycopg2 and psycopg 3, and on
SQLite. Each test counts the charges in the table, not only what the SDK says;
the server's access log says how many attempts the SDK made."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import stripe

from example_app.stripe_like import Charge
from flask_idempotency.testing import Database, Fault, KitConfig, ServedApp
from tests.conftest import postgres_url
from tests.support import pgbouncer
from tests.support.lossy_http import LossyHttpProxy

pytestmark = pytest.mark.slow

ACME, GLOBEX = "sk_test_acme", "sk_test_globex"
CHARGE = {"amount": 1250, "currency": "eur", "description": "Order 6735"}


@pytest.fixture(params=["psycopg2", "psycopg", "sqlite"])
def idempotency_config(request: pytest.FixtureRequest) -> KitConfig:
    database = "sqlite://" if request.param == "sqlite" else postgres_url(request.param)
    return KitConfig(
        app="example_app.stripe_like:create_app",
        database=database,
        # A duplicate waits 1 s for a running first request before its 409.
        app_config={"IDEMPOTENCY_WAIT": 1, **pgbouncer.declared(database)},
    )


def client(url: str, api_key: str = ACME, retries: int = 3) -> stripe.StripeClient:
    return stripe.StripeClient(api_key, base_addresses={"api": url}, max_network_retries=retries)


def attempts(api: ServedApp, status: int, expected: int = 0) -> int:
    """``POST /v1/charges`` answered ``status``, per the server's access log. A
    worker logs an answer after sending it, so the log may lag the client: wait
    (up to 10 s) for at least ``expected``."""
    deadline = time.monotonic() + 10
    while True:
        found = len(re.findall(rf'"POST /v1/charges HTTP/1.1" {status} ', api.logs()))
        if found >= expected or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


@pytest.fixture
def lossy(api: ServedApp) -> Iterator[LossyHttpProxy]:
    proxy = LossyHttpProxy(("127.0.0.1", api.port))
    yield proxy
    proxy.close()


def test_an_answer_lost_after_the_commit_is_retried_by_the_sdk_and_replayed(
    api: ServedApp, db: Database, lossy: LossyHttpProxy
) -> None:
    """No key from the caller: the SDK makes its own, and keeps it for its retry."""
    lossy.lose_next()
    charge = client(lossy.url).v1.charges.create(params=CHARGE)
    assert lossy.lost == 1
    assert db.count(Charge) == 1
    assert charge.id == db.scalar("SELECT id FROM charges")
    assert charge.last_response.headers["Idempotent-Replayed"] == "true"
    key = charge.last_response.idempotency_key
    assert key is not None
    assert len(db.records(key)) == 1


def test_the_answer_echoes_the_callers_key(api: ServedApp, db: Database) -> None:
    key = f"order-{uuid.uuid4()}"
    charge = client(api.url).v1.charges.create(params=CHARGE, options={"idempotency_key": key})
    assert charge.last_response.idempotency_key == key
    assert charge.last_response.request_id is not None
    again = client(api.url).v1.charges.create(params=CHARGE, options={"idempotency_key": key})
    assert (again.id, again.last_response.idempotency_key) == (charge.id, key)
    assert db.count(Charge) == 1


def test_a_concurrent_duplicate_is_retried_by_the_sdk_until_it_replays(
    api: ServedApp, db: Database, fault: Fault
) -> None:
    key = str(uuid.uuid4())

    def create() -> stripe.Charge:
        return client(api.url, retries=6).v1.charges.create(
            params=CHARGE, options={"idempotency_key": key}
        )

    with fault.hold_first() as held, ThreadPoolExecutor(2) as pool:
        first = pool.submit(create)
        assert held.wait_reached(timeout=30)
        duplicate = pool.submit(create)
        # The duplicate gets its 409 (after waiting 1 s), which the SDK retries.
        assert attempts(api, 409, expected=2) >= 2
        assert db.count(Charge) == 0
        held.release()
        charges = first.result(timeout=60), duplicate.result(timeout=60)
    assert db.count(Charge) == 1
    assert {c.id for c in charges} == {db.scalar("SELECT id FROM charges")}
    assert [c.last_response.idempotency_key for c in charges] == [key, key]


def test_a_key_reused_with_other_parameters_is_a_readable_idempotency_error(
    api: ServedApp, db: Database
) -> None:
    key = str(uuid.uuid4())
    sdk = client(api.url)
    sdk.v1.charges.create(params=CHARGE, options={"idempotency_key": key})
    with pytest.raises(stripe.IdempotencyError) as raised:
        sdk.v1.charges.create(params={**CHARGE, "amount": 9999}, options={"idempotency_key": key})
    error = raised.value
    assert error.http_status == 400
    assert error.error is not None
    assert error.error.code == "key-reused"
    assert error.error.type == "idempotency_error"
    assert error.error.doc_url.endswith("/problems/key-reused.html")
    assert "already used with a different request payload" in (error.user_message or "")
    assert str(error).startswith(f"Request {error.request_id}: ")
    assert error.headers["Idempotency-Key"] == key
    assert error.headers["Stripe-Should-Retry"] == "false"
    assert attempts(api, 400, expected=1) == 1  # not retried
    assert db.count(Charge) == 1
    assert db.count(Charge, amount=9999) == 0


def test_two_api_keys_with_the_same_idempotency_key_are_two_charges(
    api: ServedApp, db: Database
) -> None:
    key = str(uuid.uuid4())
    acme = client(api.url, ACME).v1.charges.create(params=CHARGE, options={"idempotency_key": key})
    globex = client(api.url, GLOBEX).v1.charges.create(
        params=CHARGE, options={"idempotency_key": key}
    )
    assert acme.id != globex.id
    assert not globex.last_response.headers.get("Idempotent-Replayed")
    assert db.count(Charge, account="acct_acme") == db.count(Charge, account="acct_globex") == 1
    # Each account sees its own charge only.
    with pytest.raises(stripe.InvalidRequestError) as raised:
        client(api.url, GLOBEX).v1.charges.retrieve(acme.id)
    assert raised.value.code == "resource_missing"


def test_a_database_outage_is_a_503_the_sdk_retries_then_shows_with_retry_after(
    api: ServedApp, db: Database, fault: Fault
) -> None:
    if fault.proxy is None:
        pytest.skip("SQLite is a local file: no network between the app and it")
    key = str(uuid.uuid4())
    fault.database_down(60, mode="refuse")
    with pytest.raises(stripe.APIError) as raised:
        client(api.url, retries=2).v1.charges.create(
            params=CHARGE, options={"idempotency_key": key}
        )
    error = raised.value
    assert error.http_status == 503
    assert error.error is not None
    assert error.error.code == "database-unavailable"
    assert error.error.type == "api_error"
    assert int(error.headers["Retry-After"]) >= 1
    assert error.headers["Stripe-Should-Retry"] == "true"
    assert error.headers["Idempotency-Key"] == key
    assert attempts(api, 503, expected=3) == 3  # the first and the SDK's two retries
    fault.database_up()
    charge = client(api.url).v1.charges.create(params=CHARGE, options={"idempotency_key": key})
    assert db.count(Charge) == 1
    assert charge.id == db.scalar("SELECT id FROM charges")


def test_a_refused_parameter_is_an_invalid_request_error_naming_it(
    api: ServedApp, db: Database
) -> None:
    with pytest.raises(stripe.InvalidRequestError) as raised:
        client(api.url).v1.charges.create(params={**CHARGE, "currency": "xyz"})
    assert (raised.value.param, raised.value.code) == ("currency", "parameter_invalid")
    with pytest.raises(stripe.AuthenticationError):
        client(api.url, "sk_test_unknown").v1.charges.create(params=CHARGE)
    assert db.count(Charge) == 0


def test_a_parameter_refused_by_validation_stores_nothing_so_the_fixed_call_charges(
    api: ServedApp, db: Database
) -> None:
    """A typo fixed and sent again with the caller's own key (one per order):
    the refusal came before the key was claimed, so the fixed call charges once."""
    key = f"order-{uuid.uuid4()}"
    with pytest.raises(stripe.InvalidRequestError) as raised:
        client(api.url).v1.charges.create(
            params={**CHARGE, "amount": "12.50"}, options={"idempotency_key": key}
        )
    assert (raised.value.param, raised.value.code) == ("amount", "parameter_invalid")
    assert raised.value.http_status == 400
    assert db.records(key) == []
    charge = client(api.url).v1.charges.create(params=CHARGE, options={"idempotency_key": key})
    assert charge.amount == 1250
    assert db.count(Charge) == 1
    assert charge.id == db.scalar("SELECT id FROM charges")
    assert len(db.records(key)) == 1
