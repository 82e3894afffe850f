"""The ``flask idempotency`` command group: tables, cleanup, inspection, jobs."""

from __future__ import annotations

import datetime as dt
import json
import logging
import signal
import sys
import threading
import typing as t

import click
import sqlalchemy as sa
from flask.cli import AppGroup

from .errors import InvalidKeyError
from .keys import parse_key
from .scope import MAX_SCOPE_LENGTH
from .state import AppState, app_state, resolve_app

idempotency_cli = AppGroup("idempotency", help="Inspect and maintain idempotency records.")


def _state() -> AppState:
    try:
        return app_state()
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _key_argument(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """The key as the client sent it in the header: quoted (``'"order-42"'``) or bare."""
    if value is None:
        return None
    try:
        return parse_key(value)
    except InvalidKeyError as exc:
        raise click.BadParameter(exc.detail) from None


def _scope_argument(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """A scope exactly as stored: byte for byte, so no trimming or case folding."""
    if not value:
        raise click.BadParameter("the scope must not be empty")
    if "\x00" in value:
        raise click.BadParameter("the scope must not contain NUL")
    if len(value) > MAX_SCOPE_LENGTH:
        raise click.BadParameter(f"the scope must be at most {MAX_SCOPE_LENGTH} characters")
    return value


@idempotency_cli.command("create-tables")
def create_tables() -> None:
    """Create the idempotency tables (only those) if they do not exist."""
    from .models import inbox_table, outbox_table

    state = _state()
    metadata = state.db.metadata
    own = (state.store.table, state.job_lock_table, outbox_table(metadata), inbox_table(metadata))
    for table in own:
        table.create(state.db.engine, checkfirst=True)
        click.echo(f"{table.name}: present")


@idempotency_cli.command("purge")
@click.option(
    "--batch-size",
    type=click.IntRange(min=1, max=100_000),
    default=None,
    help="Records deleted per transaction (default IDEMPOTENCY_PURGE_BATCH).",
)
@click.option("--dry-run", is_flag=True, help="Count the expired records; delete nothing.")
def purge(batch_size: int | None, dry_run: bool) -> None:
    """Delete expired records in small batches, each its own transaction."""
    from .jobs import purge_expired

    _state()
    report = purge_expired(resolve_app(), batch_size=batch_size, dry_run=dry_run)
    if dry_run:
        click.echo(f"{report.deleted} expired record(s) would be deleted")
    else:
        click.echo(str(report))


@idempotency_cli.command("stats")
def stats() -> None:
    """Records by status, oldest in progress, expired awaiting cleanup, table size;
    the outbox (pending, retrying, oldest pending age, parked, published) and the
    inbox (processed ids, per consumer), each when its table exists."""
    from . import inbox
    from .models import OUTBOX_TABLE_NAME
    from .relay import outbox_stats

    state = _state()
    with state.db.engine.connect() as conn:
        numbers = state.store.stats(conn, state.clock())
        has_outbox = sa.inspect(conn).has_table(OUTBOX_TABLE_NAME)
        if inbox.table_exists(conn):
            numbers.update(inbox.stats(conn, state.clock()))
    numbers["oldest_in_progress"] = _iso(numbers["oldest_in_progress"])
    if has_outbox:
        numbers.update(outbox_stats(resolve_app()))
    click.echo(json.dumps(numbers, indent=2, sort_keys=True))


def _load(scope: str, key: str) -> t.Any:
    state = _state()
    with state.db.engine.connect() as conn:
        record = state.store.load(conn, scope, key)
    if record is None:
        raise click.ClickException(f"no record for scope {scope!r} and key {key!r}")
    return record


@idempotency_cli.command("show")
@click.argument("scope", callback=_scope_argument)
@click.argument("key", callback=_key_argument)
def show(scope: str, key: str) -> None:
    """Print one record as JSON (the body as text when it is UTF-8)."""
    record = _load(scope, key)
    body: str | None = None
    if record.response_body is not None:
        try:
            body = record.response_body.decode("utf-8")
        except UnicodeDecodeError:
            body = f"<{len(record.response_body)} bytes, not UTF-8>"
    click.echo(
        json.dumps(
            {
                "scope": record.scope,
                "key": record.key,
                "status": record.status,
                "request_hash": record.request_hash,
                "fencing_token": record.fencing_token,
                "response_code": record.response_code,
                "response_headers": record.response_headers,
                "response_body": body,
                "body_omitted": record.body_omitted,
                "recovery_points": record.recovery_points,
                "recoverable": record.recoverable,
                "locked_until": _iso(record.locked_until),
                "created_at": _iso(record.created_at),
                "completed_at": _iso(record.completed_at),
                "expires_at": _iso(record.expires_at),
            },
            indent=2,
        )
    )


@idempotency_cli.command("release")
@click.argument("scope", callback=_scope_argument)
@click.argument("key", callback=_key_argument)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--force", is_flag=True, help="Also release a completed record.")
def release(scope: str, key: str, yes: bool, force: bool) -> None:
    """Delete a stuck record so the next retry with this key runs the view again."""
    record = _load(scope, key)
    if record.status != "in_progress" and not force:
        raise click.ClickException(
            f"the record is {record.status}: releasing it lets the operation run again. "
            "Use --force if that is what you want."
        )
    if not yes:
        click.confirm(
            f"Release {record.status} record {key!r} in scope {scope!r}? "
            "A retry with this key will run the view again",
            abort=True,
        )
    state = _state()
    with state.db.engine.begin() as conn:
        # Only the record shown: if it completed, or a new operation took the key,
        # while the operator read the prompt, it is left alone.
        deleted = state.store.delete_record(
            conn,
            scope,
            key,
            token=record.fencing_token,
            status=None if force else record.status,
        )
    if deleted:
        click.echo("released")
        return
    now = state.store.load_committed(state.db.engine, scope, key)
    if now is None:
        click.echo("already gone")
    else:
        raise click.ClickException(
            f"the record changed while you confirmed (now {now.status}); nothing was "
            "released. Look again with 'show'."
        )


@idempotency_cli.command("list")
@click.option("--key", callback=_key_argument, help="Only this key (quoted or bare).")
@click.option("--scope-prefix", default=None, help="Only scopes that start with this text.")
@click.option(
    "--status",
    type=click.Choice(["in_progress", "completed"]),
    default=None,
    help="Only records in this state.",
)
@click.option(
    "--limit",
    type=click.IntRange(min=1, max=10_000),
    default=20,
    show_default=True,
    help="Most records printed, newest first.",
)
def list_records(key: str | None, scope_prefix: str | None, status: str | None, limit: int) -> None:
    """Find records (scope, key, status, times) as JSON, newest first.

    For a client's key whose scope you cannot build (a bearer token or cookie
    digest): ``list --key KEY``, then ``show`` or ``release`` with its scope.
    """
    state = _state()
    with state.db.engine.connect() as conn:
        records = state.store.find(
            conn, key=key, scope_prefix=scope_prefix, status=status, limit=limit
        )
    now = state.clock()
    click.echo(
        json.dumps(
            [
                {
                    "scope": record.scope,
                    "key": record.key,
                    "status": record.status,
                    "response_code": record.response_code,
                    "created_at": _iso(record.created_at),
                    "locked_until": _iso(record.locked_until),
                    "expires_at": _iso(record.expires_at),
                    "expired": record.is_expired(now),
                }
                for record in records
            ],
            indent=2,
        )
    )


@idempotency_cli.command("recover")
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="Most records to handle in this run.",
)
def recover(limit: int) -> None:
    """Finish or release in-progress records whose lease has ended, once."""
    from .jobs import recover_abandoned

    _state()
    report = recover_abandoned(resolve_app(), limit=limit)
    click.echo(f"lease recovery: {report}")


@idempotency_cli.command("scheduler")
def scheduler() -> None:
    """Run all jobs in the foreground, as one dedicated process, until SIGTERM/SIGINT."""
    from .scheduler import JobScheduler

    _state()
    jobs = JobScheduler(resolve_app())
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    jobs.start()
    wakes = ""
    if jobs.waker is not None:
        how = "LISTEN idempotency_outbox" if jobs.waker.listening else "in-process commits"
        wakes = f" (relay wakes on {how})"
    click.echo(f"idempotency scheduler running as {jobs.holder}{wakes}; SIGTERM or Ctrl-C stops it")
    try:
        while not stop.wait(1.0):
            pass
    finally:
        jobs.shutdown(wait=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        click.echo("idempotency scheduler stopped")


@idempotency_cli.command("relay")
@click.option("--once", is_flag=True, help="Publish what is pending now, then exit.")
@click.option("--batch", type=click.IntRange(min=1), default=100, show_default=True)
@click.option(
    "--poll", type=click.FloatRange(min=0.01), default=1.0, show_default=True, help="Seconds."
)
def relay(once: bool, batch: int, poll: float) -> None:
    """Publish outbox events through IDEMPOTENCY_PUBLISHER, until SIGTERM/Ctrl-C.

    Several relays may run at once (they take disjoint rows); delivery is at
    least once. Between batches it waits up to --poll seconds, less when this
    process commits an event; on PostgreSQL it also LISTENs on the
    ``idempotency_outbox`` channel. IDEMPOTENCY_RELAY_WAKE = False: polling only.
    """
    from .relay import Listener, RelistenBackoff, relay_batch

    wake = _state().settings.relay_wake
    app = resolve_app()
    if once:
        total = 0
        while True:
            run = relay_batch(app, batch=batch)
            total += run.published
            if not run.more:  # short, or the broker is away: the rest waits
                break
        click.echo(f"outbox relay: published {total}")
        return
    stop = threading.Event()
    listener = Listener(app, wake=wake)

    def on_signal(signum: int, frame: object) -> None:
        stop.set()
        listener.interrupt()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    how = "LISTEN idempotency_outbox and polling" if listener.listening else "polling"
    how += "" if wake else " only (IDEMPOTENCY_RELAY_WAKE is off)"
    click.echo(f"outbox relay running ({how}); SIGTERM or Ctrl-C stops it")
    sys.stdout.flush()
    relisten = RelistenBackoff()
    try:
        while not stop.is_set():
            try:
                more = relay_batch(app, batch=batch).more
            except Exception:
                logging.getLogger("flask_idempotency").exception("outbox relay run failed")
                more = False
            if not more and not stop.is_set():
                try:
                    listener.wait(poll)
                except Exception:
                    # The LISTEN connection broke (a restart, a failover, an idle
                    # killer): listen again on a new one, after a pause that
                    # grows while it keeps failing (not a loop of connects).
                    logging.getLogger("flask_idempotency").warning(
                        "outbox relay: the LISTEN connection failed; listening again",
                        exc_info=True,
                    )
                    listener.close()
                    stop.wait(max(poll, relisten.delay(listener)))
                    listener = Listener(app, wake=wake)
    finally:
        listener.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        click.echo("outbox relay stopped")


@idempotency_cli.command("outbox-retry")
def outbox_retry() -> None:
    """Un-park the events the relay gave up on (attempts reset, due now)."""
    from .relay import retry_parked

    _state()
    click.echo(f"un-parked {retry_parked(resolve_app())} event(s)")


@idempotency_cli.command("outbox-purge")
@click.option(
    "--older-than",
    type=click.FloatRange(min=0),
    default=None,
    help="Hours since the event was published (default IDEMPOTENCY_OUTBOX_RETENTION).",
)
def outbox_purge(older_than: float | None) -> None:
    """Delete outbox events published more than --older-than hours ago (the
    cleanup job does it too, after IDEMPOTENCY_OUTBOX_RETENTION)."""
    from .relay import purge_published

    _state()
    age = None if older_than is None else dt.timedelta(hours=older_than)
    deleted = purge_published(resolve_app(), age)
    click.echo(f"deleted {deleted} published event(s)")
