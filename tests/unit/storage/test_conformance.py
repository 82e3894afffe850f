"""Every dialect and driver implementation of the storage layer keeps one contract.

The same tests run on each implementation, against the real database: what
each primitive answers, and what it leaves in the table (read back on a
connection of its own), never a mock.

* ``psycopg2``, ``psycopg``: PostgreSQL with each driver's fast path (the claim
  as one batch, statements compiled once);
* ``postgresql-one-by-one``: PostgreSQL with no fast path registered, each
  statement through SQLAlchemy (the path of every other PostgreSQL driver);
* ``sqlite``, ``mysql`` (MariaDB or MySQL, where one answers);
* ``generic``: SQLite served as an engine without a module of its own
  (:class:`~flask_idempotency._storage.dialects.Dialect` itself: the claim
  inserted in a savepoint), with SQLAlchemy's recipe that makes pysqlite's
  savepoints transactional.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import typing as t

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from flask_idempotency._storage import (
    COMPLETED,
    IN_PROGRESS,
    OVERRIDABLE,
    Hold,
    Store,
    as_utc,
    database_now,
    drivers,
    new_fencing_token,
    open_transaction,
)
from flask_idempotency._storage.dialects import Dialect, MySQL, PostgreSQL, dialect_of
from flask_idempotency.errors import ClaimWaitExceeded
from tests.support.storage import (
    HOUR,
    SCOPE,
    Impl,
    claimed,
    new_key,
    now_ms,
    record_values,
)


def test_the_registries_pick_the_engines_implementation(impl: Impl) -> None:
    with impl.engine.connect() as conn:
        assert type(dialect_of(conn)) is impl.dialect
        path = drivers.fast_path(conn)
        assert (type(path) if path is not None else None) is impl.fast_path
        # SQLAlchemy rewrites statements per connection there: nothing compiled once.
        mapped = conn.execution_options(schema_translate_map={"elsewhere": None})
        assert drivers.fast_path(mapped) is None


def test_a_new_key_is_claimed_in_the_callers_transaction(impl: Impl) -> None:
    now, key = now_ms(), new_key()
    values = record_values(key, now, request_method="POST", request_body=b"{}")
    with Session(impl.engine) as session:
        assert impl.store.claim(session, values, dt.timedelta(seconds=5)) == (True, None)
        assert key not in impl.rows()  # not committed yet
        session.rollback()
    assert key not in impl.rows()  # rolled back with the caller's transaction
    claimed(impl, values)
    row = impl.rows()[key]
    assert (row["scope"], row["status"], row["fencing_token"]) == (
        SCOPE,
        IN_PROGRESS,
        values["fencing_token"],
    )
    assert (row["locked_until"], row["request_body"]) == (now + HOUR, b"{}")
    with impl.engine.connect() as conn:
        whole = impl.store.load(conn, SCOPE, key)
        head = impl.store.load(conn, SCOPE, key, stored_request=False)
    assert whole is not None
    assert head is not None
    assert (whole.request_body, head.request_body) == (b"{}", None)
    assert head.fencing_token == values["fencing_token"]


def test_a_held_key_is_not_claimed_again_and_its_holder_is_told(impl: Impl) -> None:
    now, key = now_ms(), new_key()
    first = record_values(key, now)
    claimed(impl, first)
    with Session(impl.engine) as session:
        won, held = impl.store.claim(session, record_values(key, now), None)
        assert (won, held is not None) == (False, True)
        assert held is not None
        assert held.fencing_token == first["fencing_token"]
        assert held.request_body is None  # a request needs no stored request
        assert impl.store.try_insert(session, record_values(key, now)) is False
        session.commit()
    assert [row["fencing_token"] for row in impl.rows().values()] == [first["fencing_token"]]


def test_an_expired_record_is_replaced_by_a_new_operation(impl: Impl) -> None:
    now, key = now_ms(), new_key()
    old = record_values(key, now - 48 * HOUR, lease=-HOUR, recovery_points='{"a":1}')
    claimed(impl, old)
    with Session(impl.engine) as session:
        won, record = impl.store.claim(session, record_values(key, now), None)
        assert not won
        assert record is not None
        assert record.is_expired(now)
        token = new_fencing_token(record.fencing_token)
        columns = {k: v for k, v in record_values(key, now).items() if k not in ("scope", "key")}
        columns["request_hash"] = "h2"
        assert impl.store.take_over(session, record, columns, now, expired=True, token=token)
        session.commit()
    row = impl.rows()[key]
    assert (row["fencing_token"], row["request_hash"], row["created_at"]) == (token, "h2", now)
    assert (row["recovery_points"], row["status"], row["response_code"]) == (
        None,
        IN_PROGRESS,
        None,
    )


def test_a_reclaim_continues_the_operation_and_one_contender_wins(impl: Impl) -> None:
    now, key = now_ms(), new_key()
    first = record_values(
        key, now - HOUR, lease=dt.timedelta(minutes=-1), recovery_points='{"a":1}'
    )
    claimed(impl, first)
    with impl.engine.connect() as conn:
        record = impl.store.load(conn, SCOPE, key)
    assert record is not None
    tokens = [new_fencing_token(record.fencing_token) for _ in range(2)]
    outcomes = []
    for token in tokens:
        with Session(impl.engine) as session:
            columns = {
                k: v for k, v in record_values(key, now).items() if k not in ("scope", "key")
            }
            outcomes.append(
                impl.store.take_over(session, record, columns, now, expired=False, token=token)
            )
            session.commit()
    assert outcomes == [True, False]
    row = impl.rows()[key]
    assert (row["fencing_token"], row["locked_until"]) == (tokens[0], now + HOUR)
    # The operation goes on: its creation and its recovery points are kept.
    assert (row["created_at"], row["recovery_points"]) == (now - HOUR, '{"a":1}')


def test_completion_is_fenced_by_the_token(impl: Impl) -> None:
    now, key = now_ms(), new_key()
    values = record_values(key, now)
    claimed(impl, values)
    completion: dict[str, t.Any] = {
        "response_code": 201,
        "response_headers": [("Content-Type", "application/json")],
        "response_body": b'{"id":1}',
        "body_omitted": False,
        "now": now,
    }
    token = values["fencing_token"]
    with impl.engine.begin() as conn:
        assert not impl.store.complete(conn, SCOPE, key, new_fencing_token(token), **completion)
        assert impl.rows()[key]["status"] == IN_PROGRESS
        assert impl.store.complete(conn, SCOPE, key, token, **completion)
    row = impl.rows()[key]
    assert (row["status"], row["response_code"], row["response_body"]) == (
        COMPLETED,
        201,
        b'{"id":1}',
    )
    assert (row["locked_until"], row["completed_at"]) == (None, now)
    with impl.engine.begin() as conn:  # completed: no holder's statement applies any more
        assert not impl.store.complete(conn, SCOPE, key, token, **completion)
        assert not impl.store.renew_lease(conn, SCOPE, key, token, now + HOUR)
        assert not impl.store.release(conn, SCOPE, key, token)
    assert impl.rows()[key]["status"] == COMPLETED


def test_release_deletes_the_record_or_keeps_its_recovery_points(impl: Impl) -> None:
    now, gone, kept = now_ms(), new_key(), new_key()
    values = {key: record_values(key, now) for key in (gone, kept)}
    for one in values.values():
        claimed(impl, one)
    with impl.engine.begin() as conn:
        tokens = {key: one["fencing_token"] for key, one in values.items()}
        assert not impl.store.release(conn, SCOPE, gone, new_fencing_token(tokens[gone]))
        assert impl.store.release(conn, SCOPE, gone, tokens[gone])
        assert impl.store.save_recovery_points(
            conn, SCOPE, kept, tokens[kept], {"charge": 1}, now + HOUR
        )
        assert impl.store.release(conn, SCOPE, kept, tokens[kept], keep_recovery_points=True)
    rows = impl.rows()
    assert gone not in rows
    assert (rows[kept]["locked_until"], rows[kept]["recovery_points"]) == (None, '{"charge":1}')


def test_a_lease_is_renewed_and_kept_for_retry_only_by_its_holder(impl: Impl) -> None:
    now, key = now_ms(), new_key()
    values = record_values(key, now, request_method="POST", request_body=b"{}")
    claimed(impl, values)
    token = values["fencing_token"]
    with impl.engine.begin() as conn:
        assert not impl.store.renew_lease(conn, SCOPE, key, new_fencing_token(token), now)
        assert impl.store.renew_lease(conn, SCOPE, key, token, now + 2 * HOUR)
        assert impl.store.restamp(
            conn, SCOPE, key, token, locked_until=now + 3 * HOUR, expires_at=now + 48 * HOUR
        )
    row = impl.rows()[key]
    assert (row["locked_until"], row["expires_at"]) == (now + 3 * HOUR, now + 48 * HOUR)
    with Session(impl.engine) as session:
        renewed, transaction = impl.store.renew_lease_before_commit(
            session, SCOPE, key, token, now + 4 * HOUR
        )
        assert renewed
        session.commit()
    if impl.dialect is PostgreSQL:
        assert isinstance(transaction, int)
        assert impl.store.commit_outcome(impl.engine, transaction, dt.timedelta(seconds=2))
    else:
        assert transaction is None
    with impl.engine.begin() as conn:
        assert impl.store.keep_for_retry(conn, SCOPE, key, token, recovery_points={})
    row = impl.rows()[key]
    assert (row["locked_until"], row["recovery_points"], row["request_body"]) == (None, "{}", None)


def test_purge_deletes_expired_records_and_nothing_else(impl: Impl) -> None:
    now = now_ms()
    past = now - 48 * HOUR
    expired = [record_values(new_key(), past, lease=-HOUR) for _ in range(3)]
    still_leased = record_values(new_key(), past, lease=49 * HOUR)  # past retention, lease live
    live = record_values(new_key(), now)
    for values in (*expired, still_leased, live):
        claimed(impl, values)
    with impl.engine.begin() as conn:
        assert impl.store.count_expired(conn, now) == 3
        assert impl.store.purge_batch(conn, now, limit=2).rows == 2
        assert impl.store.purge_batch(conn, now, limit=2).rows == 1
        assert impl.store.purge_batch(conn, now, limit=2).rows == 0
    assert set(impl.rows()) == {still_leased["key"], live["key"]}


def test_a_purge_batch_in_a_callers_transaction_leaves_its_durability_alone(impl: Impl) -> None:
    """Cleanup's own batches commit without waiting for their flush on
    PostgreSQL (tests/unit/maintenance/test_cleanup.py); the batch's
    statements, run in a transaction of the caller's (whose other writes may
    be a business's), leave ``synchronous_commit`` as the caller had it."""
    if impl.dialect is not PostgreSQL:
        pytest.skip("only PostgreSQL sets it per transaction")
    now = now_ms()
    claimed(impl, record_values(new_key(), now - 48 * HOUR, lease=-HOUR))
    show = sa.text("SHOW synchronous_commit")
    with impl.engine.connect() as conn:
        assert impl.store.purge_batch(conn, now, limit=10).rows == 1
        assert conn.execute(show).scalar_one() == "on"
        conn.commit()
    assert impl.rows() == {}


