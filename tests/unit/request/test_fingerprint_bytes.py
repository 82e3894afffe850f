"""What the records in a table depend on: a fingerprint, a request digest and
canonical JSON are the same bytes release after release, however they are
written. A retry of a request a record holds must still match it after an
upgrade; these values were computed by the code that wrote them before the
request path was made faster (issue 29), and pin it.

Also: the key header read from the WSGI environ is what werkzeug's
``headers.getlist`` gives, and the body is read from the server once.
"""

from __future__ import annotations

import io
import typing as t

import pytest
from flask import Flask, request

from flask_idempotency._request.body import read_body
from flask_idempotency._request.fingerprint import bound_to, canonical_json, compute
from flask_idempotency._request.rules import request_digest
from flask_idempotency._request.wsgi import header_values

KEY = b"k" * 32
BOUND = bound_to("s", "k")

COMPUTED = [
    (
        ("post", "/orders", [("b", "2"), ("a", "1"), ("a", "0")], b'{"a":1}', "application/json"),
        "468921fbfd7ddbc0553aad9f066c4aacacdaa7dfc2c2fd7dc1fea1191a3db66c",
        "59a1c6a3fddf1020fa1972527210798bbe826c0fc059443f85ad52435720a87d",
    ),
    (
        ("PUT", '/caf\u00e9/"q"\\', [("n\u00e4me", "v\u2028\U0001f600")], b"", None),
        "a7d41e4539c7e027a5e872c0b7559469315dcbf667d675e5ebc0ae692f6f378e",
        "a95c5a5ecb3e9ad3d48832a70086d0747561ceaa94206ce8417a1d104397df1d",
    ),
    (
        ("PATCH", "/x", [], b"\x00\xff", "text/plain"),
        "faf8f2fbbcd1416424f6e835e82deaf61c8401e092f053aa2a11f5212e03224b",
        "a3eecd681f9a2c7443a984449c32d26f973def3268e601d12b21e3d7a237d41f",
    ),
]


@pytest.mark.parametrize(("parts", "plain", "keyed"), COMPUTED)
def test_a_fingerprint_is_the_bytes_earlier_releases_stored(
    parts: tuple[str, str, list[tuple[str, str]], bytes, str | None], plain: str, keyed: str
) -> None:
    assert compute(*parts) == plain
    assert compute(*parts, key=KEY, bound=BOUND) == keyed


DIGESTS = [
    (
        "/orders",
        "b=2&a=1",
        "application/json; charset=utf-8",
        "e9053465cc6e98df0fedc42b542fa045fb90894ad9464f90c6b92a5755f71dd8",
        "25f4d45d4db1a513e19b6c265d8ac414e1de883be1dae8c1e8b4751521d3ae9f",
    ),
    (
        "/caf%C3%A9/%22",
        "x=%E2%80%A8&y",
        None,
        "ccffe92386413fa4480b0cea864a5bb40a1c5f85acf589edd54996f1ad1bbc32",
        "eb0d829b5e79f7e66142d76ef63a29a8958bcaea188c3aa11fdead19617477cc",
    ),
]


@pytest.mark.parametrize(("path", "query", "content_type", "plain", "keyed"), DIGESTS)
def test_a_request_digest_is_the_bytes_earlier_releases_stored(
    path: str, query: str, content_type: str | None, plain: str, keyed: str
) -> None:
    app = Flask(__name__)
    options: dict[str, t.Any] = {"query_string": query, "data": b'{"a": 1}', "method": "POST"}
    if content_type is not None:
        options["content_type"] = content_type
    with app.test_request_context(path, **options):
        assert request_digest(None, b"") == plain
        assert request_digest(KEY, BOUND) == keyed


def test_canonical_json_is_the_bytes_earlier_releases_stored() -> None:
    value = {"b": [1.0, 1e16, "\u00e9\u2028"], "a": None}
    assert canonical_json(value) == b'{"a":null,"b":[1,10000000000000000,"\xc3\xa9\xe2\x80\xa8"]}'


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {"HTTP_IDEMPOTENCY_KEY": "abc"},
        {"HTTP_IDEMPOTENCY_KEY": ""},
        {"HTTP_IDEMPOTENCY_KEY": "a, b", "HTTP_X_OTHER": "1"},
        {"HTTP_X_REQUEST_KEY": "x"},
        {"CONTENT_TYPE": "", "HTTP_CONTENT_TYPE": "text/plain"},
        {"CONTENT_TYPE": "application/json"},
        {"CONTENT_LENGTH": "3", "HTTP_CONTENT_LENGTH": "4"},
        {"HTTP_K": "kelvin", "HTTP_STRASSE": "s"},
    ],
)
@pytest.mark.parametrize(
    "name",
    [
        "Idempotency-Key",
        "idempotency-key",
        "X-Request-Key",
        "Content-Type",
        # werkzeug lists headers by dashed names: a name with "_" names none,
        # also a name WSGI keeps unprefixed (a key must not be read from them).
        "Idempotency_Key",
        "X_Request_Key",
        "CONTENT_LENGTH",
        "Content_Type",
        "Content-Length",
        # Beyond ASCII, upper() and lower() disagree: the Kelvin sign lowers to "k".
        "\u212a",
        "Stra\xdfe",
    ],
)
def test_the_key_header_is_read_as_werkzeug_lists_it(environ: dict[str, str], name: str) -> None:
    app = Flask(__name__)
    with app.test_request_context("/", environ_overrides=environ):
        # The test client sets a CONTENT_TYPE/LENGTH of its own: compare on the same environ.
        assert header_values(request.environ, name) == request.headers.getlist(name)


def test_the_body_is_read_from_the_server_once() -> None:
    app = Flask(__name__)
    with app.test_request_context("/", method="POST", data=b"first"):
        assert read_body() == b"first"
        # A second read takes the bytes already checked, never the server's stream.
        request.environ["wsgi.input"] = io.BytesIO(b"other")
        assert read_body() == b"first"
        assert request.get_data() == b"first"
