"""The default scope follows the caller's identity and never merges callers.

Through the test client on PostgreSQL, SQLite and MariaDB, counting ledger rows
(side effects) and reading the stored scopes: a retry by a caller the app verified
replays even when its credential changed, two callers never see each other's
response, and nobody gets another's scope by writing their name in a header.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import subprocess
import sys
import types
import typing as t
from pathlib import Path

import pytest
from flask import Flask, abort, g, request, session
from flask_login import LoginManager, UserMixin

from tests.conftest import ledger_count, record_rows
from tests.support import testapp
from tests.support.scopes import ENDPOINT, basic_proof, basic_scope

ROUTE = "scope/charge"
BODY = {"amount": 500}


def post(client: t.Any, path: str = "/scope/charge", key: str = "pay-1", **kw: t.Any) -> t.Any:
    headers = {"Idempotency-Key": key, **kw.pop("headers", {})}
    return client.post(
        path, data=json.dumps(BODY), content_type="application/json", headers=headers, **kw
    )


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def md5(text: str) -> str:
    return hashlib.md5(text.encode()).hexdigest()


def scopes(app: Flask) -> list[str]:
    return sorted(r["scope"] for r in record_rows(app))


def scope_warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "flask_idempotency" and r.levelno == logging.WARNING and text in r.getMessage()
    ]


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
    # The user name, readable, so an operator finds a user's records by prefix
    # (see the CLI), then a keyed digest of the whole credential.
    assert scopes(app) == sorted(
        [basic_scope(app, "alice", "same-password"), basic_scope(app, "bob", "same-password")]
    )


def test_a_basic_user_name_without_its_password_gets_a_scope_of_its_own(
    app: Flask, client: t.Any
) -> None:
    first = post(client, auth=("alice", "her-password"))
    # Anyone can write the user name; only alice knows the password.
    forged = post(client, auth=("alice", "a-guess"))

    assert forged.headers.get("Idempotent-Replayed") is None
    assert forged.get_json()["id"] != first.get_json()["id"]
    assert ledger_count(app, ROUTE) == 2
    assert scopes(app) == sorted(
        [basic_scope(app, "alice", "her-password"), basic_scope(app, "alice", "a-guess")]
    )
    assert not any("her-password" in s for s in scopes(app))


def test_a_changed_basic_password_starts_a_new_scope(app: Flask, client: t.Any) -> None:
    # Documented: a user name is not proof of identity, so the scope needs the
    # password, and a retry sent after a password change runs again.
    post(client, auth=("alice", "old-password"))
    retry = post(client, auth=("alice", "new-password"))

    assert retry.headers.get("Idempotent-Replayed") is None
    assert ledger_count(app, ROUTE) == 2
    assert all(s.startswith(f"{ENDPOINT}|basic:alice:") for s in scopes(app))


def test_the_basic_digest_is_keyed_with_the_secret_key(make_app: t.Callable[..., Flask]) -> None:
    # Scopes reach logs and the CLI's output: keyed, they hold nothing a weak
    # password could be guessed against offline.
    app = make_app(SECRET_KEY="server-side-secret")
    post(app.test_client(), auth=("alice", "pw"))

    [scope] = scopes(app)
    assert scope == basic_scope(app, "alice", "pw")
    assert sha256("alice:pw")[:32] not in scope
    assert len(scope.rsplit(":", 1)[1]) == 32


class CookieShop:
    """An app that authenticates web users by their session cookie and API clients by
    HTTP Basic, before the idempotency layer, as the README asks. It never looks at a
    Basic header of a request that has a valid session."""

    PASSWORDS = {"alice": "alice-pw", "mallory": "mallory-pw"}
    CARDS = {"alice": "VISA **** 4242, 12 Elm St", "mallory": "MC **** 5555"}

    def __init__(self, make_app: t.Callable[..., Flask]) -> None:
        self.app = app = make_app(SECRET_KEY="cookie-shop-secret")

        @app.before_request
        def authenticate() -> None:
            if request.endpoint == "shop_login":
                return
            auth = request.authorization
            if session.get("user") in self.PASSWORDS:
                g.user = session["user"]
            elif auth is not None and self.PASSWORDS.get(auth.username or "") == auth.password:
                g.user = auth.username
            else:
                abort(401)

        @app.post("/shop/login/<name>", endpoint="shop_login")
        def login(name: str) -> dict[str, str]:
            session["user"] = name
            return {"user": name}

        @app.post("/shop/orders", endpoint="shop_orders")
        @testapp.idem.idempotent(required=True)
        def orders() -> tuple[dict[str, str], int]:
            testapp.write_ledger("shop/orders")
            return {"user": g.user, "card": self.CARDS[g.user]}, 201

    def order(self, client: t.Any, **kw: t.Any) -> t.Any:
        return client.post("/shop/orders", json={"item": 42}, **kw)


def test_a_forged_basic_header_never_replays_another_users_response(
    make_app: t.Callable[..., Flask],
) -> None:
    shop = CookieShop(make_app)
    alice = shop.app.test_client()
    first = shop.order(alice, auth=("alice", "alice-pw"), headers={"Idempotency-Key": "order-42"})
    assert first.status_code == 201, first.get_data()
    assert first.get_json()["user"] == "alice"

    # Mallory logs in with her own cookie, adds Basic with alice's name and a
    # guessed password, and reuses alice's guessable key and body.
    mallory = shop.app.test_client()
    mallory.post("/shop/login/mallory")
    answer = shop.order(
        mallory, auth=("alice", "anything"), headers={"Idempotency-Key": "order-42"}
    )

    assert answer.status_code == 201
    assert answer.headers.get("Idempotent-Replayed") is None
    assert answer.get_json() == {"user": "mallory", "card": shop.CARDS["mallory"]}
    assert "4242" not in answer.get_data(as_text=True)
    assert ledger_count(shop.app, "shop/orders") == 2
    assert scopes(shop.app) == sorted(
        [
            basic_scope(shop.app, "alice", "alice-pw", "shop_orders"),
            basic_scope(shop.app, "alice", "anything", "shop_orders"),
        ]
    )

    # Alice's own retry is still replayed her response.
    again = shop.order(alice, auth=("alice", "alice-pw"), headers={"Idempotency-Key": "order-42"})
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.get_data() == first.get_data()
    assert ledger_count(shop.app, "shop/orders") == 2


def test_a_basic_header_beside_the_session_cookie_is_warned_about_once(
    make_app: t.Callable[..., Flask], caplog: pytest.LogCaptureFixture
) -> None:
    # A Basic gate in front of a cookie-session app: every user sends the gate's
    # shared credential, and the app tells them apart by the cookie, which the
    # default scope cannot know. Not silent.
    shop = CookieShop(make_app)
    alice, bob = shop.app.test_client(), shop.app.test_client()
    alice.post("/shop/login/alice")
    bob.post("/shop/login/mallory")

    with caplog.at_level(logging.WARNING, logger="flask_idempotency"):
        for n, client in enumerate((alice, bob, alice)):
            headers = {"Idempotency-Key": f"k{n}"}
            shop.order(client, auth=("team-door", "gate-pw-7Q"), headers=headers)

    [warning] = scope_warnings(caplog, "session")
    assert "shop_orders" in warning
    assert "Basic" in warning
    assert "IDEMPOTENCY_SCOPE" in warning
    assert "team-door" not in warning  # never the credential
    assert "gate-pw-7Q" not in warning
    assert ledger_count(shop.app, "shop/orders") == 3


def test_flask_login_user_ranks_above_a_basic_header(app: Flask, client: t.Any) -> None:
    manager = LoginManager()
    manager.init_app(app)

    @manager.request_loader
    def load_user(req: t.Any) -> User | None:
        user_id = req.headers.get("X-Verified-User")
        return User(user_id) if user_id else None

    first = post(client, auth=("alice", "pw-1"), headers={"X-Verified-User": "7"})
    retry = post(client, auth=("alice", "pw-2"), headers={"X-Verified-User": "7"})

    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.get_data() == first.get_data()
    assert ledger_count(app, ROUTE) == 1
    assert scopes(app) == [f"{ENDPOINT}|user:7"]


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


# -- credentials that change on every request -----------------------------------------------


def digest_header(user: str, realm: str = "r", nonce: str = "n", uri: str = "/") -> str:
    """An HTTP Digest Authorization header: a fresh cnonce and response on every call."""
    cnonce, response = secrets.token_hex(8), secrets.token_hex(16)
    return (
        f'Digest username="{user}", realm="{realm}", nonce="{nonce}", uri="{uri}", '
        f'qop=auth, nc=00000001, cnonce="{cnonce}", response="{response}"'
    )


def sigv4_header() -> str:
    return (
        "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20260101/eu-west-1/execute-api/aws4_request, "
        f"SignedHeaders=host;x-amz-date, Signature={secrets.token_hex(32)}"
    )


def test_per_request_credentials_are_warned_about_and_never_merge_callers(
    app: Flask, client: t.Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Nothing in such a header is both stable and proof of the caller (a Digest
    # user name alone is as forgeable as a Basic one): each request is its own
    # scope, so two callers never share, and each retry runs again, loudly.
    with caplog.at_level(logging.WARNING, logger="flask_idempotency"):
        alice = post(client, headers={"Authorization": digest_header("alice")})
        alice_retry = post(client, headers={"Authorization": digest_header("alice")})
        bob = post(client, headers={"Authorization": digest_header("bob")})
        post(client, "/scope/refund", headers={"Authorization": sigv4_header()})
        post(client, "/scope/refund", headers={"Authorization": sigv4_header()})

    assert alice_retry.headers.get("Idempotent-Replayed") is None
    assert bob.headers.get("Idempotent-Replayed") is None
    assert len({alice.get_json()["id"], alice_retry.get_json()["id"], bob.get_json()["id"]}) == 3
    assert ledger_count(app) == 5
    stored = scopes(app)
    assert len(set(stored)) == 5
    assert all(s.split("|")[1].startswith("auth:") for s in stored)

    warnings = scope_warnings(caplog, "no stable identity")
    assert len(warnings) == 2  # once per endpoint
    charge_warning, refund_warning = warnings
    assert ENDPOINT in charge_warning
    assert "'Digest'" in charge_warning
    assert "t.scope_refund" in refund_warning
    assert "'AWS4-HMAC-SHA256'" in refund_warning
    for warning in warnings:
        assert "IDEMPOTENCY_SCOPE" in warning
        assert "runs again" in warning
        assert "alice" not in warning
        assert "AKIDEXAMPLE" not in warning


def test_stable_credentials_are_not_warned_about(
    app: Flask, client: t.Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="flask_idempotency"):
        post(client, key="b", auth=("alice", "pw"))
        post(client, key="t", headers={"Authorization": "Bearer tok"})
        # DPoP (RFC 9449): the access token is stable, the per-request proof
        # travels in its own DPoP header, which the scope does not read.
        for proof in ("proof-1", "proof-2"):
            post(client, key="d", headers={"Authorization": "DPoP tok", "DPoP": proof})

    assert scope_warnings(caplog, "Idempotency scope") == []
    assert ledger_count(app, ROUTE) == 3
    assert f"{ENDPOINT}|auth:{sha256('DPoP tok')}" in scopes(app)


class DigestClient:
    """Answers Flask-HTTPAuth's Digest challenge as a browser or SDK does."""

    def __init__(self, client: t.Any, user: str, password: str) -> None:
        self.client, self.user, self.password, self.nc = client, user, password, 0
        challenge = client.post("/digest/pay").headers["WWW-Authenticate"]
        self.fields = dict(re.findall(r'(\w+)="([^"]*)"', challenge))

    def header(self, uri: str) -> str:
        self.nc += 1
        cnonce, f = secrets.token_hex(8), self.fields
        ha1 = md5(f"{self.user}:{f['realm']}:{self.password}")
        ha2 = md5(f"POST:{uri}")
        response = md5(f"{ha1}:{f['nonce']}:{self.nc:08x}:{cnonce}:auth:{ha2}")
        return (
            f'Digest username="{self.user}", realm="{f["realm"]}", nonce="{f["nonce"]}", '
            f'uri="{uri}", qop=auth, nc={self.nc:08x}, cnonce="{cnonce}", '
            f'response="{response}", opaque="{f["opaque"]}"'
        )

    def pay(self, key: str) -> t.Any:
        headers = {"Idempotency-Key": key, "Authorization": self.header("/digest/pay")}
        return self.client.post("/digest/pay", json=BODY, headers=headers)


