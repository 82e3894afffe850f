"""``flask idempotency generate-key`` and ``reseal``, on every engine: records
and outbox rows re-sealed from key A to key B in batches, resumed from a
position, a value that does not open counted and left, a row that changed (or
is held) under the run never overwritten; afterwards key B alone opens all."""

from __future__ import annotations

import json
import logging
import re
import typing as t
from pathlib import Path

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idempotency._cli import EXIT_CONFIG, EXIT_DATABASE, EXIT_FAILED, EXIT_OK, EXIT_USAGE
from flask_idempotency._messaging.relay import relay_batch
from flask_idempotency._storage import reseal as reseal_module
from flask_idempotency._storage import seal, text_param
from flask_idempotency._storage.reseal import Walk
from flask_idempotency._storage.schema import _text, outbox_table
from flask_idempotency.publishers import ListPublisher
from tests.support import outbox_app
from tests.support.keyrings import KEY_A, KEY_B, keys_config
from tests.support.outbox import post, reset
from tests.unit.test_cli_ops import assert_one_line_error, unreachable_url

RECORDS = "idempotency_keys"
RECORD_COLUMNS = (*seal.RECORD_TEXT, *seal.RECORD_BINARY)


@pytest.fixture
def make_app(database_url: str) -> t.Iterator[t.Callable[..., Flask]]:
    reset(database_url)
    made: list[Flask] = []

    def make(*keys: tuple[str, bytes]) -> Flask:
        config = keys_config(*keys)
        if keys:  # the seeds written before encryption was on still open
            config["IDEMPOTENCY_ENCRYPTION_ALLOW_CLEAR"] = True
        app = outbox_app.create_app(database_url, **config)
        made.append(app)
        return app

    yield make
    for app in made:
        with app.app_context():
            outbox_app.db.engine.dispose()


def invoke(app: Flask, *args: str) -> t.Any:
    return app.test_cli_runner().invoke(args=["idempotency", *args])


def engine(app: Flask) -> sa.Engine:
    with app.app_context():
        return t.cast(sa.Engine, outbox_app.db.engine)


def records(app: Flask) -> list[dict[str, t.Any]]:
    with engine(app).connect() as conn:
        query = sa.text(f"SELECT * FROM {RECORDS} ORDER BY scope, {quote(app, 'key')}")
        return [dict(r._mapping) for r in conn.execute(query)]


def events(app: Flask) -> list[dict[str, t.Any]]:
    with engine(app).connect() as conn:
        return [dict(r._mapping) for r in conn.execute(sa.text("SELECT * FROM idempotency_outbox"))]


def quote(app: Flask, name: str) -> str:
    return engine(app).dialect.identifier_preparer.quote(name)


def key_ids(rows: list[dict[str, t.Any]], columns: t.Iterable[str]) -> set[str | None]:
    return {seal.key_id_of(r[c]) for r in rows for c in columns if r[c] is not None}


def seed(database_url: str, make_app: t.Callable[..., Flask]) -> Flask:
    """Four orders, each a record and an event: two written in clear (before
    encryption was on), then two sealed with A; the app under [B, A], still
    reading clear values (ALLOW_CLEAR: reseal seals them)."""
    before = make_app()
    under_a = make_app(KEY_A)
    for n in range(4):
        app = before if n < 2 else under_a
        assert post(app, key=f"k{n}", amount=4200 + n).status_code == 201
    rows = records(under_a)
    assert [seal.key_id_of(r["response_body"]) for r in rows] == [None, None, "A", "A"]
    assert [seal.key_id_of(e["payload"]) for e in events(under_a)] == [None, None, "A", "A"]
    return make_app(KEY_B, KEY_A)


def opens_with_b_alone(app: Flask, database_url: str) -> None:
    """Every record value and event opens with key B alone (and names B)."""
    ring_b = seal.Keyring(keys=(KEY_B,))
    rows = records(app)
    assert key_ids(rows, RECORD_COLUMNS) == {"B"}
    for row in rows:
        scope, key = t.cast(str, _text(row["scope"])), t.cast(str, _text(row["key"]))
        opened = seal.open_record(ring_b, RECORDS, scope, key, row)
        assert b'"order"' in bytes(opened["response_body"])
    assert key_ids(events(app), seal.OUTBOX_TEXT) == {"B"}
    only_b = outbox_app.create_app(database_url, **keys_config(KEY_B))
    publisher = ListPublisher()
    run = relay_batch(only_b, publisher)
    assert (run.published, run.failed) == (len(events(app)), 0)
    assert sorted(e.payload["amount"] for e in publisher.events) == [4200, 4201, 4202, 4203]


