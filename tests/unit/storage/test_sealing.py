"""Encryption at rest in the store, on each storage implementation: every
statement that writes a record's sealed columns seals them for that record, and
every read opens them; the settings take the keys in each documented spelling."""

from __future__ import annotations

import base64
import logging
import typing as t
import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from flask_idempotency import config
from flask_idempotency._config import Settings
from flask_idempotency._failures import SealBroken
from flask_idempotency._storage import (
    IN_PROGRESS,
    answer_values,
    new_fencing_token,
    seal,
    text_param,
)
from tests.support.sealing import FINGERPRINT_SECRET, KEY_A, KEY_B, sealed_config
from tests.support.storage import HOUR, SCOPE, Impl, claimed, new_key, now_ms, record_values

MARK = f"MARK-{uuid.uuid4().hex}"
RING = seal.Keyring(keys=(("a", bytes(range(32))),))


def _clear(rows: dict[str, dict[str, t.Any]], key: str) -> list[str]:
    """The columns of ``key``'s row that show :data:`MARK` in clear."""
    shown = []
    for column, value in rows[key].items():
        text = bytes(value).decode("latin-1") if isinstance(value, bytes) else str(value)
        if MARK in text:
            shown.append(column)
    return shown


def test_every_write_seals_and_every_read_opens(impl: Impl) -> None:
    impl.store.keyring = RING
    now, key = now_ms(), new_key()
    body = f'{{"note": "{MARK}"}}'.encode()
    values = record_values(
        key, now, request_method="POST", request_path=f"/orders?note={MARK}", request_body=body
    )
    claimed(impl, values)
    rows = impl.rows()
    assert _clear(rows, key) == []
    assert seal.key_id_of(rows[key]["request_body"]) == "a"
    assert seal.is_sealed(rows[key]["request_path"])
    token = values["fencing_token"]
    headers = [("X-Note", MARK)]
    with impl.engine.begin() as conn:
        points = {"charge": {"note": MARK}}
        assert impl.store.save_recovery_points(conn, SCOPE, key, token, points, now + HOUR)
    with Session(impl.engine) as session:
        # The answer a view's commit stores (the claim's own transaction's).
        answer = answer_values(500, headers, body, False)
        renewed, _ = impl.store.renew_lease_before_commit(
            session, SCOPE, key, token, now + HOUR, answer
        )
        assert renewed
        session.commit()
    assert _clear(impl.rows(), key) == []
    with impl.engine.connect() as conn:
        record = impl.store.load(conn, SCOPE, key)
    assert record is not None
    assert (record.request_body, record.request_path) == (body, f"/orders?note={MARK}")
    assert (record.response_headers, record.response_body) == (headers, body)
    assert record.recovery_points == {"charge": {"note": MARK}}
    with impl.engine.begin() as conn:
        assert impl.store.complete(
            conn,
            SCOPE,
            key,
            token,
            response_code=201,
            response_headers=headers,
            response_body=body,
            body_omitted=False,
            now=now,
        )
    assert _clear(impl.rows(), key) == []
    # A duplicate's claim (one batch on psycopg) reads the record opened.
    with Session(impl.engine) as session:
        won, held = impl.store.claim(session, record_values(key, now), None)
        session.rollback()
    assert not won
    assert held is not None
    assert (held.response_code, held.response_body, held.response_headers) == (201, body, headers)


def test_a_replacement_and_a_kept_operation_are_sealed_too(impl: Impl) -> None:
    impl.store.keyring = RING
    now, key = now_ms(), new_key()
    claimed(impl, record_values(key, now - 48 * HOUR, lease=-HOUR))
    with Session(impl.engine) as session:
        won, record = impl.store.claim(session, record_values(key, now), None)
        assert not won
        assert record is not None
        token = new_fencing_token(record.fencing_token)
        columns = record_values(key, now, request_method="POST", request_body=MARK.encode())
        del columns["scope"], columns["key"]
        assert impl.store.take_over(session, record, columns, now, expired=True, token=token)
        session.commit()
    assert _clear(impl.rows(), key) == []
    with impl.engine.begin() as conn:
        points = {"email": MARK}
        assert impl.store.keep_for_retry(conn, SCOPE, key, token, recovery_points=points)
    rows = impl.rows()
    assert _clear(rows, key) == []
    assert rows[key]["request_body"] is None
    with impl.engine.connect() as conn:
        kept = impl.store.load(conn, SCOPE, key)
    assert kept is not None
    assert kept.recovery_points == {"email": MARK}


