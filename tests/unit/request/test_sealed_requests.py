"""Encryption at rest through requests, on every engine: what the table holds is
sealed, what a retry gets is the exact answer; a value that does not open is a
500 ``record-unreadable`` that changes nothing and shows no other record's data."""

from __future__ import annotations

import json
import logging
import typing as t
import uuid

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idempotency import IN_PROGRESS
from flask_idempotency._maintenance.jobs import recover_abandoned
from flask_idempotency._storage import text_param
from tests.conftest import Clock, ledger_count, record_rows
from tests.support import testapp
from tests.support.flow import assert_problem, post
from tests.support.records import cli
from tests.support.sealing import (
    KEY_A,
    KEY_B,
    clear_in_rows,
    fingerprint_config,
    sealed_config,
)


def _marker() -> str:
    return f"MARK-{uuid.uuid4().hex}"


def _with_echo(app: Flask, calls: list[str]) -> None:
    """``/sealed-echo``: answers with the request's note in its body and a header."""

    @app.post("/sealed-echo")
    @testapp.idem.idempotent()
    def sealed_echo() -> tuple[dict[str, t.Any], int, dict[str, str]]:
        note = testapp.idem.payload["note"]
        calls.append(note)
        testapp.write_ledger("sealed-echo")
        return {"note": note, "n": len(calls)}, 201, {"X-Note": note}


def _app(make_app: t.Callable[..., Flask], calls: list[str], **config: t.Any) -> Flask:
    app = make_app(IDEMPOTENCY_REPLAY_HEADERS=["X-Note"], **config)
    _with_echo(app, calls)
    return app


def test_the_table_holds_no_clear_answer_and_the_retry_gets_it_exactly(
    make_app: t.Callable[..., Flask],
) -> None:
    marker, calls = _marker(), []
    app = _app(make_app, calls, **sealed_config())
    client = app.test_client()
    first = post(client, "/sealed-echo", {"note": marker})
    assert first.status_code == 201
    [row] = record_rows(app)
    assert row["response_body"] is not None
    assert clear_in_rows(app, marker) == []
    assert clear_in_rows(app, "X-Note") == []  # the headers' names are sealed too
    again = post(client, "/sealed-echo", {"note": marker})
    assert again.status_code == 201
    assert again.get_data() == first.get_data()
    assert again.headers["X-Note"] == marker
    assert again.headers["Idempotent-Replayed"] == "true"
    assert calls == [marker]
    assert ledger_count(app, "sealed-echo") == 1


def test_without_keys_the_same_traffic_is_in_clear(make_app: t.Callable[..., Flask]) -> None:
    """The check above can fail: with encryption off the marker is there."""
    marker, calls = _marker(), []
    app = _app(make_app, calls)
    assert post(app.test_client(), "/sealed-echo", {"note": marker}).status_code == 201
    assert clear_in_rows(app, marker) == ["k1.response_headers", "k1.response_body"]


def _copy_answer(app: Flask, source: str, target: str) -> None:
    """What a database writer (or a restore gone wrong) does: one record's
    sealed answer put on another record's row."""
    table = testapp.db.metadata.tables["idempotency_keys"]
    with app.app_context(), testapp.db.engine.begin() as conn:
        stolen = conn.execute(
            sa.select(table.c.response_headers, table.c.response_body).where(
                table.c.key == text_param("w_key", source)
            )
        ).one()
        conn.execute(
            sa.update(table)
            .where(table.c.key == text_param("w_key", target))
            .values(response_headers=stolen[0], response_body=stolen[1])
        )