def ring_ba() -> seal.Keyring:
    return seal.Keyring(keys=(KEY_B, KEY_A), allow_clear=True)


def test_generate_key_prints_a_key_line_the_setting_takes(make_app: t.Callable[..., Flask]) -> None:
    app = make_app()
    result = invoke(app, "generate-key", "--id", "2027-01")
    assert result.exit_code == EXIT_OK, result.output
    kid, _, key = result.output.strip().partition(":")
    assert kid == "2027-01"
    assert len(seal.parse_key(key, "test")) == 32
    default = invoke(app, "generate-key").output.strip()
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}:[A-Za-z0-9_-]{43}=", default), default
    assert default.split(":")[1] != key
    bad = invoke(app, "generate-key", "--id", "no spaces")
    assert bad.exit_code == EXIT_USAGE
    assert "--id" in bad.output


def test_reseal_moves_records_and_events_from_a_to_b(
    database_url: str, make_app: t.Callable[..., Flask]
) -> None:
    app = seed(database_url, make_app)
    before = records(app)
    assert key_ids(before, RECORD_COLUMNS) <= {"A", None}
    result = invoke(app, "reseal", "--batch", "3")
    assert result.exit_code == EXIT_OK, (result.output, result.stderr)
    assert "records: 4 re-sealed with key 'B' of 4 read" in result.stdout
    assert "outbox: 4 re-sealed with key 'B' of 4 read" in result.stdout
    positions = re.findall(r"position (\S+)", result.stderr)
    assert positions[-1] == "outbox:4"
    assert positions[0].startswith("records:[")
    opens_with_b_alone(app, database_url)
    done = records(app), events(app)
    again = invoke(app, "reseal")  # nothing left to do: nothing is rewritten
    assert again.exit_code == EXIT_OK
    assert "0 re-sealed" in again.stdout
    assert (records(app), events(app)) == done


def test_reseal_resumes_from_a_position(
    database_url: str, make_app: t.Callable[..., Flask]
) -> None:
    app = seed(database_url, make_app)
    keys = [[_text(r["scope"]), _text(r["key"])] for r in records(app)]
    result = invoke(app, "reseal", "--table", "records", "--from", "records:" + json.dumps(keys[1]))
    # The rows before the position are still under A or in clear: the check
    # over the whole table counts them, and the run is not a signal to drop A.
    assert result.exit_code == EXIT_FAILED, (result.output, result.stderr)
    assert "records: 2 re-sealed" in result.stdout
    assert "records: 2 row(s) not sealed with key 'B'" in result.stdout
    assert "outbox" not in result.stdout
    rows = records(app)
    assert key_ids(rows[2:], RECORD_COLUMNS) == {"B"}
    assert "B" not in key_ids(rows[:2], RECORD_COLUMNS)
    result = invoke(app, "reseal", "--from", "outbox:2")  # --table all: the outbox only
    assert result.exit_code == EXIT_FAILED, (result.output, result.stderr)
    assert "records: 0 re-sealed" not in result.stdout  # not walked, but checked
    assert "records: 2 row(s) not sealed with key 'B'" in result.stdout
    assert "outbox: 2 row(s) not sealed with key 'B'" in result.stdout
    by_id = {int(e["id"]): e for e in events(app)}
    assert [seal.key_id_of(by_id[i]["payload"]) for i in (1, 2, 3, 4)] == [None, None, "B", "B"]
    bad = invoke(app, "reseal", "--table", "outbox", "--from", 'records:["s","k"]')
    assert bad.exit_code == EXIT_USAGE
    assert invoke(app, "reseal", "--from", "nowhere").exit_code == EXIT_USAGE
    result = invoke(app, "reseal")  # a run from the start leaves none: exit 0
    assert result.exit_code == EXIT_OK, (result.output, result.stderr)
    assert "records: 0 row(s) not sealed with key 'B'" in result.stdout
    opens_with_b_alone(app, database_url)
    # One binary value sealed with A (its prefix names A), the rest with B: counted.
    scope, key = keys[0]
    under_a = seal.seal_record(
        seal.Keyring(keys=(KEY_A,)), RECORDS, scope, key, {"response_body": b"{}"}
    )
    with app.app_context():
        table = app.extensions["idempotency"].store.table
    with engine(app).begin() as conn:
        conn.execute(
            sa.update(table)
            .where(table.c.scope == text_param("s", scope), table.c.key == text_param("k", key))
            .values(under_a)
        )
    result = invoke(app, "reseal", "--table", "records", "--from", "records:" + json.dumps(keys[3]))
    assert result.exit_code == EXIT_FAILED, (result.output, result.stderr)
    assert "records: 1 row(s) not sealed with key 'B'" in result.stdout


