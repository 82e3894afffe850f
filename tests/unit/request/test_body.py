"""A request is judged on all of its body: read whole or refused, never run truncated.

Three layers: ``read_body`` in a bare request context; the test app on
PostgreSQL and SQLite (counting ledger rows and records); and a live server in a
subprocess that receives real chunked uploads over a socket.
"""

from __future__ import annotations

import hashlib
import io
import json
import typing as t
import uuid

import pytest
from flask import Flask, request

from flask_idempotency._request.body import parse_json, read_body
from flask_idempotency.errors import (
    PROBLEM_JSON,
    LengthRequiredError,
    MalformedBodyError,
    PayloadTooLargeError,
)
from tests.conftest import ledger_count, record_rows, reset_tables, run_sql
from tests.support import testapp
from tests.support.live import LiveServer, Reply, chunked, raw_request

LIMIT = 1000
CHUNKED = {"Transfer-Encoding": "chunked"}
# What a WSGI server that decodes chunked bodies itself (werkzeug's, gunicorn,
# waitress) puts in the environ: the body arrives with no Content-Length.
TERMINATED = {"wsgi.input_terminated": True}


class BrokenInput(io.RawIOBase):
    """A server's input stream that fails mid-body, as on a bad chunk size."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.sent = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: t.Any) -> int:
        if not self.sent:
            self.sent = True
            buffer[:5] = b"12345"
            return 5
        raise self.error


# -- read_body in a request context -------------------------------------------------


@pytest.fixture
def plain_app() -> Flask:
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = LIMIT
    return app


def read_streamed(app: Flask, body: bytes, **environ: t.Any) -> bytes:
    with app.test_request_context(
        method="POST",
        data=body,
        headers=CHUNKED,
        environ_overrides={**TERMINATED, **environ},
    ):
        return read_body()


@pytest.mark.parametrize("size", [LIMIT + 1, LIMIT * 5])
def test_streamed_body_over_the_limit_is_413(plain_app: Flask, size: int) -> None:
    with pytest.raises(PayloadTooLargeError) as info:
        read_streamed(plain_app, b"x" * size)
    assert info.value.code == 413


@pytest.mark.parametrize("size", [0, 1, LIMIT - 1, LIMIT])
def test_streamed_body_within_the_limit_is_read_whole(plain_app: Flask, size: int) -> None:
    assert read_streamed(plain_app, b"x" * size) == b"x" * size


def test_streamed_body_without_a_limit_is_read_whole(plain_app: Flask) -> None:
    plain_app.config["MAX_CONTENT_LENGTH"] = None
    assert read_streamed(plain_app, b"y" * 100_000) == b"y" * 100_000


def test_declared_length_over_the_limit_is_413(plain_app: Flask) -> None:
    with (
        plain_app.test_request_context(method="POST", data=b"x" * (LIMIT + 1)),
        pytest.raises(PayloadTooLargeError),
    ):
        read_body()


def test_chunked_body_the_server_does_not_deliver_is_411(plain_app: Flask) -> None:
    # Without wsgi.input_terminated werkzeug reads a chunked body as empty.
    with (
        plain_app.test_request_context(method="POST", data=b"abc", headers=CHUNKED),
        pytest.raises(LengthRequiredError) as info,
    ):
        read_body()
    assert info.value.code == 411


@pytest.mark.parametrize("limit", [LIMIT, None])
@pytest.mark.parametrize(
    "error", [OSError("Invalid chunk header"), ValueError("bad"), RuntimeError("server bug")]
)
def test_input_that_fails_mid_body_is_400(
    plain_app: Flask, limit: int | None, error: Exception
) -> None:
    plain_app.config["MAX_CONTENT_LENGTH"] = limit
    with pytest.raises(MalformedBodyError) as info:
        read_streamed(plain_app, b"", **{"wsgi.input": BrokenInput(error)})
    assert info.value.code == 400


def multipart_body(boundary: str) -> tuple[bytes, str]:
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="amount"\r\n\r\n100\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="receipt"; filename="r.txt"\r\n'
        f"Content-Type: text/plain\r\n\r\nsame file\r\n--{boundary}--\r\n"
    ).encode()
    return body, f"multipart/form-data; boundary={boundary}"


def test_view_reads_a_streamed_body_every_way_after_the_extension(plain_app: Flask) -> None:
    body, content_type = multipart_body("b0undary")
    with plain_app.test_request_context(
        method="POST",
        data=body,
        content_type=content_type,
        headers=CHUNKED,
        environ_overrides=TERMINATED,
    ):
        assert read_body() == body
        assert read_body() == body  # the second call reads the cache, not the server
        assert request.get_data() == body
        assert request.form["amount"] == "100"
        assert request.files["receipt"].read() == b"same file"
    with plain_app.test_request_context(
        method="POST", json={"a": 1}, headers=CHUNKED, environ_overrides=TERMINATED
    ):
        assert read_body() == b'{"a": 1}'
        assert request.get_json() == {"a": 1}
        assert request.get_data() == b'{"a": 1}'


@pytest.mark.parametrize(
    "body",
    [b"[" * 10_000 + b"]" * 10_000, b'{"a": "\\ud800"}', b"NaN", b'{"a": 1'],
    ids=["deep", "lone-surrogate", "nan", "cut-short"],
)
def test_parse_json_refuses_what_is_not_strict_json(body: bytes) -> None:
    with pytest.raises(MalformedBodyError):
        parse_json(body)


# -- through the app, on PostgreSQL and SQLite --------------------------------------


def post(client: t.Any, path: str, key: str | None = "k1", **kw: t.Any) -> t.Any:
    headers = dict(kw.pop("headers", {}))
    if key is not None:
        headers["Idempotency-Key"] = key
    return client.post(path, headers=headers, **kw)


def post_streamed(client: t.Any, path: str, data: bytes, **kw: t.Any) -> t.Any:
    headers = {**CHUNKED, **kw.pop("headers", {})}
    environ = {**TERMINATED, **kw.pop("environ_overrides", {})}
    return post(client, path, data=data, headers=headers, environ_overrides=environ, **kw)


def assert_problem(response: t.Any, status: int) -> dict[str, t.Any]:
    assert response.status_code == status, response.get_data(as_text=True)
    assert response.mimetype == PROBLEM_JSON
    doc = response.get_json(force=True)
    assert doc["status"] == status
    return t.cast(dict[str, t.Any], doc)


def assert_nothing_stored(app: Flask) -> None:
    assert ledger_count(app) == 0
    assert record_rows(app) == []


@pytest.mark.parametrize(
    ("path", "content_type"),
    [
        ("/raw", "application/octet-stream"),
        ("/body/echo", "text/plain"),
        ("/charges", "application/json"),
    ],
)
def test_streamed_body_over_the_limit_is_413_and_nothing_runs(
    app: Flask, client: t.Any, path: str, content_type: str
) -> None:
    app.config["MAX_CONTENT_LENGTH"] = LIMIT
    body = json.dumps({"amount": 1, "currency": "EUR", "note": "x" * (2 * LIMIT)}).encode()
    assert_problem(post_streamed(client, path, body, content_type=content_type), 413)
    assert_nothing_stored(app)


@pytest.mark.parametrize("size", [1, LIMIT])
def test_streamed_body_within_the_limit_runs_whole_and_replays(
    app: Flask, client: t.Any, size: int
) -> None:
    app.config["MAX_CONTENT_LENGTH"] = LIMIT
    body = b"z" * size
    first = post_streamed(client, "/body/echo", body, content_type="text/plain")
    assert first.status_code == 201
    assert first.get_json()["length"] == size
    again = post_streamed(client, "/body/echo", body, content_type="text/plain")
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.get_data() == first.get_data()
    assert ledger_count(app) == 1


def test_chunked_body_the_server_does_not_deliver_is_411_and_nothing_runs(
    app: Flask, client: t.Any
) -> None:
    response = post(client, "/body/echo", data=b"abc", headers=CHUNKED)
    assert_problem(response, 411)
    assert_nothing_stored(app)


@pytest.mark.parametrize("limit", [LIMIT, None])
def test_input_that_fails_mid_body_is_400_and_nothing_runs(
    app: Flask, client: t.Any, limit: int | None
) -> None:
    app.config["MAX_CONTENT_LENGTH"] = limit
    broken = BrokenInput(OSError("Invalid chunk header"))
    response = post_streamed(client, "/raw", b"", environ_overrides={"wsgi.input": broken})
    assert_problem(response, 400)
    assert_nothing_stored(app)


def test_multipart_retry_with_a_new_boundary_replays(app: Flask, client: t.Any) -> None:
    def upload() -> t.Any:
        # The test client draws a new random boundary for every request.
        form = {"amount": "100", "tag": ["a", "b"], "receipt": (io.BytesIO(b"same"), "r.txt")}
        return post(client, "/body/echo", data=form)

    first = upload()
    assert first.status_code == 201
    seen = first.get_json()
    assert seen["form"] == {"amount": ["100"], "tag": ["a", "b"]}
    assert seen["files"] == {"receipt": [["r.txt", hashlib.sha256(b"same").hexdigest()]]}
    again = upload()
    assert again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.get_data() == first.get_data()
    assert ledger_count(app) == 1
    assert len(record_rows(app)) == 1


def test_multipart_with_other_content_is_422(app: Flask, client: t.Any) -> None:
    post(client, "/body/echo", data={"receipt": (io.BytesIO(b"one"), "r.txt")})
    again = post(client, "/body/echo", data={"receipt": (io.BytesIO(b"two"), "r.txt")})
    assert_problem(again, 422)
    assert ledger_count(app) == 1


def test_urlencoded_retry_in_another_order_replays(app: Flask, client: t.Any) -> None:
    form = "application/x-www-form-urlencoded"
    first = post(client, "/body/echo", data="a=x%20y&b=2", content_type=form)
    assert first.get_json()["form"] == {"a": ["x y"], "b": ["2"]}
    again = post(client, "/body/echo", data="b=2&a=x+y", content_type=form)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert ledger_count(app) == 1


def test_schema_defaults_invented_per_load_replay(app: Flask, client: t.Any) -> None:
    body = {"amount": 7, "lines": [{"sku": "a"}], "client_sent_at": "2026-12-01T10:00:00+01:00"}
    first = post(client, "/body/order", json=body)
    assert first.status_code == 201
    assert uuid.UUID(first.get_json()["order_ref"])  # the view got the default
    retry = {**body, "client_sent_at": "0001-01-01T00:00:00+14:00"}  # excluded
    again = post(client, "/body/order", json=retry)
    assert again.status_code == 201, again.get_data(as_text=True)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.get_data() == first.get_data()
    assert ledger_count(app) == 1


def test_schema_sent_value_still_counts(app: Flask, client: t.Any) -> None:
    ref = "12345678-1234-5678-1234-567812345678"
    post(client, "/body/order", json={"amount": 7, "orderRef": ref})
    other = post(client, "/body/order", json={"amount": 7, "orderRef": ref.replace("1", "9")})
    assert_problem(other, 422)
    assert ledger_count(app) == 1


def test_integral_float_retry_of_any_size_replays(app: Flask, client: t.Any) -> None:
    json_type = "application/json"
    first = post(client, "/raw", data='{"a": 1e16}', content_type=json_type)
    again = post(client, "/raw", data='{"a": 10000000000000000}', content_type=json_type)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.get_data() == first.get_data()
    assert ledger_count(app) == 1


MALFORMED = {
    "lone-surrogate": (
        "/charges",
        b'{"amount": 1, "currency": "EUR", "meta": {"note": "\\ud800"}}',
    ),
    "surrogate-excluded": (
        "/charges",
        b'{"amount": 1, "currency": "EUR", "client_sent_at": "\\udfff"}',
    ),
    "surrogate-key": ("/raw", b'{"\\ud800": 1}'),
    "deep-no-schema": ("/raw", b"[" * 10_000 + b"]" * 10_000),
    "deep-schema": ("/charges", b'{"amount": 1, "meta": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"),
    "datetime-out-of-range": (
        "/body/order",
        b'{"amount": 1, "received_at": "0001-01-01T00:00:00+14:00"}',
    ),
}


@pytest.mark.parametrize(("path", "body"), MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_body_is_400_and_nothing_stored(
    app: Flask, client: t.Any, path: str, body: bytes
) -> None:
    response = post(client, path, data=body, content_type="application/json")
    assert_problem(response, 400)
    assert_nothing_stored(app)


# -- a live server, real chunked uploads (PostgreSQL) -------------------------------

LIVE_LIMIT = 64 * 1024


def stored(url: str) -> tuple[int, int]:
    """(ledger rows, idempotency_keys rows) in the live server's database."""
    ledger = run_sql(url, "SELECT count(*) FROM ledger")[0][0]
    records = run_sql(url, "SELECT count(*) FROM idempotency_keys")[0][0]
    return int(ledger), int(records)


