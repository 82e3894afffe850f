"""The served process's trace of what keyed requests commit, and each request's
kit state (its id, key and commit counts).

Every statement that changes a table of the app (not the extension's) during a
keyed request is kept on its connection and written to the trace when that
connection commits (dropped at a rollback, or a rollback to a savepoint taken
before it; retracted if the commit fails). A row inserted through the ORM, or by
a Core insert whose primary key SQLAlchemy reports, is written as the row
(``"row"``: checked later for existence); anything else that changed rows
(UPDATE, DELETE, SQL text, an insert without a known key) as a ``"write"`` of its
request. A write outside any request while requests are in flight (a thread the
view started) is written without a key: unattributable. :mod:`._hooks` installs
the listeners.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import typing as t
import uuid

import sqlalchemy as sa
from flask import current_app, has_request_context, request
from sqlalchemy import orm

from .. import models
from ._control import Control, TraceEntry

#: Where a request keeps its kit state in the WSGI environ.
_ENVIRON_KEY = "idempotency_kit"
#: Where a connection keeps what it wrote until its transaction ends (its
#: DBAPI connection's ``info``), the savepoints taken, the commit under way.
_PENDING = "idempotency_kit.pending"
_SAVEPOINTS = "idempotency_kit.savepoints"
_COMMITTING = "idempotency_kit.committing"
#: The extension's own tables: never the view's side effects (the outbox's
#: events are traced as events).
_OWN_TABLES = {
    models.TABLE_NAME,
    models.JOB_LOCK_TABLE_NAME,
    models.INBOX_TABLE_NAME,
    models.OUTBOX_TABLE_NAME,
}
#: What a statement in SQL text changes: its verb and table.
_WRITE_SQL = re.compile(
    r"^\s*(INSERT|REPLACE|UPDATE|DELETE)\b(?:\s+(?:INTO|FROM))?\s+[`\"\[]?([\w.]+)",
    re.IGNORECASE,
)
#: The name of a write made outside any request.
_OFF_REQUEST = "(outside a request)"
#: Where the trace goes (set by :func:`use`).
_control: Control | None = None
#: Requests being served now in this process (the served module counts them).
_in_flight = 0
_in_flight_lock = threading.Lock()


def use(control: Control) -> None:
    """Write the trace to ``control``'s."""
    global _control
    _control = control


def request_started() -> None:
    """A request arrived (the served module's WSGI wrapper calls this)."""
    global _in_flight
    with _in_flight_lock:
        _in_flight += 1


def request_ended() -> None:
    global _in_flight
    with _in_flight_lock:
        _in_flight -= 1


def request_state() -> dict[str, t.Any] | None:
    """This request's kit state (its id, key and commit counts), or ``None``
    outside a request."""
    if not has_request_context():
        return None
    environ = request.environ
    state = environ.get(_ENVIRON_KEY)
    if state is None:
        state = {"id": uuid.uuid4().hex[:12], "key": _request_key(), "commits": 0, "before": 0}
        environ[_ENVIRON_KEY] = state
    return t.cast(dict[str, t.Any], state)


def _request_key() -> str | None:
    """The request's Idempotency-Key as the extension reads it: the bare form
    or an RFC 8941 string (``"..."``), both naming the same key."""
    header = current_app.config.get("IDEMPOTENCY_HEADER") or "Idempotency-Key"
    raw = request.headers.get(header)
    if raw is None:
        return None
    raw = raw.strip()
    if len(raw) >= 2 and raw.startswith('"') and raw.endswith('"'):
        raw = raw[1:-1].replace('\\"', '"').replace("\\\\", "\\")
    return raw or None


def _info(connection: sa.Connection) -> dict[t.Any, t.Any]:
    """The connection's ``info`` (its DBAPI connection's); an empty dict of no
    one's when the connection is gone (invalidated: reading it must not
    reconnect)."""
    try:
        return connection.info
    except Exception:
        return {}


def _pending(connection: sa.Connection) -> list[TraceEntry]:
    return t.cast(list[TraceEntry], _info(connection).setdefault(_PENDING, []))


def _table_name(table: t.Any) -> str:
    return str(getattr(table, "fullname", None) or getattr(table, "name", None) or "")


def _origin() -> tuple[str, str | None] | None:
    """(request id, key) a write now belongs to; ``None`` when it is none of the
    kit's business (an unkeyed request; no request in flight)."""
    state = request_state()
    if state is not None:
        return None if state["key"] is None else (state["id"], state["key"])
    if _in_flight > 0:
        return (_OFF_REQUEST, None)
    return None


