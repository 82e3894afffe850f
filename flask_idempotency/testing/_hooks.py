"""What the served process does for the kit: fault points, the trace of what
requests commit, and the origin header on calls to the fake downstream.

Everything is installed once per process, globally (SQLAlchemy's ``Engine``,
``Session`` and ``Mapper`` classes, the extension's signals, ``http.client``),
so it sees whatever engines, sessions and HTTP clients the app uses. No request
content drives a fault: the test arms it in the control directory, so the
fingerprint of the request under test is the client's own.

The trace of writes is :mod:`._trace`'s; this module installs its listeners.
"""

from __future__ import annotations

import http.client
import os
import signal
import sys
import time
import typing as t

import sqlalchemy as sa
from sqlalchemy import event, orm

from .. import models, signals
from .._context import find_app_state
from . import _trace
from ._control import ORIGIN_HEADER, Control, TraceEntry
from ._trace import request_ended, request_started, request_state

__all__ = ["install", "request_ended", "request_started"]

#: Where a session keeps the outbox events it inserted until its transaction ends.
_INFO_KEY = "idempotency_kit.inserted"
#: How long a held request waits to be released, at most.
_HOLD_LIMIT = 30.0
#: How often a held request touches its claim's connection (below any idle bound).
_HOLD_TOUCH = 1.0

_control: Control | None = None
_downstream: tuple[str, int] | None = None
_installed = False


def install(control: Control, downstream: tuple[str, int] | None) -> None:
    """Install the hooks in this process (once; later calls change the targets)."""
    global _control, _downstream, _installed
    _control, _downstream = control, downstream
    _trace.use(control)
    if _installed:
        return
    _installed = True
    # Registered before anything else of the kit on these events: the trace is
    # written before a kill at the same commit.
    event.listen(orm.Mapper, "after_insert", _trace._after_insert)
    event.listen(sa.Engine, "after_execute", _trace._after_execute)
    event.listen(sa.Engine, "begin", _trace._forget)
    event.listen(sa.Engine, "rollback", _trace._forget)
    event.listen(sa.Engine, "savepoint", _trace._savepoint)
    event.listen(sa.Engine, "rollback_savepoint", _trace._rollback_savepoint)
    event.listen(sa.Engine, "commit", _trace._commit)
    event.listen(sa.Engine, "handle_error", _trace._handle_error)
    event.listen(orm.Session, "do_orm_execute", _orm_execute)
    event.listen(orm.Session, "after_commit", _after_commit)
    event.listen(orm.Session, "after_rollback", _after_rollback)
    event.listen(orm.Session, "before_commit", _before_commit)
    signals.key_claimed.connect(_key_claimed, weak=False)
    signals.step_saved.connect(_step_saved, weak=False)
    _patch_http_client()