def test_an_answer_copied_into_another_record_never_replays_there(
    make_app: t.Callable[..., Flask], caplog: pytest.LogCaptureFixture
) -> None:
    secret, calls = _marker(), []
    app = _app(make_app, calls, **sealed_config())
    client = app.test_client()
    assert post(client, "/sealed-echo", {"note": secret}, key="victim").status_code == 201
    assert post(client, "/sealed-echo", {"note": "mine"}, key="thief").status_code == 201
    _copy_answer(app, "victim", "thief")
    before = record_rows(app)
    caplog.set_level(logging.ERROR, "flask_idempotency")
    retry = post(client, "/sealed-echo", {"note": "mine"}, key="thief")
    doc = assert_problem(retry, 500)
    assert doc["type"].endswith("/record-unreadable")
    assert secret not in retry.get_data(as_text=True)
    assert "X-Note" not in retry.headers
    assert record_rows(app) == before  # nothing changed
    assert ledger_count(app, "sealed-echo") == 2  # the view did not run again
    [line] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "'thief'" in line.getMessage()
    assert "key id 'a'" in line.getMessage()
    assert secret not in line.getMessage()
    # The victim's own retry still gets its answer.
    victim = post(client, "/sealed-echo", {"note": secret}, key="victim")
    assert victim.status_code == 201
    assert victim.headers["X-Note"] == secret


@pytest.mark.parametrize("now_configured", [[KEY_B], None], ids=["other-key", "encryption-off"])
def test_a_record_whose_key_is_gone_answers_500_and_the_log_names_the_key_id(
    make_app: t.Callable[..., Flask],
    caplog: pytest.LogCaptureFixture,
    now_configured: list[str] | None,
) -> None:
    marker, calls = _marker(), []
    sealing = _app(make_app, calls, **sealed_config(KEY_A))
    assert post(sealing.test_client(), "/sealed-echo", {"note": marker}).status_code == 201
    config = sealed_config(*now_configured) if now_configured else {}
    later = _app(make_app, calls, **config)
    caplog.set_level(logging.ERROR, "flask_idempotency")
    retry = post(later.test_client(), "/sealed-echo", {"note": marker})
    assert assert_problem(retry, 500)["type"].endswith("/record-unreadable")
    assert marker not in retry.get_data(as_text=True)
    assert calls == [marker]
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "key id 'a'" in line
    assert "'k1'" in line


def test_a_record_from_before_encryption_replays_and_old_keys_still_open(
    make_app: t.Callable[..., Flask],
) -> None:
    calls: list[str] = []
    # Written in clear, under the fingerprint's key (set first, see docs/encryption.md).
    clear = _app(make_app, calls, **fingerprint_config())
    first = post(clear.test_client(), "/sealed-echo", {"note": "before"}, key="old")
    # Turned on with IDEMPOTENCY_ENCRYPTION_ALLOW_CLEAR for the records from before.
    sealed = _app(make_app, calls, IDEMPOTENCY_ENCRYPTION_ALLOW_CLEAR=True, **sealed_config(KEY_A))
    client = sealed.test_client()
    again = post(client, "/sealed-echo", {"note": "before"}, key="old")
    assert again.get_data() == first.get_data()
    assert again.headers["X-Note"] == "before"
    assert post(client, "/sealed-echo", {"note": "under-a"}, key="new").status_code == 201
    # Rotation's first half: a new key seals, the old one still opens.
    rotated = _app(make_app, calls, **sealed_config(KEY_B, KEY_A))
    replay = post(rotated.test_client(), "/sealed-echo", {"note": "under-a"}, key="new")
    assert replay.status_code == 201
    assert replay.headers["X-Note"] == "under-a"
    assert calls == ["before", "under-a"]


def _with_steps(app: Flask, runs: list[str], *, recover: bool) -> None:
    """``/sealed-steps``: a leased route whose step result carries the note;
    its first attempt fails after the step."""

    @app.post("/sealed-steps")
    @testapp.idem.idempotent(lease=True, recover=recover, ttl=testapp.LEASED_TTL)
    def sealed_steps() -> tuple[dict[str, t.Any], int]:
        note = testapp.idem.payload["note"]
        saved = testapp.idem.step("charge", lambda: runs.append("charge") or {"note": note})
        runs.append("view")
        if runs.count("view") == 1:
            raise RuntimeError("the first attempt dies after its step")
        testapp.write_ledger("sealed-steps")
        return {"saved": saved, "note": note}, 201