def digest_app(make_app: t.Callable[..., Flask]) -> Flask:
    flask_httpauth = pytest.importorskip("flask_httpauth")
    app = make_app(SECRET_KEY="digest-secret")
    auth = flask_httpauth.HTTPDigestAuth()
    passwords = {"alice": "wonderland", "bob": "builder"}

    @auth.get_password
    def get_password(user: str) -> str | None:
        return passwords.get(user)

    @app.post("/digest/pay", endpoint="digest_pay")
    @auth.login_required  # authenticate before the idempotency layer, as the README says
    @testapp.idem.idempotent(required=True)
    def pay() -> tuple[dict[str, t.Any], int]:
        row = testapp.write_ledger("digest/pay")
        return {"id": row.id, "user": auth.current_user()}, 201

    return app


def test_a_flask_httpauth_digest_user_keeps_its_scope_on_every_retry(
    make_app: t.Callable[..., Flask], caplog: pytest.LogCaptureFixture
) -> None:
    app = digest_app(make_app)
    alice = DigestClient(app.test_client(), "alice", "wonderland")

    with caplog.at_level(logging.WARNING, logger="flask_idempotency"):
        answers = [alice.pay("pay-1") for _ in range(3)]

    assert [a.status_code for a in answers] == [201, 201, 201]
    assert [a.headers.get("Idempotent-Replayed") for a in answers] == [None, "true", "true"]
    assert answers[2].get_data() == answers[0].get_data()
    assert ledger_count(app, "digest/pay") == 1
    assert scopes(app) == ["digest_pay|httpauth:alice"]
    assert scope_warnings(caplog, "Idempotency scope") == []