def test_a_value_copied_to_another_record_does_not_open_there(impl: Impl) -> None:
    impl.store.keyring = RING
    now, victim, thief = now_ms(), new_key(), new_key()
    # Abandoned, with a stored request: what the recovery job looks for.
    stored = {"request_method": "POST", "request_path": "/orders"}
    claimed(
        impl, record_values(victim, now, lease=-HOUR, recovery_points=f'{{"a":"{MARK}"}}', **stored)
    )
    claimed(impl, record_values(thief, now, lease=-HOUR, recovery_points='{"a":"mine"}', **stored))
    table = impl.store.table
    with impl.engine.begin() as conn:
        stolen = conn.execute(
            sa.select(table.c.recovery_points).where(table.c.key == text_param("w", victim))
        ).scalar_one()
        conn.execute(
            sa.update(table)
            .where(table.c.key == text_param("w", thief))
            .values(recovery_points=stolen)
        )
    with impl.engine.connect() as conn:
        with pytest.raises(SealBroken) as broken:
            impl.store.load(conn, SCOPE, thief)
        assert broken.value.key_id == "a"
        assert thief in broken.value.where
        assert MARK not in str(broken.value)
        # The operator's reads say so and go on with the others.
        found = {r.key: r for r in impl.store.find_abandoned(conn, now, 10)}
        listed = {r.key: r for r in impl.store.find(conn, scope_prefix=SCOPE)}
    for records in (found, listed):
        assert records[victim].unreadable is None
        assert records[victim].recovery_points == {"a": MARK}
        unreadable = records[thief]
        assert unreadable.unreadable is not None
        assert "key id 'a'" in unreadable.unreadable
        assert unreadable.recovery_points == {}
        assert unreadable.holds_recovery_points
        assert unreadable.status == IN_PROGRESS
        assert not unreadable.recoverable  # its stored request is not read either


def test_a_clear_record_opens_as_written_only_where_clear_values_are_allowed(
    impl: Impl,
) -> None:
    now, key = now_ms(), new_key()
    claimed(impl, record_values(key, now, request_body=MARK.encode()))  # no keyring: clear
    assert _clear(impl.rows(), key) == ["request_body"]
    # A keyring refuses it: a writer of the table could put any answer in clear.
    impl.store.keyring = RING
    with impl.engine.connect() as conn, pytest.raises(SealBroken, match="in clear"):
        impl.store.load(conn, SCOPE, key)
    # IDEMPOTENCY_ENCRYPTION_ALLOW_CLEAR: the window after turning encryption on.
    impl.store.keyring = seal.Keyring(RING.keys, allow_clear=True)
    with impl.engine.connect() as conn:
        record = impl.store.load(conn, SCOPE, key)
    assert record is not None
    assert record.request_body == MARK.encode()


def test_without_keys_a_binary_value_is_clear_unless_it_has_a_sealed_structure(
    impl: Impl,
) -> None:
    now, lookalike, sealed = now_ms(), new_key(), new_key()
    # A client's upload that starts with MAGIC but is no sealed value (no
    # plausible id, nor room for salt, nonce and tag after it).
    body = seal.MAGIC + b"\x05hello-world"
    claimed(impl, record_values(lookalike, now, request_body=body))
    with impl.engine.connect() as conn:
        record = impl.store.load(conn, SCOPE, lookalike)
    assert record is not None
    assert record.request_body == body
    impl.store.keyring = RING
    claimed(impl, record_values(sealed, now, request_body=MARK.encode()))
    impl.store.keyring = None  # a sealed value is never read as a body
    with impl.engine.connect() as conn, pytest.raises(SealBroken, match="not configured"):
        impl.store.load(conn, SCOPE, sealed)


def test_a_reused_key_id_opens_with_the_key_that_sealed_it_and_warns_once(
    impl: Impl, caplog: pytest.LogCaptureFixture
) -> None:
    now, keys = now_ms(), [new_key(), new_key()]
    impl.store.keyring = seal.Keyring((("current", RAW_A),))
    for key in keys:
        claimed(impl, record_values(key, now, request_body=MARK.encode()))
    # Ids named by role: the old key moved to "previous", a new one is "current".
    impl.store.keyring = seal.Keyring((("current", RAW_B), ("previous", RAW_A)))
    caplog.set_level(logging.WARNING, "flask_idempotency")
    with impl.engine.connect() as conn:
        for key in keys:
            record = impl.store.load(conn, SCOPE, key)
            assert record is not None
            assert record.request_body == MARK.encode()
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "'current'" in line
    assert "'previous'" in line
    assert "one key forever" in line


