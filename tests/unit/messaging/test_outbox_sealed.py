"""The outbox with encryption at rest, on every engine: payload and headers are
sealed at emit for their event id, opened by the relay before it publishes,
and an event that does not open is never published."""

from __future__ import annotations

import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idempotency import EventIdConflictError
from flask_idempotency._messaging.outbox import OutboxEvent, add_event
from flask_idempotency._messaging.relay import relay_batch, relay_once
from flask_idempotency._storage import seal
from flask_idempotency._storage.schema import outbox_table
from flask_idempotency.publishers import CallablePublisher, ListPublisher
from tests.conftest import Clock
from tests.support import outbox_app
from tests.support.keyrings import KEY_A, KEY_B, keys_config
from tests.support.outbox import post, reset, rows


@pytest.fixture
def make_app(database_url: str, clock: Clock) -> t.Iterator[t.Callable[..., Flask]]:
    """Apps on one fresh outbox, each with the keys it is given (``None``: off)."""
    reset(database_url)
    made: list[Flask] = []

    def make(*keys: tuple[str, bytes]) -> Flask:
        app = outbox_app.create_app(
            database_url, clock=clock, IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS=3, **keys_config(*keys)
        )
        made.append(app)
        return app

    yield make
    for app in made:
        with app.app_context():
            outbox_app.db.engine.dispose()


def text(value: t.Any) -> str:
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


def raw(app: Flask, sql: str, **params: t.Any) -> list[t.Any]:
    with app.app_context(), outbox_app.db.engine.begin() as conn:
        result = conn.execute(sa.text(sql), params)
        return list(result) if result.returns_rows else []


def test_payload_and_headers_are_sealed_at_rest_and_published_in_clear(
    make_app: t.Callable[..., Flask],
) -> None:
    app = make_app(KEY_A)
    assert post(app, key="k1", amount=777001).status_code == 201
    with app.app_context():
        session = outbox_app.db.session
        add_event(session, "audit", {"card": "777002"}, event_id="e-h", headers={"x-m": "777003"})
        session.commit()
    stored = raw(app, "SELECT event_id, payload, headers FROM idempotency_outbox ORDER BY id")
    assert len(stored) == 2
    # Whole clear values: a short one (say "777") turns up in random base64 now and then.
    clear = ("777001", "777002", "777003", "amount", "card")
    for _event_id, payload, headers in stored:
        assert seal.key_id_of(payload) == "A", payload
        assert not [c for c in clear if c in payload], payload
        if headers is not None:
            assert seal.key_id_of(headers) == "A", headers
            assert not [c for c in clear if c in headers], headers
    assert stored[1].headers is not None
    publisher = ListPublisher()
    assert relay_once(app, publisher) == 2
    assert [e.payload for e in publisher.events] == [
        {"amount": 777001, "order": 1},
        {"card": "777002"},
    ]
    assert publisher.events[1].headers["x-m"] == "777003"
    assert all(r["published_at"] is not None for r in rows(app))


def test_a_repeated_emit_is_compared_with_the_opened_payload(
    make_app: t.Callable[..., Flask],
) -> None:
    """A sealed payload differs at every seal: the emit's check that an id names
    one event opens the stored one. A conflict's message carries no payload."""
    app = make_app(KEY_A)
    with app.app_context():
        session = outbox_app.db.session
        add_event(session, "t", {"a": 1, "b": 2}, event_id="e1")
        session.commit()
        assert add_event(session, "t", {"b": 2, "a": 1}, event_id="e1") == "e1"
        with pytest.raises(EventIdConflictError) as caught:
            add_event(session, "t", {"a": 3777}, event_id="e1")
        assert "payload of 13 characters" in str(caught.value)  # its size, never its text
        assert "3777" not in str(caught.value)
        session.commit()
    assert len(rows(app)) == 1


