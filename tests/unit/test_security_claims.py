"""The threat model's claims (docs/security.md), each against the real database.

On PostgreSQL (both drivers), SQLite and MariaDB, through the test app: what each
request left in the record table and the ledger (the views' side effects), never
what the code says it did. The claims of the encryption, erasure and redaction pages
are tested with those features.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import re
import socket
import typing as t
import uuid

import pytest
import sqlalchemy as sa
from flask import Blueprint, Flask, g
from flask_limiter import Limiter

from flask_idempotency import signals
from flask_idempotency._maintenance.jobs import purge_expired
from flask_idempotency._messaging.outbox import OutboxEvent
from flask_idempotency.errors import BrokerUnavailable
from flask_idempotency.publishers import KombuPublisher
from tests.conftest import Clock, ledger_count, record_rows, reset_tables, run_sql
from tests.support import testapp
from tests.support.broker import RABBITMQ
from tests.support.flow import assert_problem, post
from tests.support.records import cli

BODY = {"amount": 500}


# -- another tenant's credentials ----------------------------------------------------


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@contextlib.contextmanager
def statements(app: Flask) -> t.Iterator[list[str]]:
    """The SQL the app's engine runs meanwhile, parameters left out (they are bound)."""
    seen: list[str] = []

    def record(conn: t.Any, cursor: t.Any, sql: str, *args: t.Any) -> None:
        seen.append(re.sub(r"\s+", " ", sql).strip())

    with app.app_context():
        engine = testapp.db.engine
    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)


def shape(answer: t.Any) -> tuple[int, str | None, list[str], list[str]]:
    """What a client can compare between two answers, the ids in them aside."""
    body = answer.get_json(silent=True) or {}
    return answer.status_code, answer.mimetype, sorted(answer.headers.keys()), sorted(body)


def test_a_key_in_another_scope_is_another_operation(app: Flask, client: t.Any) -> None:
    """Bob sends Alice's key with another body: no 422 (which would say the key is in
    use), no replay of Alice's answer; his own operation runs."""
    alice = post(client, "/scope/charge", BODY, key="order-7", headers=bearer("alice-token"))
    assert alice.status_code == 201
    bob = post(client, "/scope/charge", {"amount": 9}, key="order-7", headers=bearer("bob-token"))
    assert bob.status_code == 201
    assert bob.headers.get("Idempotent-Replayed") is None
    assert bob.get_json()["id"] != alice.get_json()["id"]
    assert ledger_count(app, "scope/charge") == 2
    assert len(record_rows(app)) == 2


def test_a_key_used_in_another_scope_answers_as_a_fresh_key(app: Flask, client: t.Any) -> None:
    """No existence oracle: for Bob, a key Alice used and a key nobody used get the same
    status, headers and body fields, and run the very same statements (the same work,
    so no timing to tell them apart): nothing reads across scopes."""
    post(client, "/scope/charge", BODY, key="used-by-alice", headers=bearer("alice-token"))
    post(client, "/scope/charge", BODY, key="warm-up", headers=bearer("bob-token"))
    with statements(app) as for_fresh:
        fresh = post(client, "/scope/charge", BODY, key="nobody-used", headers=bearer("bob-token"))
    with statements(app) as for_used:
        used = post(client, "/scope/charge", BODY, key="used-by-alice", headers=bearer("bob-token"))
    assert shape(used) == shape(fresh)
    assert used.status_code == 201
    assert for_used == for_fresh
    assert ledger_count(app, "scope/charge") == 4


@contextlib.contextmanager
def claims(app: Flask) -> t.Iterator[list[str]]:
    """The keys claimed meanwhile (``key_claimed``), in order."""
    claimed: list[str] = []

    def on_claim(sender: Flask, key: str, **kw: t.Any) -> None:
        claimed.append(key)

    with signals.key_claimed.connected_to(on_claim, app):
        yield claimed


def test_callers_that_share_a_scope_share_their_keys(make_app: t.Callable[..., Flask]) -> None:
    """The flip side: the scope is the boundary. In a tenant-wide scope, a colleague who
    sends Alice's key (and her body) is replayed Alice's answer."""
    app = make_app(IDEMPOTENCY_SCOPE=lambda: "scope/charge|tenant:acme")
    client = app.test_client()
    alice = post(client, "/scope/charge", BODY, key="order-7", headers=bearer("alice-token"))
    bob = post(client, "/scope/charge", BODY, key="order-7", headers=bearer("bob-token"))
    assert bob.headers["Idempotent-Replayed"] == "true"
    assert bob.get_json() == alice.get_json()
    assert ledger_count(app, "scope/charge") == 1


