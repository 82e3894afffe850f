"""The keyed fingerprint and redaction (issue 27), through real requests on every
engine: what the rows hold is read raw, what a view saw is recorded by the view.

- ``IDEMPOTENCY_FINGERPRINT_KEY``: the stored ``request_hash`` is HMAC-SHA256
  of what SHA-256 covered; a dictionary of small bodies finds nothing without
  the key; retries still match and a changed payload is still 422.
- ``redact=``: the kept request of a ``recover=True`` route lacks the fields
  (JSON, with a schema's data keys, and forms), they still count in the
  fingerprint, and the recovery job's re-run gets the body without them.
- Nothing the package logs or repr-s carries a body; bad config is refused.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import io
import json
import logging
import typing as t

import pytest
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_idempotency import Idempotency, signals
from flask_idempotency._config import Settings
from flask_idempotency._maintenance.jobs import recover_abandoned
from flask_idempotency._messaging.outbox import OutboxEvent
from flask_idempotency._request import fingerprint
from flask_idempotency._request.canonical import canonical_json
from flask_idempotency._storage import Record
from flask_idempotency.config import DEFAULTS
from tests.conftest import Clock
from tests.support.flow import assert_problem
from tests.support.redact_app import FINGERPRINT_KEY, MARKER, SCOPE, RedactApp, make_app

CARD = {"amount": 5, "card": {"number": f"4242-{MARKER}", "exp": "12/30"}, "cvc": f"{MARKER}-cvc"}


def post(client: t.Any, path: str, key: str, crash: bool = False, **kw: t.Any) -> t.Any:
    headers = {"Idempotency-Key": key, **({"X-Crash": "1"} if crash else {})}
    return client.post(path, headers=headers, **kw)


def plain_sha256(path: str, body: t.Any) -> str:
    """What an attacker computes for a guess: the unkeyed fingerprint of a JSON body."""
    return fingerprint.compute("POST", path, (), canonical_json(body), "application/json")


@pytest.fixture
def redacting(fresh_database: str, clock: Clock) -> RedactApp:
    made = make_app(fresh_database, clock=clock)
    made.app.config["PROPAGATE_EXCEPTIONS"] = False  # a crash answers 500, as served
    return made


# -- the keyed fingerprint ---------------------------------------------------------


@pytest.mark.parametrize("path", ["/plain", "/optimistic"])
def test_the_stored_hash_is_keyed_and_a_dictionary_finds_nothing(
    redacting: RedactApp, path: str
) -> None:
    client = redacting.app.test_client()
    assert post(client, path, "k1", json={"amount": 100}).status_code == 201
    stored = redacting.row("k1")["request_hash"]

    sent = canonical_json({"amount": 100})
    # Keyed, the hash covers its record (scope and key) first: the same request
    # under another key or scope hashes differently (no oracle for a reader
    # who is also a client).
    scope = redacting.row("k1")["scope"]
    scope = scope.decode() if isinstance(scope, bytes) else scope  # MySQL: VARBINARY
    bound = fingerprint.bound_to(scope, "k1")
    keyed = fingerprint.compute(
        "POST", path, (), sent, "application/json", key=FINGERPRINT_KEY.encode(), bound=bound
    )
    other = fingerprint.compute("POST", path, (), sent, "application/json", key=b"o" * 32)
    elsewhere = fingerprint.compute(
        "POST", path, (), sent, "application/json", key=FINGERPRINT_KEY.encode(), bound=b""
    )
    assert stored == keyed
    assert stored != elsewhere
    assert stored != plain_sha256(path, {"amount": 100})
    assert stored != other
    # The attack the key stops: every amount from 0 to 10000, hashed as the
    # extension did before; none is the stored hash. The same dictionary under
    # the key finds it (the attack is sound, only the key is missing).
    assert all(plain_sha256(path, {"amount": n}) != stored for n in range(10_001))
    found = [
        n
        for n in range(1000)
        if hmac.new(
            FINGERPRINT_KEY.encode(),
            bound + plain_sha256_input(path, {"amount": n}),
            hashlib.sha256,
        ).hexdigest()
        == stored
    ]
    assert found == [100]

    replay = post(client, path, "k1", json={"amount": 100})
    assert replay.status_code == 201
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert_problem(post(client, path, "k1", json={"amount": 101}), 422)
    if path == "/plain":  # an optimistic route runs the view for a duplicate too
        assert [p for p, _ in redacting.seen] == [path]


def plain_sha256_input(path: str, body: t.Any) -> bytes:
    """The bytes the fingerprint covers (as :func:`fingerprint.compute` lays them out)."""
    head = json.dumps(["POST", path, [], "application/json"], separators=(",", ":"))
    return head.encode("ascii") + b"\x00" + canonical_json(body)


def test_the_route_hint_of_a_422_hashes_with_the_key(fresh_database: str) -> None:
    """A key reused on another route with the same body: the 422 still names the
    route it was used on (the hint re-hashes the request under the key)."""
    made = make_app(fresh_database)  # one scope for every route of the app
    client = made.app.test_client()
    assert post(client, "/plain", "k", json={"amount": 1}).status_code == 201
    problem = assert_problem(post(client, "/optimistic", "k", json={"amount": 1}), 422)
    assert "another route (POST /plain)" in problem["detail"]
    # A route with exclusions of its own: the request normalized again, keyed too.
    assert post(client, "/one-time", "k2", json={"amount": 1}).status_code == 201
    problem = assert_problem(post(client, "/plain", "k2", json={"amount": 1}), 422)
    assert "another route (POST /one-time)" in problem["detail"]


# -- redaction ---------------------------------------------------------------------


def test_redacted_fields_are_never_kept_and_the_recovery_rerun_goes_without_them(
    redacting: RedactApp, clock: Clock
) -> None:
    client = redacting.app.test_client()
    assert post(client, "/pay", "k1", crash=True, json=CARD).status_code == 500
    row = redacting.row("k1")
    kept = bytes(row["request_body"])
    assert MARKER.encode() not in kept
    assert json.loads(kept) == {"amount": 5, "card": {"exp": "12/30"}}
    # Still counted in the fingerprint: another card number is another request.
    other = {**CARD, "card": {**CARD["card"], "number": "5555"}}
    assert_problem(post(client, "/pay", "k1", json=other), 422)
    other_cvc = {**CARD, "cvc": "000"}
    assert_problem(post(client, "/pay", "k1", json=other_cvc), 422)

    clock.advance(seconds=31)
    report = recover_abandoned(redacting.app)
    assert report.completed == 1, report
    assert redacting.seen[-1] == ("/pay", {"amount": 5, "card": {"exp": "12/30"}})
    # The client's retry (the full request) replays what the re-run answered.
    replay = post(client, "/pay", "k1", json=CARD)
    assert replay.status_code == 201
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert len(redacting.seen) == 2


def test_a_schema_field_is_redacted_by_its_data_key(redacting: RedactApp, clock: Clock) -> None:
    client = redacting.app.test_client()
    body = {"amount": 7, "cardNumber": MARKER}
    assert post(client, "/schema-pay", "k1", crash=True, json=body).status_code == 500
    assert json.loads(bytes(redacting.row("k1")["request_body"])) == {"amount": 7}
    assert_problem(post(client, "/schema-pay", "k1", json={"amount": 7, "cardNumber": "x"}), 422)
    clock.advance(seconds=31)
    assert recover_abandoned(redacting.app).completed == 1
    assert redacting.seen[-1] == ("/schema-pay", {"amount": 7})


@pytest.mark.parametrize("multipart", [False, True], ids=["urlencoded", "multipart"])
def test_form_fields_and_files_are_redacted(
    redacting: RedactApp, clock: Clock, multipart: bool
) -> None:
    def form(card_number: str) -> dict[str, t.Any]:
        data: dict[str, t.Any] = {"amount": "5", "card_number": card_number}
        if multipart:
            data["scan"] = (io.BytesIO(MARKER.encode() * 3), "card.png")
            data["note"] = (io.BytesIO(b"kept"), "note.txt")
        return data

    client = redacting.app.test_client()
    assert post(client, "/form-pay", "k1", crash=True, data=form(MARKER)).status_code == 500
    kept = bytes(redacting.row("k1")["request_body"])
    assert MARKER.encode() not in kept
    assert b"amount" in kept
    assert_problem(post(client, "/form-pay", "k1", data=form("other")), 422)
    clock.advance(seconds=31)
    assert recover_abandoned(redacting.app).completed == 1
    expected = {"amount": ["5"], **({"note": ["note.txt"]} if multipart else {})}
    assert redacting.seen[-1] == ("/form-pay", expected)


@pytest.mark.parametrize("name", ["card.number", "card[number]", "card[0][number]", "cvc[]"])
@pytest.mark.parametrize("multipart", [False, True], ids=["urlencoded", "multipart"])
def test_a_dotted_path_redacts_the_form_field_spelled_with_dots_or_brackets(
    redacting: RedactApp, name: str, multipart: bool
) -> None:
    """A form has no nesting: ``redact=["card.number"]`` names the field
    ``card.number`` (or ``card[number]``, or through a list index), never kept
    silently; a path drops the fields under it (``cvc`` drops ``cvc[]``)."""
    data: dict[str, t.Any] = {"amount": "5", name: MARKER, "cvc": MARKER}
    if multipart:
        data["note"] = (io.BytesIO(b"kept"), "note.txt")
    client = redacting.app.test_client()
    assert post(client, "/pay", "k1", crash=True, data=data).status_code == 500
    kept = bytes(redacting.row("k1")["request_body"])
    assert MARKER.encode() not in kept
    assert b"amount" in kept


def test_a_json_body_is_kept_re_encoded_never_as_sent(redacting: RedactApp) -> None:
    """A duplicate key hides its first value from the parse: the raw bytes
    would keep it, so a redacting route keeps the parsed body re-encoded."""
    sent = '{"amount":5,"card":{"number":"' + MARKER + '"},"card":{"exp":"12/30"}}'
    client = redacting.app.test_client()
    response = post(client, "/pay", "k1", crash=True, data=sent, content_type="application/json")
    assert response.status_code == 500
    kept = bytes(redacting.row("k1")["request_body"])
    assert MARKER.encode() not in kept
    assert json.loads(kept) == {"amount": 5, "card": {"exp": "12/30"}}


def test_a_form_body_is_kept_re_encoded_never_as_sent(redacting: RedactApp) -> None:
    """A form body too is kept as its parse, re-encoded, even when the parse
    shows no redacted field (the raw bytes are never what is kept)."""
    sent = "amount=5&note=a%20b"
    client = redacting.app.test_client()
    response = post(
        client,
        "/pay",
        "k1",
        crash=True,
        data=sent,
        content_type="application/x-www-form-urlencoded",
    )
    assert response.status_code == 500
    assert bytes(redacting.row("k1")["request_body"]) == b"amount=5&note=a+b"


def test_a_field_both_excluded_and_redacted_is_neither_counted_nor_kept(
    redacting: RedactApp, clock: Clock
) -> None:
    client = redacting.app.test_client()
    assert (
        post(client, "/one-time", "k1", crash=True, json={"a": 1, "otp": MARKER}).status_code == 500
    )
    assert json.loads(bytes(redacting.row("k1")["request_body"])) == {"a": 1}
    clock.advance(seconds=31)
    assert recover_abandoned(redacting.app).completed == 1
    # Excluded: a retry with another one-time code is the same request.
    replay = post(client, "/one-time", "k1", json={"a": 1, "otp": "another"})
    assert replay.headers["Idempotent-Replayed"] == "true"


def test_a_body_that_cannot_be_redacted_is_refused_and_nothing_kept(redacting: RedactApp) -> None:
    client = redacting.app.test_client()
    text = post(client, "/pay", "k1", data=MARKER, content_type="text/plain")
    assert_problem(text, 415)
    assert redacting.rows() == []
    assert redacting.seen == []


# -- nothing printed --------------------------------------------------------------


def test_reprs_signals_and_log_lines_carry_no_body(
    redacting: RedactApp, caplog: pytest.LogCaptureFixture
) -> None:
    """A receiver that logs every signal's arguments, and the package's own log
    at DEBUG, through a claim, a crash, a mismatch, a conflict and a replay."""
    logged = logging.getLogger("tests.receiver")

    def receiver(sender: t.Any, **kwargs: t.Any) -> None:
        logged.info("signal %r", kwargs)

    names = ["key_claimed", "response_replayed", "request_conflict", "payload_mismatch"]
    names += ["record_completed"]
    for name in names:
        getattr(signals, name).connect(receiver)
    caplog.set_level(logging.DEBUG)
    try:
        client = redacting.app.test_client()
        assert post(client, "/pay", "k1", json=CARD).status_code == 201
        assert post(client, "/pay", "k1", json=CARD).status_code == 201
        assert_problem(post(client, "/pay", "k1", json={**CARD, "cvc": "1"}), 422)
        assert post(client, "/pay", "k2", crash=True, json=CARD).status_code == 500
        assert post(client, "/pay", "k2", json=CARD).status_code == 201  # resumed
    finally:
        for name in names:
            getattr(signals, name).disconnect(receiver)
    signalled = [r for r in caplog.records if r.name == "tests.receiver"]
    assert {"record" in r.getMessage() for r in signalled} == {True, False}
    assert MARKER not in caplog.text

    store = redacting.app.extensions["idempotency"].store
    with redacting.app.app_context(), redacting.db.engine.connect() as conn:
        loaded = store.load(conn, SCOPE, "k1")
    assert loaded is not None
    assert MARKER.encode() in (loaded.response_body or b"")  # the answer echoed it
    shown = repr(loaded)
    assert MARKER not in shown
    assert f"response_body=<{len(loaded.response_body or b'')} bytes>" in shown


def test_an_outbox_events_repr_has_no_payload() -> None:
    event = OutboxEvent(
        id=1,
        event_id="e1",
        topic="payments",
        payload={"card": MARKER},
        headers={"x-secret": MARKER},
        created_at=dt.datetime.now(dt.timezone.utc),
        attempts=0,
    )
    assert MARKER not in repr(event)
    assert "payments" in repr(event)


def test_a_records_repr_has_sizes_not_contents() -> None:
    now = dt.datetime.now(dt.timezone.utc)
    record = Record(
        scope="s",
        key="k",
        request_hash="h",
        status="completed",
        fencing_token=1,
        response_code=201,
        response_headers=[("X-Card", MARKER)],
        response_body=MARKER.encode(),
        body_omitted=False,
        locked_until=None,
        created_at=now,
        completed_at=now,
        expires_at=now,
        recovery_points={"charge": MARKER},
        request_method="POST",
        request_path=f"/pay/{MARKER}",
        request_body=MARKER.encode(),
    )
    shown = repr(record)
    assert MARKER not in shown
    assert f"response_body=<{len(MARKER)} bytes>" in shown
    assert "recovery_points=<1 steps>" in shown


# -- refusals -----------------------------------------------------------------------


def _bare_app(url: str, **config: t.Any) -> tuple[Flask, SQLAlchemy]:
    app = Flask("refusals")
    app.config.update(SQLALCHEMY_DATABASE_URI=url, **config)
    return app, SQLAlchemy(app)


@pytest.mark.parametrize(
    ("value", "error", "text"),
    [
        ("short" * 6, ValueError, "at least 32 characters"),
        (b"\x00" * 31, ValueError, "at least 32 characters"),
        (12345678901234567890123456789012, TypeError, "text or bytes"),
    ],
)
def test_a_bad_fingerprint_key_is_refused_naming_the_setting(
    tmp_path: t.Any, value: t.Any, error: type[Exception], text: str
) -> None:
    app, db = _bare_app(f"sqlite:///{tmp_path}/a.db", IDEMPOTENCY_FINGERPRINT_KEY=value)
    with pytest.raises(error, match="IDEMPOTENCY_FINGERPRINT_KEY") as refused:
        Idempotency(app, db)
    assert text in str(refused.value)
    if isinstance(value, str):
        assert value not in str(refused.value)  # a secret is never echoed


@pytest.mark.parametrize("value", ["x" * 32, b"\xff" * 32, bytearray(40)])
def test_a_fingerprint_key_of_32_is_taken(tmp_path: t.Any, value: t.Any) -> None:
    app, db = _bare_app(f"sqlite:///{tmp_path}/a.db", IDEMPOTENCY_FINGERPRINT_KEY=value)
    Idempotency(app, db)
    settings = app.extensions["idempotency"].settings
    assert settings.fingerprint_key == (value.encode() if isinstance(value, str) else value)
    assert "fingerprint_key" not in repr(settings)


def test_encryption_keys_without_a_fingerprint_key_are_refused() -> None:
    values = {**DEFAULTS, "ENCRYPTION_KEYS": "k1:" + "A" * 43 + "="}
    with pytest.raises(ValueError, match="IDEMPOTENCY_ENCRYPTION_KEYS is set but IDEMPOTENCY_F"):
        Settings.from_mapping(values)
    keyed = Settings.from_mapping({**values, "FINGERPRINT_KEY": FINGERPRINT_KEY})
    assert keyed.fingerprint_key == FINGERPRINT_KEY.encode()


@pytest.mark.skipif(
    "ENCRYPTION_KEYS" not in DEFAULTS, reason="IDEMPOTENCY_ENCRYPTION_KEYS is not declared yet"
)
def test_init_app_refuses_encryption_keys_without_a_fingerprint_key(tmp_path: t.Any) -> None:
    from flask_idempotency._storage.seal import new_key_text

    app, db = _bare_app(
        f"sqlite:///{tmp_path}/a.db", IDEMPOTENCY_ENCRYPTION_KEYS=[f"k1:{new_key_text()}"]
    )
    with pytest.raises(ValueError, match="IDEMPOTENCY_FINGERPRINT_KEY"):
        Idempotency(app, db)


def test_redact_without_a_fingerprint_key_is_refused_naming_the_route(tmp_path: t.Any) -> None:
    # Decorated before init_app: init_app refuses.
    idem = Idempotency()

    @idem.idempotent(redact=["card.number"])
    def charge() -> str:
        return "x"

    app, db = _bare_app(f"sqlite:///{tmp_path}/a.db")
    with pytest.raises(ValueError, match="charge: redact= needs IDEMPOTENCY_FINGERPRINT_KEY"):
        idem.init_app(app, db)
    # Decorated after init_app: the decoration refuses.
    other, other_db = _bare_app(f"sqlite:///{tmp_path}/b.db")
    later = Idempotency(other, other_db)
    with pytest.raises(ValueError, match="refund: redact= needs IDEMPOTENCY_FINGERPRINT_KEY"):

        @later.idempotent(redact=["cvc"])
        def refund() -> str:
            return "x"


@pytest.mark.parametrize(
    ("redact", "error", "text"),
    [
        ("card.number", TypeError, "redact must be a list of field names, not the string"),
        ([1], TypeError, "redact must be a list of field names"),
        ([r"card\number"], ValueError, "redact name 'card\\\\\\\\number' has an unknown escape"),
    ],
)
def test_redact_paths_are_checked_as_exclude_paths_are(
    redact: t.Any, error: type[Exception], text: str
) -> None:
    with pytest.raises(error, match=text):
        Idempotency().idempotent(redact=redact)
