"""The default scope follows the caller's identity and never merges callers.

Through the test client on PostgreSQL and SQLite, counting ledger rows (side
effects) and reading the stored scopes: a retry by the same caller replays even
when its credential changed, and two callers never see each other's response.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
import types
import typing as t
from pathlib import Path

import pytest
from flask import Flask, g, request
from flask_login import LoginManager, UserMixin

from tests.conftest import ledger_count, record_rows

ROUTE = "scope/charge"
ENDPOINT = "t.scope_charge"
BODY = {"amount": 500}


def post(client: t.Any, path: str = "/scope/charge", key: str = "pay-1", **kw: t.Any) -> t.Any:
    headers = {"Idempotency-Key": key, **kw.pop("headers", {})}
    return client.post(
        path, data=json.dumps(BODY), content_type="application/json", headers=headers, **kw
    )


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def scopes(app: Flask) -> list[str]:
    return sorted(r["scope"] for r in record_rows(app))


class User(UserMixin):
    def __init__(self, user_id: str) -> None:
        self.id = user_id


def use_flask_login(app: Flask, tokens: dict[str, str]) -> None:
    """Flask-Login on ``app``, loading the user from a bearer token (``tokens``: token -> id)."""
    manager = LoginManager()
    manager.init_app(app)

    @manager.request_loader
    def load_user_from_token(req: t.Any) -> User | None:
        scheme, _, token = req.headers.get("Authorization", "").partition(" ")
        user_id = tokens.get(token) if scheme.lower() == "bearer" else None
        return User(user_id) if user_id is not None else None


# -- the same caller keeps its scope when its token is refreshed -------------------------


def test_flask_login_user_keeps_the_scope_across_a_token_refresh(app: Flask, client: t.Any) -> None:
    use_flask_login(app, {"tok-v1": "42", "tok-v2": "42"})
    first = post(client, headers={"Authorization": "Bearer tok-v1"})
    # The response was lost; the SDK refreshed the access token before retrying.
    retry = post(client, headers={"Authorization": "Bearer tok-v2"})

    assert first.status_code == retry.status_code == 201
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.get_data() == first.get_data()
    assert ledger_count(app, ROUTE) == 1
    assert scopes(app) == [f"{ENDPOINT}|user:42"]


def test_flask_login_users_never_share(app: Flask, client: t.Any) -> None:
    use_flask_login(app, {"alice-token": "1", "bob-token": "2"})
    alice = post(client, headers={"Authorization": "Bearer alice-token"})
    bob = post(client, headers={"Authorization": "Bearer bob-token"})

    assert bob.headers.get("Idempotent-Replayed") is None
    assert alice.get_json()["id"] != bob.get_json()["id"]
    assert ledger_count(app, ROUTE) == 2
    assert scopes(app) == [f"{ENDPOINT}|user:1", f"{ENDPOINT}|user:2"]


def test_app_scope_keeps_the_scope_across_a_token_refresh(
    make_app: t.Callable[..., Flask],
) -> None:
    # The README's one line for token APIs, ahead of a Flask-Login user.
    app = make_app(IDEMPOTENCY_SCOPE=lambda: f"user:{g.user.id}")
    use_flask_login(app, {"tok-v1": "login-42", "tok-v2": "login-42"})

    @app.before_request
    def load_user() -> None:
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        g.user = types.SimpleNamespace(id={"tok-v1": 42, "tok-v2": 42}.get(token))

    client = app.test_client()
    first = post(client, headers={"Authorization": "Bearer tok-v1"})
    retry = post(client, headers={"Authorization": "Bearer tok-v2"})

    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.get_data() == first.get_data()
    assert ledger_count(app, ROUTE) == 1
    assert scopes(app) == ["user:42"]


# -- cookie sessions ------------------------------------------------------------------------


def test_two_cookie_session_users_never_see_each_others_response(
    app: Flask, caplog: pytest.LogCaptureFixture
) -> None:
    app.config["SECRET_KEY"] = "test-secret"
    alice, bob = app.test_client(), app.test_client()
    alice.get("/scope/login/alice")
    bob.get("/scope/login/bob")

    with caplog.at_level(logging.WARNING, logger="flask_idempotency"):
        for_alice = post(alice, key="checkout-1")
        for_bob = post(bob, key="checkout-1")  # same key, same body, another user

    assert for_alice.status_code == for_bob.status_code == 201
    assert for_bob.headers.get("Idempotent-Replayed") is None
    assert for_alice.get_json()["caller"] == "alice"
    assert for_bob.get_json()["caller"] == "bob"
    assert for_alice.get_json()["id"] != for_bob.get_json()["id"]
    assert ledger_count(app, ROUTE) == 2
    stored = scopes(app)
    assert len(set(stored)) == 2
    assert all(s.startswith(f"{ENDPOINT}|session:") for s in stored)
    cookie = alice.get_cookie("session")
    assert cookie is not None
    assert stored.count(f"{ENDPOINT}|session:{sha256(cookie.value)}") == 1
    assert not any(cookie.value in s for s in stored)  # a digest, not the cookie itself
    # Not an identity: said once for the endpoint.
    warnings = [r for r in caplog.records if "'session' cookie" in r.getMessage()]
    assert len(warnings) == 1
    assert ENDPOINT in warnings[0].getMessage()

    # Alice's own retry, with the same cookie, is replayed her response.
    again = post(alice, key="checkout-1")
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.get_data() == for_alice.get_data()
    assert ledger_count(app, ROUTE) == 2


def test_flask_login_without_a_user_falls_back_to_the_cookie(app: Flask) -> None:
    app.config["SECRET_KEY"] = "test-secret"
    use_flask_login(app, {})
    alice, bob = app.test_client(), app.test_client()
    alice.get("/scope/login/alice")
    bob.get("/scope/login/bob")

    post(alice)
    bob_answer = post(bob)

    assert bob_answer.headers.get("Idempotent-Replayed") is None
    assert bob_answer.get_json()["caller"] == "bob"
    assert ledger_count(app, ROUTE) == 2
    assert all(s.startswith(f"{ENDPOINT}|session:") for s in scopes(app))


# -- Authorization header -------------------------------------------------------------------


def test_two_basic_users_never_share(app: Flask, client: t.Any) -> None:
    alice = post(client, auth=("alice", "same-password"))
    bob = post(client, auth=("bob", "same-password"))

    assert bob.headers.get("Idempotent-Replayed") is None
    assert alice.get_json()["caller"] == "alice"
    assert bob.get_json()["caller"] == "bob"
    assert ledger_count(app, ROUTE) == 2
    # The user name, readable, so an operator can build the scope (see the CLI).
    assert scopes(app) == [f"{ENDPOINT}|basic:alice", f"{ENDPOINT}|basic:bob"]


def test_the_same_basic_user_with_a_changed_password_shares(app: Flask, client: t.Any) -> None:
    first = post(client, auth=("alice", "old-password"))
    retry = post(client, auth=("alice", "new-password"))

    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.get_data() == first.get_data()
    assert ledger_count(app, ROUTE) == 1
    [scope] = scopes(app)
    assert scope == f"{ENDPOINT}|basic:alice"
    assert "password" not in scope


def test_bearer_scope_is_a_digest_of_the_token(app: Flask, client: t.Any) -> None:
    post(client, headers={"Authorization": "Bearer secret-token-1"})
    post(client, headers={"Authorization": "bearer  secret-token-1 "})  # same credential
    post(client, headers={"Authorization": "Bearer secret-token-2"})

    assert ledger_count(app, ROUTE) == 2
    assert scopes(app) == sorted(
        [
            f"{ENDPOINT}|bearer:{sha256('secret-token-1')}",
            f"{ENDPOINT}|bearer:{sha256('secret-token-2')}",
        ]
    )


def test_other_schemes_are_a_digest_of_the_header(app: Flask, client: t.Any) -> None:
    header = 'ApiKey key="k-1", client="c-9"'
    post(client, headers={"Authorization": header})
    post(client, headers={"Authorization": 'ApiKey key="k-2", client="c-9"'})

    assert ledger_count(app, ROUTE) == 2
    assert f"{ENDPOINT}|auth:{sha256(header)}" in scopes(app)


def test_long_identities_become_digests_within_the_scope_limit(app: Flask, client: t.Any) -> None:
    long_name, accented = "u" * 600, "zo\u00eb"
    post(client, auth=(long_name, "pw"))
    post(client, auth=(accented, "pw"), key="pay-2")

    assert ledger_count(app, ROUTE) == 2
    assert scopes(app) == sorted(
        [
            f"{ENDPOINT}|basic-sha256:{sha256(long_name)}",
            f"{ENDPOINT}|basic-sha256:{sha256(accented)}",
        ]
    )
    assert all(len(s) <= 512 and "\x00" not in s for s in scopes(app))


# -- no identity at all ---------------------------------------------------------------------


def test_anonymous_callers_are_warned_about_once_per_endpoint(
    app: Flask, client: t.Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="flask_idempotency"):
        post(client, key="a1")
        post(client, key="a2")
        post(client, "/scope/refund", key="r1")
        post(client, "/scope/refund", key="r2")
        post(client, key="b1", auth=("alice", "pw"))  # an identity: nothing to say
        client.post("/tenant", headers={"Idempotency-Key": "t1"})  # the route's own scope

    warnings = [
        r
        for r in caplog.records
        if r.name == "flask_idempotency" and "carries no identity" in r.getMessage()
    ]
    assert [r.levelno for r in warnings] == [logging.WARNING, logging.WARNING]
    assert ENDPOINT in warnings[0].getMessage()
    assert "t.scope_refund" in warnings[1].getMessage()
    assert "IDEMPOTENCY_SCOPE" in warnings[0].getMessage()
    # They did run: anonymous callers share the endpoint's scope, loudly.
    assert ledger_count(app) == 6
    assert scopes(app).count(ENDPOINT) == 2


# -- Flask-Login stays optional ----------------------------------------------------------------


def test_the_default_scope_works_without_flask_login_installed() -> None:
    code = (
        "import sys\n"
        "sys.modules['flask_login'] = None  # as if it were not installed\n"
        "import flask_idempotency\n"
        "from tests import testapp\n"
        "from tests.conftest import record_rows\n"
        "app = testapp.create_app('sqlite://')\n"
        "with app.app_context():\n"
        "    testapp.db.create_all()\n"
        "r = app.test_client().post('/raw', headers={'Idempotency-Key': 'k'}, auth=('al', 'pw'))\n"
        "assert r.status_code == 200, r.get_data()\n"
        "assert [row['scope'] for row in record_rows(app)] == ['t.raw|basic:al']\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, done.stderr
