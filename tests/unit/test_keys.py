"""Tests of the Idempotency-Key header: parsing, reading it off a request, key
formats and lengths, scope.

Pure (a plain Flask app for request contexts) except the last section, which
drives the test app on PostgreSQL and SQLite and counts what was stored.
"""

from __future__ import annotations

import hashlib
import json
import re
import typing as t

import pytest
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from werkzeug.wrappers import Response

from flask_idempotency import Idempotency
from flask_idempotency.errors import PROBLEM_JSON, PROBLEM_TYPE_BASE, InvalidKeyError
from flask_idempotency.keys import (
    MAX_KEY_LENGTH,
    key_from_request,
    parse_key,
    resolve_key_format,
    resolve_key_max_length,
)
from flask_idempotency.scope import default_scope
from tests.conftest import ledger_count, record_rows
from tests.support.scopes import basic_scope

HEADER = "Idempotency-Key"


@pytest.fixture
def plain_app() -> Flask:
    app = Flask(__name__)

    @app.post("/orders", endpoint="create_order")
    def create_order() -> str:  # pragma: no cover - never dispatched
        return "ok"

    return app


# -- parse_key: accepted forms --------------------------------------------------


@pytest.mark.parametrize("raw", ["abc", '"abc"'])
def test_bare_and_quoted_forms_name_the_same_key(raw: str) -> None:
    assert parse_key(raw) == "abc"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (r'"a\"b"', 'a"b'),
        (r'"a\\b"', "a\\b"),
        (r'"\\\""', '\\"'),
        (r'"\"\""', '""'),
    ],
)
def test_quoted_escapes_decode(raw: str, expected: str) -> None:
    assert parse_key(raw) == expected


@pytest.mark.parametrize("raw", ["  abc", "abc  ", "  abc  ", "\tabc\t", ' "abc" '])
def test_surrounding_whitespace_is_ignored(raw: str) -> None:
    assert parse_key(raw) == "abc"


def test_spaces_inside_quotes_are_kept() -> None:
    assert parse_key('" a b "') == " a b "


def test_comma_allowed_only_in_quoted_form() -> None:
    assert parse_key('"a,b"') == "a,b"
    with pytest.raises(InvalidKeyError, match="comma"):
        parse_key("a,b")


def test_max_length_key_is_accepted() -> None:
    key = "k" * MAX_KEY_LENGTH
    assert MAX_KEY_LENGTH == 255
    assert parse_key(key) == key
    assert parse_key(f'"{key}"') == key


def test_full_printable_ascii_range_is_accepted() -> None:
    key = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in ',"')
    assert parse_key(key) == key


# -- parse_key: rejected forms --------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ('"abc', "no closing quote"),
        ('"', "no closing quote"),
        ('"abc\\"', "no closing quote"),
        ('"abc"def', "text follows the closing quote"),
        ('"abc""', "text follows the closing quote"),
        ('"a"b"', "text follows the closing quote"),
        (r'"a\nb"', "may be escaped"),
        (r'"a\tb"', "may be escaped"),
        ('"abc\\', "may be escaped"),
    ],
)
def test_malformed_quoted_string_is_rejected(raw: str, reason: str) -> None:
    with pytest.raises(InvalidKeyError, match=reason):
        parse_key(raw)


@pytest.mark.parametrize("raw", ["", "   ", "\t", '""', ' "" '])
def test_empty_key_is_rejected(raw: str) -> None:
    with pytest.raises(InvalidKeyError, match="must not be empty"):
        parse_key(raw)


@pytest.mark.parametrize("quoted", [False, True])
def test_overlong_key_is_rejected(quoted: bool) -> None:
    key = "k" * (MAX_KEY_LENGTH + 1)
    raw = f'"{key}"' if quoted else key
    with pytest.raises(InvalidKeyError, match="at most 255 characters, got 256"):
        parse_key(raw)


def test_length_counts_decoded_characters() -> None:
    # 255 escaped quotes: 510 characters on the wire, 255 in the key.
    raw = '"' + '\\"' * MAX_KEY_LENGTH + '"'
    assert parse_key(raw) == '"' * MAX_KEY_LENGTH


@pytest.mark.parametrize(
    "raw",
    [
        "a\x01b",
        "\x01",
        "a\tb",
        "a\nb",
        "a\x7fb",
        "caf\u00e9",
        '"caf\u00e9"',
        '"a\x01b"',
        "key\u2603",
    ],
)
def test_non_printable_key_is_rejected(raw: str) -> None:
    with pytest.raises(InvalidKeyError, match="printable ASCII"):
        parse_key(raw)