def _kill(fault: str) -> None:
    sys.stderr.write(f"idempotency kit: fault {fault} fired, SIGKILL pid {os.getpid()}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _pending_events(session: orm.Session) -> list[TraceEntry]:
    return t.cast(list[TraceEntry], session.info.setdefault(_INFO_KEY, []))


def _orm_execute(execute_state: orm.ORMExecuteState) -> None:
    """An outbox event inserted through the session (``idem.emit``)."""
    if not execute_state.is_insert:
        return
    statement = execute_state.statement
    table = getattr(statement, "table", None)
    if getattr(table, "name", None) != models.OUTBOX_TABLE_NAME:
        return
    state = request_state()
    if state is None or state["key"] is None:
        return
    session = execute_state.session
    params = t.cast(t.Any, statement).compile(dialect=session.get_bind().dialect).params
    event_id = next((v for k, v in params.items() if k.startswith("event_id")), None)
    if event_id is None:
        return
    _pending_events(session).append(
        TraceEntry(
            request=state["id"],
            key=state["key"],
            kind="event",
            table=models.OUTBOX_TABLE_NAME,
            columns=("event_id",),
            pk=(event_id,),
            pid=os.getpid(),
        )
    )


def _after_commit(session: orm.Session) -> None:
    entries = session.info.pop(_INFO_KEY, None)
    if entries and _control is not None:
        _control.append_trace(entries)
    state = request_state()
    if state is None or _control is None:
        return
    state["commits"] += 1
    armed = _control.peek("kill_after_commit")
    if (
        armed
        and armed.get("nth", 1) == state["commits"]
        and _control.consume("kill_after_commit") is not None
    ):
        _kill("kill_after_commit")


def _after_rollback(session: orm.Session) -> None:
    session.info.pop(_INFO_KEY, None)  # never committed: not a side effect


def _before_commit(session: orm.Session) -> None:
    state = request_state()
    if state is None or _control is None:
        return
    state["before"] += 1
    armed = _control.peek("kill_before_commit")
    if (
        armed
        and armed.get("nth", 1) == state["before"]
        and _control.consume("kill_before_commit") is not None
    ):
        _kill("kill_before_commit")


# -- signals -------------------------------------------------------------------


def _key_claimed(sender: t.Any, **kwargs: t.Any) -> None:
    if _control is None:
        return
    held = _control.consume("hold_first")
    if held is None:
        return
    token = held["token"]
    _control.held(token, "reached").write_text(str(kwargs.get("key")), encoding="utf-8")
    sys.stderr.write(f"idempotency kit: holding the request for key {kwargs.get('key')!r}\n")
    deadline = time.monotonic() + min(float(held.get("timeout", _HOLD_LIMIT)), _HOLD_LIMIT)
    release = _control.held(token, "release")
    touched = time.monotonic()
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
        if time.monotonic() - touched >= _HOLD_TOUCH:
            _touch_claim(sender)
            touched = time.monotonic()


def _touch_claim(app: t.Any) -> None:
    """A statement on the claim's connection: a held request is a request still
    at work, not a host cut off, so the app's ``IDEMPOTENCY_CLAIM_IDLE_TIMEOUT``
    must not end its transaction however long the test takes to release it."""
    state = find_app_state(app)
    if state is None:
        return
    session = state.db.session
    session.connection(bind_arguments={"clause": state.store.table}).exec_driver_sql("SELECT 1")


def _step_saved(sender: t.Any, **kwargs: t.Any) -> None:
    if _control is None:
        return
    armed = _control.peek("kill_after_step")
    if (
        armed
        and armed.get("name") == kwargs.get("name")
        and _control.consume("kill_after_step") is not None
    ):
        _kill(f"kill_after_step({kwargs.get('name')!r})")


# -- calls to the downstream ---------------------------------------------------


def _aimed_at_downstream(conn: http.client.HTTPConnection) -> bool:
    if _downstream is None:
        return False
    host, port = _downstream
    return (
        conn.host in (host, "localhost" if host == "127.0.0.1" else host)
        and (conn.port or 80) == port
    )


def _patch_http_client() -> None:
    """Wrap ``HTTPConnection.putrequest`` (add the origin header) and
    ``getresponse`` (the kill after a call). urllib, urllib3 and requests all
    send and receive through these two."""
    connection = http.client.HTTPConnection
    original_putrequest = connection.putrequest
    original_getresponse = connection.getresponse

    def putrequest(self: http.client.HTTPConnection, *args: t.Any, **kwargs: t.Any) -> None:
        original_putrequest(self, *args, **kwargs)
        if _aimed_at_downstream(self):
            state = request_state()
            if state is not None and state["key"] is not None:
                self.putheader(ORIGIN_HEADER, state["key"])

    def getresponse(self: http.client.HTTPConnection) -> http.client.HTTPResponse:
        response = original_getresponse(self)
        aimed = _aimed_at_downstream(self) and _control is not None
        if aimed and _control is not None and _control.consume("kill_after_call") is not None:
            _kill("kill_after_call")
        return response

    connection.putrequest = putrequest  # type: ignore[method-assign]
    connection.getresponse = getresponse  # type: ignore[method-assign]
