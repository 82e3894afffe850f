"""What a declared transaction pooler asks of the app's engine.

Under transaction pooling (PgBouncer's ``pool_mode = transaction``, RDS Proxy,
PgCat) each transaction may run on a different server connection, shared with
other clients. Every statement of the extension keeps its state to its own
transaction (``SET LOCAL`` through ``set_config(..., true)``; job locks are
rows, never advisory locks; no temporary tables; a transaction id, never a
backend pid, is carried from one transaction to the next), so the request path
works through it as it is. Two things do not:

* psycopg 3 prepares a statement it has run five times on a connection, under a
  name (``_pg3_0``) the next client of that server connection also uses:
  ``DuplicatePreparedStatement``, or "prepared statement does not exist". That
  is the app's engine's setting (``prepare_threshold=None``), which the
  extension never changes: :func:`watch` logs a connection that would prepare.
* LISTEN: the relay's wake-up channel (:mod:`.notify`), which goes to
  ``IDEMPOTENCY_RELAY_LISTEN_URL`` or falls back to polling.
"""

from __future__ import annotations

import logging
import typing as t
import weakref

import sqlalchemy as sa
from sqlalchemy import event

from . import drivers

logger = logging.getLogger("flask_idempotency")

#: Where a pooled connection's record keeps that it was checked.
_CHECKED = "flask_idempotency.pooler_checked"

_watched: weakref.WeakSet[sa.Engine] = weakref.WeakSet()


def watch(engine: sa.Engine) -> None:
    """Log, once per engine, when a connection it hands out would prepare
    statements on the server by itself (under a pooler declared as
    ``"transaction"``). Checked at checkout, once per connection: after every
    ``connect`` listener of the app's has run, so a threshold set there counts."""
    if engine in _watched:
        return
    _watched.add(engine)
    told: list[bool] = []

    def checkout(dbapi_connection: t.Any, record: t.Any, proxy: t.Any) -> None:
        if told or record.info.get(_CHECKED):
            return
        record.info[_CHECKED] = True
        if drivers.prepares(engine.dialect, dbapi_connection):
            told.append(True)
            logger.warning(
                'IDEMPOTENCY_DATABASE_POOLER is "transaction", but this engine\'s %s '
                "connections prepare statements on the server (prepare_threshold=%r): "
                "through the pooler a request will fail now and then with "
                'DuplicatePreparedStatement ("_pg3_0") or "prepared statement does not '
                "exist\". Create the engine with connect_args={'prepare_threshold': None} "
                "(Flask-SQLAlchemy: SQLALCHEMY_ENGINE_OPTIONS), or, where the pooler tracks "
                "prepared statements (PgBouncer 1.21+ with max_prepared_statements > 0), "
                'declare IDEMPOTENCY_DATABASE_POOLER = "transaction+prepared".',
                engine.dialect.driver,
                getattr(dbapi_connection, "prepare_threshold", None),
            )

    event.listen(engine, "checkout", checkout)
