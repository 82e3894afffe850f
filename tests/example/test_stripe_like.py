"""The Stripe-like example's error envelope, in process (Flask's test client, SQLite):
every kind of problem the extension raises, whatever its status, answered in
Stripe's envelope with the status, type and ``Stripe-Should-Retry`` its SDK reads.
The SDK itself drives the example in test_stripe_sdk.py (which also sees the
``Retry-After`` and the echoed key the extension adds to the extension's own problems)."""

from __future__ import annotations

import typing as t
from datetime import timedelta
from pathlib import Path

import pytest
from flask import Flask

from example_app import stripe_like
from flask_idempotency import ProblemError
from flask_idempotency.errors import (
    ConflictError,
    DatabaseUnavailableError,
    FailedAfterCommitError,
    KeyReusedError,
    MissingKeyError,
    PayloadTooLargeError,
    TransactionConflictError,
)

BEARER = {"Authorization": "Bearer sk_test_acme"}

#: A problem, then the status, type and Stripe-Should-Retry it is answered with.
PROBLEMS: list[tuple[ProblemError, int, str, str]] = [
    (KeyReusedError("reused"), 400, "idempotency_error", "false"),
    (ConflictError("running", retry_after=timedelta(seconds=2)), 409, "idempotency_error", "true"),
    (
        TransactionConflictError("locked", retry_after=timedelta(seconds=1)),
        409,
        "idempotency_error",
        "true",
    ),
    (DatabaseUnavailableError("down"), 503, "api_error", "true"),
    (FailedAfterCommitError(), 500, "api_error", "false"),
    (MissingKeyError("no key"), 400, "invalid_request_error", "false"),
    (PayloadTooLargeError("big"), 400, "invalid_request_error", "false"),
]


@pytest.fixture
def app(tmp_path: Path) -> t.Iterator[Flask]:
    app = stripe_like.create_app({"SQLALCHEMY_DATABASE_URI": f"sqlite:///{tmp_path}/s.db"})
    raised: list[ProblemError] = []

    @app.post("/raises")
    def raises() -> t.NoReturn:
        raise raised[0]

    app.config["RAISED"] = raised
    yield app
    with app.app_context():
        stripe_like.db.engine.dispose()


@pytest.mark.parametrize(
    ("problem", "status", "kind", "retry"), PROBLEMS, ids=[p[0].slug for p in PROBLEMS]
)
def test_every_problem_is_answered_in_stripes_envelope(
    app: Flask, problem: ProblemError, status: int, kind: str, retry: str
) -> None:
    app.config["RAISED"].append(problem)
    answer = app.test_client().post("/raises", headers=BEARER)
    assert answer.status_code == status
    assert answer.content_type == "application/json"
    assert answer.json == {
        "error": {
            "type": kind,
            "code": problem.slug,
            "message": problem.detail,
            "doc_url": f"https://flask-idempotency.readthedocs.io/en/latest/problems/{problem.slug}.html",
        }
    }
    assert answer.headers["Stripe-Should-Retry"] == retry
    assert answer.headers["Request-Id"].startswith("req_")


def test_a_missing_api_key_is_401_before_the_key_is_read(app: Flask) -> None:
    answer = app.test_client().post("/v1/charges", data={"amount": "1", "currency": "eur"})
    assert answer.status_code == 401
    assert answer.json == {
        "error": {"type": "invalid_request_error", "message": "Invalid API Key provided."}
    }


def test_basic_auth_with_the_key_as_the_user_name_is_the_same_account(app: Flask) -> None:
    client = app.test_client()
    charge = {"amount": "1250", "currency": "EUR"}
    headers = {"Idempotency-Key": "k-1"}
    first = client.post("/v1/charges", data=charge, headers={**headers, **BEARER})
    again = client.post("/v1/charges", data=charge, headers=headers, auth=("sk_test_acme", ""))
    assert first.status_code == again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json == first.json
    assert first.json["currency"] == "eur"


def charges(app: Flask) -> int:
    with app.app_context():
        return stripe_like.db.session.query(stripe_like.Charge).count()


@pytest.mark.parametrize(
    ("sent", "param"),
    [
        ({"amount": "12.50", "currency": "eur"}, "amount"),
        ({"amount": "0", "currency": "eur"}, "amount"),
        ({"amount": "1_250", "currency": "eur"}, "amount"),
        ({"currency": "eur"}, "amount"),
        ({"amount": "1250", "currency": "xyz"}, "currency"),
        ({"amount": "1250", "currency": "eur", "description": "x" * 10_000}, "description"),
    ],
)
def test_a_refused_parameter_is_named_and_stores_nothing(
    app: Flask, sent: dict[str, str], param: str
) -> None:
    """Refused before the key is claimed: the corrected request, same key, charges."""
    client = app.test_client()
    headers = {**BEARER, "Idempotency-Key": "order-6735"}
    refused = client.post("/v1/charges", data=sent, headers=headers)
    assert refused.status_code == 400
    assert refused.json["error"]["type"] == "invalid_request_error"
    assert refused.json["error"]["code"] == "parameter_invalid"
    assert refused.json["error"]["param"] == param
    assert refused.headers["Stripe-Should-Retry"] == "false"
    assert "Idempotent-Replayed" not in refused.headers
    fixed = client.post("/v1/charges", data={"amount": "1250", "currency": "eur"}, headers=headers)
    assert fixed.status_code == 200
    assert charges(app) == 1
    again = client.post("/v1/charges", data={"amount": "1250", "currency": "eur"}, headers=headers)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert charges(app) == 1


def test_an_idempotency_key_body_parameter_is_a_parameter_not_a_form_key(app: Flask) -> None:
    """An API renders no forms: the form field is off, so this is a keyless
    charge (the example does not require a key), never ``form-key-invalid``."""
    client = app.test_client()
    sent = {"amount": "1250", "currency": "eur", "idempotency_key": "order-1"}
    first = client.post("/v1/charges", data=sent, headers=BEARER)
    second = client.post("/v1/charges", data=sent, headers=BEARER)
    assert first.status_code == second.status_code == 200
    assert "Idempotency-Key" not in first.headers
    assert first.json["id"] != second.json["id"]  # no key: two calls, two charges
    assert charges(app) == 2


def test_a_body_over_the_limit_is_the_extensions_problem_not_werkzeugs_413(app: Flask) -> None:
    """The form is read before the extension (to validate it before the claim):
    too large is still ``payload-too-large``, a 400 the SDK raises as ``InvalidRequestError``."""
    sent = {"amount": "1250", "currency": "eur", "description": "x" * 70_000}
    headers = {**BEARER, "Idempotency-Key": "k-big"}
    answer = app.test_client().post("/v1/charges", data=sent, headers=headers)
    assert answer.status_code == 400
    assert answer.json["error"]["code"] == "payload-too-large"
    assert answer.json["error"]["type"] == "invalid_request_error"
    assert charges(app) == 0