def test_purge_batches_resume_at_the_last_expiry_without_skipping_ties(impl: Impl) -> None:
    """Each batch reports the latest ``expires_at`` it deleted; the next, given it
    as ``after``, starts there (``>=``), so records sharing that time that the
    limit left over are still deleted, and nothing live or leased is."""
    now = now_ms()
    early, tied = now - 72 * HOUR, now - 48 * HOUR

    def expiring(at: dt.datetime, lease_ends: dt.datetime) -> dict[str, t.Any]:
        created = at - 24 * HOUR  # record_values keeps records a day
        return record_values(new_key(), created, lease=lease_ends - created)

    first = expiring(early, now - HOUR)
    ties = [expiring(tied, now - HOUR) for _ in range(4)]
    leased = expiring(tied, now + HOUR)  # past its retention, its lease runs
    live = record_values(new_key(), now)  # expires in a day
    for values in (first, *ties, leased, live):
        claimed(impl, values)
    counts, lasts, after = [], [], None
    with impl.engine.begin() as conn:
        for _ in range(5):  # bounded: 5 records to delete, 2 a batch
            batch = impl.store.purge_batch(conn, now, 2, after=after)
            counts.append(batch.rows)
            lasts.append(as_utc(batch.last))
            if batch.rows < 2:
                break
            after = batch.last
    assert counts == [2, 2, 1]  # the first and a tie, two ties, the last tie
    assert lasts == [tied, tied, tied]
    assert set(impl.rows()) == {leased["key"], live["key"]}
    late = expiring(early, now - HOUR)
    claimed(impl, late)
    with impl.engine.begin() as conn:
        # A batch bounded past a record's expiry leaves it (the next run finds it).
        assert impl.store.purge_batch(conn, now, 2, after=tied).rows == 0
        assert impl.store.purge_batch(conn, now, 2).rows == 1
        empty = impl.store.purge_batch(conn, now, 2)
    assert (empty.rows, empty.last) == (0, None)
    assert set(impl.rows()) == {leased["key"], live["key"]}


