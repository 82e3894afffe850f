"""psycopg2's and psycopg 3's direct path: the claim's batch and the fenced
statements go to the driver's cursor where nothing observes statements, and
through SQLAlchemy (seen by every listener) where something does."""

from __future__ import annotations

import datetime as dt
import typing as t
import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import Session

from flask_idempotency._storage import Store, drivers
from tests.conftest import postgres_url, reset_tables
from tests.support import testapp
from tests.support.claims import HOUR, claim_values


def _claim_and_complete(engine: sa.Engine, store: Store, key: str) -> bool:
    now = dt.datetime.now(dt.timezone.utc)
    values = claim_values(key, now)
    with Session(engine) as session:
        assert store.claim(session, values, dt.timedelta(seconds=5)) == (True, None)
        done = store.complete(
            session,
            "outcomes",
            key,
            values["fencing_token"],
            response_code=201,
            response_headers=[],
            response_body=b"{}",
            body_omitted=False,
            now=now,
            expires_at=now + HOUR,
        )
        session.commit()
    return done


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_direct_unless_observed(driver: str, monkeypatch: pytest.MonkeyPatch) -> None:
    url = postgres_url(driver)
    reset_tables(url)
    engine = sa.create_engine(url)
    store = Store(testapp.db.metadata.tables["idempotency_keys"])
    ran: list[str] = []
    real = drivers.FastPath.run

    def counted(self: t.Any, connection: sa.Connection, sql: str, params: t.Any) -> t.Any:
        ran.append(sql.split()[0])
        return real(self, connection, sql, params)

    monkeypatch.setattr(drivers.FastPath, "run", counted)
    try:
        # Direct exactly where nothing observes the engine's statements: a
        # listener another test left on every Engine (in the same process) turns
        # the direct path off, as it must.
        with engine.connect() as probe:
            direct = drivers.unobserved(probe)
        assert _claim_and_complete(engine, store, str(uuid.uuid4()))
        # the completion (the claim is one batch)
        assert ran == (["UPDATE"] if direct else [])
        seen: list[str] = []

        def listener(*args: t.Any) -> None:
            seen.append(args[2])

        event.listen(engine, "before_cursor_execute", listener)
        ran.clear()
        key = str(uuid.uuid4())
        assert _claim_and_complete(engine, store, key)
        event.remove(engine, "before_cursor_execute", listener)
        assert ran == []
        statements = " ".join(seen)
        if driver == "psycopg2":  # psycopg 3's batch is its ClientCursor's either way
            assert "INSERT INTO idempotency_keys" in statements
        assert "UPDATE idempotency_keys" in statements
        done = store.load_committed(engine, "outcomes", key)
        assert done is not None
        assert done.status == "completed"
    finally:
        engine.dispose()
