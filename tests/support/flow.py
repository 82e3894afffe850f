"""The test client's side of the request flow tests: a keyed POST, the check of a
problem+json answer, and a record left in progress as by a worker that died."""

from __future__ import annotations

import datetime as dt
import json
import typing as t

from flask import Flask

from flask_idempotency import IN_PROGRESS
from tests.conftest import Clock, insert_records
from tests.support import testapp

PROBLEM = "application/problem+json"


def post(
    client: t.Any, path: str, body: t.Any = None, key: str | None = "k1", **kw: t.Any
) -> t.Any:
    headers = dict(kw.pop("headers", {}))
    if key is not None:
        headers["Idempotency-Key"] = key
    if body is not None and "data" not in kw:
        kw["data"] = json.dumps(body)
        kw.setdefault("content_type", "application/json")
    return client.post(path, headers=headers, **kw)


def assert_problem(response: t.Any, status: int) -> dict[str, t.Any]:
    assert response.status_code == status, response.get_data(as_text=True)
    assert response.mimetype == PROBLEM
    doc = response.get_json(force=True)
    assert doc["status"] == status
    assert {"type", "title", "detail"} <= set(doc)
    return t.cast(dict[str, t.Any], doc)


def abandon(app: Flask, clock: Clock, *, path: str = "/status/201", key: str = "k1") -> None:
    """Leave an in-progress record as a worker that committed and died would."""
    with app.app_context(), app.test_request_context(path, method="POST", json={}):
        from flask_idempotency._request.fingerprint import request_fingerprint

        _, fingerprint = request_fingerprint(None, ())
        with testapp.db.engine.begin() as conn:
            insert_records(
                conn,
                [
                    {
                        "scope": "t.status",
                        "key": key,
                        "request_hash": fingerprint,
                        "status": IN_PROGRESS,
                        "fencing_token": 1,
                        "body_omitted": False,
                        "locked_until": clock.now + dt.timedelta(seconds=60),
                        "created_at": clock.now,
                        "expires_at": clock.now + dt.timedelta(hours=24),
                    }
                ],
            )
