"""The HTTP behaviour of an idempotent route, row by row, on PostgreSQL and SQLite.

Every test counts side effects (ledger rows) and records in the real database.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idempotency import COMPLETED, IN_PROGRESS, Idempotency, signals
from tests.conftest import Clock, ledger_count, record_rows, reset_tables
from tests.support import pgbouncer, testapp
from tests.support.flow import abandon, assert_problem, post

CHARGE = {"amount": 500, "currency": "EUR", "meta": {"note": "n", "trace_id": "t1"}}


@contextlib.contextmanager
def recorded(signal: t.Any) -> t.Iterator[list[dict[str, t.Any]]]:
    calls: list[dict[str, t.Any]] = []

    def receiver(sender: t.Any, **kwargs: t.Any) -> None:
        calls.append(kwargs)

    signal.connect(receiver)
    try:
        yield calls
    finally:
        signal.disconnect(receiver)


# -- first request, replay, mismatch ----------------------------------------------


def test_first_request_runs_view_and_commits_record_with_business_row(
    app: Flask, client: t.Any
) -> None:
    response = post(client, "/charges", CHARGE)
    assert response.status_code == 201
    assert response.headers.get("Idempotent-Replayed") is None
    assert ledger_count(app) == 1
    [record] = record_rows(app)
    assert record["status"] == COMPLETED
    assert record["key"] == "k1"
    assert record["response_code"] == 201
    assert bytes(record["response_body"]) == response.get_data()
    assert record["locked_until"] is None


def test_replay_is_byte_identical_with_safe_headers_and_view_does_not_run(
    app: Flask, client: t.Any
) -> None:
    first = post(client, "/charges", CHARGE)
    with recorded(signals.response_replayed) as replayed, recorded(signals.key_claimed) as claims:
        second = post(client, "/charges", CHARGE)
    assert second.status_code == 201
    assert second.get_data() == first.get_data()
    assert second.headers["Idempotent-Replayed"] == "true"
    assert second.headers["Content-Type"] == first.headers["Content-Type"]
    assert second.headers["Location"] == first.headers["Location"]
    assert second.headers["X-Request-Cost"] == "3"  # configured extra header
    # Set-Cookie is never replayed, even when configured.
    assert "Set-Cookie" in first.headers
    assert "Set-Cookie" not in second.headers
    assert claims == []
    assert len(replayed) == 1
    assert replayed[0]["key"] == "k1"
    assert ledger_count(app) == 1


def test_same_key_different_payload_is_422_and_changes_nothing(app: Flask, client: t.Any) -> None:
    post(client, "/charges", CHARGE)
    before = record_rows(app)
    with recorded(signals.payload_mismatch) as mismatches:
        response = post(client, "/charges", {**CHARGE, "amount": 501})
    assert_problem(response, 422)
    assert response.get_json(force=True)["type"].endswith("key-reused")
    assert len(mismatches) == 1
    assert ledger_count(app) == 1
    assert record_rows(app) == before


def test_same_key_on_other_path_of_same_endpoint_is_a_mismatch(app: Flask, client: t.Any) -> None:
    assert post(client, "/status/200", {}).status_code == 200
    # /status/201 is the same endpoint (same default scope) but another request.
    assert_problem(post(client, "/status/201", {}), 422)
    assert ledger_count(app) == 1


# -- the fingerprint: what counts as "the same payload" ---------------------------


@pytest.mark.parametrize(
    "retry_body",
    [
        '{"currency":"EUR","amount":500,"meta":{"trace_id":"t1","note":"n"}}',
        '{\n  "amount" : 500 ,\n "currency": "EUR", "meta": {"note": "n", "trace_id": "t1"}}',
        '{"amount": "500", "currency": "EUR", "meta": {"note": "n", "trace_id": "t1"}}',
        '{"amount": 500.0, "currency": "EUR", "meta": {"note": "n", "trace_id": "t1"}}',
        '{"amount": 500, "currency": "EUR", "meta": {"note": "n", "trace_id": "OTHER"},'
        ' "client_sent_at": "2026-11-30T10:00:00Z"}',
    ],
    ids=["key-order", "whitespace", "string-coerced", "float-coerced", "excluded-fields"],
)
def test_equivalent_payloads_replay(app: Flask, client: t.Any, retry_body: str) -> None:
    first = post(client, "/charges", CHARGE)
    second = post(client, "/charges", data=retry_body, content_type="application/json")
    assert second.status_code == 201, second.get_data(as_text=True)
    assert second.headers["Idempotent-Replayed"] == "true"
    assert second.get_data() == first.get_data()
    assert ledger_count(app) == 1


def test_change_in_nested_field_not_excluded_is_a_mismatch(app: Flask, client: t.Any) -> None:
    post(client, "/charges", CHARGE)
    response = post(client, "/charges", {**CHARGE, "meta": {"note": "other", "trace_id": "t1"}})
    assert_problem(response, 422)
    assert ledger_count(app) == 1


def test_raw_body_without_schema_hashes_bytes(app: Flask, client: t.Any) -> None:
    assert post(client, "/raw", data=b"abc", content_type="text/plain").status_code == 200
    replay = post(client, "/raw", data=b"abc", content_type="text/plain")
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert_problem(post(client, "/raw", data=b"abd", content_type="text/plain"), 422)
    assert ledger_count(app) == 1


# -- keys ----------------------------------------------------------------------------


def test_structured_field_string_and_bare_key_are_the_same_key(app: Flask, client: t.Any) -> None:
    post(client, "/charges", CHARGE, key='"order-7"')
    second = post(client, "/charges", CHARGE, key="order-7")
    assert second.headers["Idempotent-Replayed"] == "true"
    assert [r["key"] for r in record_rows(app)] == ["order-7"]
    assert ledger_count(app) == 1


def test_missing_key_on_required_route_is_400(app: Flask, client: t.Any) -> None:
    response = post(client, "/required", {}, key=None)
    assert_problem(response, 400)
    assert ledger_count(app) == 0
    assert record_rows(app) == []


def test_missing_key_on_optional_route_runs_unprotected(app: Flask, client: t.Any) -> None:
    assert post(client, "/charges", CHARGE, key=None).status_code == 201
    assert post(client, "/charges", CHARGE, key=None).status_code == 201
    assert ledger_count(app) == 2
    assert record_rows(app) == []


def test_required_by_config(database_url: str, clock: Clock) -> None:
    app = testapp.create_app(database_url, clock=clock, IDEMPOTENCY_REQUIRED=True)
    reset_tables(database_url)
    assert_problem(post(app.test_client(), "/charges", CHARGE, key=None), 400)
    assert ledger_count(app) == 0


@pytest.mark.parametrize(
    "bad_key",
    ["", "   ", '""', "x" * 256, '"' + "x" * 256 + '"', "ab\x01c", '"abc', '"ab"c"', '"a\\nb"'],
    ids=[
        "empty",
        "blank",
        "empty-quoted",
        "too-long",
        "too-long-quoted",
        "control-char",
        "unclosed-quote",
        "text-after-quote",
        "bad-escape",
    ],
)
def test_malformed_key_is_400_and_nothing_stored(app: Flask, client: t.Any, bad_key: str) -> None:
    response = post(client, "/charges", CHARGE, key=bad_key)
    doc = assert_problem(response, 400)
    assert doc["type"].endswith(("invalid-key", "missing-key"))
    assert ledger_count(app) == 0
    assert record_rows(app) == []


def test_non_ascii_key_is_400(app: Flask, client: t.Any) -> None:
    response = client.post(
        "/charges",
        data=json.dumps(CHARGE),
        content_type="application/json",
        headers=[("Idempotency-Key", "clé".encode().decode("latin-1"))],
    )
    assert_problem(response, 400)
    assert ledger_count(app) == 0


def test_two_key_headers_are_400(app: Flask, client: t.Any) -> None:
    response = client.post(
        "/charges",
        data=json.dumps(CHARGE),
        content_type="application/json",
        headers=[("Idempotency-Key", "a"), ("Idempotency-Key", "b")],
    )
    assert_problem(response, 400)
    assert record_rows(app) == []


def test_key_of_255_characters_is_accepted(app: Flask, client: t.Any) -> None:
    assert post(client, "/charges", CHARGE, key="k" * 255).status_code == 201
    assert ledger_count(app) == 1


# -- bad bodies ------------------------------------------------------------------------


def test_schema_failure_is_422_with_messages_and_nothing_stored(app: Flask, client: t.Any) -> None:
    response = post(client, "/charges", {"amount": "lots", "currency": "EUR"})
    doc = assert_problem(response, 422)
    assert "amount" in doc["errors"]
    assert ledger_count(app) == 0
    assert record_rows(app) == []


@pytest.mark.parametrize(
    ("data", "content_type", "status"),
    [
        ("amount=500", "application/x-www-form-urlencoded", 415),
        ('{"amount": 500', "application/json", 400),
        ("", "application/json", 400),
        ('{"amount": NaN, "currency": "EUR"}', "application/json", 400),
        ("\xff\xfe", "application/json", 400),
    ],
    ids=["form", "truncated-json", "empty", "nan", "not-utf8"],
)
def test_body_not_json_where_schema_needs_json(
    app: Flask, client: t.Any, data: str, content_type: str, status: int
) -> None:
    response = post(client, "/charges", data=data.encode("latin-1"), content_type=content_type)
    assert_problem(response, status)
    assert ledger_count(app) == 0
    assert record_rows(app) == []


def test_huge_payload_is_413_and_nothing_stored(database_url: str, clock: Clock) -> None:
    app = testapp.create_app(database_url, clock=clock, MAX_CONTENT_LENGTH=10_000)
    reset_tables(database_url)
    big = {**CHARGE, "meta": {"note": "x" * 50_000}}
    assert_problem(post(app.test_client(), "/charges", big), 413)
    assert_problem(post(app.test_client(), "/raw", data=b"y" * 50_000), 413)
    assert ledger_count(app) == 0
    assert record_rows(app) == []


# -- what is stored: status classes -----------------------------------------------


@pytest.mark.parametrize("code", [200, 201, 202, 204, 302, 400, 402, 403, 404, 410, 422])
def test_deterministic_answers_are_stored_and_replayed(
    app: Flask, client: t.Any, code: int
) -> None:
    first = post(client, f"/status/{code}", {})
    assert first.status_code == code
    second = post(client, f"/status/{code}", {})
    assert second.status_code == code
    assert second.headers["Idempotent-Replayed"] == "true"
    assert second.get_data() == first.get_data()
    assert ledger_count(app) == 1


@pytest.mark.parametrize("code", [408, 409, 423, 425, 429, 500, 502, 503])
def test_transient_answers_roll_back_and_retry_runs_again(
    app: Flask, client: t.Any, code: int
) -> None:
    with recorded(signals.key_claimed) as claims:
        assert post(client, f"/status/{code}", {}).status_code == code
        second = post(client, f"/status/{code}", {})
    assert second.status_code == code
    assert second.headers.get("Idempotent-Replayed") is None
    assert len(claims) == 2  # the view ran again
    assert ledger_count(app) == 0  # and each attempt's writes were rolled back
    assert record_rows(app) == []


def test_view_that_raises_rolls_back_and_retry_runs_again(app: Flask) -> None:
    client = app.test_client()
    with recorded(signals.key_claimed) as claims:
        assert post(client, "/raise", {}).status_code == 500
        assert post(client, "/raise", {}).status_code == 500
    assert len(claims) == 2
    assert ledger_count(app) == 0
    assert record_rows(app) == []


# -- bodies that are not kept ----------------------------------------------------------


def test_large_body_commits_once_and_replay_says_body_not_kept(app: Flask, client: t.Any) -> None:
    first = post(client, "/big/5000", {})
    assert first.status_code == 201
    assert first.get_data() == b"x" * 5000
    [record] = record_rows(app)
    assert record["body_omitted"] is True
    assert record["response_body"] is None
    second = post(client, "/big/5000", {})
    doc = assert_problem(second, 201)
    assert doc["type"].endswith("response-not-stored")
    assert second.headers["Location"] == first.headers["Location"]
    assert second.headers["Idempotent-Replayed"] == "true"
    assert ledger_count(app) == 1


def test_body_at_the_limit_is_kept(app: Flask, client: t.Any) -> None:
    first = post(client, "/big/1000", {})
    second = post(client, "/big/1000", {})
    assert second.get_data() == first.get_data() == b"x" * 1000
    assert second.headers["Content-Type"] == "text/plain"


def test_streamed_response_commits_once_and_is_not_kept(app: Flask, client: t.Any) -> None:
    first = post(client, "/stream", {})
    assert first.status_code == 201
    assert first.get_data() == b"part-1;part-2"
    second = post(client, "/stream", {})
    assert_problem(second, 201)
    assert second.headers["Location"] == first.headers["Location"]
    assert ledger_count(app) == 1


# -- scopes ------------------------------------------------------------------------------


def test_two_tenants_with_same_key_and_body_are_independent(app: Flask, client: t.Any) -> None:
    a1 = post(client, "/tenant", {"x": 1}, headers={"X-Tenant": "a"})
    b1 = post(client, "/tenant", {"x": 1}, headers={"X-Tenant": "b"})
    a2 = post(client, "/tenant", {"x": 1}, headers={"X-Tenant": "a"})
    b2 = post(client, "/tenant", {"x": 1}, headers={"X-Tenant": "b"})
    assert a1.get_json()["tenant"] == a2.get_json()["tenant"] == "a"
    assert b1.get_json()["tenant"] == b2.get_json()["tenant"] == "b"
    assert a2.headers["Idempotent-Replayed"] == b2.headers["Idempotent-Replayed"] == "true"
    assert ledger_count(app) == 2
    assert sorted(r["scope"] for r in record_rows(app)) == ["tenant:a", "tenant:b"]


def test_default_scope_keeps_credentials_apart(app: Flask, client: t.Any) -> None:
    alice = post(client, "/charges", CHARGE, headers={"Authorization": "Bearer alice"})
    bob = post(client, "/charges", CHARGE, headers={"Authorization": "Bearer bob"})
    assert bob.headers.get("Idempotent-Replayed") is None
    assert alice.get_json()["id"] != bob.get_json()["id"]
    assert ledger_count(app) == 2
    scopes = {r["scope"] for r in record_rows(app)}
    assert len(scopes) == 2
    assert not any("alice" in s or "bob" in s for s in scopes)


# -- time: expiry and leases -------------------------------------------------------------


def test_expired_record_counts_as_absent_before_cleanup(
    app: Flask, client: t.Any, clock: Clock
) -> None:
    post(client, "/short-ttl", {})
    [first] = record_rows(app)
    clock.advance(minutes=4, seconds=59)
    assert post(client, "/short-ttl", {}).headers["Idempotent-Replayed"] == "true"
    clock.advance(seconds=2)
    # Even a different payload is fine: the old record is gone as far as anyone knows.
    again = post(client, "/short-ttl", {"other": True})
    assert again.status_code == 201
    assert again.headers.get("Idempotent-Replayed") is None
    assert ledger_count(app) == 2
    [record] = record_rows(app)
    assert record["fencing_token"] != first["fencing_token"]  # a new operation, a new token
    assert record["expires_at"] > clock.now


def test_default_ttl_is_24_hours(app: Flask, client: t.Any, clock: Clock) -> None:
    post(client, "/charges", CHARGE)
    [record] = record_rows(app)
    expires = record["expires_at"]
    if expires.tzinfo is None:
        expires = expires.replace(tzinfo=dt.timezone.utc)
    assert expires == clock.now + dt.timedelta(hours=24)


def test_in_progress_under_live_lease_is_409_then_reclaimed(
    app: Flask, client: t.Any, clock: Clock
) -> None:
    abandon(app, clock)
    with recorded(signals.request_conflict) as conflicts:
        response = post(client, "/status/201", {})
    assert_problem(response, 409)
    assert response.headers["Retry-After"] == "60"
    assert len(conflicts) == 1
    clock.advance(seconds=30)
    assert post(client, "/status/201", {}).headers["Retry-After"] == "30"
    assert ledger_count(app) == 0
    clock.advance(seconds=31)
    reclaimed = post(client, "/status/201", {})
    assert reclaimed.status_code == 201
    assert reclaimed.headers.get("Idempotent-Replayed") is None
    [record] = record_rows(app)
    assert record["status"] == COMPLETED
    assert record["fencing_token"] != 1  # the reclaim drew a new token
    assert ledger_count(app) == 1


def test_in_progress_with_other_payload_is_422_not_409(
    app: Flask, client: t.Any, clock: Clock
) -> None:
    abandon(app, clock)
    assert_problem(post(client, "/status/201", {"different": 1}), 422)


# -- registration --------------------------------------------------------------------


def test_init_app_twice_is_refused(database_url: str) -> None:
    app = testapp.create_app(database_url)
    with pytest.raises(RuntimeError, match="already registered"):
        Idempotency().init_app(app, testapp.db)


def test_table_is_on_the_apps_metadata() -> None:
    table = testapp.db.metadata.tables["idempotency_keys"]
    assert {c.name for c in table.primary_key.columns} == {"scope", "key"}
    assert any(ix.name == "idempotency_keys_expires_at" for ix in table.indexes)


def test_unknown_option_is_refused() -> None:
    with pytest.raises(TypeError, match="unknown Idempotency option"):
        Idempotency(tll=5)


def test_view_reads_payload_and_key(database_url: str, clock: Clock) -> None:
    app = testapp.create_app(database_url, clock=clock)
    reset_tables(database_url)
    seen: dict[str, t.Any] = {}

    @app.post("/echo")
    @testapp.idem.idempotent(schema=testapp.ChargeSchema())
    def echo() -> dict[str, t.Any]:
        seen.update(payload=testapp.idem.payload, key=testapp.idem.key, scope=testapp.idem.scope)
        return {}

    post(app.test_client(), "/echo", {"amount": "7", "currency": "EUR"}, key='"abc"')
    assert seen["payload"]["amount"] == 7
    assert seen["key"] == "abc"
    assert seen["scope"] == "echo"


# -- records committed before the view finishes -----------------------------------


def test_leased_route_commits_the_claim_before_the_view(database_url: str, clock: Clock) -> None:
    app = testapp.create_app(database_url, clock=clock)
    seen: dict[str, list[dict[str, t.Any]]] = {}

    @app.post("/observe/leased")
    @testapp.idem.idempotent(lease=30)
    def observe_leased() -> tuple[dict[str, t.Any], int]:
        seen["leased"] = record_rows(app)  # another connection: only committed rows
        return {}, 201

    @app.post("/observe/plain")
    @testapp.idem.idempotent()
    def observe_plain() -> tuple[dict[str, t.Any], int]:
        seen["plain"] = record_rows(app)
        return {}, 201

    reset_tables(database_url)
    client = app.test_client()
    assert post(client, "/observe/leased", {}, key="a").status_code == 201
    assert post(client, "/observe/plain", {}, key="b").status_code == 201
    [leased] = seen["leased"]
    assert leased["status"] == IN_PROGRESS
    locked_until = leased["locked_until"]
    if locked_until.tzinfo is None:
        locked_until = locked_until.replace(tzinfo=dt.timezone.utc)
    assert locked_until == clock.now + dt.timedelta(seconds=30)
    # Without a lease the claim is invisible to others until the view's commit.
    assert [r["key"] for r in seen["plain"]] == ["a"]
    assert {r["key"]: r["status"] for r in record_rows(app)} == {"a": COMPLETED, "b": COMPLETED}
    assert post(client, "/observe/leased", {}, key="a").headers["Idempotent-Replayed"] == "true"


def test_leased_route_failure_releases_the_record(app: Flask, client: t.Any) -> None:
    with recorded(signals.key_claimed) as claims:
        assert post(client, "/leased/500", {}).status_code == 500
        assert record_rows(app) == []  # released at once, not left to the lease
        assert post(client, "/leased/500", {}).status_code == 500
    assert len(claims) == 2
    assert ledger_count(app) == 0


def test_view_that_commits_then_fails_never_runs_twice(app: Flask, client: t.Any) -> None:
    """What the view committed itself stays committed, so the operation happened:
    its failure is recorded and replayed, and the view never runs a second time.
    What it wrote after its commit was rolled back."""
    with recorded(signals.key_claimed) as claims:
        first = post(client, "/commits-then-fails", {})
        assert first.status_code == 503
        [record] = record_rows(app)
        assert record["status"] == COMPLETED
        retry = post(client, "/commits-then-fails", {})
        assert retry.status_code == 503
        assert retry.headers["Idempotent-Replayed"] == "true"
        assert retry.get_data() == first.get_data()
    assert len(claims) == 1
    assert ledger_count(app) == 1


def test_unbounded_wait_setting_still_claims_and_replays(database_url: str, clock: Clock) -> None:
    app = testapp.create_app(database_url, clock=clock, IDEMPOTENCY_WAIT=None)
    reset_tables(database_url)
    client = app.test_client()
    assert post(client, "/charges", CHARGE).status_code == 201
    assert post(client, "/charges", CHARGE).headers["Idempotent-Replayed"] == "true"
    assert ledger_count(app) == 1


def test_constructor_options_are_defaults_that_config_overrides(
    database_url: str, clock: Clock
) -> None:
    from flask_sqlalchemy import SQLAlchemy

    app = Flask("opts")
    app.config["SQLALCHEMY_DATABASE_URI"] = database_url
    app.config["IDEMPOTENCY_HEADER"] = "X-Request-Key"
    db = SQLAlchemy()
    db.init_app(app)
    idem = Idempotency(app, db, clock=clock, ttl=120, header="Ignored-Header")
    assert app.config["IDEMPOTENCY_TTL"] == 120
    assert app.config["IDEMPOTENCY_HEADER"] == "X-Request-Key"

    @app.post("/op")
    @idem.idempotent()
    def op() -> tuple[dict[str, t.Any], int]:
        return {"ok": True}, 201

    with app.app_context():
        db.drop_all()
        db.create_all()
    client = app.test_client()
    client.post("/op", headers={"X-Request-Key": "k"})
    assert client.post("/op", headers={"X-Request-Key": "k"}).headers["Idempotent-Replayed"]
    with app.app_context():
        with db.engine.connect() as conn:
            table = db.metadata.tables["idempotency_keys"]
            expires = conn.execute(sa.select(table.c.expires_at)).scalar_one()
        db.engine.dispose()
    if expires.tzinfo is None:
        expires = expires.replace(tzinfo=dt.timezone.utc)
    assert expires == clock.now + dt.timedelta(seconds=120)


def test_cli_create_tables(database_url: str) -> None:
    app = testapp.create_app(database_url)
    engine = sa.create_engine(database_url)
    testapp.db.metadata.drop_all(engine)
    result = app.test_cli_runner().invoke(args=["idempotency", "create-tables"])
    assert result.exit_code == 0, result.output
    tables = sa.inspect(engine).get_table_names()
    engine.dispose()
    for table in ("idempotency_keys", "idempotency_job_locks", "idempotency_outbox"):
        assert table in tables
    assert "idempotency_inbox" in tables
    assert "ledger" not in tables  # only the extension's own tables


@pytest.mark.parametrize("apps_own", ["server default", "connection", "transaction"])
def test_lock_timeout_is_restored_for_the_view_and_after_a_refusal(
    pg_url: str, clock: Clock, apps_own: str, pooled_role: t.Callable[..., str]
) -> None:
    """The claim's bounded wait must not leak into the app's own statements: the
    view (and an error handler after a refusal) sees the app's own lock_timeout,
    whether it is the server's default, set for the connection, or set in the
    request's transaction before the claim (SET LOCAL in a before_request hook)."""
    from flask_idempotency import KeyReusedError

    url = pg_url
    expected = None
    if apps_own == "connection" and pgbouncer.is_pooled(pg_url):
        # Behind the pooler, the connection's own setting is the role's.
        url, expected = pooled_role(pg_url, lock_timeout="4321ms"), "4321ms"
    elif apps_own == "connection":
        # Added to the URL's own options (a configured server's carry the test
        # schema's search_path), not in place of them.
        parsed = sa.make_url(pg_url)
        own = f"{parsed.query.get('options', '')} -c lock_timeout=4321ms".strip()
        url = parsed.update_query_dict({"options": own}).render_as_string(hide_password=False)
        expected = "4321ms"
    app = testapp.create_app(url, clock=clock, IDEMPOTENCY_WAIT=2)
    if apps_own == "transaction":
        expected = "777ms"

        @app.before_request
        def set_local() -> None:
            testapp.db.session.execute(sa.text("SET LOCAL lock_timeout = '777ms'"))

    def lock_timeout() -> str:
        return str(testapp.db.session.execute(sa.text("SHOW lock_timeout")).scalar_one())

    @app.post("/show")
    @testapp.idem.idempotent()
    def show() -> dict[str, t.Any]:
        return {"in_view": lock_timeout()}

    @app.errorhandler(KeyReusedError)
    def refused(error: KeyReusedError) -> tuple[dict[str, t.Any], int]:
        return {"in_handler": lock_timeout()}, 422

    reset_tables(pg_url)
    client = app.test_client()
    if expected is None:
        with app.app_context():
            expected = str(testapp.db.session.execute(sa.text("SHOW lock_timeout")).scalar_one())
            testapp.db.session.remove()
    assert expected != "2s"
    assert post(client, "/show", {"a": 1}).get_json() == {"in_view": expected}
    assert post(client, "/show", {"a": 2}).get_json() == {"in_handler": expected}
    with app.app_context():
        testapp.db.engine.dispose()
