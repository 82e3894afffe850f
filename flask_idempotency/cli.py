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

import contextlib
import datetime as dt
import functools
import json
import logging
import math
import signal
import sys
import threading
import time
import typing as t

import click
import sqlalchemy as sa
from flask import Flask
from flask.cli import AppGroup

from . import signals
from ._context import AppState, app_state, resolve_app
from .errors import InvalidKeyError
from .keys import parse_key
from .scope import MAX_SCOPE_LENGTH

if t.TYPE_CHECKING:
    from ._messaging.relay import Publisher, RelayRun

logger = logging.getLogger("flask_idempotency")

#: Done.
EXIT_OK = 0
#: The command ran but did not do all that was asked (click's own code for an error).
EXIT_FAILED = 1
#: A bad option or argument (click's own code for a usage error).
EXIT_USAGE = 2
#: The database failed: unreachable, refused the connection, read-only, or
#: refused a statement (sysexits' ``EX_UNAVAILABLE``).
EXIT_DATABASE = 69
#: The broker is unavailable; the events stay pending (sysexits' ``EX_TEMPFAIL``).
EXIT_BROKER = 75
#: Misconfigured: not registered, no usable publisher, a table missing
#: (sysexits' ``EX_CONFIG``).
EXIT_CONFIG = 78

EXIT_CODES_HELP = (
    "\b\nExit codes: 0 done; 1 not all done (see the message); 2 usage error;\n"
    "69 the database failed (unreachable, read-only, refused); 78 misconfigured."
)
RELAY_EXIT_CODES_HELP = (
    "\b\nExit codes: 0 done; 1 an event failed (retried later); 2 usage error;\n"
    "69 the database failed (unreachable, read-only, refused); 75 the broker is\n"
    "unavailable (the events stay pending); 78 misconfigured (no usable\n"
    "IDEMPOTENCY_PUBLISHER, the outbox table missing)."
)


class CommandError(click.ClickException):
    """A problem that ends a command: one line on stderr, and its exit code."""

    exit_code = EXIT_FAILED


class DatabaseFailed(CommandError):
    """The database failed: unreachable, read-only, or refused a statement."""

    exit_code = EXIT_DATABASE


class BrokerUnavailableExit(CommandError):
    """The relay could not reach the broker; the events stay pending."""

    exit_code = EXIT_BROKER


class Misconfigured(CommandError):
    """The app's configuration or schema does not let the command run."""

    exit_code = EXIT_CONFIG


# -- verbosity and logging -----------------------------------------------------------

_VERBOSITY = "flask_idempotency.verbosity"


def _count_verbosity(step: int) -> t.Callable[[click.Context, click.Parameter, int], None]:
    def callback(ctx: click.Context, param: click.Parameter, value: int) -> None:
        ctx.meta[_VERBOSITY] = ctx.meta.get(_VERBOSITY, 0) + step * (value or 0)

    return callback


def _verbosity_options() -> list[click.Parameter]:
    return [
        click.Option(
            ["-v", "--verbose"],
            count=True,
            expose_value=False,
            callback=_count_verbosity(+1),
            help="Log DEBUG lines too, and tracebacks.",
        ),
        click.Option(
            ["-q", "--quiet"],
            count=True,
            expose_value=False,
            callback=_count_verbosity(-1),
            help="Only problems (-qq: only errors); no report lines on stdout.",
        ),
    ]


def _verbosity() -> int:
    ctx = click.get_current_context(silent=True)
    return int(ctx.meta.get(_VERBOSITY, 0)) if ctx is not None else 0


