"""A rolling deploy, live: v1 and v2 of one service (tests/support/deploys.py; v2
excludes a field, gains a load_default and makes a new fingerprint key current)
serve the same database at once, each a server in a subprocess. Client threads
send each key's request to both at the same moment and retry it across both;
then a retry with other bytes. Every key has one order; every answer is the
original's (replayed, same body) or 422 fingerprint-rules-changed."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import random
import subprocess
import threading

import sqlalchemy as sa

from flask_idempotency.errors import PROBLEM_TYPE_BASE
from tests.support.deploys import FIRST, OTHER_BYTES, make_version
from tests.support.live import start_ready

RULES_CHANGED = PROBLEM_TYPE_BASE + "fingerprint-rules-changed"
KEYS = 40


def send(port: int, key: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
        conn.request("POST", "/orders", body=body, headers=headers)
        reply = conn.getresponse()
        return reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read()
    finally:
        conn.close()


def test_both_versions_serving_at_once_run_each_key_once(fresh_database: str) -> None:
    app, db = make_version(fresh_database)  # creates the tables, as a migration would
    with app.app_context():
        db.engine.dispose()
    servers: list[subprocess.Popen[str]] = []
    try:
        ports = []
        for version in ("v1", "v2"):
            proc, port = start_ready("tests.support.deploys", fresh_database, version)
            servers.append(proc)
            ports.append(port)
        answers: dict[str, list[tuple[int, dict[str, str], bytes]]] = {}
        lock = threading.Lock()
        start = threading.Barrier(2)

        def first(key: str, port: int) -> None:
            start.wait(timeout=30)
            reply = send(port, key, FIRST)
            while reply[0] == 409:  # the other server's run still holds the key
                reply = send(port, key, FIRST)
            with lock:
                answers.setdefault(key, []).append(reply)

        chooser = random.Random(28)
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            for n in range(KEYS):
                key = f"deploy-{n}"
                start.reset()
                for f in [pool.submit(first, key, port) for port in ports]:
                    f.result(timeout=120)
                # Retries of the same bytes, to either version.
                for _ in range(2):
                    answers[key].append(send(chooser.choice(ports), key, FIRST))
        bodies = {}
        for key, replies in answers.items():
            assert {status for status, _, _ in replies} == {201}, (key, replies)
            assert len({body for _, _, body in replies}) == 1, (key, replies)
            assert sum(h.get("idempotent-replayed") != "true" for _, h, _ in replies) == 1
            bodies[key] = replies[0][2]
        # Other bytes: the original's answer where the rules are the record's
        # (same payload, same fingerprint), the new problem where they are not.
        for key in answers:
            statuses = []
            for port in ports:
                status, headers, body = send(port, key, OTHER_BYTES)
                statuses.append(status)
                if status == 201:
                    assert headers.get("idempotent-replayed") == "true"
                    assert body == bodies[key]
                else:
                    assert status == 422, body
                    assert headers["content-type"] == "application/problem+json"
                    assert json.loads(body)["type"] == RULES_CHANGED
            # The version that made the record replays; the other cannot tell.
            assert sorted(statuses) == [201, 422], (key, statuses)
    finally:
        for proc in servers:
            proc.kill()
            proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
    engine = sa.create_engine(fresh_database)
    try:
        with engine.connect() as conn:
            counts = dict(
                conn.execute(
                    sa.text("SELECT body, count(*) FROM deploy_orders GROUP BY body")
                ).all()
            )
    finally:
        engine.dispose()
    assert counts == {f"deploy-{n}": 1 for n in range(KEYS)}
