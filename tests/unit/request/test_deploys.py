"""Fingerprints across a deploy: app v1 and app v2 of one service, on the same
database, v2 with changed fingerprint rules (a field newly excluded, a schema
that gains a load_default, a field renamed behind its data_key, a fingerprint
key added or rotated, the canonical form's version bumped). v1 serves, v2
takes over, and both serve at once: a retry of the same bytes replays on
either version (one order), other bytes answer 422 fingerprint-rules-changed
(no second order); with the same rules, nothing changes (422 key-reused for
another payload). On every engine, through real requests; orders counted."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idempotency._maintenance import erasure
from flask_idempotency._maintenance.jobs import recover_abandoned
from flask_idempotency._request import canonical, rules
from flask_idempotency._storage import added
from flask_idempotency.errors import PROBLEM_TYPE_BASE
from tests.support.deploys import (
    FIRST,
    KEY_1,
    KEY_2,
    OTHER_BYTES,
    make_version,
    order_schema,
    orders,
    post,
)
from tests.support.flow import assert_problem
from tests.support.keyrings import KEY_A, key_line

RULES_CHANGED = PROBLEM_TYPE_BASE + "fingerprint-rules-changed"
KEY_REUSED = PROBLEM_TYPE_BASE + "key-reused"


#: Each change a deploy may make, as (v1's options, v2's options), and bodies:
#: the first request, and a retry whose bytes differ from it.
CHANGES: dict[str, tuple[dict[str, t.Any], dict[str, t.Any]]] = {
    "field-newly-excluded": ({}, {"exclude": ["note"]}),
    "schema-gains-load-default": ({}, {"schema": order_schema(default=True)}),
    "field-renamed-via-data-key": ({}, {"schema": order_schema(renamed=True)}),
    "fingerprint-key-added": ({}, {"key": KEY_1}),
    # Rotated in two deploys, as docs/deploys.md says: v1 already accepts the
    # new key (after its current one), v2 makes it current and keeps the old one.
    "fingerprint-key-rotated": ({"key": [KEY_1, KEY_2]}, {"key": [KEY_2, KEY_1]}),
}


@pytest.fixture
def deploy(
    fresh_database: str, request: pytest.FixtureRequest
) -> t.Iterator[tuple[tuple[Flask, t.Any], tuple[Flask, t.Any]]]:
    v1_options, v2_options = CHANGES[request.param]
    v1 = make_version(fresh_database, **v1_options)
    v2 = make_version(fresh_database, **v2_options)
    yield v1, v2
    for app, db in (v1, v2):
        with app.app_context():
            db.engine.dispose()


@pytest.mark.parametrize("deploy", list(CHANGES), indirect=True)
def test_a_retry_of_the_same_bytes_replays_on_either_version_and_other_bytes_are_refused(
    deploy: tuple[tuple[Flask, t.Any], tuple[Flask, t.Any]], request: pytest.FixtureRequest
) -> None:
    (app1, db1), (app2, _) = deploy
    first = post(app1, "k1", FIRST)
    assert first.status_code == 201, first.get_data(as_text=True)
    # v2 takes over: the retry of the same bytes replays v1's answer.
    replayed = post(app2, "k1", FIRST)
    assert replayed.status_code == 201
    assert replayed.headers.get("Idempotent-Replayed") == "true"
    assert replayed.get_data() == first.get_data()
    # Other bytes under other rules: the server cannot tell, and says so.
    refused = assert_problem(post(app2, "k1", OTHER_BYTES), 422)
    assert refused["type"] == RULES_CHANGED
    assert "rules changed" in refused["detail"]
    # Both versions live at once (a rolling deploy): v1 still replays its own.
    again = post(app1, "k1", FIRST)
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert again.get_data() == first.get_data()
    # A record v2 made, retried on v1: the same bytes replay, others are refused.
    made = post(app2, "k2", FIRST)
    assert made.status_code == 201
    back = post(app1, "k2", FIRST)
    if request.node.callspec.params["deploy"] == "fingerprint-key-added":
        # v1 has no key: it cannot check a digest keyed by v2's. Refused, never run.
        assert assert_problem(back, 422)["type"] == RULES_CHANGED
    else:
        assert back.headers.get("Idempotent-Replayed") == "true"
        assert back.get_data() == made.get_data()
    assert assert_problem(post(app1, "k2", OTHER_BYTES), 422)["type"] == RULES_CHANGED
    assert orders(app1, db1) == 2  # one per key, whatever was retried where


@pytest.mark.parametrize("deploy", ["field-newly-excluded"], indirect=True)
def test_same_rules_keep_todays_answers(
    deploy: tuple[tuple[Flask, t.Any], tuple[Flask, t.Any]],
) -> None:
    """Within one version: another payload is key-reused (not the new problem),
    and other bytes of the same payload replay (the fingerprint decides)."""
    (app1, db1), (app2, _) = deploy
    for app, key in ((app1, "a"), (app2, "b")):
        assert post(app, key, FIRST).status_code == 201
        assert post(app, key, OTHER_BYTES).headers.get("Idempotent-Replayed") == "true"
        reused = assert_problem(post(app, key, b'{"total": 999}'), 422)
        assert reused["type"] == KEY_REUSED
    assert orders(app1, db1) == 2


def test_a_bumped_canonical_form_is_compared_by_bytes(
    fresh_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    app1, db1 = make_version(fresh_database)
    first = post(app1, "k1", FIRST)
    assert first.status_code == 201
    with app1.test_request_context():
        before = rules.rules_version(
            app1.view_functions["orders"]._idempotency_route,  # type: ignore[attr-defined]
            None,
            None,
        )
    monkeypatch.setattr(canonical, "CANONICAL_FORM_VERSION", canonical.CANONICAL_FORM_VERSION + 1)
    app2, _ = make_version(fresh_database)  # the release with the new canonical form
    with app2.test_request_context():
        after = rules.rules_version(
            app2.view_functions["orders"]._idempotency_route,  # type: ignore[attr-defined]
            None,
            None,
        )
    assert after != before
    replayed = post(app2, "k1", FIRST)
    assert replayed.headers.get("Idempotent-Replayed") == "true"
    assert replayed.get_data() == first.get_data()
    assert assert_problem(post(app2, "k1", OTHER_BYTES), 422)["type"] == RULES_CHANGED
    assert orders(app1, db1) == 1
    with app1.app_context():
        db1.engine.dispose()


def test_an_old_table_without_the_columns_warns_once_and_works_as_before(
    fresh_database: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A record table from an earlier release: one WARNING naming the ALTER
    statement; records written without the columns; retries judged by their
    fingerprint, as before (a changed rule gives key-reused, never a replay
    of another request)."""
    engine = sa.create_engine(fresh_database)
    try:
        metadata = sa.MetaData()
        from flask_idempotency._storage.schema import record_table

        table = record_table(metadata)
        old = sa.Table(
            table.name,
            sa.MetaData(),
            *(c._copy() for c in table.c if c.name not in added.ADDED_COLUMNS),
            sa.PrimaryKeyConstraint("scope", "key"),
        )
        old.create(engine)
    finally:
        engine.dispose()
    logger = logging.getLogger("flask_idempotency")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        app1, db1 = make_version(fresh_database)
        app2, _ = make_version(fresh_database, exclude=["note"])
        first = post(app1, "k1", FIRST)
        assert first.status_code == 201
        assert post(app1, "k1", FIRST).headers.get("Idempotent-Replayed") == "true"
        # v2's fingerprint differs and there is no digest to judge by: as before.
        assert assert_problem(post(app2, "k1", FIRST), 422)["type"] == KEY_REUSED
        assert post(app2, "k2", FIRST).status_code == 201
    warned = [r.getMessage() for r in caplog.records if "earlier release" in r.getMessage()]
    assert len(warned) == 4, warned  # one per column, once per engine (one per app)
    assert all("ALTER TABLE" in message for message in warned)
    with app1.app_context():
        columns = {c["name"] for c in sa.inspect(db1.engine).get_columns(table.name)}
    assert not columns.intersection(added.ADDED_COLUMNS)
    assert orders(app1, db1) == 2