def test_flask_httpauth_users_never_share(make_app: t.Callable[..., Flask]) -> None:
    app = digest_app(make_app)
    alice = DigestClient(app.test_client(), "alice", "wonderland")
    bob = DigestClient(app.test_client(), "bob", "builder")

    for_alice = alice.pay("pay-1")
    for_bob = bob.pay("pay-1")

    assert for_bob.headers.get("Idempotent-Replayed") is None
    assert (for_alice.get_json()["user"], for_bob.get_json()["user"]) == ("alice", "bob")
    assert ledger_count(app, "digest/pay") == 2
    assert scopes(app) == ["digest_pay|httpauth:alice", "digest_pay|httpauth:bob"]


def test_a_flask_httpauth_user_object_is_not_guessed_at(make_app: t.Callable[..., Flask]) -> None:
    # verify_password may return any object; its str() is no identity (a repr
    # with an address, or one text for every user), so the header decides.
    flask_httpauth = pytest.importorskip("flask_httpauth")
    app = make_app(SECRET_KEY="basic-secret")
    auth = flask_httpauth.HTTPBasicAuth()

    @auth.verify_password
    def verify(user: str, password: str) -> User | None:
        return User(user) if (user, password) == ("alice", "pw") else None

    @app.post("/basic/pay", endpoint="basic_pay")
    @auth.login_required
    @testapp.idem.idempotent()
    def pay() -> tuple[dict[str, t.Any], int]:
        testapp.write_ledger("basic/pay")
        return {"user": auth.current_user().id}, 201

    client = app.test_client()
    for _ in range(2):
        client.post("/basic/pay", auth=("alice", "pw"), headers={"Idempotency-Key": "k"})

    assert ledger_count(app, "basic/pay") == 1
    assert scopes(app) == [basic_scope(app, "alice", "pw", "basic_pay")]


