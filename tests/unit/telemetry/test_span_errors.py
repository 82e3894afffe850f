"""What a span records of an error: its type, never its text. SQLAlchemy's text
of a database error carries the statement's parameters (the scope, the key, the
response stored, an event id), and the extension's own internal errors name the
scope and key they concern; none of it may reach a trace."""

from __future__ import annotations

import sqlite3
import typing as t
from pathlib import Path

import pytest
import sqlalchemy as sa
from flask import request
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.trace import StatusCode

from flask_idempotency._messaging import inbox
from flask_idempotency._messaging.outbox import OutboxEvent, add_event
from flask_idempotency._messaging.relay import relay_once
from flask_idempotency._telemetry import safety
from flask_idempotency.errors import DatabaseUnavailableError, RecordGone
from flask_idempotency.publishers import CallablePublisher
from tests.conftest import Clock, reset_tables
from tests.support import outbox_app, testapp
from tests.support.flow import assert_problem, post
from tests.support.outbox import reset
from tests.support.tracing import named, sdk_tracing

from .conftest import Otel

SECRETS = ("SECRET-KEY", "SECRET-TENANT", "SECRET-BODY", "4111-1111", "SECRET-EVENT")


def everything_recorded(span: ReadableSpan) -> str:
    """All a span carries, as text: its name, attributes, status, events."""
    parts = [span.name, repr(dict(span.attributes or {})), span.status.description or ""]
    for event in span.events:
        parts += [event.name, repr(dict(event.attributes or {}))]
    return "\n".join(parts)


def assert_no_secret(spans: t.Iterable[ReadableSpan]) -> None:
    for span in spans:
        text = everything_recorded(span)
        for secret in SECRETS:
            assert secret not in text, (span.name, secret, text)


def test_a_database_outage_puts_no_key_scope_or_body_on_any_span(
    otel: Otel, pg_url: str, clock: Clock
) -> None:
    """The app's connection is killed between two requests (the claim's INSERT
    fails) and inside a view (the completion's UPDATE fails): 503 each, and the
    claim and complete spans say which error, never its statement's parameters."""
    app = testapp.create_app(
        pg_url, clock=clock, SQLALCHEMY_ENGINE_OPTIONS={"pool_size": 1, "max_overflow": 5}
    )
    reset_tables(pg_url)
    admin = sa.create_engine(pg_url, poolclass=sa.pool.NullPool)

    def kill(pid: int) -> None:
        with admin.connect() as conn:
            conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})

    @app.post("/secret")
    @testapp.idem.idempotent(scope=lambda: "tenant:SECRET-TENANT")
    def secret() -> tuple[dict[str, t.Any], int]:
        if (request.get_json() or {}).get("kill"):
            kill(testapp.db.session.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())
        return {"card": "4111-1111-1111-1111"}, 201

    client = app.test_client()
    try:
        assert (
            post(client, "/secret", {"note": "SECRET-BODY"}, key="SECRET-KEY-1").status_code == 201
        )
        with app.app_context():  # the pool's one idle connection, killed
            pid = testapp.db.session.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
            testapp.db.session.commit()
        kill(pid)
        assert_problem(post(client, "/secret", {"note": "SECRET-BODY"}, key="SECRET-KEY-2"), 503)
        answer = post(client, "/secret", {"kill": True, "note": "SECRET-BODY"}, key="SECRET-KEY-3")
        assert_problem(answer, 503)
    finally:
        admin.dispose()
        with app.app_context():
            testapp.db.engine.dispose()
    spans = otel.spans()
    failed = [s for s in spans if s.status.status_code is StatusCode.ERROR]
    assert sorted(s.name for s in failed) == ["idempotency claim", "idempotency complete"]
    for span in failed:
        [event] = span.events
        assert event.name == "exception"
        attributes = dict(event.attributes or {})
        assert attributes["exception.type"] == "sqlalchemy.exc.OperationalError"
        # The driver's class (psycopg2's or psycopg 3's), no text of it.
        assert str(attributes["exception.message"]).startswith("psycopg")
        assert "[SQL" not in str(attributes["exception.stacktrace"])
        assert span.status.description == "OperationalError"
    assert_no_secret(spans)