def test_abandoned_records_are_found_and_released(impl: Impl) -> None:
    now = now_ms()
    abandoned = record_values(new_key(), now - HOUR, lease=dt.timedelta(minutes=-1))
    resumable = record_values(
        new_key(), now - HOUR, lease=dt.timedelta(minutes=-2), recovery_points='{"a":1}'
    )
    held = record_values(new_key(), now)
    for values in (abandoned, resumable, held):
        claimed(impl, values)
    with impl.engine.begin() as conn:
        found = impl.store.find_abandoned(conn, now, limit=10)
        assert [record.key for record in found] == [abandoned["key"]]
        assert impl.store.delete_releasable(conn, found[0], now)
        assert not impl.store.delete_releasable(conn, found[0], now)  # already gone
        # What the rule keeps: recovery points, a live lease (unless overridden).
        [kept] = [r for r in impl.store.find(conn, key=resumable["key"])]
        assert not impl.store.delete_releasable(conn, kept, now)
        [live] = [r for r in impl.store.find(conn, key=held["key"])]
        assert not impl.store.delete_releasable(conn, live, now)
    assert set(impl.rows()) == {resumable["key"], held["key"]}


def test_the_operators_queries_compare_scope_and_key_exactly(impl: Impl) -> None:
    now = now_ms()
    ours = record_values("Kéy", now)
    ours["scope"] = "tenant-é:1"
    other = record_values("kéy", now)
    other["scope"] = "tenant-E:1"
    for values in (ours, other):
        claimed(impl, values)
    with impl.engine.begin() as conn:
        found = impl.store.find(conn, scope_prefix="tenant-é")
        assert [(r.scope, r.key) for r in found] == [("tenant-é:1", "Kéy")]
        assert [r.scope for r in impl.store.find(conn, key="kéy")] == ["tenant-E:1"]
        stats = impl.store.stats(conn, now)
        assert stats["by_status"] == {IN_PROGRESS: 2}
        assert stats["table_bytes"] is None or stats["table_bytes"] > 0
        [record] = impl.store.find(conn, key="Kéy")
        stale = dataclasses.replace(record, fencing_token=new_fencing_token(record.fencing_token))
        assert not impl.store.delete_releasable(conn, stale, now, OVERRIDABLE)
        assert not impl.store.delete_releasable(conn, record, now)  # its lease is live
        assert impl.store.delete_releasable(conn, record, now, {Hold.LIVE_LEASE})
    assert set(impl.rows()) == {"kéy"}


