"""Bad input at volume against the live servers: every answer 2xx or 4xx problem+json."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import http.client
import json
import random
import re
import socket
import typing as t
import uuid

import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reliability import _harness as h
from reliability._context import Context

NAME = "badinput"
TITLE = "Bad input at volume against the live servers"
DESCRIPTION = """\
Two gunicorn servers (2 sync workers each) run on the scenario's PostgreSQL: the reliability app
(`/plain`, `/leased`) and the example payments app (`/payments`, which requires a key, scopes it
by merchant and limits bodies to 64 KiB). hypothesis (derandomized: the same requests every run)
writes each request byte by byte on a socket of its own, so it can send what an HTTP library
refuses to: random methods on the decorated routes; `Idempotency-Key` headers empty, over 255
characters, with control characters, tabs or bytes over 0x7f, quoted (well and badly), several
(two headers, or a comma list), spelled in lower case, or missing; random content types (JSON with
odd charsets, form, multipart with and without a boundary, text, garbage); bodies that are valid,
of the wrong types, with huge numbers (`1e999`, 5,000 digits), NaN, lone surrogates, NUL, deep
nesting (to 100,000 levels), malformed or truncated JSON, bytes that are not UTF-8, empty, or over
the size limit (to 1 MiB); sent with a `Content-Length`, chunked, chunked and broken, or cut short
(declared longer than sent). Every new key carries a fresh UUID, used by no other request.