def test_a_shorter_max_length_is_enforced_on_the_unquoted_key() -> None:
    assert parse_key('"abcd"', max_length=4) == "abcd"
    with pytest.raises(InvalidKeyError, match="at most 4 characters, got 5"):
        parse_key("abcde", max_length=4)


# -- key formats and lengths: the settings ----------------------------------------

UUID_LOWER = "8e03978e-40d5-43e8-bc93-6894a57f9324"


def test_key_format_settings_resolve() -> None:
    assert resolve_key_format(None, "X") is None
    uuid = resolve_key_format("uuid", "X")
    assert uuid is not None
    assert uuid.kind == "uuid"
    text = resolve_key_format(r"order-\d+", "X")
    assert text is not None
    assert (text.kind, text.pattern.pattern) == ("regex", r"order-\d+")
    compiled = re.compile("ab+", re.IGNORECASE)
    resolved = resolve_key_format(compiled, "X")
    assert resolved is not None
    assert resolved.pattern is compiled  # flags kept


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ("order-[0-9", ValueError, "IDEMPOTENCY_KEY_FORMAT is not a valid regular expression"),
        ("", ValueError, "must not be empty"),
        (re.compile(b"abc"), TypeError, "not a bytes pattern"),
        (42, TypeError, 'must be None, a format name ("uuid", "uuid4", "uuid7"), a regular'),
        # A name this extension does not know is refused, not taken for a pattern
        # that refuses every key.
        ("uuidv4", ValueError, "'uuidv4' is not a key format this extension knows"),
        ("ulid", ValueError, "pass re.compile('ulid')"),
    ],
)
def test_bad_key_format_settings_are_refused(value: t.Any, error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        resolve_key_format(value, "IDEMPOTENCY_KEY_FORMAT")


def test_key_max_length_settings() -> None:
    assert resolve_key_max_length(1, "X") == 1
    assert resolve_key_max_length(255, "X") == 255
    with pytest.raises(ValueError, match="at most 255, the size of the idempotency key column"):
        resolve_key_max_length(256, "IDEMPOTENCY_KEY_MAX_LENGTH")
    for bad in (0, -1, True, "10", 10.0, None):
        with pytest.raises(ValueError, match="must be a positive integer"):
            resolve_key_max_length(bad, "IDEMPOTENCY_KEY_MAX_LENGTH")


def _init(**config: t.Any) -> None:
    app = Flask(__name__)
    app.config.update(SQLALCHEMY_DATABASE_URI="sqlite://", **config)
    db = SQLAlchemy()
    db.init_app(app)
    Idempotency().init_app(app, db)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"IDEMPOTENCY_KEY_MAX_LENGTH": 256}, "IDEMPOTENCY_KEY_MAX_LENGTH must be at most 255"),
        ({"IDEMPOTENCY_KEY_MAX_LENGTH": 0}, "IDEMPOTENCY_KEY_MAX_LENGTH must be a positive"),
        ({"IDEMPOTENCY_KEY_FORMAT": "(unclosed"}, "IDEMPOTENCY_KEY_FORMAT is not a valid"),
    ],
)
def test_init_app_refuses_bad_key_settings(config: dict[str, t.Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        _init(**config)


def test_init_app_refuses_bad_key_settings_passed_to_the_constructor() -> None:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = "sqlite://"
    db = SQLAlchemy()
    db.init_app(app)
    with pytest.raises(ValueError, match="IDEMPOTENCY_KEY_MAX_LENGTH must be at most 255"):
        Idempotency(key_max_length=1000).init_app(app, db)


def test_route_key_options_are_checked_when_decorating() -> None:
    idem = Idempotency()
    with pytest.raises(ValueError, match="key_format is not a valid regular expression"):
        idem.idempotent(key_format="[")
    with pytest.raises(ValueError, match="key_max_length must be at most 255"):
        idem.idempotent(key_max_length=300)
    with pytest.raises(TypeError, match="key_format must be None"):
        idem.idempotent(key_format=7)  # type: ignore[arg-type]


# -- key formats: reading the header ------------------------------------------------


@pytest.mark.parametrize(
    "key", [UUID_LOWER, UUID_LOWER.upper(), "8E03978e-40D5-43e8-bc93-6894A57f9324"]
)
def test_uuid_format_accepts_canonical_uuids_of_either_case(plain_app: Flask, key: str) -> None:
    uuid = resolve_key_format("uuid", "X")
    with plain_app.test_request_context("/orders", method="POST", headers=[(HEADER, f'"{key}"')]):
        assert key_from_request(HEADER, key_format=uuid) == key  # as sent: no case folding


@pytest.mark.parametrize(
    "key",
    [
        "8e03978e40d543e8bc936894a57f9324",  # no hyphens
        "{8e03978e-40d5-43e8-bc93-6894a57f9324}",
        "urn:uuid:8e03978e-40d5-43e8-bc93-6894a57f9324",
        "8e03978e-40d5-43e8-bc93-6894a57f932",  # one digit short
        "8e03978e-40d5-43e8-bc93-6894a57f9324a",
        "8e03978g-40d5-43e8-bc93-6894a57f9324",
        "order-42",
    ],
)
def test_uuid_format_refuses_anything_else(plain_app: Flask, key: str) -> None:
    uuid = resolve_key_format("uuid", "X")
    with (
        plain_app.test_request_context("/orders", method="POST", headers=[(HEADER, key)]),
        pytest.raises(InvalidKeyError, match="must be a UUID") as info,
    ):
        key_from_request(HEADER, key_format=uuid)
    assert info.value.problem()["expected_format"] == "uuid"


@pytest.mark.parametrize(
    ("key", "ok"), [("order-42", True), ("order-42x", False), ("my-order-42", False)]
)
def test_regex_format_must_match_the_whole_key(plain_app: Flask, key: str, ok: bool) -> None:
    fmt = resolve_key_format(r"order-[0-9]+", "X")
    with plain_app.test_request_context("/orders", method="POST", headers=[(HEADER, key)]):
        if ok:
            assert key_from_request(HEADER, key_format=fmt) == key
            return
        with pytest.raises(
            InvalidKeyError, match=re.escape("'order-[0-9]+' (the whole key)")
        ) as info:
            key_from_request(HEADER, key_format=fmt)
    assert info.value.problem()["expected_format"] == "regex"
    assert info.value.problem()["pattern"] == "order-[0-9]+"


def test_length_is_checked_before_the_format(plain_app: Flask) -> None:
    fmt = resolve_key_format(r"a+", "X")
    with (
        plain_app.test_request_context("/orders", method="POST", headers=[(HEADER, "a" * 11)]),
        pytest.raises(InvalidKeyError, match="at most 10 characters, got 11"),
    ):
        key_from_request(HEADER, max_length=10, key_format=fmt)


# -- key_from_request -----------------------------------------------------------


def test_absent_header_gives_none(plain_app: Flask) -> None:
    with plain_app.test_request_context("/orders", method="POST"):
        assert key_from_request(HEADER) is None


@pytest.mark.parametrize("value", ["abc", '"abc"', " abc "])
def test_header_is_parsed(plain_app: Flask, value: str) -> None:
    with plain_app.test_request_context("/orders", method="POST", headers=[(HEADER, value)]):
        assert key_from_request(HEADER) == "abc"


def test_header_name_is_configurable(plain_app: Flask) -> None:
    with plain_app.test_request_context(
        "/orders", method="POST", headers=[("X-Request-Key", "abc")]
    ):
        assert key_from_request("X-Request-Key") == "abc"
        assert key_from_request(HEADER) is None


def test_header_name_is_case_insensitive(plain_app: Flask) -> None:
    with plain_app.test_request_context("/orders", method="POST", headers=[(HEADER, "abc")]):
        assert key_from_request(HEADER.lower()) == "abc"


@pytest.mark.parametrize(
    ("first", "second"),
    [("a", "b"), ("a", "a"), ('"a"', '"b"'), ('"a"', '"a"')],
)
def test_two_headers_are_rejected(plain_app: Flask, first: str, second: str) -> None:
    with (
        plain_app.test_request_context(
            "/orders", method="POST", headers=[(HEADER, first), (HEADER, second)]
        ),
        pytest.raises(InvalidKeyError),
    ):
        key_from_request(HEADER)


def test_invalid_header_value_is_rejected(plain_app: Flask) -> None:
    with (
        plain_app.test_request_context("/orders", method="POST", headers=[(HEADER, '"abc')]),
        pytest.raises(InvalidKeyError, match="no closing quote"),
    ):
        key_from_request(HEADER)


# -- default_scope --------------------------------------------------------------


def test_scope_is_endpoint_without_authorization(plain_app: Flask) -> None:
    with plain_app.test_request_context("/orders", method="POST"):
        assert default_scope() == "create_order"


def test_scope_falls_back_to_path_without_endpoint(plain_app: Flask) -> None:
    with plain_app.test_request_context("/unrouted", method="POST"):
        assert default_scope() == "/unrouted"


def test_empty_authorization_is_like_none(plain_app: Flask) -> None:
    with plain_app.test_request_context("/orders", method="POST", headers=[("Authorization", "")]):
        assert default_scope() == "create_order"


def _scope(app: Flask, authorization: str) -> str:
    with app.test_request_context(
        "/orders", method="POST", headers=[("Authorization", authorization)]
    ):
        return default_scope()


def test_authorization_separates_scopes(plain_app: Flask) -> None:
    alice = _scope(plain_app, "Bearer alice-secret-token")
    bob = _scope(plain_app, "Bearer bob-secret-token")
    assert alice != bob
    for scope in (alice, bob):
        assert scope.startswith("create_order|")
        assert scope != "create_order"


def test_scope_does_not_contain_the_credential(plain_app: Flask) -> None:
    scope = _scope(plain_app, "Bearer alice-secret-token")
    assert "alice-secret-token" not in scope
    assert "Bearer" not in scope


def test_same_authorization_gives_same_scope(plain_app: Flask) -> None:
    first = _scope(plain_app, "Bearer alice-secret-token")
    second = _scope(plain_app, "Bearer alice-secret-token")
    assert first == second


def test_basic_scope_is_the_user_name_and_a_keyed_digest_of_the_credential(
    plain_app: Flask,
) -> None:
    plain_app.secret_key = "k-1"
    with plain_app.test_request_context("/orders", method="POST", auth=("alice", "pw-1")):
        scope = default_scope()
    assert scope == basic_scope(plain_app, "alice", "pw-1", "create_order")
    assert scope.startswith("create_order|basic:alice:")
    assert "pw-1" not in scope
    # Another password, or another SECRET_KEY, is another scope.
    with plain_app.test_request_context("/orders", method="POST", auth=("alice", "pw-2")):
        assert default_scope() != scope
    plain_app.secret_key = b"k-2"
    with plain_app.test_request_context("/orders", method="POST", auth=("alice", "pw-1")):
        assert default_scope() == basic_scope(plain_app, "alice", "pw-1", "create_order")
        assert default_scope() != scope


def test_bearer_scope_is_the_token_digest(plain_app: Flask) -> None:
    digest = hashlib.sha256(b"alice-secret-token").hexdigest()
    assert _scope(plain_app, "Bearer alice-secret-token") == f"create_order|bearer:{digest}"


def test_malformed_basic_credentials_are_a_digest_of_the_header(plain_app: Flask) -> None:
    digest = hashlib.sha256(b"Basic !!not-base64!!").hexdigest()
    assert _scope(plain_app, "Basic !!not-base64!!") == f"create_order|auth:{digest}"


def test_an_overlong_endpoint_still_fits_the_scope_column(plain_app: Flask) -> None:
    endpoint = "e" * 600
    plain_app.add_url_rule("/long", endpoint=endpoint, view_func=lambda: "", methods=["POST"])
    with plain_app.test_request_context("/long", method="POST", auth=("alice", "pw")):
        scope = default_scope()
    expected = hashlib.sha256(basic_scope(plain_app, "alice", "pw", endpoint).encode()).hexdigest()
    assert scope == f"sha256:{expected}"


# -- InvalidKeyError as a response ----------------------------------------------


def test_invalid_key_error_is_problem_json() -> None:
    with pytest.raises(InvalidKeyError) as info:
        parse_key("")
    error = info.value
    assert error.code == 400

    response = error.get_response()

    assert isinstance(response, Response)
    assert response.status_code == 400
    assert response.mimetype == PROBLEM_JSON == "application/problem+json"
    body = json.loads(response.get_data(as_text=True))
    assert body == {
        "type": PROBLEM_TYPE_BASE + "invalid-key",
        "title": "Invalid idempotency key",
        "status": 400,
        "detail": "The Idempotency-Key must not be empty.",
    }
    assert body == error.problem()


# -- key options through the test app (PostgreSQL and SQLite) ----------------------


def _post(client: t.Any, path: str, key: str) -> t.Any:
    return client.post(path, json={"amount": 1}, headers={HEADER: key})


def _invalid_key(response: t.Any) -> dict[str, t.Any]:
    assert response.status_code == 400, response.get_data(as_text=True)
    assert response.mimetype == PROBLEM_JSON
    doc = t.cast(dict[str, t.Any], response.get_json(force=True))
    assert doc["type"] == PROBLEM_TYPE_BASE + "invalid-key"
    return doc


def test_route_uuid_format_refuses_other_keys_and_stores_nothing(app: Flask, client: t.Any) -> None:
    refused = _invalid_key(_post(client, "/scope/uuid-key", "order-42"))
    assert refused["expected_format"] == "uuid"
    assert "must be a UUID" in refused["detail"]
    assert ledger_count(app) == 0
    assert record_rows(app) == []

    assert _post(client, "/scope/uuid-key", UUID_LOWER).status_code == 201
    assert (
        _post(client, "/scope/uuid-key", f'"{UUID_LOWER}"').headers["Idempotent-Replayed"] == "true"
    )
    assert ledger_count(app) == 1
    assert [r["key"] for r in record_rows(app)] == [UUID_LOWER]


def test_route_regex_format_and_max_length(app: Flask, client: t.Any) -> None:
    too_long = _invalid_key(_post(client, "/scope/order-key", "order-1234567"))  # 13 > 12
    assert "at most 12 characters, got 13" in too_long["detail"]
    mismatch = _invalid_key(_post(client, "/scope/order-key", "order-42x"))
    assert mismatch["pattern"] == "order-[0-9]+"
    assert ledger_count(app) == 0
    assert record_rows(app) == []

    assert _post(client, "/scope/order-key", "order-42").status_code == 201
    assert ledger_count(app, "scope/order-key") == 1
    # Other routes keep the app's defaults: any printable key up to 255.
    assert _post(client, "/raw", "k" * 255).status_code == 200
    assert ledger_count(app, "raw") == 1


def test_app_key_format_applies_to_every_route_unless_overridden(
    make_app: t.Callable[..., Flask],
) -> None:
    app = make_app(IDEMPOTENCY_KEY_FORMAT="uuid")
    client = app.test_client()
    refused = _invalid_key(_post(client, "/raw", "order-42"))
    assert refused["expected_format"] == "uuid"
    assert ledger_count(app) == 0
    assert record_rows(app) == []

    assert _post(client, "/raw", UUID_LOWER).status_code == 200
    assert _post(client, "/scope/order-key", "order-7").status_code == 201  # the route's format
    assert ledger_count(app) == 2
    assert len(record_rows(app)) == 2


def test_app_key_max_length(make_app: t.Callable[..., Flask]) -> None:
    app = make_app(IDEMPOTENCY_KEY_MAX_LENGTH=8)
    client = app.test_client()
    refused = _invalid_key(_post(client, "/raw", "k" * 9))
    assert "at most 8 characters, got 9" in refused["detail"]
    assert ledger_count(app) == 0
    assert record_rows(app) == []

    assert _post(client, "/raw", "k" * 8).status_code == 200
    assert ledger_count(app) == 1


# -- format names ---------------------------------------------------------------------

UUID4 = "8e03978e-40d5-43e8-bc93-6894a57f9324"
UUID7 = "01936f5e-6b7a-7cc3-9d2e-5f0a8b1c2d3e"
UUID1 = "c232ab00-9414-11ec-b3c8-9f6bdeced846"


@pytest.mark.parametrize(
    ("name", "accepted", "refused"),
    [
        ("uuid4", [UUID4, UUID4.upper()], [UUID7, UUID1, "order-42"]),
        ("UUID4", [UUID4], [UUID7]),
        ("uuid7", [UUID7], [UUID4, UUID1]),
        ("uuid", [UUID4, UUID7, UUID1], ["order-42"]),
    ],
)
def test_format_names_users_write(
    make_app: t.Callable[..., Flask], name: str, accepted: list[str], refused: list[str]
) -> None:
    """``IDEMPOTENCY_KEY_FORMAT = "uuid4"``, the name other libraries use, is a
    version 4 UUID: it once became a regular expression refusing every UUID."""
    app = make_app(IDEMPOTENCY_KEY_FORMAT=name)
    client = app.test_client()
    for key in accepted:
        assert _post(client, "/raw", key).status_code == 200, key
    for key in refused:
        doc = _invalid_key(_post(client, "/raw", key))
        assert doc["expected_format"] == name.lower()
    assert ledger_count(app) == len(accepted)


@pytest.mark.parametrize("name", ["uuidv4", "UUIDv7", "ulid", "hex", "uuid-4"])
def test_an_unknown_format_name_is_refused_at_start_up(name: str) -> None:
    app = Flask("fmt")
    app.config.update(SQLALCHEMY_DATABASE_URI="sqlite://", IDEMPOTENCY_KEY_FORMAT=name)
    with pytest.raises(ValueError, match="is not a key format this extension knows"):
        Idempotency(app, SQLAlchemy(app))
    with pytest.raises(ValueError, match=re.escape(f"re.compile({name!r})")):
        Idempotency().idempotent(key_format=name)
    # An explicit pattern of the same characters is taken as one.
    fmt = resolve_key_format(re.compile(name), "X")
    assert fmt is not None
    assert fmt.kind == "regex"