def test_a_resumed_run_counts_what_a_cut_off_run_left_before_its_position(
    database_url: str, make_app: t.Callable[..., Flask]
) -> None:
    """A run cut off forgets, with its process, the rows it skipped: the run
    resumed after its position ends with a check over the whole table."""
    app = seed(database_url, make_app)
    with app.app_context():
        walk = Walk("outbox", outbox_table(outbox_app.db.metadata), ring_ba())
    with engine(app).begin() as conn:  # the cut-off run re-sealed event 2, not event 1
        row = conn.execute(sa.select(*walk.columns()).where(walk.at([2]))).one()
        assert walk.swap(conn, row, walk.resealed(row))
    result = invoke(app, "reseal", "--table", "outbox", "--from", "outbox:2")
    assert result.exit_code == EXIT_FAILED, (result.output, result.stderr)
    assert "outbox: 2 re-sealed" in result.stdout
    assert "outbox: 1 row(s) not sealed with key 'B'" in result.stdout
    assert "1 row(s) still not sealed" in result.output


@pytest.mark.parametrize(
    "position",
    [
        'records:["\\ud800","k"]',  # a lone surrogate: no database can hold it
        'records:["a\\u0000","k"]',  # NUL
        "outbox:99999999999999999999999",  # beyond BIGINT
        "outbox:-1",
        "outbox: 1",
        "outbox:1e3",
        'records:["a"]',
        'records:["a",1]',
    ],
)
def test_a_position_no_row_can_have_is_a_usage_error(
    make_app: t.Callable[..., Flask], position: str
) -> None:
    app = make_app(KEY_B)
    line = assert_one_line_error(
        invoke(app, "reseal", "--from", position), EXIT_USAGE, "--from", "not a position"
    )
    assert "Traceback" not in line


def test_rows_held_anywhere_in_a_batch_are_counted_and_left(
    database_url: str, make_app: t.Callable[..., Flask]
) -> None:
    """Held rows past the first of a batch (SKIP LOCKED takes the rows after
    them instead) are counted too: the batch is a window of positions read
    without locks, and what it could not take in it was held."""
    if database_url.startswith("sqlite"):
        pytest.skip("SQLite has one writer: a held write lock holds every table")
    app = seed(database_url, make_app)
    with app.app_context():
        table = outbox_table(outbox_app.db.metadata)
    holder = engine(app).connect()
    try:
        with holder.begin():
            for held in (2, 3):  # as a claim or the relay holds a row: by its key
                holder.execute(sa.select(table.c.id).where(table.c.id == held).with_for_update())
            result = invoke(app, "reseal", "--table", "outbox", "--batch", "2")
            assert result.exit_code == EXIT_FAILED, (result.output, result.stderr)
            assert "outbox: 2 re-sealed" in result.stdout
            assert "2 changed under the run" in result.stdout
            assert "outbox: 2 row(s) not sealed with key 'B'" in result.stdout
    finally:
        holder.close()
    by_id = {int(e["id"]): seal.key_id_of(e["payload"]) for e in events(app)}
    assert by_id == {1: "B", 2: None, 3: "A", 4: "B"}
    result = invoke(app, "reseal", "--table", "outbox")
    assert result.exit_code == EXIT_OK, (result.output, result.stderr)
    assert "outbox: 2 re-sealed" in result.stdout


def test_a_value_that_does_not_open_is_counted_and_left_as_it_is(
    database_url: str, make_app: t.Callable[..., Flask], monkeypatch: pytest.MonkeyPatch
) -> None:
    app = seed(database_url, make_app)
    with engine(app).begin() as conn:  # event 4 gets event 3's sealed payload
        [payload] = conn.execute(sa.text("SELECT payload FROM idempotency_outbox WHERE id = 3"))
        conn.execute(
            sa.text("UPDATE idempotency_outbox SET payload = :p WHERE id = 4"), {"p": payload[0]}
        )
    # Reseal's log, read through a logger of the test's own put in its place:
    # what other tests in this process did to logging's state cannot hide it.
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    own = logging.Logger("reseal-under-test")
    own.addHandler(handler)
    monkeypatch.setattr(reseal_module, "logger", own)
    monkeypatch.setattr(logging.root.manager, "disable", logging.NOTSET)
    result = invoke(app, "reseal")
    assert result.exit_code == EXIT_FAILED, result.output
    assert "outbox: 3 re-sealed" in result.stdout
    assert "1 unreadable" in result.stdout
    [line] = [message for message in lines if "reseal: skipped" in message]
    assert "idempotency_outbox.payload of event" in line
    assert "'A'" in line
    by_id = {int(e["id"]): e for e in events(app)}
    assert by_id[4]["payload"] == payload[0]  # never rewritten


