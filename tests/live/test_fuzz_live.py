"""Fuzz a live server with odd and malformed requests: never an HTML 500, and the
records always agree with the side effects.

Keys, bodies, content types, framings (Content-Length, chunked, broken chunked,
cut short) and headers are drawn by hypothesis and sent byte for byte over a
socket to ``python -m tests.support.live_server`` on PostgreSQL. After every request:

* the answer is a normal app answer (JSON from the view, or its replay) or a
  problem+json 4xx/409/503 from the extension, never an HTML error;
* a refused request stored nothing (no ledger row, no record);
* every completed record has exactly its ledger row, and no record is left in
  progress.

CI runs a bounded, derandomized profile. For a long exploration with fresh
randomness: ``IDEMPOTENCY_FUZZ_EXAMPLES=20000 pytest tests/live/test_fuzz_live.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing as t
import urllib.parse

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from flask_idempotency.errors import PROBLEM_JSON
from tests.conftest import reset_tables
from tests.support import testapp
from tests.support.live import LiveServer, Reply, chunked, raw_request

pytestmark = pytest.mark.slow

EXAMPLES_ENV = "IDEMPOTENCY_FUZZ_EXAMPLES"
EXAMPLES = int(os.environ.get(EXAMPLES_ENV, "250"))
LIMIT = 4096
BOUNDARY = "fuzzB0undary"
# Statuses the extension answers with problem+json.
PROBLEM_STATUSES = {400, 409, 411, 413, 415, 422, 503}
# Routes of the test app whose views answer JSON and never fail on their own.
PATHS = [
    "/raw",
    "/charges",
    "/body/echo",
    "/body/order",
    "/status/201",
    "/status/422",
    "/required",
    "/tenant",
]


@dataclasses.dataclass
class Sent:
    path: str
    headers: list[tuple[str, str]]
    body: bytes  # as framed on the wire
    retry: Sent | None = None  # the same request again, maybe framed otherwise


# -- strategies --------------------------------------------------------------------

SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff", "\ud83d\ude00"])
TEXT = st.lists(st.one_of(st.text(max_size=8), SURROGATES), max_size=4).map("".join)
NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1e16, 2.0**53 + 2, 1e300, -0.0, 0.1, 1.0000000000000001]),
)
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), NUMBERS, TEXT),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(TEXT, children, max_size=4)
    ),
    max_leaves=12,
)
DATETIMES = st.sampled_from(
    [
        "0001-01-01T00:00:00+14:00",
        "9999-12-31T23:59:59-14:00",
        "2026-12-01T10:00:00+01:00",
        "2026-12-01T10:00:00",
        "not a date",
    ]
)
CHARGES = st.fixed_dictionaries(
    {"amount": st.one_of(st.integers(0, 10**6), st.just("500")), "currency": TEXT},
    optional={
        "meta": st.fixed_dictionaries({}, optional={"note": TEXT, "trace_id": TEXT}),
        "client_sent_at": TEXT,
    },
)
ORDERS = st.fixed_dictionaries(
    {"amount": st.integers(0, 10**6)},
    optional={
        "orderRef": st.one_of(st.uuids().map(str), TEXT),
        "lines": st.lists(st.fixed_dictionaries({"sku": TEXT}), max_size=3),
        "client_sent_at": DATETIMES,
        "received_at": DATETIMES,
    },
)
FIELDS = st.lists(st.tuples(st.text(max_size=6), st.text(max_size=12)), max_size=5)


def multipart(fields: list[tuple[str, str]], files: list[tuple[str, bytes]]) -> bytes:
    parts = [
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{urllib.parse.quote(n)}"'
        f"\r\n\r\n{v}\r\n".encode()
        for n, v in fields
    ]
    parts += [
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="f"; filename="{i}.bin"'
        "\r\nContent-Type: application/octet-stream\r\n\r\n".encode()
        + content
        + b"\r\n"
        for i, (_, content) in enumerate(files)
    ]
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


BODIES = st.one_of(
    CHARGES.map(lambda v: json.dumps(v).encode()),
    ORDERS.map(lambda v: json.dumps(v).encode()),
    JSON_VALUES.map(lambda v: json.dumps(v).encode()),
    st.integers(1, 20_000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(1, 3_000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
    st.sampled_from([b"NaN", b'{"a": 1e400}', b'{"a": 1', b"\xff\xfe", b"", b'"\\ud800"']),
    st.binary(max_size=6000),
    FIELDS.map(lambda f: urllib.parse.urlencode(f).encode()),
    st.tuples(FIELDS, st.lists(st.tuples(st.just("f"), st.binary(max_size=300)), max_size=2)).map(
        lambda ff: multipart(*ff)
    ),
)
CONTENT_TYPES = st.sampled_from(
    [
        "application/json",
        "application/json; charset=utf-8",
        "application/merge-patch+json",
        "text/plain",
        "application/octet-stream",
        "application/x-www-form-urlencoded",
        f"multipart/form-data; boundary={BOUNDARY}",
        "multipart/form-data",
        "garbage",
        None,
    ]
)
# Header values as a client may send them: printable Latin-1, no line breaks.
HEADER_TEXT = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
    max_size=300,
)
# Mostly well-formed keys (fresh ones, and a few that repeat across examples to
# meet other payloads), then anything a header can carry.
GOOD_KEYS = st.one_of(st.uuids().map(str), st.sampled_from(["k1", "k2", '"k1"']))
KEYS = st.one_of(
    st.none(),
    GOOD_KEYS,
    GOOD_KEYS,
    GOOD_KEYS,
    st.sampled_from(["", '"unterminated', "a" * 256, "caf\xe9"]),
    HEADER_TEXT,
)
FRAMINGS = st.sampled_from(["length", "length", "chunked", "chunked-split", "broken", "short"])


@st.composite
def requests(draw: st.DrawFn) -> Sent:
    path = draw(st.sampled_from(PATHS))
    body = draw(BODIES)
    headers: list[tuple[str, str]] = []
    content_type = draw(CONTENT_TYPES)
    if content_type is not None:
        headers.append(("Content-Type", content_type))
    key = draw(KEYS)
    if key is not None:
        headers.append(("Idempotency-Key", key))
        if draw(st.booleans()) and draw(st.booleans()):
            headers.append(("Idempotency-Key", key))  # sent twice
    if draw(st.booleans()):
        headers.append(("Authorization", draw(st.sampled_from(["Bearer a", "Bearer b", "x"]))))
    if draw(st.booleans()):
        headers.append(("X-Tenant", draw(st.sampled_from(["t1", "t2", "é"]))))
    sent = framed(draw, path, headers, body, draw(FRAMINGS))
    if draw(st.booleans()):
        sent.retry = framed(draw, path, headers, body, draw(st.sampled_from(RETRY_FRAMINGS)))
    return sent


RETRY_FRAMINGS = ["length", "chunked", "chunked-split"]


def framed(
    draw: st.DrawFn, path: str, headers: list[tuple[str, str]], body: bytes, framing: str
) -> Sent:
    if framing == "length":
        return Sent(path, [*headers, ("Content-Length", str(len(body)))], body)
    if framing == "short":
        # Announces more than it sends, then stops: the server reads end of input.
        announced = len(body) + draw(st.integers(1, 100))
        return Sent(path, [*headers, ("Content-Length", str(announced))], body)
    headers = [*headers, ("Transfer-Encoding", "chunked")]
    cut = draw(st.integers(0, len(body)))
    if framing == "chunked":
        return Sent(path, headers, chunked(body) if body else chunked())
    if framing == "chunked-split":
        return Sent(path, headers, chunked(*[p for p in (body[:cut], body[cut:]) if p]))
    bad_size = draw(st.sampled_from([b"zz", b"-1", b"", b"1" * 40, b"fffffffffff"]))
    start = chunked(body[:cut]).removesuffix(b"0\r\n\r\n") if cut else b""
    return Sent(path, headers, start + bad_size + b"\r\n" + body[cut:])


# -- the server and the invariants --------------------------------------------------


@pytest.fixture(scope="module")
def server(pg_url: str) -> t.Iterator[LiveServer]:
    testapp.create_app(pg_url)  # registers the record table on the metadata
    reset_tables(pg_url)
    live = LiveServer("tests", pg_url, {"MAX_CONTENT_LENGTH": LIMIT}).start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def engine(pg_url: str) -> t.Iterator[sa.Engine]:
    engine = sa.create_engine(pg_url)
    yield engine
    engine.dispose()


COUNTS = sa.text("SELECT (SELECT count(*) FROM ledger), (SELECT count(*) FROM idempotency_keys)")
# Keys whose ledger rows and completed records do not pair up one to one. The
# same key in two scopes has two records and two ledger rows.
UNPAIRED = sa.text(
    """
    SELECT coalesce(l.key, r.key), coalesce(l.n, 0), coalesce(r.n, 0)
    FROM (SELECT key, count(*) AS n FROM ledger WHERE key IS NOT NULL GROUP BY key) AS l
    FULL OUTER JOIN
         (SELECT key, count(*) AS n FROM idempotency_keys WHERE status = 'completed'
          GROUP BY key) AS r
    ON l.key = r.key
    WHERE coalesce(l.n, 0) <> coalesce(r.n, 0)
    """
)
IN_PROGRESS = sa.text("SELECT count(*) FROM idempotency_keys WHERE status <> 'completed'")


KEYED = [("Idempotency-Key", "example"), ("Content-Type", "application/json")]
EDGE = b"0001-01-01T00:00:00+14:00"


def with_length(path: str, body: bytes) -> Sent:
    return Sent(path, [*KEYED, ("Content-Length", str(len(body)))], body)


def counts(engine: sa.Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        ledger, records = conn.execute(COUNTS).one()
    return int(ledger), int(records)


def check_answer(sent: Sent, reply: Reply) -> bool:
    """Assert the answer is an app answer or a problem; return whether it is a problem."""
    content_type = reply.headers.get("content-type", "")
    where = (
        f"{sent.path} {sent.headers!r} {sent.body[:200]!r} -> {reply.status} {reply.body[:300]!r}"
    )
    if content_type == PROBLEM_JSON:
        assert reply.status in PROBLEM_STATUSES, where
        assert json.loads(reply.body)["status"] == reply.status, where
        return True
    assert content_type == "application/json", where
    expected = 422 if sent.path == "/status/422" else None
    assert reply.status in ({200, 201} if expected is None else {expected}), where
    return False


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=EXAMPLES_ENV not in os.environ,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(sent=requests())
@example(sent=with_length("/raw", b"[" * 10_000 + b"]" * 10_000))
@example(sent=with_length("/charges", b'{"amount":1,"currency":"EUR","client_sent_at":"\\ud800"}'))
@example(sent=with_length("/body/order", b'{"amount":1,"client_sent_at":"%s"}' % EDGE))
@example(sent=with_length("/body/order", b'{"amount":1,"received_at":"%s"}' % EDGE))
@example(sent=Sent("/raw", [*KEYED, ("Transfer-Encoding", "chunked")], b"zz\r\nabc\r\n0\r\n\r\n"))
@example(sent=Sent("/raw", [*KEYED, ("Transfer-Encoding", "chunked")], chunked(b"x" * LIMIT, b"y")))
def test_every_answer_is_an_app_answer_or_a_problem_and_records_stay_consistent(
    server: LiveServer, engine: sa.Engine, sent: Sent
) -> None:
    before = counts(engine)
    reply = raw_request(server.port, sent.path, sent.headers, sent.body)
    refused = check_answer(sent, reply)
    event(f"{reply.status}{' replayed' if reply.replayed else ''}")  # --hypothesis-show-statistics
    after = counts(engine)
    if refused or reply.replayed:
        assert after == before, f"{sent!r} -> {reply.status} stored something"
    if sent.retry is not None:
        again = raw_request(server.port, sent.retry.path, sent.retry.headers, sent.retry.body)
        check_answer(sent.retry, again)
        if after[1] == before[1] + 1:
            # The first answer was stored: however the body is framed, the retry replays it.
            event("retry of a stored answer")
            assert again.replayed, (sent, again)
            assert (again.status, again.body) == (reply.status, reply.body)
            assert counts(engine) == after
    with engine.connect() as conn:
        assert conn.execute(UNPAIRED).all() == []
        assert conn.execute(IN_PROGRESS).scalar_one() == 0
