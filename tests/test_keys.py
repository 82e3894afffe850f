"""Unit tests of the Idempotency-Key header: parsing, reading it off a request, scope.

Pure: a plain Flask app for request contexts, no database.
"""

from __future__ import annotations

import json

import pytest
from flask import Flask
from werkzeug.wrappers import Response

from flask_idempotency.errors import PROBLEM_JSON, PROBLEM_TYPE_BASE, InvalidKeyError
from flask_idempotency.keys import MAX_KEY_LENGTH, default_scope, key_from_request, parse_key

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