Every answer must be 2xx or a 4xx `application/problem+json`; a 5xx, a 4xx of another type or no
answer at all counts as an HTML 500 and fails the run. The one exception, counted apart and shown:
gunicorn's own `400` (HTML) for a request it cannot parse as HTTP (a control character in a header
value), which never reaches the app. Afterwards the databases are read: **no ledger row and no
idempotency record may carry the UUID of a request that was refused** (a failed check otherwise),
and every POST with a valid key that got a 2xx has its one ledger row (lost otherwise).
"""

UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
#: Stand-ins hypothesis writes where a request's fresh UUIDs go (as long as one);
#: :func:`materialize` replaces them, so no two requests share a key.
TOKEN = b"tttttttt-tttt-4ttt-8ttt-tttttttttttt"
OTHER = b"uuuuuuuu-uuuu-4uuu-8uuu-uuuuuuuuuuuu"


@dataclasses.dataclass
class Raw:
    """One request as bytes, and what the scenario needs to judge its answer."""

    app: str  # "reliability" or "payments"
    method: str
    path: str
    headers: list[tuple[bytes, bytes]]
    body: bytes
    framing: str  # "length", "none", "chunked", "broken-chunked", "short"
    #: The request's fresh UUID (in its key, and in the payments body's
    #: customer_id): stored rows carrying it belong to this request.
    token: str | None
    #: The key is one the extension must accept (a valid POST may then succeed).
    valid_key: bool

    def summary(self) -> str:
        heads = {k.decode("latin-1"): v.decode("latin-1")[:60] for k, v in self.headers}
        return (
            f"{self.method} {self.app}{self.path} {self.framing} headers={heads} "
            f"body={self.body[:80]!r}{'...' if len(self.body) > 80 else ''} ({len(self.body)} B)"
        )


# -- strategies ----------------------------------------------------------------------

_METHODS = ["POST"] * 16 + ["PUT", "PATCH", "DELETE", "GET", "HEAD", "OPTIONS", "TRACE", "FROB"]
_TARGETS = [("reliability", "/plain"), ("reliability", "/leased"), ("payments", "/payments")]
_CONTENT_TYPES: list[bytes | None] = [
    *[b"application/json"] * 6,
    b"application/json; charset=utf-8",
    b"application/json; charset=latin-1",
    b"application/json; charset=utf-16",
    b"APPLICATION/JSON",
    b"application/problem+json",
    b"application/vnd.api+json",
    b"text/plain",
    b"text/json",
    b"application/x-www-form-urlencoded",
    b"multipart/form-data; boundary=xyzzy",
    b"multipart/form-data",
    b"a/b/c;;;=",
    b"",
    b"application/json\xff",
    None,
]


@st.composite
def keys(draw: st.DrawFn) -> tuple[list[tuple[bytes, bytes]], bool]:
    """Idempotency-Key headers (:data:`TOKEN` standing for the UUID), and whether
    the extension must accept the key."""
    token = TOKEN.decode()
    name = draw(st.sampled_from([b"Idempotency-Key"] * 5 + [b"idempotency-key"]))
    kind = draw(
        st.sampled_from(
            ["valid"] * 6
            + ["quoted", "max-length", "escaped", "absent", "empty", "blank", "too-long"]
            + ["control", "tab", "del", "high-bytes", "utf8", "two-headers", "comma-list"]
            + ["bad-quote", "text-after-quote", "bad-escape", "nul"]
        )
    )
    value: bytes
    if kind == "absent":
        return [], False
    valid = kind in ("valid", "quoted", "max-length", "escaped")
    if kind == "valid":
        value = token.encode()
    elif kind == "quoted":
        value = f'"{token}"'.encode()
    elif kind == "max-length":
        value = (token + "k" * (255 - len(token))).encode()
    elif kind == "escaped":
        value = f'"{token}\\"x\\\\"'.encode()
    elif kind == "empty":
        value = b""
    elif kind == "blank":
        value = b"   "
    elif kind == "too-long":
        value = (token + "k" * draw(st.integers(256 - len(token), 5000))).encode()
    elif kind == "control":
        ch = draw(st.sampled_from([0x01, 0x07, 0x08, 0x0B, 0x0C, 0x1B, 0x1F]))
        value = token.encode() + bytes([ch]) + b"x"
    elif kind == "tab":
        value = TOKEN + b"\tx"
    elif kind == "del":
        value = token.encode() + b"\x7f"
    elif kind == "high-bytes":
        value = token.encode() + draw(st.binary(min_size=1, max_size=8).map(_high))
    elif kind == "utf8":
        value = (token + "é€").encode()
    elif kind == "two-headers":
        return [(name, TOKEN), (name, OTHER)], False
    elif kind == "comma-list":
        value = TOKEN + b", " + OTHER
    elif kind == "bad-quote":
        value = f'"{token}'.encode()
    elif kind == "text-after-quote":
        value = f'"{token}"x'.encode()
    elif kind == "bad-escape":
        value = f'"{token}\\n"'.encode()
    else:  # "nul"
        value = token.encode() + b"\x00"
    return [(name, value)], valid


def _high(data: bytes) -> bytes:
    return bytes(0x80 | b for b in data)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _payload(app: str, amount: t.Any = 1250, **more: t.Any) -> dict[str, t.Any]:
    body: dict[str, t.Any] = {"amount": amount, "currency": "EUR"}
    if app == "payments":
        body["customer_id"] = "c-" + TOKEN.decode()
    body.update(more)
    return body


def _object(app: str, amount: bytes, rest: bytes = b"") -> bytes:
    """A JSON object written by hand (what json.dumps would refuse to write)."""
    customer = b', "customer_id": "c-' + TOKEN + b'"' if app == "payments" else b""
    return b'{"amount": ' + amount + b', "currency": "EUR"' + customer + rest + b"}"


#: The field each app's schema takes free text in.
_TEXT_FIELD = {"reliability": "note", "payments": "description"}


@st.composite
def bodies(draw: st.DrawFn, app: str) -> bytes:
    text = _TEXT_FIELD[app].encode()
    kind = draw(
        st.sampled_from(
            ["valid"] * 5
            + ["random-json", "wrong-type", "huge-number", "huge-literal", "nan", "surrogate"]
            + ["nul", "deep", "malformed", "truncated", "not-utf8", "empty", "oversize"]
            + ["form", "top-level-scalar", "duplicate-field", "unknown-field"]
        )
    )
    if kind == "valid":
        return json.dumps(_payload(app, draw(st.integers(1, 1_000_000)))).encode()
    if kind == "random-json":
        return json.dumps(draw(json_values)).encode()
    if kind == "wrong-type":
        wrong = draw(
            st.sampled_from(["12", 12.5, True, None, [1], {"a": 1}, -1, 0, 2**31, 2**63, ""])
        )
        field = draw(st.sampled_from(["amount", "currency", "customer_id", _TEXT_FIELD[app]]))
        return json.dumps({**_payload(app), field: wrong}).encode()
    if kind == "huge-number":
        return _object(app, b"9" * draw(st.integers(20, 6000)))
    if kind == "huge-literal":
        return _object(app, draw(st.sampled_from([b"1e999", b"-1e999", b"1e-999", b"1E400"])))
    if kind == "nan":
        return _object(app, draw(st.sampled_from([b"NaN", b"Infinity", b"-Infinity"])))
    if kind == "surrogate":
        if draw(st.booleans()):
            return _object(app, b"1", b', "\\ud800": 1')
        return _object(app, b"1", b', "' + text + b'": "a\\udc80b"')
    if kind == "nul":
        return _object(app, b"1", b', "' + text + b'": "a\\u0000b"')
    if kind == "deep":
        depth = draw(st.sampled_from([100, 1_000, 10_000, 100_000]))
        return _object(app, b"1", b', "' + text + b'": ' + b"[" * depth + b"]" * depth)
    if kind == "malformed":
        return draw(
            st.sampled_from(
                [b"{", b"}", b"{'amount': 1}", b'{"amount": 1,}', b"[1, 2", b"nul", b"\x00"]
            )
            | st.binary(max_size=64)
        )
    if kind == "truncated":
        whole = json.dumps(_payload(app)).encode()
        return whole[: draw(st.integers(1, len(whole) - 1))]
    if kind == "not-utf8":
        return _object(app, b"1", b', "' + text + b'": "\xff\xfe\xc3("')
    if kind == "empty":
        return b""
    if kind == "oversize":
        size = draw(st.sampled_from([70_000, 300_000, 1_048_576]))
        return json.dumps(_payload(app, **{_TEXT_FIELD[app]: "x" * size})).encode()
    if kind == "form":
        return b"amount=1&currency=EUR&customer_id=c-" + TOKEN
    if kind == "top-level-scalar":
        return draw(st.sampled_from([b"1", b'"x"', b"null", b"true", b"[]"]))
    if kind == "unknown-field":
        return _object(app, b"1", b', "surprise": {"a": [1, 2]}')
    return _object(app, b"1", b', "amount": "2"')


@st.composite
def raw_requests(draw: st.DrawFn) -> Raw:
    app, path = draw(st.sampled_from(_TARGETS))
    method = draw(st.sampled_from(_METHODS))
    key_headers, valid_key = draw(keys())
    headers: list[tuple[bytes, bytes]] = list(key_headers)
    content_type = draw(st.sampled_from(_CONTENT_TYPES))
    if content_type is not None:
        headers.append((b"Content-Type", content_type))
    if app == "payments":
        merchant = draw(st.sampled_from([b"m1"] * 8 + [b"", b"m" * 65, b"m\xff"]))
        if merchant or draw(st.booleans()):
            headers.append((b"X-Merchant", merchant))
    body = draw(bodies(app))
    framing = draw(st.sampled_from(["length"] * 6 + ["chunked", "broken-chunked", "short", "none"]))
    return Raw(app, method, path, headers, body, framing, None, valid_key)


def materialize(raw: Raw) -> Raw:
    """``raw`` with its stand-ins replaced by fresh UUIDs (the same in key and body)."""
    token, other = uuid.uuid4(), uuid.uuid4()

    def fill(data: bytes) -> bytes:
        return data.replace(TOKEN, str(token).encode()).replace(OTHER, str(other).encode())

    return dataclasses.replace(
        raw,
        headers=[(name, fill(value)) for name, value in raw.headers],
        body=fill(raw.body),
        token=str(token),
    )


# -- sending -------------------------------------------------------------------------


def _chunks(body: bytes, rng: random.Random) -> bytes:
    """``body`` in chunks of random sizes (no last chunk)."""
    out, i = [], 0
    while i < len(body):
        n = rng.randint(1, len(body) // 3 + 1)
        out.append(b"%x\r\n%s\r\n" % (len(body[i : i + n]), body[i : i + n]))
        i += n
    return b"".join(out)


def encode(raw: Raw) -> tuple[bytes, bool]:
    """The request's bytes, and whether to half-close after them (a body cut short)."""
    head = [f"{raw.method} {raw.path} HTTP/1.1".encode(), b"Host: 127.0.0.1"]
    head += [name + b": " + value for name, value in raw.headers]
    head.append(b"Connection: close")
    body, half_close = raw.body, False
    if raw.framing == "length":
        head.append(b"Content-Length: %d" % len(body))
    elif raw.framing == "short":
        head.append(b"Content-Length: %d" % (len(body) + 10))
        half_close = True
    elif raw.framing in ("chunked", "broken-chunked"):
        head.append(b"Transfer-Encoding: chunked")
        body = _chunks(body, random.Random(len(body)))
        if raw.framing == "chunked":
            body += b"0\r\n\r\n"
        else:
            body += b"zz\r\nnot a chunk"
            half_close = True
    else:  # "none": no framing header at all; the body, if any, follows
        half_close = True
    return b"\r\n".join(head) + b"\r\n\r\n" + body, half_close