def test_database_now_is_the_servers_clock_in_utc(impl: Impl) -> None:
    with impl.engine.connect() as conn:
        now = database_now(conn)
    assert now.utcoffset() == dt.timedelta(0)
    assert abs(now - dt.datetime.now(dt.UTC)) < dt.timedelta(seconds=5)


def _wait_setting(impl: Impl, conn: sa.Connection) -> t.Any:
    if impl.dialect is PostgreSQL:
        return conn.execute(sa.text("SHOW lock_timeout")).scalar_one()
    if impl.dialect is MySQL:
        # Row locks' bound and the table's (metadata locks: LOCK TABLES, ALTER TABLE).
        bounds = "SELECT @@SESSION.innodb_lock_wait_timeout, @@SESSION.lock_wait_timeout"
        return tuple(conn.execute(sa.text(bounds)).one())
    return conn.exec_driver_sql("PRAGMA busy_timeout").scalar_one()


def test_a_duplicate_waits_no_longer_than_the_bound_which_is_then_put_back(impl: Impl) -> None:
    if impl.dialect is Dialect:
        pytest.skip("an engine without a module has no bound of ours")
    now, key = now_ms(), new_key()
    other = impl.engine_like(pool_size=1, max_overflow=0)  # one connection: its settings
    try:
        with Session(impl.engine) as first, Session(other) as second:
            assert impl.store.claim(first, record_values(key, now), None) == (True, None)
            before = _wait_setting(impl, second.connection())
            with pytest.raises(ClaimWaitExceeded):
                impl.store.claim(second, record_values(key, now), dt.timedelta(milliseconds=200))
            second.rollback()
            assert _wait_setting(impl, second.connection()) == before
            first.commit()
            won, held = impl.store.claim(second, record_values(key, now), dt.timedelta(seconds=5))
            assert (won, held is not None) == (False, True)
            assert _wait_setting(impl, second.connection()) == before
            second.rollback()
    finally:
        other.dispose()


