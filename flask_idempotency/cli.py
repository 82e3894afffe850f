"""The ``flask idempotency`` command group: tables, cleanup, inspection, jobs.

Every command exits with one of these codes, so that cron, systemd and
monitoring can tell what happened without reading the text (README, "Command
line"; each command's ``--help``):

======  =================================================================
code    meaning
======  =================================================================
0       done
1       the command ran but did not do all that was asked: no such record,
        a record that changed while you confirmed, a relay run in which an
        event failed (it is retried later), an abort at the prompt
2       usage error: a bad option or argument (a malformed key or scope);
        also click's "No such command" for an app that never called
        ``init_app``, which is what adds this group
69      the database failed: unreachable, refused the connection, read-only,
        or refused a statement (``EX_UNAVAILABLE``)
75      the broker is unavailable: the relay's events stay pending for a
        later run (``EX_TEMPFAIL``)
78      misconfigured: the extension is not registered on the app (the
        group added by hand, without ``init_app``),
        ``IDEMPOTENCY_PUBLISHER`` is missing or unusable, or a table is
        missing (``EX_CONFIG``)
======  =================================================================

Problems are one line on stderr (``Error: ...``), never a traceback; ``-v``
adds the traceback. Results go to stdout. ``scheduler`` and the foreground
``relay`` log a line per run at INFO on the ``flask_idempotency`` logger:
through the app's logging when it configured any, otherwise to stderr, at
INFO (``-v``: DEBUG, with tracebacks; ``-q``: WARNING, and no report lines on
stdout; ``-qq``: ERROR). ``-v`` and ``-q`` go before or after the command's
name.
"""

from __future__ import annotations

import datetime as dt
import json
import typing as t

import click
from flask.cli import AppGroup

from . import _cli, _cli_erase, _cli_keys, _cli_reconcile, _cli_show
from ._cli import (
    EXIT_CODES_HELP,
    MAX_OLDER_THAN_HOURS,
    MAX_RECOVER_LIMIT,
    MAX_RELAY_BATCH,
    MAX_RELAY_POLL,
    RELAY_EXIT_CODES_HELP,
    BrokerUnavailableExit,
    CommandError,
    Finite,
    key_argument,
    scope_argument,
    scope_prefix_argument,
)
from ._context import resolve_app
from ._maintenance import runner
from ._maintenance.jobs import PURGE_PAUSE, purge_expired, recover_abandoned
from ._messaging.admin import purge_published, retry_parked
from ._storage import OVERRIDABLE, Hold, release_verdict
from ._storage import outbox as outbox_sql
from ._storage.added import lacking_columns as added_columns
from ._storage.schema import inbox_table, outbox_table

__all__ = ["idempotency_cli"]


def _command(
    name: str, *, epilog: str = EXIT_CODES_HELP
) -> t.Callable[[t.Callable[..., None]], click.Command]:
    """A command of the group, with ``-v``/``-q``, the exit codes in its help,
    and database failures as one line."""

    def decorate(fn: t.Callable[..., None]) -> click.Command:
        command = idempotency_cli.command(name, epilog=epilog)(_cli.guarded(fn))
        command.params.extend(_cli.verbosity_options())
        return command

    return decorate


idempotency_cli = AppGroup(
    "idempotency",
    help="Inspect and maintain idempotency records.",
    epilog=(
        "\b\nExit codes: 0 done; 1 not all done (see the message); 2 usage error;\n"
        "69 the database failed (unreachable, read-only, refused); 75 the broker is\n"
        "unavailable (relay); 78 misconfigured."
    ),
    params=_cli.verbosity_options(),
)