def _after_insert(mapper: orm.Mapper[t.Any], connection: sa.Connection, target: t.Any) -> None:
    origin = _origin()
    if origin is None:
        return
    columns = list(mapper.primary_key)
    name = _table_name(columns[0].table)
    if name in _OWN_TABLES:
        return
    _pending(connection).append(
        TraceEntry(
            request=origin[0],
            key=origin[1],
            kind="row",
            table=name,
            columns=tuple(c.name for c in columns),
            pk=tuple(mapper.primary_key_from_instance(target)),
            pid=os.getpid(),
            verb="INSERT",
            rowcount=1,
        )
    )


def _after_execute(
    connection: sa.Connection,
    clauseelement: t.Any,
    multiparams: t.Any,
    params: t.Any,
    execution_options: t.Any,
    result: t.Any,
) -> None:
    """Any statement that changed rows: Core, ORM (a flush's inserts are traced
    by the mapper too: the same request), SQL text."""
    context = getattr(result, "context", None)
    if context is None:
        return
    origin = _origin()
    if origin is None:
        return
    table: t.Any = None
    if context.isinsert or context.isupdate or context.isdelete:
        verb = "INSERT" if context.isinsert else "UPDATE" if context.isupdate else "DELETE"
        compiled_statement = getattr(context.compiled, "statement", None)
        table = getattr(compiled_statement, "table", None)
        name = _table_name(table)
    else:
        found = _WRITE_SQL.match(str(getattr(context, "statement", "") or ""))
        if found is None:
            return
        verb, name = found.group(1).upper(), found.group(2)
    if not name or name.rpartition(".")[2] in _OWN_TABLES:
        return
    try:
        rowcount = int(result.rowcount)
    except Exception:  # a driver that cannot say
        rowcount = -1
    if rowcount == 0:
        return  # changed nothing
    entries = _inserted_rows(origin, result, table) if verb == "INSERT" else None
    if not entries:
        entries = [
            TraceEntry(
                request=origin[0],
                key=origin[1],
                kind="write",
                table=name,
                columns=(),
                pk=(),
                pid=os.getpid(),
                verb=verb,
                rowcount=rowcount,
            )
        ]
    _pending(connection).extend(entries)


def _inserted_rows(
    origin: tuple[str, str | None], result: t.Any, table: t.Any
) -> list[TraceEntry] | None:
    """The rows a Core insert made, by primary key, where SQLAlchemy knows them
    (a single-row insert; psycopg2's executemany); ``None`` otherwise."""
    if not isinstance(table, sa.Table) or not table.primary_key.columns:
        return None
    try:
        rows = list(result.inserted_primary_key_rows)
    except Exception:  # explicit RETURNING, a multi-row VALUES, ...: not known
        return None
    if not rows or any(row is None or any(v is None for v in row) for row in rows):
        return None
    columns = tuple(c.name for c in table.primary_key.columns)
    return [
        TraceEntry(
            request=origin[0],
            key=origin[1],
            kind="row",
            table=_table_name(table),
            columns=columns,
            pk=tuple(row),
            pid=os.getpid(),
            verb="INSERT",
            rowcount=1,
        )
        for row in rows
    ]


def _forget(connection: sa.Connection) -> None:
    """A transaction begins or rolls back: nothing of it is committed."""
    info = _info(connection)
    info.pop(_PENDING, None)
    info.pop(_SAVEPOINTS, None)
    info.pop(_COMMITTING, None)


def _savepoint(connection: sa.Connection, name: str) -> None:
    info = _info(connection)
    info.setdefault(_SAVEPOINTS, {})[name] = len(info.get(_PENDING, ()))


def _rollback_savepoint(connection: sa.Connection, name: str, context: t.Any) -> None:
    info = _info(connection)
    mark = info.get(_SAVEPOINTS, {}).get(name)
    pending = info.get(_PENDING)
    if mark is not None and pending is not None:
        del pending[mark:]


def _commit(connection: sa.Connection) -> None:
    """Sent just before the DBAPI commit: the writes go to the trace now, so a
    kill right after the commit cannot lose them; a failed commit retracts them."""
    info = _info(connection)
    entries = info.pop(_PENDING, None)
    info.pop(_SAVEPOINTS, None)
    if not entries or _control is None:
        return
    batch = uuid.uuid4().hex
    info[_COMMITTING] = batch
    _control.append_trace([dataclasses.replace(e, batch=batch) for e in entries])


def _handle_error(context: t.Any) -> None:
    connection = getattr(context, "connection", None)
    if connection is None or context.statement is not None or _control is None:
        return
    batch = _info(connection).pop(_COMMITTING, None)
    if batch:  # the commit itself failed: what it carried is not committed
        _control.append_trace(
            [TraceEntry("", None, "retract", "", (), (), os.getpid(), batch=batch)]
        )