def start_live(pg_url: str, limit: int | None) -> LiveServer:
    testapp.create_app(pg_url)  # registers the record table on the metadata
    reset_tables(pg_url)
    return LiveServer("tests", pg_url, {"MAX_CONTENT_LENGTH": limit}).start()


@pytest.fixture(scope="module")
def live_limited(pg_url: str) -> t.Iterator[LiveServer]:
    server = start_live(pg_url, LIVE_LIMIT)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def live_unlimited(pg_url: str) -> t.Iterator[LiveServer]:
    server = start_live(pg_url, None)
    yield server
    server.stop()


def clean(pg_url: str) -> None:
    run_sql(pg_url, "DELETE FROM ledger")
    run_sql(pg_url, "DELETE FROM idempotency_keys")


@pytest.fixture
def limited(live_limited: LiveServer, pg_url: str) -> LiveServer:
    """A live server with MAX_CONTENT_LENGTH = 64 KiB, and empty tables."""
    clean(pg_url)
    return live_limited


@pytest.fixture(params=["limit", "no-limit"])
def server(request: pytest.FixtureRequest, pg_url: str) -> LiveServer:
    """Each live server in turn (with and without MAX_CONTENT_LENGTH), and empty tables."""
    live = request.getfixturevalue("live_limited" if request.param == "limit" else "live_unlimited")
    clean(pg_url)
    return t.cast(LiveServer, live)


def send_chunked(server: LiveServer, path: str, framed: bytes, key: str, **headers: str) -> Reply:
    sent = [
        ("Transfer-Encoding", "chunked"),
        ("Idempotency-Key", key),
        ("Content-Type", headers.pop("content_type", "application/octet-stream")),
        *headers.items(),
    ]
    return raw_request(server.port, path, sent, framed)


def assert_live_problem(reply: Reply, status: int) -> None:
    assert reply.status == status, reply.body[:300]
    assert reply.headers["content-type"] == PROBLEM_JSON
    assert reply.json()["status"] == status


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/raw", "/body/echo"])
def test_live_chunked_body_over_the_limit_is_413_and_nothing_stored(
    limited: LiveServer, pg_url: str, path: str
) -> None:
    framed = chunked(*[b"x" * 8192] * 12)  # 96 KiB over a 64 KiB limit
    assert_live_problem(send_chunked(limited, path, framed, "big"), 413)
    assert stored(pg_url) == (0, 0)


@pytest.mark.slow
@pytest.mark.parametrize("size", [1, 40_000, LIVE_LIMIT])
def test_live_chunked_body_within_the_limit_runs_whole_and_replays(
    server: LiveServer, pg_url: str, size: int
) -> None:
    body = bytes(range(256)) * (size // 256) + b"!" * (size % 256)
    first = send_chunked(server, "/body/echo", chunked(body[:1000], body[1000:]), "ok")
    assert first.status == 201, first.body
    assert first.json()["length"] == size
    assert first.json()["sha256"] == hashlib.sha256(body).hexdigest()
    # The retry is cut into other chunks: the body, not its framing, counts.
    pieces = [body[i : i + 777] for i in range(0, size, 777)]
    again = send_chunked(server, "/body/echo", chunked(*pieces), "ok")
    assert again.status == 201
    assert again.replayed
    assert again.body == first.body
    assert stored(pg_url) == (1, 1)


@pytest.mark.slow
@pytest.mark.parametrize(
    "framed",
    [b"zz\r\nabc\r\n0\r\n\r\n", b"3\r\nabc\r\n-5\r\nabcde\r\n0\r\n\r\n", b"4\r\nabc"],
    ids=["not-hex", "negative", "cut-short"],
)
def test_live_broken_chunked_body_is_400_and_nothing_stored(
    server: LiveServer, pg_url: str, framed: bytes
) -> None:
    reply = send_chunked(server, "/raw", framed, "broken")
    assert_live_problem(reply, 400)
    assert stored(pg_url) == (0, 0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "body", [b"[" * 10_000 + b"]" * 10_000, b'{"a": "\\ud800"}'], ids=["deep", "lone-surrogate"]
)
def test_live_malformed_json_is_400_problem_json(
    server: LiveServer, pg_url: str, body: bytes
) -> None:
    reply = raw_request(
        server.port,
        "/raw",
        [
            ("Content-Type", "application/json"),
            ("Idempotency-Key", "m"),
            ("Content-Length", str(len(body))),
        ],
        body,
    )
    assert_live_problem(reply, 400)
    assert stored(pg_url) == (0, 0)