@_command("create-tables")
def create_tables() -> None:
    """Create the idempotency tables (only those) if they do not exist.

    Never a column of a table that exists: an outbox from an earlier release,
    without ``trace_context`` or the owner columns, exits 78 with the statements
    to run (or run your migrations), as the changelog's schema changes say."""
    state = _cli.current_state()
    metadata = state.db.metadata
    outbox = outbox_table(metadata)
    own = (state.store.table, state.job_lock_table, outbox, inbox_table(metadata))
    for table in own:
        table.create(state.db.engine, checkfirst=True)
        _cli.report(f"{table.name}: present")
    with state.db.engine.connect() as conn:
        for table, lacking in ((outbox, outbox_sql.lacking_columns), (own[0], added_columns)):
            if missing := lacking(conn, table):
                statements = "; ".join(
                    outbox_sql.add_column_sql(conn.dialect, table, name) for name in missing
                )
                raise _cli.Misconfigured(
                    f"{table.name} has no column {', '.join(missing)} (created by an earlier "
                    f"release; create-tables adds no columns): run {statements} "
                    "or your migrations"
                )


@_command("purge")
@click.option(
    "--batch-size",
    type=click.IntRange(min=1, max=100_000),
    default=None,
    help="Records deleted per transaction (default IDEMPOTENCY_PURGE_BATCH).",
)
@click.option("--dry-run", is_flag=True, help="Count the expired records; delete nothing.")
@click.option(
    "--pause",
    type=Finite(min=0, max=100),
    default=PURGE_PAUSE,
    show_default=True,
    help="Pause after each batch, as a multiple of the time it took (0: flat out).",
)
def purge(batch_size: int | None, dry_run: bool, pause: float) -> None:
    """Delete expired records in small batches, each its own transaction."""
    _cli.require_tables(_cli.current_state().store.table)
    report = purge_expired(resolve_app(), batch_size=batch_size, dry_run=dry_run, pause=pause)
    if dry_run:
        _cli.report(f"{report.deleted} expired record(s) would be deleted")
    else:
        _cli.report(str(report))


@_command("stats")
def stats() -> None:
    """Records by status, oldest in progress, expired awaiting cleanup, table size;
    the outbox (pending, retrying, oldest pending age, parked, published), the inbox
    (processed ids, per consumer), the jobs' last runs, each when its table exists.
    ``jobs`` is null, and ``errors`` says why, when the role may not read the job
    locks' table."""
    numbers = _cli.gather_stats()
    click.echo(json.dumps(numbers, indent=2, sort_keys=True))


def _load_or_none(scope: str, key: str) -> tuple[t.Any, dt.datetime]:
    """The record (or ``None``), and the time to judge it at: the database's
    (``state.now``), not this host's, whose clock may run ahead of the hosts
    that hold leases."""
    state = _cli.current_state()
    _cli.require_tables(state.store.table)
    with state.db.engine.connect() as conn:
        # A record whose sealed data does not open is shown (and judged) by
        # what is in clear, "unreadable" saying why: never a traceback.
        return state.store.load(conn, scope, key, unreadable_ok=True), state.now(conn)


def _load(scope: str, key: str) -> tuple[t.Any, dt.datetime]:
    """As :func:`_load_or_none`; no record is an error."""
    record, now = _load_or_none(scope, key)
    if record is None:
        raise CommandError(f"no record for scope {scope!r} and key {key!r}")
    return record, now


@_command("show")
@click.argument("scope", callback=scope_argument)
@click.argument("key", callback=key_argument)
@click.option(
    "--reveal",
    is_flag=True,
    help="Also print the response body and header values, the recovery points and the "
    "stored request, with the fields the app's routes redact masked.",
)
def show(scope: str, key: str, reveal: bool) -> None:
    """Print one record as JSON; its contents only with --reveal.

    Without it: the record's state, the sizes of its bodies and stored request, the
    names of its headers and recovery points. Bodies show as text when UTF-8. A record
    whose sealed data does not open shows what is in clear and why (`unreadable`)."""
    record, _ = _load(scope, key)
    click.echo(json.dumps(_cli_show.record_document(record, reveal=reveal), indent=2))


