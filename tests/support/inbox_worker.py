"""An inbox consumer for the relay fault tests: the work for each event is one
``relay_work`` row, done at most once per event through ``@inbox.consumer``.

``python -m tests.support.inbox_worker DATABASE_URL FILE...`` delivers every message
(one JSON line ``{"event_id", "payload"}``) of the files, each in a
transaction of its own, as a consumer process reading a queue would.
"""

from __future__ import annotations

import json
import sys
import typing as t

import sqlalchemy as sa
from sqlalchemy import orm

from flask_idempotency._messaging import inbox
from tests.support import pgbouncer

CONSUMER = "shipping"

metadata = sa.MetaData()
work = sa.Table(
    "relay_work",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("event_id", sa.String(64), nullable=False),
    sa.Column("payload", sa.Text, nullable=False),
)
inbox.inbox_table(metadata)


def reset(engine: sa.Engine) -> None:
    metadata.drop_all(engine)
    metadata.create_all(engine)


def make_consumer(session: orm.Session) -> t.Callable[[str, t.Any], t.Any]:
    """``deliver(event_id, payload)``: the work once per event id; ``None`` for a
    duplicate (skipped), ``"done"`` when the work ran."""

    @inbox.consumer(CONSUMER, session=session, event_id=lambda event_id, payload: event_id)
    def deliver(event_id: str, payload: t.Any) -> str:
        session.execute(
            sa.insert(work).values(event_id=event_id, payload=json.dumps(payload, sort_keys=True))
        )
        return "done"

    return deliver


def counts(engine: sa.Engine) -> tuple[int, int, int]:
    """Work rows, distinct event ids among them, inbox rows."""
    with engine.connect() as conn:
        rows = conn.execute(sa.select(sa.func.count(), sa.func.count(work.c.event_id.distinct())))
        total, distinct = rows.one()
        kept = conn.execute(
            sa.select(sa.func.count()).select_from(metadata.tables[inbox.INBOX_TABLE_NAME])
        )
        return int(total), int(distinct), int(kept.scalar_one())


def main(url: str, *paths: str) -> None:
    # Behind the suite's PgBouncer: psycopg 3 prepares nothing, as docs/poolers.md says.
    options = pgbouncer.user_config(url).get("SQLALCHEMY_ENGINE_OPTIONS", {})
    engine = sa.create_engine(url, pool_size=1, connect_args=options.get("connect_args", {}))
    with orm.Session(engine) as session:
        deliver = make_consumer(session)
        for path in paths:
            with open(path) as f:
                for line in f:
                    message = json.loads(line)
                    deliver(message["event_id"], message["payload"])
    engine.dispose()


if __name__ == "__main__":
    main(*sys.argv[1:])