def test_find_abandoned_pages_past_unreadable_records(impl: Impl) -> None:
    now = now_ms()
    unreadable, committed, plain = [new_key(), new_key()], new_key(), new_key()
    impl.store.keyring = RING
    for i, key in enumerate(unreadable):  # kept for a re-run: sealed request
        values = record_values(key, now - (3 - i) * HOUR, request_method="POST", request_body=b"x")
        claimed(impl, {**values, "locked_until": now - (3 - i) * HOUR})
    claimed(
        impl,
        {
            **record_values(committed, now, response_code=500, response_body=b"failed"),
            "locked_until": now - HOUR,
        },
    )
    claimed(impl, {**record_values(plain, now), "locked_until": now - HOUR / 2})
    impl.store.keyring = seal.Keyring((("b", RAW_B),))  # key "a" is gone
    with impl.engine.connect() as conn:
        found = impl.store.find_abandoned(conn, now, limit=2)
    assert [r.key for r in found] == [*unreadable, committed, plain]
    assert [r.unreadable is not None for r in found] == [True, True, True, False]
    # The view that committed is settled from its clear columns alone.
    [settle] = [r for r in found if r.key == committed]
    with impl.engine.begin() as conn:
        assert impl.store.settle_committed(
            conn, SCOPE, committed, settle.fencing_token, now, retention=HOUR
        )
    assert impl.rows()[committed]["status"] == "completed"


def test_a_body_that_starts_like_a_sealed_value_is_sealed_all_the_same(impl: Impl) -> None:
    impl.store.keyring = RING
    now, key = now_ms(), new_key()
    tricky = seal.MAGIC + b"\x01a" + MARK.encode()
    claimed(impl, record_values(key, now, request_body=tricky))
    assert _clear(impl.rows(), key) == []
    with impl.engine.connect() as conn:
        record = impl.store.load(conn, SCOPE, key)
    assert record is not None
    assert record.request_body == tricky


# --- the setting ---

RAW_A, RAW_B = bytes(range(32)), bytes(range(100, 132))
TEXT_A, TEXT_B = KEY_A.split(":", 1)[1], KEY_B.split(":", 1)[1]


def _settings(keys: t.Any) -> Settings:
    values = {**config.DEFAULTS, "ENCRYPTION_KEYS": keys}
    if "FINGERPRINT_KEY" in config.DEFAULTS:  # required beside encryption keys
        values["FINGERPRINT_KEY"] = FINGERPRINT_SECRET
    return Settings.from_mapping(values)


@pytest.mark.parametrize(
    "written",
    [
        [KEY_A, KEY_B],
        [("a", TEXT_A), ("b", TEXT_B)],
        {"a": TEXT_A, "b": TEXT_B},
        f"{KEY_A}, {KEY_B}",
        [("a", RAW_A), ("b", RAW_B)],
        # Standard base64, without its padding, as some tools print it.
        [f"a:{base64.b64encode(RAW_A).decode().rstrip('=')}", KEY_B],
    ],
    ids=["strings", "pairs", "dict", "one-string", "bytes", "standard-base64"],
)
def test_every_spelling_gives_the_keys_in_order(written: t.Any) -> None:
    assert _settings(written).encryption_keys == (("a", RAW_A), ("b", RAW_B))
    assert _settings(None).encryption_keys is None


@pytest.mark.parametrize(
    ("written", "error"),
    [
        ([], "names no key"),
        ("", "names no key"),
        (["bad id!:" + TEXT_A], "key id 'bad id!'"),
        ([TEXT_A], "no id"),
        (["a:c2hvcnQ="], "32 random bytes"),
        ([KEY_A, "a:" + TEXT_B], "key id 'a' is configured twice"),
        ([("a", 42)], "key 'a' must be base64 text"),
        (42, "must be None, a list"),
    ],
)
def test_a_bad_key_list_is_refused_naming_the_setting(written: t.Any, error: str) -> None:
    with pytest.raises((ValueError, TypeError)) as refused:
        _settings(written)
    assert "IDEMPOTENCY_ENCRYPTION_KEYS" in str(refused.value)
    assert error in str(refused.value)
    assert TEXT_B not in str(refused.value)  # a key is never shown


