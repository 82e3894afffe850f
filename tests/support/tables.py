"""Fresh tables for a test app or the benchmark app: every table of its
metadata dropped and created again, the extension's among them."""

from __future__ import annotations

import typing as t

import sqlalchemy as sa

from flask_idempotency._storage.schema import job_lock_table, outbox_table, record_table

#: The extension's tables every app here uses: those ``init_app`` puts on the app's
#: metadata (the record's, the job lock's, and the outbox's, which readiness requires).
EXTENSION_TABLES: tuple[t.Callable[[sa.MetaData], sa.Table], ...] = (
    record_table,
    job_lock_table,
    outbox_table,
)


def recreate_tables(
    metadata: sa.MetaData,
    url: str,
    extension_tables: t.Iterable[t.Callable[[sa.MetaData], sa.Table]] = EXTENSION_TABLES,
) -> None:
    """Drop and create every table of ``metadata`` at ``url``, empty.

    The extension's tables join the metadata at ``init_app``; they are put on it
    here first, so that this works whether or not an app on ``metadata`` was
    made yet in this process (test order varies with xdist)."""
    for table in extension_tables:
        table(metadata)
    engine = sa.create_engine(url)
    try:
        metadata.drop_all(engine)
        metadata.create_all(engine)
    finally:
        engine.dispose()
