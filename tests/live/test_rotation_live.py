"""Key rotation under load, with real processes on every engine.

A server (tests.support.sealed_server, the outbox test app: a record and an
outbox event per order) first runs under key A alone, then under [B, A] while
client threads create orders with new keys and retry old ones, and
``flask idempotency reseal`` runs in another process. Every answer must be
right: a new key runs once (201), a retry replays the first answer byte for
byte, nothing answers 500. Then the server runs under key B alone and answers
every retry the same way, the relay under key B alone publishes every event in
clear, and a dump of the tables (``pg_dump``, the SQLite file) names key B
only: no value sealed with key A is left, no payload is readable.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
import typing as t
from pathlib import Path

import pytest
import sqlalchemy as sa

from flask_idempotency._messaging.relay import relay_batch
from flask_idempotency._storage import seal
from flask_idempotency._storage.schema import _text
from flask_idempotency.publishers import ListPublisher
from tests.support import outbox_app, pgbouncer
from tests.support.keyrings import KEY_A, KEY_B, keys_app, keys_text
from tests.support.live import ROOT, LiveServer, Reply, start_ready
from tests.support.outbox import reset
from tests.support.pgdump import pg_dump

#: The amounts carry this prefix: a payload in clear would show it in a dump.
MARKER = 9876500
SEEDED = 150
CLIENTS = 4
RECORDS = "idempotency_keys"
OUTBOX = "idempotency_outbox"


def serve(url: str, *keys: tuple[str, bytes]) -> LiveServer:
    server = LiveServer("sealed", url)
    server.proc, server.port = start_ready("tests.support.sealed_server", url, keys_text(*keys))
    return server


def order(server: LiveServer, key: str, n: int) -> Reply:
    return server.post("/orders", {"amount": MARKER + n}, key)


def same(first: Reply, again: Reply) -> bool:
    """A replay of ``first``: its status and body, byte for byte, marked replayed."""
    return (again.status, again.body) == (first.status, first.body) and again.replayed


def reseal(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "SEALED_TEST_DB": url,
        "SEALED_TEST_KEYS": keys_text(KEY_B, KEY_A),
    }
    app = "tests.support.sealed_server:from_env"
    command = [sys.executable, "-m", "flask", "--app", app, "idempotency", "reseal", *args]
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


class Load:
    """Client threads: each creates orders with new keys and retries its own
    and the seeded ones, recording every answer that is not right."""

    def __init__(self, server: LiveServer, first: dict[str, tuple[int, Reply]]) -> None:
        self.server, self.first = server, first
        self.stop = threading.Event()
        self.wrong: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(i,)) for i in range(CLIENTS)]
        self.requests = 0

    def run(self, i: int) -> None:
        rng = random.Random(i)
        n = 0
        while not self.stop.is_set():
            n += 1
            key, amount = f"load-{i}-{n}", 1000 * (i + 1) + n
            try:
                reply = order(self.server, key, amount)
                if reply.status != 201 or reply.replayed:
                    self.note(f"new {key}: {reply.status} {reply.body[:200]!r}")
                    continue
                with self.lock:
                    self.first[key] = (amount, reply)
                    old_key = rng.choice(list(self.first))
                    old_amount, old = self.first[old_key]
                for k, a, f in ((key, amount, reply), (old_key, old_amount, old)):
                    again = order(self.server, k, a)
                    if not same(f, again):
                        self.note(f"retry {k}: {again.status} {again.body[:200]!r}")
                with self.lock:
                    self.requests += 3
            except Exception as exc:  # a dropped connection is a wrong answer too
                self.note(f"{key}: {exc!r}")

    def note(self, what: str) -> None:
        with self.lock:
            self.wrong.append(what)

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(120)


def dump(url: str, tmp_path: Path) -> bytes:
    """The idempotency tables as a backup holds them: ``pg_dump`` of both, the
    SQLite file, or (MySQL) every row's values."""
    parsed = sa.make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return Path(t.cast(str, parsed.database)).read_bytes()
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            if parsed.get_backend_name() == "postgresql":
                schema = conn.execute(sa.text("SELECT current_schema()")).scalar_one()
            else:
                rows = [
                    repr(tuple(r)).encode()
                    for table in (RECORDS, OUTBOX)
                    for r in conn.execute(sa.text(f"SELECT * FROM {table}"))
                ]
                return b"\n".join(rows)
    finally:
        engine.dispose()
    out = pg_dump(url, "--data-only", "-t", f"{schema}.{RECORDS}", "-t", f"{schema}.{OUTBOX}")
    assert b"COPY" in out, out[:500]
    return out