def test_long_identities_become_digests_within_the_scope_limit(app: Flask, client: t.Any) -> None:
    long_name, accented = "u" * 600, "zo\u00eb"
    post(client, auth=(long_name, "pw"))
    post(client, auth=(accented, "pw"), key="pay-2")

    assert ledger_count(app, ROUTE) == 2
    assert scopes(app) == sorted(
        [
            f"{ENDPOINT}|basic-sha256:{sha256(long_name)}:{basic_proof(app, long_name, 'pw')}",
            f"{ENDPOINT}|basic-sha256:{sha256(accented)}:{basic_proof(app, accented, 'pw')}",
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
        "from tests.support import testapp\n"
        "from tests.conftest import record_rows\n"
        "app = testapp.create_app('sqlite://')\n"
        "with app.app_context():\n"
        "    testapp.db.create_all()\n"
        "r = app.test_client().post('/raw', headers={'Idempotency-Key': 'k'}, auth=('al', 'pw'))\n"
        "assert r.status_code == 200, r.get_data()\n"
        "import hashlib, hmac\n"
        "proof = hmac.new(b'', b'flask-idempotency basic scope\\x00al:pw', hashlib.sha256)\n"
        "expected = 't.raw|basic:al:' + proof.hexdigest()[:32]\n"
        "assert [row['scope'] for row in record_rows(app)] == [expected]\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr
