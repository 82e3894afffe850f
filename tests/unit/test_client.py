"""flask_idempotency.client: real HTTP against a scripted server on 127.0.0.1.

The server records every attempt (method, path, Idempotency-Key as received,
time) and answers from a script: a status with headers, ``"drop"`` (close the
connection without an answer) or ``("sleep", seconds)`` (answer 200 late, for
read timeouts), ``"cut"`` (201 headers and part of the body, then close) or
``("stall", seconds)`` (the same, going quiet before closing); once the script
is used up it answers 200. ``delay`` seconds pass before every answer.
"""

from __future__ import annotations

import array
import dataclasses
import http.server
import io
import json
import socket
import threading
import time
import typing as t
import uuid
from pathlib import Path

import pytest
import requests
from flask import Flask

from flask_idempotency.client import IdempotentSession
from flask_idempotency.keys import derive_key as public_derive_key
from flask_idempotency.keys import parse_key, quote_key, scoped_parent_key
from tests.conftest import reset_tables
from tests.support import testapp

Action = int | tuple[int, dict[str, str]] | str | tuple[str, float]


@dataclasses.dataclass
class Attempt:
    method: str
    path: str
    key: str | None
    at: float
    body: bytes = b""


class Downstream:
    def __init__(self, script: list[Action] | None = None, port: int = 0) -> None:
        self.script: list[Action] = list(script or [])
        #: When set, the answer to the first attempt at each path (before the script).
        self.first_at_path: Action | None = None
        #: Seconds to wait before answering each attempt (a slow server).
        self.delay = 0.0
        self.attempts: list[Attempt] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: t.Any) -> None:
                pass

            def do_GET(self) -> None:
                self._handle()

            def do_POST(self) -> None:
                self._handle()

            do_PATCH = do_PUT = do_DELETE = do_OPTIONS = do_CHARGE = do_POST

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with outer.lock:
                    first = all(a.path != self.path for a in outer.attempts)
                    outer.attempts.append(
                        Attempt(
                            self.command,
                            self.path,
                            # A header sent twice is its values joined, as
                            # a proxy would pass them on.
                            ", ".join(self.headers.get_all("Idempotency-Key") or []) or None,
                            time.monotonic(),
                            body,
                        )
                    )
                    action: Action
                    if first and outer.first_at_path is not None:
                        action = outer.first_at_path
                    elif outer.script:
                        action = outer.script.pop(0)
                    else:
                        action = 200
                time.sleep(outer.delay)
                if action == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if action == "cut" or (isinstance(action, tuple) and action[0] == "stall"):
                    # The headers (201: the server acted), then part of the body,
                    # then the connection closes ("cut") or goes quiet ("stall").
                    self.send_response(201)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", "100")
                    self.end_headers()
                    self.wfile.write(b'{"partial": ')
                    self.wfile.flush()
                    if action != "cut":
                        time.sleep(t.cast(float, action[1]))
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                headers: dict[str, str] = {}
                if isinstance(action, tuple) and action[0] == "sleep":
                    time.sleep(t.cast(float, action[1]))
                    status = 200
                elif isinstance(action, tuple):
                    status, headers = t.cast(tuple[int, dict[str, str]], action)
                else:
                    status = t.cast(int, action)
                body = json.dumps({"attempt": len(outer.attempts)}).encode()
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def keys(self) -> list[str | None]:
        return [a.key for a in self.attempts]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def downstream() -> t.Iterator[Downstream]:
    server = Downstream()
    yield server
    server.close()


def fast(**options: t.Any) -> IdempotentSession:
    """A session whose backoff is short, so tests do not wait on it."""
    defaults: dict[str, t.Any] = {"backoff_factor": 0.01, "backoff_jitter": 0.0}
    return IdempotentSession(**{**defaults, **options})


def one_key(server: Downstream, attempts: int) -> str:
    """Assert ``attempts`` attempts, all with one key; return that key (unquoted)."""
    keys = server.keys()
    assert len(keys) == attempts, keys
    assert len(set(keys)) == 1, keys
    assert keys[0] is not None
    return parse_key(keys[0])


def test_same_key_on_every_attempt_until_success(downstream: Downstream) -> None:
    downstream.script = [503, 502, 504, 429, 200]
    response = fast().post(downstream.url + "/charges", json={"amount": 1})
    assert response.status_code == 200
    key = one_key(downstream, 5)
    assert str(uuid.UUID(key)) == key
    assert downstream.keys()[0] == quote_key(key)  # sent as an RFC 8941 string


@pytest.mark.parametrize(
    "make_body",
    [
        lambda: (chunk for chunk in [b'{"amount": ', "4200}"]),
        lambda: _Unseekable(b'{"amount": 4200}'),
    ],
    ids=["generator", "unseekable stream"],
)
def test_every_attempt_sends_the_same_body(
    downstream: Downstream, make_body: t.Callable[[], t.Any]
) -> None:
    """A body urllib3 cannot rewind is read once, before the first attempt: the
    retry carries the same key and the same bytes, not an empty body."""
    downstream.script = [503, 200]
    answer = fast().post(downstream.url, data=make_body(), idempotency_key="body-1")
    assert answer.status_code == 200
    assert [a.body for a in downstream.attempts] == [b'{"amount": 4200}'] * 2
    assert downstream.keys() == ['"body-1"'] * 2


_PAYLOAD = b'{"amount": 1250}'


@pytest.mark.parametrize(
    "make_body",
    [bytearray, memoryview, lambda data: array.array("B", data)],
    ids=["bytearray", "memoryview", "array"],
)
@pytest.mark.parametrize("way", ["post", "send"])
def test_a_bytes_like_body_is_sent_as_given_on_every_attempt(
    downstream: Downstream, make_body: t.Callable[[bytes], t.Any], way: str
) -> None:
    """requests sends a bytes-like body (the buffer protocol) as its bytes.
    Before, the session took it for an iterable of chunks and made each byte
    ``b`` into ``b`` zero bytes: 1266 bytes of zeros for these 16. It is sent
    as is, not copied (a large body is not held twice), on every attempt."""
    downstream.script = [503, 201]
    body = make_body(_PAYLOAD)
    http = fast()
    if way == "post":
        answer = http.post(downstream.url + "/charges", data=body)
    else:
        answer = http.send(prepared("POST", downstream.url + "/charges", data=body))
    assert answer.status_code == 201
    assert [a.body for a in downstream.attempts] == [_PAYLOAD] * 2
    one_key(downstream, 2)
    assert answer.request.body is body  # the caller's buffer, not a copy of it


def test_a_generator_of_bytes_like_chunks_is_sent_as_their_bytes(
    downstream: Downstream,
) -> None:
    downstream.script = [503, 201]
    chunks = (c for c in [bytearray(b'{"amount": '), memoryview(b"12"), array.array("B", b"50}")])
    assert fast().post(downstream.url, data=chunks).status_code == 201
    assert [a.body for a in downstream.attempts] == [_PAYLOAD] * 2


class _Unseekable(io.RawIOBase):
    def __init__(self, data: bytes) -> None:
        self._data = data

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data, self._data = (self._data, b"") if size < 0 else (self._data[:size], self._data[size:])
        return data


def test_each_call_gets_its_own_key(downstream: Downstream) -> None:
    http = fast()
    http.post(downstream.url + "/a", json={})
    http.post(downstream.url + "/b", json={})
    first, second = downstream.keys()
    assert first != second


def test_stops_after_total_retries_and_returns_the_last_response(
    downstream: Downstream,
) -> None:
    downstream.script = [503] * 10
    response = fast(total=2).post(downstream.url + "/charges", json={})
    assert response.status_code == 503
    one_key(downstream, 3)


def test_stops_at_its_deadline(downstream: Downstream) -> None:
    downstream.script = [503] * 1000
    http = IdempotentSession(
        total=1000, backoff_factor=0.1, backoff_max=0.2, backoff_jitter=0.05, deadline=1.0
    )
    started = time.monotonic()
    response = http.post(downstream.url + "/charges", json={})
    elapsed = time.monotonic() - started
    assert response.status_code == 503
    assert 2 <= len(downstream.attempts) < 100
    assert elapsed < 3.0
    # No attempt started after the budget.
    assert downstream.attempts[-1].at - started <= 1.0 + 0.2
    one_key(downstream, len(downstream.attempts))


def test_a_retry_after_beyond_the_deadline_is_not_waited_for(downstream: Downstream) -> None:
    downstream.script = [(503, {"Retry-After": "30"})]
    started = time.monotonic()
    response = fast(deadline=2.0).post(downstream.url + "/charges", json={})
    assert response.status_code == 503
    assert time.monotonic() - started < 2.0
    assert len(downstream.attempts) == 1


def test_honours_retry_after(downstream: Downstream) -> None:
    downstream.script = [(503, {"Retry-After": "1"}), 200]
    response = fast().post(downstream.url + "/charges", json={})
    assert response.status_code == 200
    one_key(downstream, 2)
    first, second = downstream.attempts
    assert second.at - first.at >= 0.9


def test_409_with_retry_after_is_retried(downstream: Downstream) -> None:
    downstream.script = [(409, {"Retry-After": "0"}), 201]
    response = fast().post(downstream.url + "/charges", json={})
    assert response.status_code == 201
    one_key(downstream, 2)


@pytest.mark.parametrize(
    "action",
    [409, 400, 404, 422, (422, {"Retry-After": "0"}), (413, {"Retry-After": "0"}), 500],
)
def test_no_retry_for_other_client_errors(downstream: Downstream, action: Action) -> None:
    downstream.script = [action]
    response = fast().post(downstream.url + "/charges", json={})
    expected = action[0] if isinstance(action, tuple) else action
    assert response.status_code == expected
    assert len(downstream.attempts) == 1


def test_retries_a_dropped_connection(downstream: Downstream) -> None:
    downstream.script = ["drop", "drop", 201]
    response = fast().post(downstream.url + "/charges", json={})
    assert response.status_code == 201
    one_key(downstream, 3)


def test_retries_a_read_timeout(downstream: Downstream) -> None:
    downstream.script = [("sleep", 1.5), 201]
    response = fast().post(downstream.url + "/charges", json={}, timeout=0.5)
    assert response.status_code == 201
    one_key(downstream, 2)


def test_a_body_cut_off_after_the_headers_is_sent_again(downstream: Downstream) -> None:
    """urllib3 retries only failures before the headers; a response cut off in
    its body (the server acted) is sent again too, with the same key."""
    downstream.script = ["cut", "cut"]
    response = fast().post(downstream.url + "/charges", json={"amount": 1})
    assert response.status_code == 200
    assert response.json() == {"attempt": 3}
    one_key(downstream, 3)
    assert {a.body for a in downstream.attempts} == {b'{"amount": 1}'}


def test_a_read_timeout_inside_the_body_is_sent_again(downstream: Downstream) -> None:
    downstream.script = [("stall", 1.5)]
    response = fast().post(downstream.url + "/charges", json={}, timeout=0.5)
    assert response.status_code == 200
    one_key(downstream, 2)


def test_a_body_cut_off_every_time_ends_at_total(downstream: Downstream) -> None:
    downstream.script = ["cut"] * 10
    with pytest.raises(requests.exceptions.ChunkedEncodingError):
        fast(total=2).post(downstream.url + "/charges", json={})
    one_key(downstream, 3)


def test_a_body_cut_off_is_not_resent_past_the_deadline(downstream: Downstream) -> None:
    downstream.script = ["cut"] * 10
    with pytest.raises(requests.exceptions.ChunkedEncodingError):
        fast(total=10, backoff_factor=1.0, deadline=0.5).post(downstream.url + "/charges", json={})
    one_key(downstream, 1)


def test_a_streamed_response_is_the_caller_to_read(downstream: Downstream) -> None:
    """With ``stream=True`` the caller reads the body, after the call returned:
    nothing can be sent again then, and the error is the caller's."""
    downstream.script = ["cut"]
    response = fast().post(downstream.url + "/charges", json={}, stream=True)
    with pytest.raises(requests.exceptions.ChunkedEncodingError):
        response.content  # noqa: B018
    one_key(downstream, 1)


@pytest.mark.parametrize(
    "value",
    ["soon", "1.5", "-3", "9" * 5000, "Fri, 31 Dec 99999 23:59:59 GMT"],
    ids=["word", "fraction", "negative", "5000 digits", "year 99999"],
)
def test_an_unreadable_retry_after_falls_back_to_the_backoff(
    downstream: Downstream, value: str
) -> None:
    """Also values urllib3 reads with ``int()`` or a date conversion that fail
    with ``ValueError`` (more digits than Python converts, a year out of
    range): before, ``post()`` raised it instead of backing off."""
    downstream.script = [(503, {"Retry-After": value}), (429, {"Retry-After": value}), 201]
    response = fast().post(downstream.url + "/charges", json={})
    assert response.status_code == 201
    one_key(downstream, 3)


def test_the_first_retry_waits_for_the_backoff_too(downstream: Downstream) -> None:
    """urllib3 retries the first failure at once; the session backs off from
    the first retry: backoff_factor, then twice that, and so on."""
    downstream.script = [503, 503, 201]
    http = IdempotentSession(backoff_factor=0.4, backoff_jitter=0.0)
    assert http.post(downstream.url + "/charges", json={}).status_code == 201
    first, second, third = (a.at for a in downstream.attempts)
    assert second - first >= 0.4
    assert third - second >= 0.8


def test_retries_a_refused_connection_until_the_server_is_up() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started: list[Downstream] = []

    def start_later() -> None:
        time.sleep(0.5)
        started.append(Downstream(port=port))

    starter = threading.Thread(target=start_later)
    starter.start()
    try:
        http = IdempotentSession(total=10, backoff_factor=0.1, backoff_max=0.4, deadline=10)
        response = http.post(f"http://127.0.0.1:{port}/charges", json={})
        assert response.status_code == 200
    finally:
        starter.join()
        for server in started:
            server.close()
    assert len(started[0].attempts) == 1


def test_gives_up_on_a_refused_connection_with_a_connection_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(requests.ConnectionError):
        fast(total=2).post(f"http://127.0.0.1:{port}/charges", json={})


def test_caller_key_is_used_as_is(downstream: Downstream) -> None:
    downstream.script = [503, 200]
    fast().post(downstream.url + "/charges", json={}, idempotency_key="order-42, part 1")
    assert parse_key(one_key_raw(downstream, 2)) == "order-42, part 1"


def test_an_explicit_header_is_sent_verbatim(downstream: Downstream) -> None:
    downstream.script = [503, 200]
    fast().post(downstream.url + "/charges", json={}, headers={"idempotency-key": "abc"})
    assert one_key_raw(downstream, 2) == "abc"


@pytest.mark.parametrize(
    "name",
    [b"Idempotency-Key", b"idempotency-key", "IDEMPOTENCY-KEY"],
    ids=["bytes name", "bytes lower name", "str upper name"],
)
@pytest.mark.parametrize("value", [b'"order-42"', '"order-42"'], ids=["bytes value", "str value"])
@pytest.mark.parametrize(
    "where", ["headers=", "session.headers", "prepared", "prepared, set after"]
)
def test_the_callers_key_is_kept_whatever_the_header_name_is_given_as(
    downstream: Downstream, name: str | bytes, value: str | bytes, where: str
) -> None:
    """requests takes header names and values as str or bytes. Before, a name
    given as bytes was not seen: the session added a new UUID key under the
    str name, which replaced the caller's, so the caller's own retry of the
    operation (a second call with its key) was a second charge."""
    downstream.script = [503, 201]
    http = fast()
    url = downstream.url + "/charges"
    for _ in range(2):  # the caller's retry of the operation: the same key again
        if where == "headers=":
            answer = http.post(url, json={}, headers={name: value})
        elif where == "session.headers":
            t.cast(t.Any, http.headers)[name] = value  # requests takes bytes names
            answer = http.post(url, json={})
        else:
            if where == "prepared":
                request = prepared("POST", url, json={}, headers={name: value})
            else:
                request = prepared("POST", url, json={})
                t.cast(t.Any, request.headers)[name] = value
            answer = http.send(request)
        assert answer.status_code in (200, 201)
    assert downstream.keys() == ['"order-42"'] * 3


def test_a_key_in_the_session_headers_left_out_by_none_gets_a_new_one(
    downstream: Downstream,
) -> None:
    """``None`` leaves the session's header out (requests' rule), and a POST
    without a key gets one of its own, kept across its retry."""
    downstream.script = [503, 201]
    http = fast()
    t.cast(t.Any, http.headers)[b"Idempotency-Key"] = b"session-wide"
    assert http.post(downstream.url, json={}, headers={"idempotency-key": None}).status_code == 201
    key = one_key(downstream, 2)
    assert str(uuid.UUID(key)) == key


def test_a_key_in_two_places_is_refused(downstream: Downstream) -> None:
    with pytest.raises(TypeError):
        fast().post(downstream.url, json={}, headers={"Idempotency-Key": "a"}, idempotency_key="b")
    assert downstream.attempts == []


def test_get_gets_no_key_but_is_retried(downstream: Downstream) -> None:
    downstream.script = [503, 200]
    assert fast().get(downstream.url + "/charges/1").status_code == 200
    assert downstream.keys() == [None, None]


def test_a_step_outside_an_idempotent_view_is_refused(downstream: Downstream) -> None:
    with pytest.raises(RuntimeError):
        fast().post(downstream.url, json={}, step="charge")
    assert downstream.attempts == []


# -- every way into the session: one key for every resend of a POST or PATCH --------------


def prepared(method: str, url: str, **kwargs: t.Any) -> requests.PreparedRequest:
    return requests.Request(method, url, **kwargs).prepare()


@pytest.mark.parametrize("method", ["POST", "PATCH"])
def test_send_of_a_prepared_request_without_a_key_gives_it_one_for_every_attempt(
    downstream: Downstream, method: str
) -> None:
    """requests' prepared-request pattern: before, the first attempt was made
    (the server acted), the connection dropped, and the retry went again
    without a key: the server ran it twice."""
    downstream.script = ["drop", 201]
    request = prepared(method, downstream.url + "/charges", json={"amount": 1})
    response = fast().send(request)
    assert response.status_code == 201
    key = one_key(downstream, 2)
    assert str(uuid.UUID(key)) == key
    # Written into the prepared request: sending it again is the same operation.
    assert request.headers["Idempotency-Key"] == quote_key(key)
    assert {a.body for a in downstream.attempts} == {b'{"amount": 1}'}


def test_send_of_a_prepared_request_keeps_the_key_it_has(downstream: Downstream) -> None:
    downstream.script = [503, 201]
    request = prepared("POST", downstream.url, json={}, headers={"idempotency-key": '"mine"'})
    assert fast().send(request).status_code == 201
    assert downstream.keys() == ['"mine"', '"mine"']


def test_send_of_a_prepared_request_with_a_generator_body_sends_it_whole_every_time(
    downstream: Downstream,
) -> None:
    """Before, the retry sent the exhausted generator: an empty body."""
    downstream.script = [503, 201]
    request = prepared("POST", downstream.url, data=(c for c in [b'{"amount": ', b"7}"]))
    assert request.headers.get("Transfer-Encoding") == "chunked"
    assert fast().send(request).status_code == 201
    one_key(downstream, 2)
    assert [a.body for a in downstream.attempts] == [b'{"amount": 7}'] * 2


def test_a_header_given_as_none_counts_as_no_key(downstream: Downstream) -> None:
    """``None`` is requests' way to leave a header out. Before, the session took
    it for a key the caller had, sent none, and retried the keyless POST."""
    downstream.script = ["drop", 201]
    response = fast().post(downstream.url, json={}, headers={"Idempotency-Key": None})
    assert response.status_code == 201
    one_key(downstream, 2)


def test_an_adapter_of_your_own_that_retries_posts_gets_the_key_too(
    downstream: Downstream,
) -> None:
    """A mounted adapter retries with its own policy; every attempt it makes
    still carries the key the session chose before the first."""
    from requests.adapters import HTTPAdapter
    from urllib3.util.retry import Retry

    http = fast()
    http.mount(downstream.url, HTTPAdapter(max_retries=Retry(total=3, allowed_methods=None)))
    downstream.script = ["drop", "drop", 201]
    request = prepared("POST", downstream.url + "/charges", json={})
    assert http.send(request).status_code == 201
    one_key(downstream, 3)


def test_a_keyless_post_sent_to_the_adapter_directly_is_not_resent(
    downstream: Downstream,
) -> None:
    """Code that bypasses the session (``get_adapter(url).send``) gets no key
    from it; such a POST is then never sent twice (only a failure to connect,
    when nothing was sent, is retried)."""
    http = fast()
    downstream.script = ["drop", 201]
    request = prepared("POST", downstream.url + "/charges", json={})
    with pytest.raises(requests.ConnectionError):
        http.get_adapter(downstream.url).send(request)
    assert downstream.keys() == [None]
    downstream.script = [503, 201]
    answer = http.get_adapter(downstream.url).send(prepared("PATCH", downstream.url, json={}))
    assert answer.status_code == 503
    assert downstream.keys() == [None, None]


@pytest.mark.parametrize(
    ("method", "keyed", "retried"),
    [
        ("POST", True, True),
        ("PATCH", True, True),
        ("PUT", False, True),
        ("DELETE", False, True),
        ("OPTIONS", False, True),
        ("GET", False, True),  # with a body, below: still no key, and the same body
        ("CHARGE", False, False),  # a method urllib3 is not told is safe to resend
    ],
)
@pytest.mark.parametrize("way", ["request", "send"])
def test_every_method_by_every_way_in(
    downstream: Downstream, method: str, keyed: bool, retried: bool, way: str
) -> None:
    downstream.script = [503, 201]
    http = fast()
    url = downstream.url + "/things"
    if way == "request":
        response = http.request(method, url, json={"n": 1})
    else:
        response = http.send(http.prepare_request(requests.Request(method, url, json={"n": 1})))
    attempts = 2 if retried else 1
    assert response.status_code == (201 if retried else 503)
    assert [a.method for a in downstream.attempts] == [method] * attempts
    assert {a.body for a in downstream.attempts} == {b'{"n": 1}'}
    if keyed:
        one_key(downstream, attempts)
    else:
        assert downstream.keys() == [None] * attempts


def test_a_307_redirect_resends_the_post_with_its_key(downstream: Downstream) -> None:
    downstream.script = [(307, {"Location": "/moved"}), "drop", 201]
    response = fast().post(downstream.url + "/charges", json={"amount": 3})
    assert response.status_code == 201
    one_key(downstream, 3)
    assert [(a.method, a.path) for a in downstream.attempts] == [
        ("POST", "/charges"),
        ("POST", "/moved"),
        ("POST", "/moved"),
    ]
    assert {a.body for a in downstream.attempts} == {b'{"amount": 3}'}


def test_the_hops_of_a_redirect_share_one_retry_budget(downstream: Downstream) -> None:
    """``total`` bounds the call, not each hop: before, every hop of a redirect
    started a full budget again, and a hop cost nothing (total=2 allowed four
    attempts here). The 503, the hop and the 503 after it are two retries."""
    downstream.script = [503, (307, {"Location": "/moved"}), 503, 503, 503]
    response = fast(total=2).post(downstream.url + "/charges", json={})
    assert response.status_code == 503
    one_key(downstream, 3)


def test_a_redirect_loop_ends_at_total(downstream: Downstream) -> None:
    """Before, a 307 loop sent the POST 31 times (requests' max_redirects),
    whatever ``total``."""
    downstream.script = [(307, {"Location": "/loop"})] * 100
    with pytest.raises(requests.TooManyRedirects) as raised:
        fast(total=2).post(downstream.url + "/charges", json={"amount": 1})
    one_key(downstream, 3)
    assert {a.body for a in downstream.attempts} == {b'{"amount": 1}'}
    # requests' error for a redirect cut off, and its error for retries run out.
    from flask_idempotency.client import RedirectBudgetExceeded

    assert isinstance(raised.value, RedirectBudgetExceeded)
    assert isinstance(raised.value, requests.exceptions.RetryError)
    assert raised.value.response is not None
    assert raised.value.response.status_code == 307


def test_no_redirect_hop_starts_after_the_deadline(downstream: Downstream) -> None:
    """A slow server redirecting to itself: before, the hops went on for 31
    POSTs (9 s here) past a deadline of 1 s."""
    downstream.delay = 0.3
    downstream.script = [(307, {"Location": "/loop"})] * 100
    started = time.monotonic()
    with pytest.raises(requests.exceptions.RequestException) as raised:
        fast(total=100, deadline=1.0).post(downstream.url + "/charges", json={})
    assert time.monotonic() - started < 2.0
    assert "deadline" in str(raised.value)
    assert 2 <= len(downstream.attempts) <= 5
    assert downstream.attempts[-1].at - started <= 1.0 + 0.1
    one_key(downstream, len(downstream.attempts))


@pytest.mark.parametrize("status", [303, 302, 301])
def test_the_get_after_a_post_redirected_to_its_result_is_no_retry(
    downstream: Downstream, status: int
) -> None:
    """Post/redirect/get with no retry left (review 4, item 6): the server acted
    on the POST and answered 303 (or 301/302, which requests also turns into a
    GET for a POST); before, ``total=0`` raised ``RedirectBudgetExceeded`` (a
    RetryError, "retries ran out") for an operation that succeeded, and the
    GET of the result was never made. That GET is no resend of the POST."""
    downstream.script = [(status, {"Location": "/orders/1"}), 200]
    response = fast(total=0).post(downstream.url + "/orders", json={"amount": 3})
    assert response.status_code == 200
    assert response.json() == {"attempt": 2}  # the GET's answer
    assert [h.status_code for h in response.history] == [status]
    assert [(a.method, a.path) for a in downstream.attempts] == [
        ("POST", "/orders"),
        ("GET", "/orders/1"),
    ]
    assert downstream.attempts[1].body == b""


def test_the_get_after_a_303_at_the_last_retry_and_past_the_deadline(
    downstream: Downstream,
) -> None:
    """The POST's last allowed attempt succeeds with a 303 after the deadline:
    the result is still fetched (the deadline bounds resends, not the GET)."""
    downstream.delay = 0.3
    downstream.script = [503, (303, {"Location": "/orders/1"}), 200]
    response = fast(total=1, deadline=0.5).post(downstream.url + "/orders", json={})
    assert response.status_code == 200
    assert [(a.method, a.path) for a in downstream.attempts] == [
        ("POST", "/orders"),
        ("POST", "/orders"),
        ("GET", "/orders/1"),
    ]


@pytest.mark.parametrize(
    ("method", "status"), [("POST", 307), ("POST", 308), ("PUT", 301), ("DELETE", 301)]
)
def test_a_hop_that_sends_the_method_again_is_a_retry(
    downstream: Downstream, method: str, status: int
) -> None:
    """A 307 or 308 resends the POST and its body; requests keeps any method
    but POST on a 301 (a PUT, a DELETE): each such hop is one retry of
    ``total``, so ``total=0`` follows none."""
    from flask_idempotency.client import RedirectBudgetExceeded

    downstream.script = [(status, {"Location": "/moved"})] * 3
    with pytest.raises(RedirectBudgetExceeded) as raised:
        fast(total=0).request(method, downstream.url + "/things", json={"n": 1})
    assert [(a.method, a.path) for a in downstream.attempts] == [(method, "/things")]
    assert raised.value.response is not None
    assert raised.value.response.status_code == status


def test_a_307_loop_after_a_303_still_ends(downstream: Downstream) -> None:
    """A POST's 303 then a GET redirected to itself: the GETs are no resend of
    the POST, so ``total`` does not stop them, but requests' ``max_redirects``
    does (``TooManyRedirects``, not a RetryError), and the POST went once."""
    http = fast(total=2)
    http.max_redirects = 10
    downstream.script = [(303, {"Location": "/loop"})] + [(307, {"Location": "/loop"})] * 100
    with pytest.raises(requests.TooManyRedirects) as raised:
        http.post(downstream.url + "/orders", json={})
    assert not isinstance(raised.value, requests.exceptions.RetryError)
    assert [a.method for a in downstream.attempts] == ["POST"] + ["GET"] * 10


def test_a_303_loop_ends_at_max_redirects(downstream: Downstream) -> None:
    """A 303 loop of a POST: one POST, then requests' default ``max_redirects``
    (30) GETs, then ``TooManyRedirects``."""
    downstream.script = [(303, {"Location": "/loop"})] * 100
    with pytest.raises(requests.TooManyRedirects) as raised:
        fast(total=0).post(downstream.url + "/orders", json={})
    assert not isinstance(raised.value, requests.exceptions.RetryError)
    assert [a.method for a in downstream.attempts] == ["POST"] + ["GET"] * 30


def test_a_cut_off_body_is_resent_within_the_same_total(downstream: Downstream) -> None:
    """A resend after a cut-off body is one more retry of the call: before, it
    started urllib3's count again, and total=1 allowed four attempts."""
    downstream.script = [503, "cut", 503, "cut"]
    with pytest.raises(requests.exceptions.ChunkedEncodingError):
        fast(total=1).post(downstream.url + "/charges", json={})
    one_key(downstream, 2)


def test_a_cut_off_body_of_a_prepared_post_is_resent_with_its_key(
    downstream: Downstream,
) -> None:
    downstream.script = ["cut", 201]
    request = prepared("POST", downstream.url + "/charges", json={})
    assert fast().send(request).status_code == 201
    one_key(downstream, 2)


def test_a_cut_off_file_body_is_resent_from_its_start(
    downstream: Downstream, tmp_path: Path
) -> None:
    path = tmp_path / "body.json"
    path.write_bytes(b'{"amount": 5}')
    downstream.script = ["cut", 201]
    with path.open("rb") as body:
        assert fast().post(downstream.url, data=body).status_code == 201
    one_key(downstream, 2)
    assert [a.body for a in downstream.attempts] == [b'{"amount": 5}'] * 2


def test_threads_sharing_a_session_keep_their_own_keys_and_budgets(
    downstream: Downstream,
) -> None:
    """Eight threads on one session, by post() and by send(): every call has one
    key, kept across its retry, and its own budget (total=1 each)."""
    http = fast(total=1)
    downstream.first_at_path = 503  # the first attempt of every call fails
    errors: list[BaseException] = []

    def calls(n: int) -> None:
        try:
            for j in range(2):
                if n % 2:
                    answer = http.post(downstream.url + f"/t{n}-{j}", json={"n": n})
                else:
                    request = prepared("POST", downstream.url + f"/t{n}-{j}", json={"n": n})
                    answer = http.send(request)
                assert answer.status_code == 200
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=calls, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    by_path: dict[str, set[str | None]] = {}
    for attempt in downstream.attempts:
        by_path.setdefault(attempt.path, set()).add(attempt.key)
    assert len(by_path) == 16
    assert all(len(keys) == 1 and None not in keys for keys in by_path.values())
    assert len({k for keys in by_path.values() for k in keys}) == 16
    assert len(downstream.attempts) == 32