def test_no_keys_is_misconfigured(make_app: t.Callable[..., Flask]) -> None:
    app = make_app()
    result = invoke(app, "reseal")
    assert result.exit_code == EXIT_CONFIG
    assert "IDEMPOTENCY_ENCRYPTION_KEYS" in result.output


def test_a_row_that_changed_after_it_was_read_is_not_overwritten(
    database_url: str, make_app: t.Callable[..., Flask]
) -> None:
    """The compare-and-swap: a completion (here, a new response body) written
    between reseal's read and its update stands."""
    app = seed(database_url, make_app)
    with app.app_context():
        state = app.extensions["idempotency"]
        ring = ring_ba()
        walk = Walk("records", state.store.table, ring)
        with engine(app).begin() as conn:
            row = conn.execute(sa.select(*walk.columns()).order_by(*walk.key).limit(1)).one()
        new = walk.resealed(row)
        scope, key = t.cast(str, _text(row.scope)), t.cast(str, _text(row.key))
        theirs = seal.seal_record(ring, RECORDS, scope, key, {"response_body": b"meanwhile"})
        table = state.store.table
        with engine(app).begin() as conn:
            conn.execute(
                sa.update(table)
                .where(table.c.scope == text_param("s", scope), table.c.key == text_param("k", key))
                .values(theirs)
            )
        with engine(app).begin() as conn:
            assert walk.swap(conn, row, new) is False
        stored = records(app)[0]
        assert bytes(stored["response_body"]) == theirs["response_body"]
        assert stored["response_headers"] == row.response_headers
        with engine(app).begin() as conn:  # as read, it swaps
            fresh = conn.execute(sa.select(*walk.columns()).where(walk.at([scope, key]))).one()
            assert walk.swap(conn, fresh, walk.resealed(fresh)) is True


def test_a_row_held_by_a_transaction_is_skipped_and_left_for_the_next_run(
    database_url: str, make_app: t.Callable[..., Flask]
) -> None:
    """A request's claim holds its record's row for its whole transaction:
    reseal skips it (never waits on it), counts it, and a later run re-seals it."""
    if database_url.startswith("sqlite"):
        pytest.skip("SQLite has one writer: a held write lock holds every table")
    app = seed(database_url, make_app)
    first = records(app)[0]
    with app.app_context():
        table = app.extensions["idempotency"].store.table
    holder = engine(app).connect()
    try:
        with holder.begin():
            holder.execute(
                sa.select(table.c.key)
                .where(
                    table.c.scope == text_param("s", _text(first["scope"])),
                    table.c.key == text_param("k", _text(first["key"])),
                )
                .with_for_update()
            ).all()
            result = invoke(app, "reseal", "--table", "records", "--batch", "2")
            assert result.exit_code == EXIT_FAILED, (result.output, result.stderr)
            assert "records: 3 re-sealed" in result.stdout
            assert "1 changed under the run" in result.stdout
    finally:
        holder.close()
    assert "B" not in key_ids(records(app)[:1], RECORD_COLUMNS)
    result = invoke(app, "reseal", "--table", "records")
    assert result.exit_code == EXIT_OK
    assert "records: 1 re-sealed" in result.stdout


def test_reseal_with_the_database_down_exits_69_in_one_line(
    database_url: str, tmp_path: Path
) -> None:
    app = outbox_app.create_app(unreachable_url(database_url, tmp_path), **keys_config(KEY_B))
    line = assert_one_line_error(
        invoke(app, "reseal"), EXIT_DATABASE, "the database", "is unavailable"
    )
    assert "SELECT" not in line


def test_an_erased_event_keeps_its_placeholder_and_is_never_published(
    database_url: str, make_app: t.Callable[..., Flask]
) -> None:
    # Erasure and outbox-retry know an erased event by its clear placeholder:
    # sealed by a reseal, it would be un-parked and published.
    from flask_idempotency._storage.schema import ERASED_PAYLOAD

    app = seed(database_url, make_app)
    with engine(app).begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE idempotency_outbox SET payload = :p, headers = NULL, failed_at = "
                "created_at WHERE id = 1"
            ),
            {"p": ERASED_PAYLOAD},
        )
    assert invoke(app, "reseal").exit_code == EXIT_OK
    erased = next(e for e in events(app) if e["id"] == 1)
    assert erased["payload"] == ERASED_PAYLOAD
    assert invoke(app, "outbox-retry").exit_code in (EXIT_OK, EXIT_FAILED)
    publisher = ListPublisher()
    relay_batch(app, publisher)
    assert sorted(e.payload["amount"] for e in publisher.events) == [4201, 4202, 4203]