def test_a_leased_operation_resumes_from_sealed_recovery_points(
    make_app: t.Callable[..., Flask],
) -> None:
    marker, runs = _marker(), []
    app = make_app(**sealed_config())
    _with_steps(app, runs, recover=False)
    client = app.test_client()
    assert post(client, "/sealed-steps", {"note": marker}).status_code == 500
    [row] = record_rows(app)
    assert row["status"] == IN_PROGRESS
    assert row["recovery_points"] is not None
    assert clear_in_rows(app, marker) == []
    resumed = post(client, "/sealed-steps", {"note": marker})
    assert resumed.status_code == 201
    assert resumed.get_json() == {"saved": {"note": marker}, "note": marker}
    assert runs == ["charge", "view", "view"]  # the step did not run again
    assert clear_in_rows(app, marker) == []


def test_the_recovery_job_reruns_a_sealed_stored_request(
    make_app: t.Callable[..., Flask], clock: Clock
) -> None:
    marker, runs = _marker(), []
    app = make_app(**sealed_config())
    _with_steps(app, runs, recover=True)
    client = app.test_client()
    assert post(client, "/sealed-steps", {"note": marker}).status_code == 500
    [row] = record_rows(app)
    assert row["request_body"] is not None
    assert row["request_path"] is not None
    assert clear_in_rows(app, marker) == []
    assert clear_in_rows(app, "/sealed-steps") == []  # the stored path too
    clock.advance(seconds=120)
    report = recover_abandoned(app)
    assert (report.completed, report.unreadable) == (1, 0)
    assert runs == ["charge", "view", "view"]
    assert clear_in_rows(app, marker) == []
    replay = post(client, "/sealed-steps", {"note": marker})
    assert replay.status_code == 201
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.get_json() == {"saved": {"note": marker}, "note": marker}