def test_an_interruption_inside_a_bounded_wait_comes_out_as_itself(impl: Impl) -> None:
    """KeyboardInterrupt (SystemExit: gunicorn's worker timeout) mid-statement:
    SQLAlchemy discards the connection, so the bound cannot be put back; the
    interruption still comes out, not the refusal of the statement that would
    have put it back."""
    if impl.dialect is Dialect:
        pytest.skip("an engine without a module has no bound of ours")
    with Session(impl.engine) as session:
        session.connection()

        def interrupted() -> None:
            with impl.store.bounded_wait(session, dt.timedelta(seconds=2)):
                # What SQLAlchemy does when an exit exception interrupts a statement.
                session.connection().invalidate()
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            interrupted()
        session.rollback()
        assert session.execute(sa.text("SELECT 1")).scalar_one() == 1


def test_a_fenced_update_of_the_values_already_there_counts_as_held(impl: Impl) -> None:
    """A lease renewed to the end it has (a clock that did not move): the row
    is matched, so still held, on every engine (MySQL's drivers as SQLAlchemy
    opens them, and as docs/performance.md says to ask for multi-statement
    strings: FOUND_ROWS, matched rows)."""
    now = now_ms()
    values = record_values(new_key(), now)
    with Session(impl.engine) as session:
        assert impl.store.claim(session, values, None) == (True, None)
        token, until = values["fencing_token"], now + HOUR
        for _ in range(2):
            assert impl.store.renew_lease(session, SCOPE, values["key"], token, until)
        session.commit()


def test_a_claim_bounds_how_long_its_transaction_may_sit_idle(impl: Impl) -> None:
    """On PostgreSQL, for the rest of the claim's transaction only; elsewhere the
    setting does nothing, and the claim works the same."""
    store = Store(impl.store.table, claim_idle=dt.timedelta(seconds=30))
    show = sa.text("SHOW idle_in_transaction_session_timeout")
    with Session(impl.engine) as session:
        if impl.dialect is PostgreSQL:
            server_setting = session.execute(show).scalar_one()
            assert server_setting == "0"  # the suite's servers: off
            session.rollback()
        values = record_values(new_key(), now_ms())
        assert store.claim(session, values, dt.timedelta(seconds=5)) == (True, None)
        if impl.dialect is PostgreSQL:
            assert session.execute(show).scalar_one() == "30s"
        session.commit()
        if impl.dialect is PostgreSQL:
            assert session.execute(show).scalar_one() == server_setting
    assert impl.rows()[values["key"]]["fencing_token"] == values["fencing_token"]