# -- keys ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({}, "k" * 256),  # over the key column's 255
        ({"IDEMPOTENCY_KEY_MAX_LENGTH": 64}, "k" * 65),
        ({"IDEMPOTENCY_KEY_FORMAT": "uuid4"}, "order-42"),
        ({"IDEMPOTENCY_KEY_FORMAT": "uuid4"}, str(uuid.uuid1())),  # a UUID, not version 4
        ({"IDEMPOTENCY_KEY_FORMAT": r"ord_[0-9a-f]{32}"}, "ord_123"),
        ({}, "two,keys"),
    ],
    ids=["too-long", "over-max-length", "not-a-uuid", "uuid1", "regex", "comma"],
)
def test_a_refused_key_stores_nothing_and_runs_nothing(
    make_app: t.Callable[..., Flask], config: dict[str, t.Any], key: str
) -> None:
    app = make_app(**config)
    with claims(app) as claimed:
        answer = post(app.test_client(), "/raw", BODY, key=key)
    assert assert_problem(answer, 400)["type"].endswith("/invalid-key")
    assert claimed == []
    assert record_rows(app) == []
    assert ledger_count(app) == 0


def test_a_key_of_the_configured_format_and_length_is_taken(
    make_app: t.Callable[..., Flask],
) -> None:
    """The same settings let a good key through (the refusals above are not of every key)."""
    app = make_app(IDEMPOTENCY_KEY_MAX_LENGTH=36, IDEMPOTENCY_KEY_FORMAT="uuid4")
    key = str(uuid.uuid4())
    assert post(app.test_client(), "/raw", BODY, key=key).status_code == 200
    assert [r["key"] for r in record_rows(app)] == [key]


# -- body sizes ----------------------------------------------------------------------------


def test_a_body_over_max_content_length_stores_nothing(make_app: t.Callable[..., Flask]) -> None:
    """Refused before the claim: no row, and no key claimed meanwhile."""
    app = make_app(MAX_CONTENT_LENGTH=1024)
    with claims(app) as claimed:
        answer = post(app.test_client(), "/raw", None, data=b"x" * 4096, content_type="text/plain")
    assert_problem(answer, 413)
    assert claimed == []
    assert record_rows(app) == []
    assert ledger_count(app) == 0


def test_a_response_over_max_body_keeps_no_body(app: Flask, client: t.Any) -> None:
    """IDEMPOTENCY_MAX_BODY (1000 in the test app) bounds what a record holds; the
    operation is still recorded once, and its retry gets ``response-not-stored``, not
    a second run."""
    assert post(client, "/big/5000", {}).status_code == 201
    [row] = record_rows(app)
    assert row["response_body"] is None
    assert row["body_omitted"] is True
    retry = post(client, "/big/5000", {})
    assert retry.status_code == 201  # the operation's status, with the problem's body
    assert retry.get_json()["type"].endswith("/response-not-stored")
    assert ledger_count(app, "big") == 1


def test_cookies_and_credentials_are_never_kept(app: Flask, client: t.Any) -> None:
    """The test app lists Set-Cookie in IDEMPOTENCY_REPLAY_HEADERS, and /charges sets
    one: the stored headers hold the other listed header, never the cookie."""
    charge = {"amount": 500, "currency": "EUR"}
    assert "visitor=" in post(client, "/charges", charge).headers["Set-Cookie"]
    [row] = record_rows(app)
    assert "X-Request-Cost" in row["response_headers"]
    assert "visitor" not in row["response_headers"]
    assert "Set-Cookie" not in row["response_headers"]


# -- a flood of unique keys ---------------------------------------------------------------


def test_a_flood_of_unique_keys_is_one_row_each_and_cleanup_removes_them(
    app: Flask, client: t.Any, clock: Clock
) -> None:
    keys = [f"flood-{i}" for i in range(60)]
    for key in keys:
        assert post(client, "/raw", BODY, key=key).status_code == 200
    rows = record_rows(app)
    assert sorted(r["key"] for r in rows) == sorted(keys)
    assert {r["scope"] for r in rows} == {"t.raw"}
    clock.advance(hours=24, seconds=1)  # past IDEMPOTENCY_TTL
    report = purge_expired(app, batch_size=25)
    assert (report.deleted, report.batches) == (60, 3)
    assert record_rows(app) == []