def send(host: str, port: int, raw: Raw, timeout: float = 20) -> tuple[h.Answer, bool]:
    """The answer to ``raw``, and whether it is gunicorn's own error page (see
    :func:`verdict`)."""
    data, half_close = encode(raw)
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        with contextlib.suppress(OSError):  # the server may answer before reading it all
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        response = http.client.HTTPResponse(sock, method=raw.method)
        try:
            response.begin()
            body = response.read()
        except TimeoutError:
            return h.Answer("timeout"), False
        except (OSError, http.client.HTTPException):
            return h.Answer("conn"), False
        content_type = response.getheader("Content-Type", "")
        # gunicorn writes its own error page (a request it cannot parse) with
        # exactly these headers; whatever the app answers has a Server and a Date.
        own_page = content_type == "text/html" and response.getheader("Server") is None
        return h.Answer(response.status, content_type, body), own_page
    finally:
        sock.close()


def verdict(answer: h.Answer, own_page: bool) -> str:
    if not isinstance(answer.status, int):
        return f"no answer ({answer.status})"
    if 200 <= answer.status < 300:
        return "2xx"
    if 400 <= answer.status < 500 and answer.content_type.startswith("application/problem+json"):
        return "4xx problem+json"
    if own_page and 400 <= answer.status < 500:
        return "gunicorn's own 400"
    return f"{answer.status} {answer.content_type or 'no content type'}"