def test_an_autocommit_connection_is_refused_before_anything_is_written(impl: Impl) -> None:
    engine = impl.engine_like(isolation_level="AUTOCOMMIT")
    try:
        with Session(engine) as session, pytest.raises(RuntimeError, match="AUTOCOMMIT"):
            impl.store.claim(session, record_values(new_key(), now_ms()), None)
    finally:
        engine.dispose()
    assert impl.rows() == {}


def test_a_savepoint_first_in_the_transaction_rolls_back_with_it(impl: Impl) -> None:
    """Once the transaction is opened on the server (pysqlite's own waits for a
    write), a savepoint made first belongs to it: released, then rolled back
    with it, it leaves nothing."""
    with impl.engine.connect() as conn:
        conn.begin()
        open_transaction(conn)
        with conn.begin_nested():
            assert impl.store.try_insert(conn, record_values(new_key(), now_ms()))
        conn.rollback()
    assert impl.rows() == {}


def test_the_rules_version_and_request_digest_are_written_and_read_on_every_path(
    impl: Impl,
) -> None:
    """The claim (each driver's path), the holder's read, a reclaim judged the
    same request by its bytes (a new fingerprint and rules version written over
    the record's own, matched on the record's fingerprint), and the replacement
    of an expired record (a new operation: its own values, or none)."""
    now, key = now_ms(), new_key()
    digest = "d" * 64
    first = record_values(
        key,
        now - HOUR,
        lease=dt.timedelta(minutes=-1),
        rules_version="a" * 16,
        request_digest=digest,
    )
    claimed(impl, first)
    assert (impl.rows()[key]["rules_version"], impl.rows()[key]["request_digest"]) == (
        "a" * 16,
        digest,
    )
    with Session(impl.engine) as session:
        won, held = impl.store.claim(session, record_values(key, now), None)
        assert not won
        assert held is not None
        assert (held.rules_version, held.request_digest) == ("a" * 16, digest)
        session.rollback()
    with impl.engine.connect() as conn:
        record = impl.store.load(conn, SCOPE, key)
        listed = impl.store.find(conn, key=key)
    assert record is not None
    assert (record.rules_version, record.request_digest) == ("a" * 16, digest)
    assert [(r.rules_version, r.request_digest) for r in listed] == [("a" * 16, digest)]
    token = new_fencing_token(record.fencing_token)
    columns = {
        k: v
        for k, v in record_values(key, now, rules_version="b" * 16, request_digest=digest).items()
        if k not in ("scope", "key")
    }
    columns["request_hash"] = "h-new"
    with Session(impl.engine) as session:
        assert impl.store.take_over(session, record, columns, now, expired=False, token=token)
        session.commit()
    row = impl.rows()[key]
    assert (row["fencing_token"], row["request_hash"], row["rules_version"]) == (
        token,
        "h-new",
        "b" * 16,
    )
    # Expired: replaced by a new operation that names no rules (made outside a route).
    with impl.engine.connect() as conn:
        record = impl.store.load(conn, SCOPE, key)
    assert record is not None
    later = now + 48 * HOUR
    fresh = {k: v for k, v in record_values(key, later).items() if k not in ("scope", "key")}
    with Session(impl.engine) as session:
        token = new_fencing_token(record.fencing_token)
        assert impl.store.take_over(session, record, fresh, later, expired=True, token=token)
        session.commit()
    assert (impl.rows()[key]["rules_version"], impl.rows()[key]["request_digest"]) == (None, None)