def quote(conn: sa.Connection) -> str:
    return conn.dialect.identifier_preparer.quote("key")


def sealed_with(kid: str) -> list[bytes]:
    """How a value sealed with ``kid`` shows in a dump: text, binary, and
    binary as PostgreSQL's hex output."""
    binary = seal.MAGIC + bytes([len(kid)]) + kid.encode()
    return [f"{seal.TEXT_PREFIX}{kid}:".encode(), binary, b"\\\\x" + binary.hex().encode()]


def test_rotation_under_load_answers_right_and_leaves_key_b_alone(
    database_url: str, tmp_path: Path
) -> None:
    if pgbouncer.is_pooled(database_url):
        pytest.skip("the processes of this test reach the database directly")
    reset(database_url)
    first: dict[str, tuple[int, Reply]] = {}

    # Under key A alone: what the rotation has to move.
    server = serve(database_url, KEY_A)
    try:
        for n in range(SEEDED):
            reply = order(server, f"seed-{n}", n)
            assert reply.status == 201, reply.body
            first[f"seed-{n}"] = (n, reply)
    finally:
        server.stop()

    # Under [B, A], with clients creating and retrying while reseal runs.
    server = serve(database_url, KEY_B, KEY_A)
    try:
        with Load(server, first) as load:
            time.sleep(1)
            before = load.requests
            during = reseal(database_url, "--batch", "7")
            served_during = load.requests - before
            time.sleep(1)
        assert load.wrong == [], load.wrong[:5]
        assert load.requests > 30
        assert served_during > 0  # the clients ran while reseal did
        assert during.returncode in (0, 1), during.stderr
        assert "position outbox:" in during.stderr
        assert "re-sealed with key 'B'" in during.stdout
        # Rows that changed under it (or were held) are left to the next run.
        after = reseal(database_url)
        assert after.returncode == 0, (after.stdout, after.stderr)
    finally:
        server.stop()

    # Under key B alone: every retry still replays its first answer.
    server = serve(database_url, KEY_B)
    try:
        wrong = [
            key
            for key, (amount, reply) in first.items()
            if not same(reply, order(server, key, amount))
        ]
        assert wrong == [], wrong[:5]
    finally:
        server.stop()

    # The relay under key B alone publishes every event, in clear.
    app = keys_app(outbox_app.create_app, database_url, keys_text(KEY_B))
    publisher = ListPublisher()
    try:
        while relay_batch(app, publisher, batch=500).more:
            pass
        with app.app_context(), outbox_app.db.engine.connect() as conn:
            count = conn.execute(sa.text(f"SELECT count(*) FROM {OUTBOX}")).scalar_one()
            parked = conn.execute(
                sa.text(f"SELECT count(*) FROM {OUTBOX} WHERE failed_at IS NOT NULL")
            ).scalar_one()
            ids = {
                t.cast(str, _text(r[1]))
                for r in conn.execute(sa.text(f"SELECT scope, {quote(conn)} FROM {RECORDS}"))
            }
    finally:
        with app.app_context():
            outbox_app.db.engine.dispose()
    assert parked == 0
    assert len(publisher.events) == count == len(first)
    assert {e.payload["amount"] for e in publisher.events} == {
        MARKER + a for a, _ in first.values()
    }
    assert ids == set(first)

    # A backup of the tables names key B alone, and shows no payload.
    backup = dump(database_url, tmp_path)
    for shown in sealed_with("A"):
        assert shown not in backup
    assert any(shown in backup for shown in sealed_with("B"))
    # As the payload's JSON holds it: never a run of hex digits in a dump's bytea,
    # which random ciphertext shows at times.
    assert f'"amount":{str(MARKER)[:5]}'.encode() not in backup