def test_a_lease_ended_on_v1_is_reclaimed_by_v2_for_the_same_bytes_and_v1_loses_it(
    fresh_database: str, clock: t.Any
) -> None:
    """v1 claims on a leased route and stalls; its lease ends; v2 gets the same
    bytes, judges them the record's request, reclaims it (writing its own
    fingerprint and rules version over v1's) and runs it. v1's stalled run
    then finds its lease lost (409), its writes rolled back: one order. The
    record now answers by v2's rules: replayed for the same payload on v2."""
    stalled, release = threading.Event(), threading.Event()

    def stall() -> None:
        if not release.is_set():
            stalled.set()
            assert release.wait(timeout=60)

    app1, db1 = make_version(fresh_database, clock=clock, before_write=stall, lease=True)
    app2, _ = make_version(
        fresh_database, clock=clock, lease=True, exclude=["note"], schema=order_schema(default=True)
    )
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(post, app1, "k1", FIRST)
        assert stalled.wait(timeout=60)
        with app1.app_context():
            lease = app1.extensions["idempotency"].settings.lease
        clock.advance(seconds=lease.total_seconds() + 1)
        store = app2.extensions["idempotency"].store
        reclaimed = post(app2, "k1", FIRST)  # v1 still stalled (the stall is v1's only)
        release.set()
        lost = first.result(timeout=60)
        assert reclaimed.status_code == 201, reclaimed.get_data(as_text=True)
        assert reclaimed.headers.get("Idempotent-Replayed") is None
    assert lost.status_code == 409, lost.get_data(as_text=True)
    assert orders(app1, db1) == 1
    with app1.app_context(), db1.engine.connect() as conn:
        record = store.load(conn, "tenant:a", "k1")
    with app2.test_request_context():
        v2_rules = rules.rules_version(
            app2.view_functions["orders"]._idempotency_route,  # type: ignore[attr-defined]
            None,
            "idempotency_key",
        )
    assert record is not None
    assert record.rules_version == v2_rules  # the reclaim wrote v2's rules
    again = post(app2, "k1", OTHER_BYTES)  # v2's rules, same payload: its fingerprint
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert again.get_data() == reclaimed.get_data()
    assert post(app1, "k1", FIRST).headers.get("Idempotent-Replayed") == "true"
    assert orders(app1, db1) == 1
    with app1.app_context():
        db1.engine.dispose()


@pytest.mark.parametrize(
    ("value", "error", "text"),
    [
        ([], ValueError, "empty list"),
        ([KEY_1, "short"], ValueError, "at least 32 characters"),
        ([KEY_1, None], TypeError, "text or bytes"),
        ([[KEY_1]], TypeError, "text or bytes"),
        ((KEY_1, 5), TypeError, "text or bytes"),
    ],
)
def test_a_bad_list_of_fingerprint_keys_is_refused_at_init(
    tmp_path: t.Any, value: t.Any, error: type[Exception], text: str
) -> None:
    app = Flask("keys")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=f"sqlite:///{tmp_path}/a.db", IDEMPOTENCY_FINGERPRINT_KEY=value
    )
    from flask_sqlalchemy import SQLAlchemy

    from flask_idempotency import Idempotency

    with pytest.raises(error, match="IDEMPOTENCY_FINGERPRINT_KEY") as refused:
        Idempotency(app, SQLAlchemy(app))
    assert text in str(refused.value)
    assert KEY_1 not in str(refused.value)  # a secret is never echoed


def test_a_list_of_fingerprint_keys_makes_the_first_current(tmp_path: t.Any) -> None:
    app, _ = make_version(f"sqlite:///{tmp_path}/a.db", key=(KEY_2, KEY_1))
    assert app.extensions["idempotency"].settings.fingerprint_key == KEY_2.encode()


@pytest.mark.parametrize("deploy", ["field-newly-excluded"], indirect=True)
def test_an_erased_record_answers_410_on_either_version_and_keeps_no_digest(
    deploy: tuple[tuple[Flask, t.Any], tuple[Flask, t.Any]],
) -> None:
    (app1, db1), (app2, _) = deploy
    assert post(app1, "k1", FIRST).status_code == 201
    erasure.erase(app1, "tenant:a", "k1")
    idem = app1.extensions["idempotency"]
    for app in (app1, app2):
        for body in (FIRST, OTHER_BYTES):
            assert assert_problem(post(app, "k1", body), 410)["type"].endswith("key-erased")
    with app1.app_context(), db1.engine.connect() as conn:
        record = idem.store.load(conn, "tenant:a", "k1")
    assert record is not None
    assert (record.status, record.request_digest, record.rules_version) == ("erased", None, None)
    assert orders(app1, db1) == 1


def test_the_optimistic_path_judges_a_deploy_by_bytes_too(fresh_database: str) -> None:
    """Optimistic routes insert the completed record at the end: the record
    carries the rules version and digest, and a duplicate that ran on the other
    version finds it and answers by bytes."""
    app1, db1 = make_version(fresh_database, optimistic=True)
    app2, _ = make_version(fresh_database, optimistic=True, schema=order_schema(default=True))
    first = post(app1, "opt", FIRST)
    assert first.status_code == 201
    replayed = post(app2, "opt", FIRST)
    assert replayed.headers.get("Idempotent-Replayed") == "true"
    assert replayed.get_data() == first.get_data()
    assert assert_problem(post(app2, "opt", OTHER_BYTES), 422)["type"] == RULES_CHANGED
    assert orders(app1, db1) == 1
    with app1.app_context():
        db1.engine.dispose()