def test_the_job_and_the_cli_report_an_unreadable_record_and_go_on(
    make_app: t.Callable[..., Flask], clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    marker, runs = _marker(), []
    sealing = make_app(**sealed_config(KEY_A))
    _with_steps(sealing, runs, recover=True)
    _with_echo(sealing, [])
    assert post(sealing.test_client(), "/sealed-steps", {"note": marker}).status_code == 500
    echoed = post(sealing.test_client(), "/sealed-echo", {"note": marker}, key="k2")
    assert echoed.status_code == 201
    later = make_app(**sealed_config(KEY_B))  # key a is gone
    clock.advance(seconds=120)
    caplog.set_level(logging.ERROR, "flask_idempotency")
    caplog.clear()
    report = recover_abandoned(later)
    assert (report.completed, report.released, report.unreadable) == (0, 0, 1)
    assert "unreadable 1" in str(report)
    [line] = [r for r in caplog.records if r.name == "flask_idempotency"]
    assert "key id 'a'" in line.getMessage()
    assert line.exc_info is None
    assert len(record_rows(later)) == 2  # nothing deleted
    listed = cli(later, "list")
    assert listed.exit_code == 0, listed.output
    assert all("key id 'a'" in entry["unreadable"] for entry in json.loads(listed.output))
    [scope] = {row["scope"] for row in record_rows(later) if row["key"] == "k2"}
    shown = cli(later, "show", scope, "k2")
    assert shown.exit_code == 0, shown.output
    assert "key id 'a'" in shown.output
    assert marker not in shown.output
    assert "Traceback" not in shown.output + listed.output
    # The operator may still release the unreadable operation kept for its retry.
    [kept] = [row for row in record_rows(later) if row["key"] == "k1"]
    released = cli(later, "release", kept["scope"], "k1", "--override", "recovery-points", "--yes")
    assert released.exit_code == 0, released.output
    assert "recovery-points (sealed, unreadable)" in released.output
    assert [row["key"] for row in record_rows(later)] == ["k2"]


def test_a_clear_answer_written_over_a_sealed_one_never_replays(
    make_app: t.Callable[..., Flask],
) -> None:
    """A database writer without the key puts its own answer, in clear, on the
    victim's row: without IDEMPOTENCY_ENCRYPTION_ALLOW_CLEAR it is unreadable."""
    calls: list[str] = []
    app = _app(make_app, calls, **sealed_config())
    client = app.test_client()
    assert post(client, "/sealed-echo", {"note": "victim"}, key="victim").status_code == 201
    mine = post(client, "/sealed-echo", {"note": "mallory"}, key="thief")
    table = testapp.db.metadata.tables["idempotency_keys"]
    with app.app_context(), testapp.db.engine.begin() as conn:
        conn.execute(
            sa.update(table)
            .where(table.c.key == text_param("w_key", "victim"))
            .values(
                response_body=mine.get_data(),
                response_headers=json.dumps([["X-Note", "mallory"]]),
            )
        )
    retry = post(client, "/sealed-echo", {"note": "victim"}, key="victim")
    assert assert_problem(retry, 500)["type"].endswith("/record-unreadable")
    assert "mallory" not in retry.get_data(as_text=True)
    assert calls == ["victim", "mallory"]


def test_an_expired_record_under_a_dropped_key_is_replaced_unopened(
    make_app: t.Callable[..., Flask], clock: Clock
) -> None:
    calls: list[str] = []
    sealing = _app(make_app, calls, **sealed_config(KEY_A))
    assert post(sealing.test_client(), "/sealed-echo", {"note": "old"}).status_code == 201
    later = _app(make_app, calls, **sealed_config(KEY_B))  # key a dropped
    clock.advance(days=2)  # past the record's retention; cleanup has not run
    again = post(later.test_client(), "/sealed-echo", {"note": "new"})
    assert again.status_code == 201
    assert again.headers.get("Idempotent-Replayed") != "true"
    assert calls == ["old", "new"]
    [row] = record_rows(later)
    assert row["response_body"] is not None
    assert clear_in_rows(later, "new") == []


def test_an_unreadable_view_committed_record_is_settled_by_the_job(
    make_app: t.Callable[..., Flask], clock: Clock
) -> None:
    sealing = _app(make_app, [], **sealed_config(KEY_A))
    assert post(sealing.test_client(), "/sealed-echo", {"note": "x"}).status_code == 201
    # What a worker that died after its view committed leaves: in progress,
    # its lease over, the answer its commit stored (sealed with key a).
    table = testapp.db.metadata.tables["idempotency_keys"]
    with sealing.app_context(), testapp.db.engine.begin() as conn:
        conn.execute(
            sa.update(table).values(status=IN_PROGRESS, response_code=500, locked_until=clock())
        )
    later = make_app(**sealed_config(KEY_B))  # key a is gone
    clock.advance(seconds=120)
    report = recover_abandoned(later)
    assert (report.completed, report.unreadable) == (1, 0)
    [row] = record_rows(later)
    assert row["status"] == "completed"
    assert row["response_code"] == 500


def test_the_keyed_fingerprint_differs_across_records_of_one_request(
    make_app: t.Callable[..., Flask],
) -> None:
    """A reader of the table who is also a client cannot confirm a guess by
    sending it under a key (or in a scope) of their own."""
    app = _app(make_app, [], **sealed_config())
    client = app.test_client()
    for key in ("mine", "theirs"):
        assert post(client, "/sealed-echo", {"note": "same"}, key=key).status_code == 201
    hashes = {row["key"]: row["request_hash"] for row in record_rows(app)}
    assert hashes["mine"] != hashes["theirs"]
    assert post(client, "/sealed-echo", {"note": "same"}, key="mine").status_code == 201
    mismatch = post(client, "/sealed-echo", {"note": "other"}, key="mine")
    assert mismatch.status_code == 422