def test_events_written_in_clear_still_publish_once_keys_are_set(
    make_app: t.Callable[..., Flask],
) -> None:
    before = make_app()
    with before.app_context():
        add_event(outbox_app.db.session, "t", {"n": 1}, event_id="clear", headers={"h": "v"})
        outbox_app.db.session.commit()
    after = make_app(KEY_A)
    with after.app_context():  # the same event again: compared with the clear row
        assert add_event(outbox_app.db.session, "t", {"n": 1}, event_id="clear") == "clear"
        outbox_app.db.session.commit()
    publisher = ListPublisher()
    assert relay_once(after, publisher) == 1
    assert publisher.events[0].payload == {"n": 1}
    assert publisher.events[0].headers == {"h": "v"}


def test_an_event_copied_under_another_event_id_is_parked_never_published(
    make_app: t.Callable[..., Flask], caplog: pytest.LogCaptureFixture
) -> None:
    """A sealed payload copied into another event's row does not open there:
    that event is parked at once (no configuration can open it), its
    last_error naming the key id; the other events of the batch are published."""
    app = make_app(KEY_A)
    with app.app_context():
        session = outbox_app.db.session
        for n in (1, 2, 3):
            add_event(session, "t", {"n": n}, event_id=f"e{n}")
        session.commit()
    [(sealed_e1,)] = raw(app, "SELECT payload FROM idempotency_outbox WHERE id = 1")
    raw(app, "UPDATE idempotency_outbox SET payload = :p WHERE id = 2", p=sealed_e1)
    published: list[OutboxEvent] = []
    run = relay_batch(app, CallablePublisher(published.append))
    assert [e.event_id for e in published] == ["e1", "e3"]
    assert [e.payload for e in published] == [{"n": 1}, {"n": 3}]
    assert (run.published, run.failed) == (2, 1)
    stored = {text(r["event_id"]): r for r in rows(app)}
    assert stored["e2"]["published_at"] is None
    assert stored["e2"]["failed_at"] is not None
    assert "'A'" in stored["e2"]["last_error"]
    assert "does not open" in stored["e2"]["last_error"]
    assert "SealBroken" in stored["e2"]["last_error"]
    assert any(
        "not published" in r.getMessage() and "'A'" in r.getMessage() for r in caplog.records
    )


def test_an_event_whose_key_is_not_configured_backs_off_and_opens_once_it_is(
    make_app: t.Callable[..., Flask], clock: Clock
) -> None:
    """A relay without the event's key (a host whose config lags a rolling
    deploy) publishes nothing of it: the failure is counted and backed off,
    last_error names the missing key id; a relay with the key publishes it."""
    sealing = make_app(KEY_B, KEY_A)
    with sealing.app_context():
        add_event(outbox_app.db.session, "t", {"n": 1}, event_id="by-b")
        outbox_app.db.session.commit()
    lagging = make_app(KEY_A)
    publisher = ListPublisher()
    run = relay_batch(lagging, publisher)
    assert (run.published, run.failed, publisher.events) == (0, 1, [])
    [row] = rows(lagging)
    assert row["failed_at"] is None
    assert row["attempts"] == 1
    assert "'B'" in row["last_error"]
    assert "not configured" in row["last_error"]
    off = make_app()  # encryption off: nothing opens, nothing is published
    clock.advance(seconds=60)
    assert relay_once(off, publisher) == 0
    assert publisher.events == []
    assert "not configured" in rows(off)[0]["last_error"]
    clock.advance(seconds=60)
    assert relay_once(sealing, publisher) == 1
    assert publisher.events[0].payload == {"n": 1}


def test_the_relay_checks_the_table_it_was_given(make_app: t.Callable[..., Flask]) -> None:
    """The payload's seal names this table: the same value read as another
    column (headers) does not open."""
    app = make_app(KEY_A)
    with app.app_context():
        add_event(outbox_app.db.session, "t", {"n": 1}, event_id="e1", headers={"h": "1"})
        outbox_app.db.session.commit()
        table = outbox_table(outbox_app.db.metadata)
    raw(app, f"UPDATE {table.name} SET headers = payload")
    run = relay_batch(app, ListPublisher())
    assert (run.published, run.failed) == (0, 1)
    assert rows(app)[0]["failed_at"] is not None