@pytest.mark.parametrize("where", ["urllib3's backoff", "the backoff after a cut-off body"])
def test_an_interrupt_in_a_backoff_ends_the_call_and_the_next_starts_afresh(
    downstream: Downstream, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Ctrl-C while the session waits to retry: the call ends with it, and the
    next call on the session has a new key and a whole budget."""
    from flask_idempotency.client import IdempotentRetry

    http = fast(total=1)
    original = IdempotentRetry.sleep
    interrupted = []

    def sleep_then_interrupt(self: IdempotentRetry, response: t.Any = None) -> None:
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        original(self, response)

    monkeypatch.setattr(IdempotentRetry, "sleep", sleep_then_interrupt)
    downstream.script = [503 if where.startswith("urllib3") else "cut"]
    with pytest.raises(KeyboardInterrupt):
        http.post(downstream.url + "/first", json={})
    downstream.script = [503, 201]
    answer = http.send(prepared("POST", downstream.url + "/second", json={}))
    assert answer.status_code == 201
    first, *second = downstream.attempts
    assert len(second) == 2
    assert second[0].key == second[1].key != first.key


def one_key_raw(server: Downstream, attempts: int) -> str:
    one_key(server, attempts)
    key = server.keys()[0]
    assert key is not None
    return key


# -- inside an idempotent view ----------------------------------------------------------


@pytest.fixture
def app(tmp_path: Path) -> t.Iterator[Flask]:
    url = f"sqlite:///{tmp_path / 'client.sqlite3'}"
    app = testapp.create_app(url)
    reset_tables(url)
    yield app
    with app.app_context():
        testapp.db.engine.dispose()


def test_a_step_in_an_idempotent_view_sends_the_derived_key(
    app: Flask, downstream: Downstream
) -> None:
    seen: list[str] = []
    http = fast()

    @app.post("/calls-downstream")
    @testapp.idem.idempotent(required=True, lease=30)
    def calls_downstream() -> tuple[dict[str, t.Any], int]:
        state = testapp.idem._request_state()
        assert state is not None
        assert state.scope is not None
        assert state.key is not None
        parent = scoped_parent_key(state.scope, state.key, operation=state.operation)
        seen.append(public_derive_key(parent, "charge"))
        seen.append(testapp.idem.derived_key("charge"))
        answer = http.post(downstream.url + "/charges", json={}, step="charge")
        return {"downstream": answer.status_code}, 201

    downstream.script = [503, "drop", 200]
    client = app.test_client()
    first = client.post("/calls-downstream", json={}, headers={"Idempotency-Key": "up-1"})
    assert first.status_code == 201
    assert first.get_json() == {"downstream": 200}
    key = one_key(downstream, 3)
    assert seen == [key, key]
    # The client's retry is replayed: the downstream is not called again.
    retry = client.post("/calls-downstream", json={}, headers={"Idempotency-Key": "up-1"})
    assert retry.get_json() == first.get_json()
    assert len(downstream.attempts) == 3


def test_a_retried_operation_sends_the_same_derived_key(app: Flask, downstream: Downstream) -> None:
    """A leased view charges through the client in a step, then fails: its retry
    resumes the operation with the same derived key, and skips the saved step."""
    seen: list[str] = []
    failures = [True]
    http = fast()

    @app.post("/charge-then-fail")
    @testapp.idem.idempotent(lease=30, required=True)
    def charge_then_fail() -> tuple[dict[str, t.Any], int]:
        seen.append(testapp.idem.derived_key("charge"))
        charge = testapp.idem.step(
            "charge",
            lambda: http.post(downstream.url + "/charges", json={}, step="charge").json(),
        )
        if failures.pop() if failures else False:
            return {"error": "later failure"}, 503
        return {"charge": charge["attempt"]}, 201

    downstream.script = [503, 200]
    client = app.test_client()
    headers = {"Idempotency-Key": "up-3"}
    assert client.post("/charge-then-fail", json={}, headers=headers).status_code == 503
    retry = client.post("/charge-then-fail", json={}, headers=headers)
    assert retry.status_code == 201
    assert retry.get_json() == {"charge": 2}
    key = one_key(downstream, 2)  # the saved step was not called again
    assert seen == [key, key]


def test_a_call_with_an_unknown_outcome_keeps_its_key_on_the_retry(
    app: Flask, downstream: Downstream
) -> None:
    http = fast(total=1)

    @app.post("/times-out")
    @testapp.idem.idempotent(lease=30, required=True)
    def times_out() -> tuple[dict[str, t.Any], int]:
        try:
            testapp.idem.step(
                "charge",
                lambda: http.post(
                    downstream.url + "/charges", json={}, step="charge", timeout=0.3
                ).json(),
            )
        except requests.ConnectionError:
            return {"error": "downstream timed out"}, 504
        return {}, 201

    # Both attempts time out: the downstream may have acted on either.
    downstream.script = [("sleep", 0.6), ("sleep", 0.6)]
    client = app.test_client()
    headers = {"Idempotency-Key": "up-4"}
    assert client.post("/times-out", json={}, headers=headers).status_code == 504
    time.sleep(0.01)  # the retry's operation starts at a later time
    assert client.post("/times-out", json={}, headers=headers).status_code == 201
    one_key(downstream, 3)


def test_a_keyless_post_in_an_idempotent_view_is_refused(
    app: Flask, downstream: Downstream
) -> None:
    errors: list[str] = []

    @app.post("/keyless-downstream")
    @testapp.idem.idempotent(required=True)
    def keyless_downstream() -> tuple[dict[str, t.Any], int]:
        try:
            fast().post(downstream.url + "/charges", json={})
        except ValueError as exc:
            errors.append(str(exc))
        return {}, 201

    response = app.test_client().post(
        "/keyless-downstream", json={}, headers={"Idempotency-Key": "up-2"}
    )
    assert response.status_code == 201
    assert errors
    assert "step=" in errors[0]
    assert downstream.attempts == []


def test_a_keyless_prepared_post_sent_in_an_idempotent_view_is_refused(
    app: Flask, downstream: Downstream
) -> None:
    """As for post(): a fresh key on each run of the view would let the
    downstream act once per retry of the view."""
    errors: list[str] = []

    @app.post("/keyless-send")
    @testapp.idem.idempotent(required=True)
    def keyless_send() -> tuple[dict[str, t.Any], int]:
        try:
            fast().send(prepared("POST", downstream.url + "/charges", json={}))
        except ValueError as exc:
            errors.append(str(exc))
        return {}, 201

    response = app.test_client().post("/keyless-send", json={}, headers={"Idempotency-Key": "s-1"})
    assert response.status_code == 201
    assert errors
    assert "step=" in errors[0]
    assert downstream.attempts == []


def test_after_a_request_in_a_shared_app_context_a_call_is_outside_the_view(
    app: Flask, downstream: Downstream
) -> None:
    """A test or a script that sends requests inside one app context shares
    ``g`` between them: the request's state must end with the request, or a
    keyless POST made afterwards would be refused and ``step=`` would send the
    finished operation's key."""

    @app.post("/done-request")
    @testapp.idem.idempotent(required=True)
    def done_request() -> tuple[dict[str, t.Any], int]:
        return {}, 201

    with app.app_context():
        response = app.test_client().post(
            "/done-request", json={}, headers={"Idempotency-Key": "up-3"}
        )
        assert response.status_code == 201
        assert fast().post(downstream.url + "/charges", json={}).status_code == 200
        with pytest.raises(RuntimeError):
            fast().post(downstream.url + "/charges", json={}, step="charge")
    [key] = downstream.keys()
    assert key is not None
    assert uuid.UUID(parse_key(key))


# -- idem.forward_headers ---------------------------------------------------------------


def test_forward_headers_pass_the_key_through_or_derive_it(app: Flask) -> None:
    @app.post("/forward")
    @testapp.idem.idempotent(lease=30)
    def forward() -> dict[str, t.Any]:
        return {
            "through": testapp.idem.forward_headers(),
            "charge": testapp.idem.forward_headers("charge"),
            "derived": testapp.idem.derived_key("charge"),
        }

    client = app.test_client()
    for sent, key in [('"a,b \\"c\\""', 'a,b "c"'), ("plain-1", "plain-1")]:
        body = client.post("/forward", json={}, headers={"Idempotency-Key": sent}).get_json()
        assert body["through"] == {"Idempotency-Key": quote_key(key)}
        assert parse_key(body["through"]["Idempotency-Key"]) == key
        assert body["charge"] == {"Idempotency-Key": quote_key(body["derived"])}


def test_forward_headers_use_the_configured_header(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'header.sqlite3'}"
    app = testapp.create_app(url, IDEMPOTENCY_HEADER="X-Request-Key")
    reset_tables(url)

    @app.post("/forward-header")
    @testapp.idem.idempotent()
    def forward_header() -> dict[str, str]:
        return testapp.idem.forward_headers()

    response = app.test_client().post("/forward-header", json={}, headers={"X-Request-Key": "k9"})
    assert response.get_json() == {"X-Request-Key": '"k9"'}
    with app.app_context():
        testapp.db.engine.dispose()


def test_forward_headers_without_a_key_ask_the_client_for_one(app: Flask) -> None:
    @app.post("/forward-keyless")
    @testapp.idem.idempotent()
    def forward_keyless() -> dict[str, str]:
        return testapp.idem.forward_headers()

    response = app.test_client().post("/forward-keyless", json={})
    assert response.status_code == 400
    assert response.get_json()["type"].endswith("/missing-key")


def test_forward_headers_are_refused_on_optimistic_routes(app: Flask) -> None:
    errors: list[str] = []

    @app.post("/forward-optimistic")
    @testapp.idem.idempotent(optimistic=True)
    def forward_optimistic() -> tuple[dict[str, t.Any], int]:
        try:
            testapp.idem.forward_headers()
        except RuntimeError as exc:
            errors.append(str(exc))
            raise
        return {}, 201

    response = app.test_client().post(
        "/forward-optimistic", json={}, headers={"Idempotency-Key": "o-1"}
    )
    assert response.status_code == 500
    assert errors
    assert "optimistic" in errors[0]


def test_forward_headers_outside_a_view_are_refused(app: Flask) -> None:
    with app.test_request_context(), pytest.raises(RuntimeError, match="idempotent view"):
        testapp.idem.forward_headers()


def test_without_requests_the_import_error_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "requests", None)
    monkeypatch.delitem(sys.modules, "flask_idempotency.client")
    with pytest.raises(ImportError, match=r"flask-idempotency\[client\]"):
        importlib.import_module("flask_idempotency.client")