def test_the_flood_bench_measures_both_engines() -> None:
    """``python -m bench.flood``, whose figures docs/security.md quotes, runs (tiny)."""
    from bench.flood import on_postgres, on_sqlite

    for figures in (on_postgres(40), on_sqlite(40)):
        assert 200 < figures["bytes/record"] < 20_000, figures
        assert figures["cleanup rows/s"] > 0


# -- rate limiting with Flask-Limiter -------------------------------------------------------

# One limiter for this module's routes; each test starts its counts afresh. The limit
# is keyed by the authenticated caller (g.user, set by a before_request hook), so the
# decorator's check runs after authentication.
limiter = Limiter(key_func=lambda: g.user, storage_uri="memory://")
limited_bp = Blueprint("limited", __name__)


@limited_bp.post("/limited/right-order")
@limiter.limit("2/minute")
@testapp.idem.idempotent
def limited_right_order() -> tuple[dict[str, t.Any], int]:
    row = testapp.write_ledger("limited")
    return {"id": row.id}, 201


@limited_bp.post("/limited/wrong-order")
@testapp.idem.idempotent
@limiter.limit("2/minute")
def limited_wrong_order() -> tuple[dict[str, t.Any], int]:
    row = testapp.write_ledger("limited")
    return {"id": row.id}, 201


@pytest.fixture
def limited(make_app: t.Callable[..., Flask]) -> t.Iterator[tuple[Flask, list[str]]]:
    """The test app with the limiter; the keys claimed (``key_claimed``), in order."""
    app = make_app()
    app.before_request(lambda: setattr(g, "user", "alice"))
    limiter.init_app(app)
    app.register_blueprint(limited_bp)
    limiter.reset()
    with claims(app) as claimed:
        yield app, claimed


def test_the_limiter_above_the_extension_refuses_before_any_claim(
    limited: tuple[Flask, list[str]],
) -> None:
    app, claimed = limited
    client = app.test_client()
    for key in ("a", "b"):
        assert post(client, "/limited/right-order", BODY, key=key).status_code == 201
    refused = post(client, "/limited/right-order", BODY, key="c")
    assert refused.status_code == 429
    assert claimed == ["a", "b"]  # "c" was never claimed: no row, no lock, no wait
    assert sorted(r["key"] for r in record_rows(app)) == ["a", "b"]
    assert ledger_count(app, "limited") == 2
    # A retry counts against the limit like a new request: refused, not replayed.
    assert post(client, "/limited/right-order", BODY, key="a").status_code == 429


def test_the_limiter_below_the_extension_runs_after_the_claim(
    limited: tuple[Flask, list[str]],
) -> None:
    """The wrong order: the refused request claimed its key first (the 429 is not
    stored, so the claim rolls back), and a retry of a completed key is replayed
    without the limiter ever counting it."""
    app, claimed = limited
    client = app.test_client()
    for key in ("a", "b"):
        assert post(client, "/limited/wrong-order", BODY, key=key).status_code == 201
    assert post(client, "/limited/wrong-order", BODY, key="c").status_code == 429
    assert claimed == ["a", "b", "c"]
    assert sorted(r["key"] for r in record_rows(app)) == ["a", "b"]
    replayed = post(client, "/limited/wrong-order", BODY, key="a")
    assert replayed.headers["Idempotent-Replayed"] == "true"


def test_default_limits_refuse_before_any_claim(make_app: t.Callable[..., Flask]) -> None:
    """Limits that are not a route's decorator (``default_limits``, a Blueprint's) are
    checked in Flask-Limiter's ``before_request`` hook: before every view, and so
    before the extension, whatever the decorators' order."""
    app = make_app()
    throttle = Limiter(
        key_func=lambda: "everyone", default_limits=["2/minute"], storage_uri="memory://"
    )
    throttle.init_app(app)
    with claims(app) as claimed:
        client = app.test_client()
        assert [post(client, "/raw", BODY, key=k).status_code for k in "abc"] == [200, 200, 429]
    assert claimed == ["a", "b"]
    assert sorted(r["key"] for r in record_rows(app)) == ["a", "b"]
    assert ledger_count(app) == 2


# Default limits, and a route with a decorator of its own below the extension.
defaults = Limiter(
    key_func=lambda: "everyone", default_limits=["2/minute"], storage_uri="memory://"
)
defaults_bp = Blueprint("defaults", __name__)