def test_the_recovery_job_on_v2_finishes_v1s_abandoned_request_under_its_record(
    fresh_database: str, clock: t.Any
) -> None:
    """v1's request on a recover=True route stalls past its lease; the
    recovery job of v2 re-runs the stored request: it is the record's own
    request (its fingerprint, rules version and digest kept), so it reclaims
    and completes it. The client's retry then replays on either version."""
    stalled, release = threading.Event(), threading.Event()

    def stall() -> None:
        stalled.set()
        assert release.wait(timeout=60)

    options = {"clock": clock, "lease": True, "recover": True}
    app1, db1 = make_version(fresh_database, before_write=stall, **options)
    app2, _ = make_version(fresh_database, exclude=["note"], **options)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(post, app1, "k1", FIRST)
        assert stalled.wait(timeout=60)
        lease = app1.extensions["idempotency"].settings.lease
        clock.advance(seconds=lease.total_seconds() + 1)
        report = recover_abandoned(app2)
        release.set()
        assert first.result(timeout=60).status_code == 409  # v1 lost its lease
    assert report.completed == 1, report
    assert orders(app1, db1) == 1
    retried = [post(app, "k1", FIRST) for app in (app2, app1)]
    assert [r.headers.get("Idempotent-Replayed") for r in retried] == ["true", "true"]
    assert retried[0].get_data() == retried[1].get_data()
    assert assert_problem(post(app2, "k1", OTHER_BYTES), 422)["type"] == RULES_CHANGED
    assert orders(app1, db1) == 1
    with app1.app_context():
        db1.engine.dispose()


def test_a_multipart_form_resent_with_a_new_boundary_is_the_same_request_across_a_deploy(
    fresh_database: str,
) -> None:
    """A browser sends a form again (a reload, the back button) with a new
    random boundary: across a deploy it still counts as the same bytes (its
    parsed fields and files), and another value in a field does not."""
    app1, db1 = make_version(fresh_database, forms=True)
    app2, _ = make_version(fresh_database, forms=True, exclude=["note"])

    def send(app: Flask, boundary: str, total: str) -> t.Any:
        body = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="total"\r\n\r\n{total}\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="receipt"; '
            f'filename="r.txt"\r\nContent-Type: text/plain\r\n\r\nreceipt bytes\r\n'
            f"--{boundary}--\r\n"
        ).encode()
        return app.test_client().post(
            "/orders",
            data=body,
            headers={
                "Idempotency-Key": "form-1",
                "Content-Type": f"multipart/form-data; boundary={boundary}",
            },
        )

    first = send(app1, "first-boundary", "100")
    assert first.status_code == 201
    again = send(app2, "another-boundary", "100")
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert again.get_data() == first.get_data()
    assert assert_problem(send(app2, "third-boundary", "999"), 422)["type"] == RULES_CHANGED
    assert orders(app1, db1) == 1
    with app1.app_context():
        db1.engine.dispose()


def test_sealed_records_replay_across_a_key_rotation_and_changed_rules(
    fresh_database: str,
) -> None:
    """Encryption at rest on both versions (the response sealed at rest), v2
    with a newly excluded field and the fingerprint key rotated: the same
    bytes replay the sealed answer, opened; other bytes are refused."""
    sealed = {"IDEMPOTENCY_ENCRYPTION_KEYS": [key_line(KEY_A)]}
    app1, db1 = make_version(fresh_database, key=[KEY_1, KEY_2], config=sealed)
    app2, _ = make_version(fresh_database, key=[KEY_2, KEY_1], exclude=["note"], config=sealed)
    first = post(app1, "sealed", FIRST)
    assert first.status_code == 201
    with app1.app_context():
        raw = db1.session.execute(
            sa.text("SELECT response_body FROM idempotency_keys")
        ).scalar_one()
    assert first.get_data() not in bytes(raw)  # sealed at rest
    replayed = post(app2, "sealed", FIRST)
    assert replayed.headers.get("Idempotent-Replayed") == "true"
    assert replayed.get_data() == first.get_data()
    assert assert_problem(post(app2, "sealed", OTHER_BYTES), 422)["type"] == RULES_CHANGED
    assert orders(app1, db1) == 1
    with app1.app_context():
        db1.engine.dispose()
