"""The one reader of PostgreSQL's client protocol (:mod:`tests.support.pgwire`)
that the benchmarks' counting proxy and the reliability suite's commit cutter
share: messages however the bytes arrive, encryption, statements followed.
Against a real server, the proxies' own tests (tests/live/test_bench.py,
tests/unit/request/test_commit_cut_on_the_wire.py); here, bytes as a client
sends them."""

from __future__ import annotations

import struct

from tests.support.pgwire import ClientStream, Statement

_SSL_REQUEST = struct.pack("!II", 8, 80877103)


def _startup() -> bytes:
    body = struct.pack("!I", 196608) + b"user\0app\0\0"
    return struct.pack("!I", len(body) + 4) + body


def _message(kind: bytes, *fields: bytes) -> bytes:
    body = b"".join(fields)
    return kind + struct.pack("!I", len(body) + 4) + body


def _read(stream: ClientStream, data: bytes) -> list[Statement | None]:
    return [stream.follow(kind, body) for kind, body in stream.messages(data)]


def test_messages_split_anywhere_are_read_whole_once() -> None:
    sent = _startup() + _message(b"Q", b"BEGIN\0") + _message(b"Q", b"COMMIT\0")
    stream = ClientStream()
    seen = []
    for i in range(len(sent)):  # one byte at a time
        seen += _read(stream, sent[i : i + 1])
    assert seen == [None, Statement(b"BEGIN", "query"), Statement(b"COMMIT", "query")]
    assert stream.pending == b""


def test_prepared_statements_are_followed_by_name() -> None:
    stream = ClientStream()
    _read(stream, _startup())
    parse = _message(b"P", b"_pg3_0\0", b"SELECT $1\0", b"\0\0")
    bind = _message(b"B", b"\0", b"_pg3_0\0", b"\0\0\0\0\0\0")
    unnamed = _message(b"P", b"\0", b"SELECT 2\0", b"\0\0")
    bind_unnamed = _message(b"B", b"\0", b"\0", b"\0\0\0\0\0\0")
    execute, sync = _message(b"E", b"\0", b"\0\0\0\0"), _message(b"S")
    seen = _read(stream, parse + bind + execute + unnamed + bind_unnamed + execute + sync)
    assert [s for s in seen if s is not None] == [
        Statement(b"SELECT $1", "prepare", b"_pg3_0"),
        Statement(b"SELECT $1", "prepared", b"_pg3_0"),
        Statement(b"SELECT 2", "parse"),
    ]
    close = _message(b"C", b"S", b"_pg3_0\0")
    seen = _read(stream, close + bind + execute)
    assert [s for s in seen if s is not None] == [Statement(None, "prepared", b"_pg3_0")]


def test_an_encrypted_connection_is_not_read() -> None:
    stream = ClientStream()
    assert stream.messages(_SSL_REQUEST + b"\x16\x03") == [(b"", b"")]
    assert stream.negotiating
    assert stream.answered(b"S")
    assert stream.messages(_message(b"Q", b"COMMIT\0")) == []


def test_a_refused_encryption_goes_on_in_the_clear() -> None:
    stream = ClientStream()
    stream.messages(_SSL_REQUEST)
    assert not stream.answered(b"N")
    seen = _read(stream, _startup() + _message(b"Q", b"COMMIT\0"))
    assert seen == [None, Statement(b"COMMIT", "query")]