def test_an_inbox_delivery_that_fails_puts_no_event_id_on_its_span(tmp_path: Path) -> None:
    """SQLite, another writer holds the database: the inbox's insert fails, with
    the consumer and event id in SQLAlchemy's text; the CONSUMER span has neither."""
    path = tmp_path / "inbox.sqlite3"
    url = f"sqlite:///{path}"
    app = outbox_app.create_app(url, SQLALCHEMY_ENGINE_OPTIONS={"connect_args": {"timeout": 0.1}})
    reset(url)
    other = sqlite3.connect(path, timeout=0)
    try:
        with sdk_tracing() as (_, exporter), app.app_context():
            other.execute("BEGIN IMMEDIATE")
            with (
                pytest.raises(sa.exc.OperationalError, match="SECRET-EVENT"),
                inbox.process(
                    outbox_app.db.session,
                    consumer="shipping",
                    event_id="order-SECRET-EVENT-42",
                    commit=True,
                ),
            ):
                pass
            spans = list(exporter.get_finished_spans())
    finally:
        other.rollback()
        other.close()
        with app.app_context():
            outbox_app.db.engine.dispose()
    [span] = named(spans, "idempotency.inbox process")
    assert span.status.status_code is StatusCode.ERROR
    [event] = span.events
    assert dict(event.attributes or {})["exception.type"] == "sqlalchemy.exc.OperationalError"
    assert_no_secret(spans)


def test_a_failed_publish_puts_no_payload_on_its_span(tmp_path: Path, clock: Clock) -> None:
    """A publisher whose error quotes the event: the PRODUCER span has the type."""
    url = f"sqlite:///{tmp_path / 'relay.sqlite3'}"
    app = outbox_app.create_app(url, clock=clock)
    reset(url)
    with app.app_context():
        add_event(outbox_app.db.session, "t", {"card": "4111-1111"}, event_id="SECRET-EVENT-1")
        outbox_app.db.session.commit()

    def publish(event: OutboxEvent) -> None:
        raise TypeError(f"cannot send {event.event_id}: {event.payload}")

    try:
        with sdk_tracing() as (_, exporter):
            assert relay_once(app, CallablePublisher(publish)) == 0
            spans = list(exporter.get_finished_spans())
    finally:
        with app.app_context():
            outbox_app.db.engine.dispose()
    [span] = named(spans, "idempotency.outbox publish")
    [event] = span.events
    assert dict(event.attributes or {}) == {
        "exception.type": "TypeError",
        "exception.stacktrace": dict(event.attributes or {})["exception.stacktrace"],
    }
    assert span.status.description == "TypeError"
    assert_no_secret(spans)


def test_the_rule_type_always_a_message_only_where_public_and_fixed() -> None:
    """A problem: its title; a database error: its driver's class; anything
    else (the extension's internal errors name scope and key): the type alone."""
    provider = TracerProvider()
    tracer = provider.get_tracer("test")

    def recorded(error: BaseException) -> dict[str, t.Any]:
        try:
            raise error
        except BaseException as raised:
            span = tracer.start_span("s")
            safety.record_error(span, raised, trace)
            span.end()
            assert isinstance(span, ReadableSpan)
            [event] = span.events
            return dict(event.attributes or {})

    gone = recorded(RecordGone("'tenant:SECRET-TENANT' 'SECRET-KEY-1'"))
    assert gone["exception.type"] == "flask_idempotency.errors.RecordGone"
    assert "exception.message" not in gone
    assert "test_span_errors.py" in gone["exception.stacktrace"]  # where, not what
    problem = recorded(DatabaseUnavailableError("detail naming SECRET-KEY-1"))
    assert problem["exception.message"] == DatabaseUnavailableError.title
    database = recorded(
        sa.exc.IntegrityError("INSERT", {"key": "SECRET-KEY-1"}, sqlite3.IntegrityError("x"))
    )
    assert database["exception.message"] == "sqlite3.IntegrityError"
    for attributes in (gone, problem, database):
        assert not any(secret in repr(attributes) for secret in SECRETS)
    provider.shutdown()