class _LineFormatter(logging.Formatter):
    """One line per record (time, level, message); an exception as its type and
    first line, or as the whole traceback when ``tracebacks``."""

    def __init__(self, *, tracebacks: bool) -> None:
        super().__init__("%(asctime)s %(levelname)s %(message)s")
        self.tracebacks = tracebacks

    def format(self, record: logging.LogRecord) -> str:
        if self.tracebacks or not record.exc_info or record.exc_info[1] is None:
            return super().format(record)
        from ._storage.dberrors import summary

        line = f"{record.getMessage()}: {summary(record.exc_info[1])}"
        flat = logging.makeLogRecord(
            {**record.__dict__, "msg": line, "args": None, "exc_info": None, "exc_text": None}
        )
        return super().format(flat)


@contextlib.contextmanager
def _command_logging(verbosity: int) -> t.Iterator[None]:
    """Logging while a command runs.

    When the app configured logging (a handler on the root logger or on
    ``flask_idempotency``), it is kept, and ``-v``/``-q`` only set the
    ``flask_idempotency`` logger's level. Otherwise the CLI puts a stderr
    handler of its own on the root logger, one line per record (other
    libraries' warnings too: SQLAlchemy's pool, APScheduler), with
    ``flask_idempotency`` at INFO (``-v``: DEBUG and tracebacks; ``-q``:
    WARNING; ``-qq``: ERROR). Everything is put back afterwards, so a command
    invoked in-process (tests, an app) leaves no trace.
    """
    level = (
        logging.DEBUG
        if verbosity > 0
        else logging.INFO
        if verbosity == 0
        else logging.WARNING
        if verbosity == -1
        else logging.ERROR
    )
    before = logger.level
    root = logging.getLogger()
    handler: logging.Handler | None = None
    if not logger.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_LineFormatter(tracebacks=verbosity > 0))
        root.addHandler(handler)
        logger.setLevel(level)
    elif verbosity:
        logger.setLevel(level)
    try:
        yield
    finally:
        if handler is not None:
            root.removeHandler(handler)
        logger.setLevel(before)


def _report(text: str) -> None:
    """A command's report line on stdout (not with ``-q``)."""
    if _verbosity() >= 0:
        click.echo(text)


# -- errors ----------------------------------------------------------------------------


def _database_error(exc: BaseException) -> CommandError:
    """The one line for a database failure: which database, and the driver's
    first line (never SQLAlchemy's text, which carries the statement and its
    parameters)."""
    from ._storage.dberrors import UNAVAILABLE, classify, summary

    logger.debug("database error", exc_info=exc)
    where = ""
    try:
        url = app_state().db.engine.url
        where = " " + url.set(password=None, query={}).render_as_string(hide_password=True)
    except Exception:  # the message goes out without the address then
        pass
    what = "is unavailable" if classify(exc) is UNAVAILABLE else "failed"
    return DatabaseFailed(f"the database{where} {what}: {summary(exc)}")


P = t.ParamSpec("P")
R = t.TypeVar("R")