# -- the scenario --------------------------------------------------------------------


def _stored(url: str, ledger_sql: str) -> tuple[dict[str, int], dict[str, int]]:
    """UUID -> ledger rows and UUID -> idempotency records in the database at ``url``
    (``ledger_sql`` selects the ledger column that carries a request's UUID)."""
    engine = sa.create_engine(url)
    found: list[collections.Counter[str]] = []
    try:
        with engine.connect() as conn:
            for sql in (ledger_sql, "SELECT key FROM idempotency_keys"):
                counter: collections.Counter[str] = collections.Counter()
                for (value,) in conn.execute(sa.text(sql)):
                    counter.update(UUID_RE.findall(str(value or "")))
                found.append(counter)
    finally:
        engine.dispose()
    return dict(found[0]), dict(found[1])


def run(ctx: Context) -> list[h.Result]:
    examples = ctx.scale.pick(5000, 600)
    result = h.Result(f"{NAME}: {examples:,} requests", f"{examples:,} hypothesis requests")
    rel_url = ctx.database("badinput_reliability")
    pay_url = ctx.database("badinput_payments")
    h.reset_tables(rel_url)
    sent: list[tuple[Raw, h.Answer, bool]] = []
    with (
        h.timed(result),
        h.Gunicorn(
            "reliability.app:create_app()", {"RELIABILITY_DATABASE_URL": rel_url}, workers=2
        ) as rel,
        h.Gunicorn(
            "example_app.app:create_app()", {"EXAMPLE_DATABASE_URL": pay_url}, workers=2
        ) as pay,
    ):
        servers = {"reliability": rel, "payments": pay}

        @settings(
            max_examples=examples,
            derandomize=True,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(raw_requests())
        def probe(template: Raw) -> None:
            raw = materialize(template)
            server = servers[raw.app]
            sent.append((raw, *send(server.host, server.port, raw)))

        probe()

    verdicts: collections.Counter[str] = collections.Counter()
    failed: list[str] = []
    for raw, answer, own_page in sent:
        v = verdict(answer, own_page)
        verdicts[v] += 1
        result.answers[str(answer.status)] += 1
        if v not in ("2xx", "4xx problem+json", "gunicorn's own 400"):
            result.html_500 += 1
            if len(failed) < 5:
                failed.append(f"{v} for {raw.summary()}: {answer.body[:200]!r}")
    result.operations = result.attempts = len(sent)

    # What the databases hold, per request's UUID.
    stored: dict[str, tuple[dict[str, int], dict[str, int]]] = {
        "reliability": _stored(rel_url, "SELECT key FROM reliability_ledger"),
        "payments": _stored(pay_url, "SELECT customer_id FROM ledger"),
    }
    refused_stored: list[str] = []
    for raw, answer, _ in sent:
        if raw.token is None:
            continue
        rows, records = stored[raw.app]
        n_rows, n_records = rows.get(raw.token, 0), records.get(raw.token, 0)
        ok = isinstance(answer.status, int) and 200 <= answer.status < 300
        if not ok and (n_rows or n_records):
            refused_stored.append(
                f"{answer.status} with {n_rows} ledger rows, {n_records} records: {raw.summary()}"
            )
        if ok and raw.method == "POST" and raw.valid_key:
            result.ledger_rows += n_rows
            result.duplicates += max(0, n_rows - 1)
            result.lost += n_rows == 0
    if refused_stored:
        result.failures.append(
            f"{len(refused_stored)} refused requests left rows or records;"
            f" first: {refused_stored[0]}"
        )
    h.count_stuck(rel_url, result)
    h.count_stuck(pay_url, result)
    result.extra["answers"] = ", ".join(f"{k}: {v:,}" for k, v in verdicts.most_common())
    result.extra["POSTs with a valid key answered 2xx"] = sum(
        1
        for raw, a, _ in sent
        if raw.method == "POST" and raw.valid_key and isinstance(a.status, int) and a.status < 300
    )
    result.notes += [f"failing answer: {f}" for f in failed]
    ctx.show(result)
    return [result]