@defaults_bp.post("/defaults/decorated-below")
@testapp.idem.idempotent
@defaults.limit("100/minute", override_defaults=False)
def decorated_below() -> tuple[dict[str, t.Any], int]:
    row = testapp.write_ledger("decorated-below")
    return {"id": row.id}, 201


def test_default_limits_move_to_a_routes_decorator(make_app: t.Callable[..., Flask]) -> None:
    """On a route with a ``@limiter.limit`` of its own that keeps the default limits
    (``override_defaults=False``), Flask-Limiter checks them at that decorator, not in
    ``before_request``: below the extension, they too run after the claim. The
    decorator's place decides for every limit of the route."""
    app = make_app()
    defaults.init_app(app)
    defaults.reset()
    app.register_blueprint(defaults_bp)
    with claims(app) as claimed:
        client = app.test_client()
        answers = [post(client, "/defaults/decorated-below", BODY, key=k) for k in "abc"]
    assert [a.status_code for a in answers] == [201, 201, 429]
    assert claimed == ["a", "b", "c"]  # "c" was claimed, then refused by the default limit
    assert sorted(r["key"] for r in record_rows(app)) == ["a", "b"]


# -- TLS to the database -----------------------------------------------------------------


def test_the_database_urls_sslmode_governs_the_extensions_connections(pg_url: str) -> None:
    """The extension connects through the app's engine alone: ``sslmode=require`` in
    the URL, against a server without TLS, makes every protected request a clean 503
    (never a connection in clear), and the CLI exits 69; nothing is stored."""
    if run_sql(pg_url, "SHOW ssl")[0][0] == "on":
        pytest.skip("this PostgreSQL offers TLS: the refusal cannot be shown here")
    url = sa.make_url(pg_url)
    socket = str(url.query.get("host") or url.host or "")
    if not url.host or socket.startswith("/"):
        # libpq never uses TLS on a Unix-domain socket: sslmode=require is met there.
        pytest.skip("this PostgreSQL is reached through a Unix socket (the embedded server)")
    reset_tables(pg_url)
    url = url.update_query_dict({"sslmode": "require"})
    app = testapp.create_app(url.render_as_string(hide_password=False))
    try:
        answer = post(app.test_client(), "/raw", BODY, key="over-tls")
        assert assert_problem(answer, 503)["type"].endswith("/database-unavailable")
        assert cli(app, "stats").exit_code == 69
    finally:
        with app.app_context():
            testapp.db.engine.dispose()
    assert run_sql(pg_url, "SELECT count(*) FROM idempotency_keys")[0][0] == 0
    assert run_sql(pg_url, "SELECT count(*) FROM ledger")[0][0] == 0


# -- TLS to the broker -------------------------------------------------------------------


def an_event() -> OutboxEvent:
    now = dt.datetime.now(dt.timezone.utc)
    return OutboxEvent(1, "tls-1", "orders.created", {"id": 1}, {}, now, 0)


@pytest.mark.parametrize(
    ("url", "tls"),
    [
        (f"amqps://guest:guest@{RABBITMQ[0]}:{RABBITMQ[1]}//", None),
        (f"amqp://guest:guest@{RABBITMQ[0]}:{RABBITMQ[1]}//", {"server_hostname": None}),
    ],
    ids=["amqps-url", "ssl-option"],
)
def test_tls_to_the_broker_is_never_given_up_for_a_connection_in_clear(
    url: str, tls: dict[str, t.Any] | None
) -> None:
    """Against a RabbitMQ that speaks only plain AMQP, a publisher told to use TLS
    (the URL's ``amqps``, or ``ssl=``) publishes nothing: the broker is unavailable
    (the event stays pending), the message never crosses in clear."""
    try:
        socket.create_connection(RABBITMQ, timeout=2).close()
    except OSError as exc:
        pytest.skip(f"no RabbitMQ at {RABBITMQ[0]}:{RABBITMQ[1]}: {exc}")
    plain = KombuPublisher(f"amqp://guest:guest@{RABBITMQ[0]}:{RABBITMQ[1]}//", timeout=5)
    over_tls = KombuPublisher(url, exchange="tls-claims", timeout=5, ssl=tls)
    try:
        plain.publish(an_event())  # the broker is there, in clear
        with pytest.raises(BrokerUnavailable):
            over_tls.publish(an_event())
    finally:
        plain.close()
        over_tls.close()
