"""Claims made straight on the :class:`Store`, and the claim's round trips
counted on the wire, for the storage tests and the claim idle bound's."""

from __future__ import annotations

import contextlib
import datetime as dt
import typing as t
import uuid

import sqlalchemy as sa
from sqlalchemy.orm import Session

from bench.wire import CountingProxy
from flask_idempotency._storage import Store, added, new_fencing_token, operation_values
from flask_idempotency._storage.schema import IN_PROGRESS

HOUR = dt.timedelta(hours=1)


def claim_values(key: str, now: dt.datetime, *, lease: dt.timedelta = HOUR) -> dict[str, t.Any]:
    """A record's values for :meth:`Store.claim` in scope ``outcomes``: in
    progress, leased for ``lease`` from ``now``, a fencing token of its own."""
    return {
        "scope": "outcomes",
        "key": key,
        "fencing_token": new_fencing_token(),
        **operation_values(
            request_hash="h",
            status=IN_PROGRESS,
            locked_until=now + lease,
            created_at=now,
            expires_at=now + 24 * HOUR,
        ),
    }


@contextlib.contextmanager
def claimed_in_one_round_trip_each(
    pg_url: str, store: Store, wait: dt.timedelta | None
) -> t.Iterator[Session]:
    """Claims a new key, then the same key again, through a proxy that counts
    exchanges: asserts that the first wins, the second finds it taken, and that
    each took one exchange (the client sends after a reply). Yields the session
    in the second claim's transaction; rolls it back after."""
    with CountingProxy(pg_url) as proxy:
        engine = sa.create_engine(proxy.url())
        try:
            now = dt.datetime.now(dt.timezone.utc)
            values = claim_values(str(uuid.uuid4()), now)
            with Session(engine) as session:
                session.execute(sa.text("SELECT 1"))  # BEGIN and the connection's set-up
                # Which added columns the table lacks is read once per engine, at
                # its first claim (a table from an earlier release): not per claim.
                added.absent_columns(session.connection(), store.table)
                proxy.reset()
                assert store.claim(session, values, wait) == (True, None)
                assert proxy.exchanges == 1
                proxy.reset()
                won, held = store.claim(session, claim_values(values["key"], now), wait)
                assert (won, held is not None) == (False, True)
                assert proxy.exchanges == 1
                yield session
                session.rollback()
        finally:
            engine.dispose()