def _refuse_force(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    if value:
        raise click.BadParameter(
            "--force is gone: a completed record, or one whose view committed, is a "
            "committed outcome and is never released; name what to override instead "
            "(--override live-lease, --override recovery-points)",
            ctx,
            param,
        )
    return value


@_command("release")
@click.argument("scope", callback=scope_argument)
@click.argument("key", callback=key_argument)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option(
    "--override",
    "overrides",
    multiple=True,
    type=click.Choice(sorted(hold.value for hold in OVERRIDABLE)),
    help=(
        "Release the record although this holds it (repeat for both): live-lease (the "
        "operation is running now: its holder is cut off and a retry runs it again) or "
        "recovery-points (the retry starts afresh instead of resuming after its "
        "finished steps). A committed outcome is never overridden."
    ),
)
@click.option("--force", is_flag=True, hidden=True, expose_value=False, callback=_refuse_force)
def release(scope: str, key: str, yes: bool, overrides: tuple[str, ...]) -> None:
    """Delete a stuck record so the next retry with this key runs the view again.

    Refused (exit 1, saying why) for what the lease-recovery job refuses too: a
    record under a live lease, one holding recovery points (unless you
    --override them), and a committed outcome: a completed record, or one
    whose view committed work of its own (never). An expired record is
    released whatever it holds: requests already treat it as absent.
    """
    record, now = _load(scope, key)
    state = _cli.current_state()
    held = frozenset(Hold(value) for value in overrides)
    verdict = release_verdict(record, now, held)
    if not verdict.allowed:
        raise CommandError(f"not released: {verdict.reason}")
    if not yes:
        overriding = f", {verdict.reason}" if verdict.overridden else ""
        click.confirm(
            f"Release {record.status} record {key!r} in scope {scope!r}{overriding}? "
            "A retry with this key will run the view again",
            abort=True,
        )
    with state.db.engine.begin() as conn:
        # Only the record shown, and only if the rule still lets it go: if it
        # completed, a step was saved, or a new operation took the key while
        # the operator read the prompt, it is left alone.
        deleted = state.store.delete_releasable(conn, record, state.now(conn), held)
    if deleted:
        _cli.report(f"released, {verdict.reason}" if verdict.overridden else "released")
        return
    current, now = _load_or_none(scope, key)
    if current is None:
        _cli.report("already gone")
        return
    if current.fencing_token == record.fencing_token:
        again = release_verdict(current, now, held)
        if not again.allowed:
            raise CommandError(
                f"the record changed while you confirmed; not released: {again.reason}"
            )
    raise CommandError(
        f"the record changed while you confirmed (now {current.status}); nothing was "
        "released. Look again with 'show'."
    )


@_command("list")
@click.option("--key", callback=key_argument, help="Only this key (quoted or bare).")
@click.option(
    "--scope-prefix",
    default=None,
    callback=scope_prefix_argument,
    help="Only scopes that start with this text.",
)
@click.option(
    "--status",
    type=click.Choice(["in_progress", "completed", "erased"]),
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
    state = _cli.current_state()
    _cli.require_tables(state.store.table)
    with state.db.engine.connect() as conn:
        records = state.store.find(
            conn, key=key, scope_prefix=scope_prefix, status=status, limit=limit
        )
        now = state.now(conn)
    click.echo(
        json.dumps(
            [
                {
                    "scope": record.scope,
                    "key": record.key,
                    "status": record.status,
                    "response_code": record.response_code,
                    "created_at": _cli.iso(record.created_at),
                    "locked_until": _cli.iso(record.locked_until),
                    "expires_at": _cli.iso(record.expires_at),
                    "expired": record.is_expired(now),
                    **({"unreadable": record.unreadable} if record.unreadable else {}),
                }
                for record in records
            ],
            indent=2,
        )
    )


@_command("recover")
@click.option(
    "--limit",
    type=click.IntRange(min=1, max=MAX_RECOVER_LIMIT),
    default=100,
    show_default=True,
    help="Most records to handle in this run.",
)
def recover(limit: int) -> None:
    """Finish or release in-progress records whose lease has ended, once."""
    _cli.require_tables(_cli.current_state().store.table)
    report = recover_abandoned(resolve_app(), limit=limit)
    _cli.report(f"lease recovery: {report}")


# -- the long-running commands -----------------------------------------------------------


@_command("scheduler")
def scheduler() -> None:
    """Run all jobs in the foreground, as one dedicated process, until SIGTERM/SIGINT.

    Logs a line per job run at INFO (an idle relay run at DEBUG). It stops
    with 69 or 78 when the database or the configuration is unusable at the
    start; later outages are logged and waited out.
    """
    state = _cli.current_state()
    app = resolve_app()
    tables = [state.store.table, state.job_lock_table]
    if app.config.get("IDEMPOTENCY_PUBLISHER") is not None:
        _cli.checked_publisher(app)
        tables.append(_cli.app_outbox())
    _cli.require_tables(*tables)
    runner.run_scheduler(app, _cli.report)


@_command("relay", epilog=RELAY_EXIT_CODES_HELP)
@click.option("--once", is_flag=True, help="Publish what is pending now, then exit.")
@click.option(
    "--batch",
    type=click.IntRange(min=1, max=MAX_RELAY_BATCH),
    default=100,
    show_default=True,
    help="Events taken per batch.",
)
@click.option(
    "--poll",
    type=Finite(min=0.01, max=MAX_RELAY_POLL),
    default=1.0,
    show_default=True,
    help="Seconds between polls when no wake-up comes.",
)
def relay(once: bool, batch: int, poll: float) -> None:
    """Publish outbox events through IDEMPOTENCY_PUBLISHER, until SIGTERM/Ctrl-C.

    Several relays may run at once (they take disjoint rows); delivery is at
    least once. Between batches it waits up to --poll seconds, less when this
    process commits an event; on PostgreSQL it also LISTENs on the
    ``idempotency_outbox`` channel. IDEMPOTENCY_RELAY_WAKE = False: polling only.

    With --once (for cron) it publishes everything pending and exits: 0 when
    all went out, 75 when the broker could not be reached (the rest stays
    pending), 1 when an event failed (it is retried later). Running, it logs a
    line per run that published anything at INFO, an outage of the broker or
    the database when it starts and ends, and rides it out.
    """
    wake = _cli.current_state().settings.relay_wake
    app = resolve_app()
    _cli.checked_publisher(app)
    _cli.require_tables(_cli.app_outbox())
    if not once:
        runner.run_relay(app, batch=batch, poll=poll, wake=wake, report=_cli.report)
        return
    totals = runner.relay_pending(app, batch)
    if totals.broker_unavailable:
        raise BrokerUnavailableExit(
            f"outbox relay: the broker is unavailable; published {totals.published}, the rest "
            "stays pending for a later run"
        )
    if totals.failed:
        raise CommandError(
            f"outbox relay: published {totals.published}; {totals.failed} failed and will be "
            "retried (the log says why)"
        )
    _cli.report(f"outbox relay: published {totals.published}")


@_command("outbox-retry")
def outbox_retry() -> None:
    """Un-park the events the relay gave up on (attempts reset, due now)."""
    _cli.require_tables(_cli.app_outbox())
    _cli.report(f"un-parked {retry_parked(resolve_app())} event(s)")


@_command("outbox-purge")
@click.option(
    "--older-than",
    type=Finite(min=0, max=MAX_OLDER_THAN_HOURS),
    default=None,
    help="Hours since the event was published (default IDEMPOTENCY_OUTBOX_RETENTION).",
)
def outbox_purge(older_than: float | None) -> None:
    """Delete outbox events published more than --older-than hours ago (the
    cleanup job does it too, after IDEMPOTENCY_OUTBOX_RETENTION)."""
    _cli.require_tables(_cli.app_outbox())
    age = None if older_than is None else dt.timedelta(hours=older_than)
    deleted = purge_published(resolve_app(), age)
    _cli.report(f"deleted {deleted} published event(s)")


_command("erase")(_cli_erase.erase)
_command("reconcile")(_cli_reconcile.reconcile)
_cli_keys.register(_command)  # generate-key, reseal