def _guarded(fn: t.Callable[P, R]) -> t.Callable[P, R]:
    """Run a command with its logging set up, turning a database failure into
    its one line and exit code."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with _command_logging(_verbosity()):
            try:
                return fn(*args, **kwargs)
            except sa.exc.SQLAlchemyError as exc:
                raise _database_error(exc) from None

    return run


def _command(
    name: str, *, epilog: str = EXIT_CODES_HELP
) -> t.Callable[[t.Callable[..., None]], click.Command]:
    """A command of the group, with ``-v``/``-q``, the exit codes in its help,
    and database failures as one line."""

    def decorate(fn: t.Callable[..., None]) -> click.Command:
        command = idempotency_cli.command(name, epilog=epilog)(_guarded(fn))
        command.params.extend(_verbosity_options())
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
    params=_verbosity_options(),
)


def _state() -> AppState:
    try:
        return app_state()
    except RuntimeError as exc:
        raise Misconfigured(str(exc)) from None


def _require_tables(*tables: sa.Table) -> None:
    """Exit 78 with what to run when a table the command needs is missing
    (instead of the database's "no such table" in the middle of the work)."""
    engine = _state().db.engine
    with engine.connect() as conn:
        inspector = sa.inspect(conn)
        missing = [t.name for t in tables if not inspector.has_table(t.name, schema=t.schema)]
    if missing:
        raise Misconfigured(
            f"missing table(s) {', '.join(missing)}: run 'flask idempotency create-tables' "
            "or your migrations"
        )


def _outbox() -> sa.Table:
    from ._storage.schema import outbox_table

    return outbox_table(_state().db.metadata)


def _publisher(app: Flask) -> Publisher:
    """The app's ``IDEMPOTENCY_PUBLISHER``, or exit 78 saying what is wrong with it."""
    from ._messaging.relay import app_publisher
    from .errors import BrokerUnavailable

    try:
        publisher = app_publisher(app)
    except (BrokerUnavailable, OSError) as exc:  # a factory that connects, to no broker
        logger.debug("IDEMPOTENCY_PUBLISHER", exc_info=exc)
        raise BrokerUnavailableExit(
            f"the broker is unavailable: making IDEMPOTENCY_PUBLISHER failed: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    except Exception as exc:  # an import, an attribute, the factory's arguments
        logger.debug("IDEMPOTENCY_PUBLISHER", exc_info=exc)
        raise Misconfigured(
            f"IDEMPOTENCY_PUBLISHER is unusable: {type(exc).__name__}: {exc}"
        ) from None
    if publisher is None:
        raise Misconfigured(
            "no outbox publisher: set IDEMPOTENCY_PUBLISHER to an object with "
            "publish(event), or to 'module:attribute' naming one"
        )
    return publisher


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


class _Finite(click.FloatRange):
    """A float in a closed range, NaN refused (it compares false with both
    bounds, so click's range lets it through)."""

    def convert(
        self, value: t.Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> t.Any:
        number = super().convert(value, param, ctx)
        if math.isnan(number):
            self.fail(f"{value!r} is not a number.", param, ctx)
        return number


#: The most records ``recover`` handles in one run, and ``relay`` takes per batch.
MAX_RECOVER_LIMIT = 100_000
MAX_RELAY_BATCH = 10_000
#: The longest ``relay --poll`` (seconds): the fallback when no wake-up comes.
MAX_RELAY_POLL = 3600.0
#: The oldest ``outbox-purge --older-than`` (hours): 100 years, as the settings.
MAX_OLDER_THAN_HOURS = 36500 * 24.0


def _scope_prefix_argument(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> str | None:
    """A scope prefix as stored, byte for byte; NUL refused (no scope holds one,
    and PostgreSQL refuses it in text)."""
    if value is None:
        return None
    if "\x00" in value:
        raise click.BadParameter("the scope prefix must not contain NUL")
    return value


@_command("create-tables")
def create_tables() -> None:
    """Create the idempotency tables (only those) if they do not exist."""
    from ._storage.schema import inbox_table, outbox_table

    state = _state()
    metadata = state.db.metadata
    own = (state.store.table, state.job_lock_table, outbox_table(metadata), inbox_table(metadata))
    for table in own:
        table.create(state.db.engine, checkfirst=True)
        _report(f"{table.name}: present")


@_command("purge")
@click.option(
    "--batch-size",
    type=click.IntRange(min=1, max=100_000),
    default=None,
    help="Records deleted per transaction (default IDEMPOTENCY_PURGE_BATCH).",
)
@click.option("--dry-run", is_flag=True, help="Count the expired records; delete nothing.")
def purge(batch_size: int | None, dry_run: bool) -> None:
    """Delete expired records in small batches, each its own transaction."""
    from ._maintenance.jobs import purge_expired

    _require_tables(_state().store.table)
    report = purge_expired(resolve_app(), batch_size=batch_size, dry_run=dry_run)
    if dry_run:
        _report(f"{report.deleted} expired record(s) would be deleted")
    else:
        _report(str(report))


@_command("stats")
def stats() -> None:
    """Records by status, oldest in progress, expired awaiting cleanup, table size;
    the outbox (pending, retrying, oldest pending age, parked, published) and the
    inbox (processed ids, per consumer), each when its table exists."""
    from ._messaging.admin import outbox_stats
    from ._storage import inbox
    from ._storage.schema import OUTBOX_TABLE_NAME

    state = _state()
    _require_tables(state.store.table)
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
    _require_tables(state.store.table)
    with state.db.engine.connect() as conn:
        record = state.store.load(conn, scope, key)
    if record is None:
        raise CommandError(f"no record for scope {scope!r} and key {key!r}")
    return record


@_command("show")
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


@_command("release")
@click.argument("scope", callback=_scope_argument)
@click.argument("key", callback=_key_argument)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--force", is_flag=True, help="Also release a completed record.")
def release(scope: str, key: str, yes: bool, force: bool) -> None:
    """Delete a stuck record so the next retry with this key runs the view again."""
    record = _load(scope, key)
    if record.status != "in_progress" and not force:
        raise CommandError(
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
        _report("released")
        return
    now = state.store.load_committed(state.db.engine, scope, key)
    if now is None:
        _report("already gone")
    else:
        raise CommandError(
            f"the record changed while you confirmed (now {now.status}); nothing was "
            "released. Look again with 'show'."
        )


@_command("list")
@click.option("--key", callback=_key_argument, help="Only this key (quoted or bare).")
@click.option(
    "--scope-prefix",
    default=None,
    callback=_scope_prefix_argument,
    help="Only scopes that start with this text.",
)
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
    _require_tables(state.store.table)
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
    from ._maintenance.jobs import recover_abandoned

    _require_tables(_state().store.table)
    report = recover_abandoned(resolve_app(), limit=limit)
    _report(f"lease recovery: {report}")


# -- the long-running commands -----------------------------------------------------------


class _Trouble:
    """Problems per source (a job, the broker, the database), logged so that an
    outage is a few lines, not one per poll: at WARNING when it starts, at
    DEBUG while it lasts (whatever the error says meanwhile), and its end at
    INFO."""

    def __init__(self) -> None:
        self._now: dict[str, str] = {}
        self._lock = threading.Lock()

    def problem(self, source: str, text: str) -> None:
        with self._lock:
            ongoing = source in self._now
            self._now[source] = text
        logger.log(logging.DEBUG if ongoing else logging.WARNING, "%s: %s", source, text)

    def fine(self, source: str) -> None:
        with self._lock:
            was = self._now.pop(source, None)
        if was is not None:
            logger.info("%s: working again (last: %s)", source, was)


def _database_problem(exc: BaseException) -> str:
    from ._storage.dberrors import summary

    logger.debug("database error", exc_info=exc)
    return f"the database failed: {summary(exc)}"


class _PublishedCount(threading.local):
    """Events the relay published in this thread while counting (the relay job's
    per-run line); ``None`` when not counting."""

    count: int | None = None


_published = _PublishedCount()


def _count_published(sender: object, **kwargs: object) -> None:
    if _published.count is not None:
        _published.count += 1


class _JobSummaries(logging.Filter):
    """Drops the jobs' own summaries ("cleanup: ...", "lease recovery: ...") in
    ``flask idempotency scheduler``, whose per-run line says the same."""

    SUPERSEDED = frozenset({"cleanup: %s", "lease recovery: %s"})

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in self.SUPERSEDED


def _logged_scheduler(app: Flask) -> t.Any:
    """A :class:`~flask_idempotency.scheduler.JobScheduler` that logs a line per
    run: the job, what it did and how long it took, at INFO (an idle relay run
    at DEBUG: it runs every second); a run that could not start because the
    database failed, as one line while that lasts."""
    from ._maintenance.scheduler import JobFunc, JobScheduler

    trouble = _Trouble()

    class LoggedJobs(JobScheduler):
        def run_job(self, name: str, func: JobFunc, every: dt.timedelta | None = None) -> bool:
            done: list[tuple[int, str]] = []  # (level, line) of the run, once it ended

            def timed(app: Flask, keep_going: t.Callable[[], bool]) -> object:
                started = time.monotonic()
                _published.count = 0
                try:
                    result = func(app, keep_going)
                finally:
                    published, _published.count = _published.count or 0, None
                took = f"({time.monotonic() - started:.2f} s)"
                if name == "relay":
                    # Every second or so, and at each commit: idle runs at DEBUG.
                    level = logging.INFO if published else logging.DEBUG
                    done.append((level, f"published {published} event(s) {took}"))
                else:
                    done.append((logging.INFO, f"{result} {took}"))
                return result

            try:
                ran = super().run_job(name, timed, every)
            except sa.exc.SQLAlchemyError as exc:  # taking the job's lock failed
                trouble.problem(f"job {name}", _database_problem(exc))
                return False
            trouble.fine(f"job {name}")
            for level, line in done:  # none when it failed (logged) or was skipped
                logger.log(level, "job %s: %s", name, line)
            return bool(ran)

    return LoggedJobs(app)


@_command("scheduler")
def scheduler() -> None:
    """Run all jobs in the foreground, as one dedicated process, until SIGTERM/SIGINT.

    Logs a line per job run at INFO (an idle relay run at DEBUG). It stops
    with 69 or 78 when the database or the configuration is unusable at the
    start; later outages are logged and waited out.
    """
    state = _state()
    app = resolve_app()
    tables = [state.store.table, state.job_lock_table]
    if app.config.get("IDEMPOTENCY_PUBLISHER") is not None:
        _publisher(app)
        tables.append(_outbox())
    _require_tables(*tables)
    jobs = _logged_scheduler(app)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    summaries = _JobSummaries()
    logger.addFilter(summaries)
    signals.event_published.connect(_count_published, app, weak=False)
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        jobs.start()
        wakes = ""
        if jobs.waker is not None:
            how = "LISTEN idempotency_outbox" if jobs.waker.listening else "in-process commits"
            wakes = f" (relay wakes on {how})"
        _report(
            f"idempotency scheduler running as {jobs.holder}{wakes}; SIGTERM or Ctrl-C stops it"
        )
        sys.stdout.flush()
        while not stop.wait(1.0):
            pass
    finally:
        jobs.shutdown(wait=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signals.event_published.disconnect(_count_published, app)
        logger.removeFilter(summaries)
        _report("idempotency scheduler stopped")


#: Seconds between attempts to LISTEN again after the connection was lost.
RELISTEN_EVERY = 5.0


def _relay_line(run: RelayRun) -> str:
    if not run.taken:
        return "nothing pending"
    text = f"published {run.published}"
    if run.failed:
        text += f", {run.failed} failed (retried later)"
    return text


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
    type=_Finite(min=0.01, max=MAX_RELAY_POLL),
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
    from ._maintenance.scheduler import JobScheduler
    from ._messaging.listener import Listener, RelistenBackoff
    from ._messaging.relay import relay_batch

    wake = _state().settings.relay_wake
    app = resolve_app()
    _publisher(app)
    _require_tables(_outbox())
    if once:
        published = failed = 0
        unavailable = False
        while True:
            run = relay_batch(app, batch=batch)
            published += run.published
            failed += run.failed
            unavailable = unavailable or run.broker_unavailable
            if not run.more:  # short, or the broker is away: the rest waits
                break
        if unavailable:
            raise BrokerUnavailableExit(
                f"outbox relay: the broker is unavailable; published {published}, the rest "
                "stays pending for a later run"
            )
        if failed:
            raise CommandError(
                f"outbox relay: published {published}; {failed} failed and will be retried "
                "(the log says why)"
            )
        _report(f"outbox relay: published {published}")
        return
    stop = threading.Event()
    listener = Listener(app, wake=wake)
    # Meant to LISTEN, whether the first LISTEN worked or not: one that failed
    # (the database away as it started) is tried again every RELISTEN_EVERY.
    wants_listen, relisten_at = listener.can_listen, 0.0
    trouble = _Trouble()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()
        listener.interrupt()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    how = "LISTEN idempotency_outbox and polling" if listener.listening else "polling"
    how += "" if wake else " only (IDEMPOTENCY_RELAY_WAKE is off)"
    _report(f"outbox relay running ({how}); SIGTERM or Ctrl-C stops it")
    sys.stdout.flush()
    relisten = RelistenBackoff()
    try:
        while not stop.is_set():
            more = broker_away = False
            try:
                run = relay_batch(app, batch=batch)
            except sa.exc.SQLAlchemyError as exc:
                trouble.problem("outbox relay", _database_problem(exc))
            except Exception as exc:  # the publisher or a bug: said once, not every poll
                logger.debug("outbox relay run failed", exc_info=exc)
                trouble.problem("outbox relay", f"the run failed: {type(exc).__name__}: {exc}")
            else:
                more = run.more
                trouble.fine("outbox relay")
                if run.broker_unavailable:
                    broker_away = True
                    trouble.problem("outbox broker", "unavailable; the events wait for it")
                else:
                    trouble.fine("outbox broker")
                level = logging.INFO if run.taken else logging.DEBUG
                logger.log(level, "outbox relay: %s", _relay_line(run))
            if wants_listen and not listener.listening and time.monotonic() >= relisten_at:
                # LISTEN failed or was lost with the database: try again, now
                # and then (its failures at DEBUG: said when it first failed).
                listener.close()
                listener = Listener(app, wake=wake, retrying=True)
                relisten_at = time.monotonic() + RELISTEN_EVERY
                if listener.listening:
                    trouble.fine("outbox relay LISTEN")
            if broker_away and not stop.is_set():
                # While the broker is away, a commit (here or a NOTIFY) does not
                # make a run, a connection attempt, of its own: one per pause.
                # Wake-ups meanwhile stay queued, so the next wait ends at once.
                stop.wait(min(JobScheduler.BROKER_PAUSE, poll))
            if not more and not stop.is_set():
                try:
                    listener.wait(poll)
                except Exception as exc:
                    # The LISTEN connection broke (a restart, a failover, an idle
                    # killer): listen again on a new one, after a pause that
                    # grows while it keeps failing (not a loop of connects).
                    trouble.problem("outbox relay LISTEN", _database_problem(exc))
                    listener.close()
                    stop.wait(max(poll, relisten.delay(listener)))
                    listener = Listener(app, wake=wake)
                    relisten_at = time.monotonic() + RELISTEN_EVERY
                    if listener.listening:
                        trouble.fine("outbox relay LISTEN")
    finally:
        listener.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _report("outbox relay stopped")


@_command("outbox-retry")
def outbox_retry() -> None:
    """Un-park the events the relay gave up on (attempts reset, due now)."""
    from ._messaging.admin import retry_parked

    _require_tables(_outbox())
    _report(f"un-parked {retry_parked(resolve_app())} event(s)")


@_command("outbox-purge")
@click.option(
    "--older-than",
    type=_Finite(min=0, max=MAX_OLDER_THAN_HOURS),
    default=None,
    help="Hours since the event was published (default IDEMPOTENCY_OUTBOX_RETENTION).",
)
def outbox_purge(older_than: float | None) -> None:
    """Delete outbox events published more than --older-than hours ago (the
    cleanup job does it too, after IDEMPOTENCY_OUTBOX_RETENTION)."""
    from ._messaging.admin import purge_published

    _require_tables(_outbox())
    age = None if older_than is None else dt.timedelta(hours=older_than)
    deleted = purge_published(resolve_app(), age)
    _report(f"deleted {deleted} published event(s)")