def test_init_app_refuses_a_bad_key(tmp_path: t.Any) -> None:
    from tests.support import testapp

    with pytest.raises(ValueError, match="IDEMPOTENCY_ENCRYPTION_KEYS, key 'a'"):
        testapp.create_app(
            f"sqlite:///{tmp_path / 'bad.sqlite3'}",
            **{**sealed_config(), "IDEMPOTENCY_ENCRYPTION_KEYS": ["a:too-short"]},
        )
    # Out of the store's hot path: the keyring is built once, at init_app.
    app = testapp.create_app(f"sqlite:///{tmp_path / 'good.sqlite3'}", **sealed_config(KEY_A))
    store = app.extensions["idempotency"].store
    assert store.keyring is not None
    assert store.keyring.current == "a"


def test_a_value_moved_to_another_column_or_altered_does_not_open(impl: Impl) -> None:
    impl.store.keyring = RING
    now, moved, altered = now_ms(), new_key(), new_key()
    for key in (moved, altered):
        claimed(impl, record_values(key, now, recovery_points='{"a":1}', request_path="/x"))
    table = impl.store.table
    with impl.engine.begin() as conn:
        sealed = conn.execute(
            sa.select(table.c.recovery_points).where(table.c.key == text_param("w", altered))
        ).scalar_one()
        # One character of the ciphertext changed (mid-value: never padding bits).
        at = len(sealed) // 2 + 10
        flipped = sealed[:at] + ("A" if sealed[at] != "A" else "B") + sealed[at + 1 :]
        conn.execute(
            sa.update(table)
            .where(table.c.key == text_param("w", altered))
            .values(recovery_points=flipped)
        )
        # The record's own stored path, put where its recovery points are.
        conn.execute(
            sa.update(table)
            .where(table.c.key == text_param("w", moved))
            .values(recovery_points=table.c.request_path)
        )
    with impl.engine.connect() as conn:
        for key in (moved, altered):
            with pytest.raises(SealBroken, match="recovery_points"):
                impl.store.load(conn, SCOPE, key)


@pytest.mark.parametrize(
    "written",
    [
        # 43 characters of the alphabet, but no encoding of 32 bytes (low bits set).
        ["a:" + TEXT_A[:42] + "B"],
        ["a:" + TEXT_A + "=="],  # wrong padding
        ["a:" + TEXT_A.replace("=", "").replace("A", "+", 1).replace("E", "-", 1)],  # mixed
        ["a:" + "correct-horse-battery-staple-and-some-more!"],  # a passphrase
    ],
    ids=["low-bits", "padding", "mixed-alphabets", "passphrase"],
)
def test_a_key_is_its_exact_base64_or_refused(written: t.Any) -> None:
    with pytest.raises(ValueError, match="32 random bytes"):
        _settings(written)


@pytest.mark.parametrize(
    "swapped",
    [f"{TEXT_B}:a", {TEXT_B: "a"}, [(TEXT_B, "a")], [(RAW_B, "a")]],
    ids=["string", "dict", "pair", "bytes"],
)
def test_an_id_and_key_written_the_wrong_way_round_never_show_the_key(swapped: t.Any) -> None:
    with pytest.raises((ValueError, TypeError)) as refused:
        _settings(swapped)
    assert "key id" in str(refused.value)
    for shown in (TEXT_B, TEXT_B.rstrip("="), repr(RAW_B)):
        assert shown not in str(refused.value)
    ring = seal.Keyring((("a", RAW_B),))
    assert repr(RAW_B) not in repr(ring)
    assert repr(ring) == "Keyring(ids=['a'], allow_clear=False)"


def test_init_app_refuses_keys_without_a_secret_key_for_the_default_scope(tmp_path: t.Any) -> None:
    from tests.support import testapp

    url = f"sqlite:///{tmp_path / 'app.sqlite3'}"
    with pytest.raises(ValueError, match="no SECRET_KEY") as refused:
        testapp.create_app(url, **{**sealed_config(), "SECRET_KEY": None})
    assert TEXT_A not in str(refused.value)
    with pytest.raises(TypeError, match="IDEMPOTENCY_ENCRYPTION_ALLOW_CLEAR"):
        testapp.create_app(url, IDEMPOTENCY_ENCRYPTION_ALLOW_CLEAR="yes", **sealed_config())
    # With a scope of its own, the app keeps no proof of a password.
    app = testapp.create_app(
        url, **{**sealed_config(), "SECRET_KEY": None, "IDEMPOTENCY_SCOPE": lambda: "tenant"}
    )
    assert app.extensions["idempotency"].store.keyring.allow_clear is False
    app = testapp.create_app(url, IDEMPOTENCY_ENCRYPTION_ALLOW_CLEAR=True, **sealed_config())
    assert app.extensions["idempotency"].store.keyring.allow_clear is True
