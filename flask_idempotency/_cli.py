"""The command line's support: exit codes, the errors that end a command,
``-v``/``-q`` and the logging they set, and the checks and argument types the
commands of :mod:`flask_idempotency.cli` share.

Private: the commands and their exit codes (documented in
:mod:`flask_idempotency.cli`) are the public surface.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import logging
import math
import sys
import typing as t

import click
import sqlalchemy as sa
from flask import Flask

from ._context import AppState, app_state, resolve_app
from ._maintenance.jobs import job_runs
from ._messaging.admin import outbox_stats
from ._messaging.relay import app_publisher
from ._storage import dberrors, inbox
from ._storage.dberrors import UNAVAILABLE, classify, summary
from ._storage.schema import OUTBOX_TABLE_NAME, outbox_table
from .errors import BrokerUnavailable, InvalidKeyError
from .keys import parse_key
from .scope import MAX_SCOPE_LENGTH

if t.TYPE_CHECKING:
    from ._messaging.relay import Publisher

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

VERBOSITY = "flask_idempotency.verbosity"


def count_verbosity(step: int) -> t.Callable[[click.Context, click.Parameter, int], None]:
    def callback(ctx: click.Context, param: click.Parameter, value: int) -> None:
        ctx.meta[VERBOSITY] = ctx.meta.get(VERBOSITY, 0) + step * (value or 0)

    return callback


def verbosity_options() -> list[click.Parameter]:
    return [
        click.Option(
            ["-v", "--verbose"],
            count=True,
            expose_value=False,
            callback=count_verbosity(+1),
            help="Log DEBUG lines too, and tracebacks.",
        ),
        click.Option(
            ["-q", "--quiet"],
            count=True,
            expose_value=False,
            callback=count_verbosity(-1),
            help="Only problems (-qq: only errors); no report lines on stdout.",
        ),
    ]


def verbosity() -> int:
    ctx = click.get_current_context(silent=True)
    return int(ctx.meta.get(VERBOSITY, 0)) if ctx is not None else 0


class LineFormatter(logging.Formatter):
    """One line per record (time, level, message); an exception as its type and
    first line, or as the whole traceback when ``tracebacks``."""

    def __init__(self, *, tracebacks: bool) -> None:
        super().__init__("%(asctime)s %(levelname)s %(message)s")
        self.tracebacks = tracebacks

    def format(self, record: logging.LogRecord) -> str:
        if self.tracebacks or not record.exc_info or record.exc_info[1] is None:
            return super().format(record)
        line = f"{record.getMessage()}: {summary(record.exc_info[1])}"
        flat = logging.makeLogRecord(
            {**record.__dict__, "msg": line, "args": None, "exc_info": None, "exc_text": None}
        )
        return super().format(flat)


@contextlib.contextmanager
def command_logging(verbosity: int) -> t.Iterator[None]:
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
        handler.setFormatter(LineFormatter(tracebacks=verbosity > 0))
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


def report(text: str) -> None:
    """A command's report line on stdout (not with ``-q``)."""
    if verbosity() >= 0:
        click.echo(text)


# -- errors ----------------------------------------------------------------------------


def database_error(exc: BaseException) -> CommandError:
    """The one line for a database failure: which database, and the driver's
    first line (never SQLAlchemy's text, which carries the statement and its
    parameters)."""
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


def guarded(fn: t.Callable[P, R]) -> t.Callable[P, R]:
    """Run a command with its logging set up, turning a database failure into
    its one line and exit code."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with command_logging(verbosity()):
            try:
                return fn(*args, **kwargs)
            except sa.exc.SQLAlchemyError as exc:
                raise database_error(exc) from None

    return run


def current_state() -> AppState:
    """The app's extension state, or exit 78 when the app never called ``init_app``."""
    try:
        return app_state()
    except RuntimeError as exc:
        raise Misconfigured(str(exc)) from None


def require_tables(*tables: sa.Table) -> None:
    """Exit 78 with what to run when a table the command needs is missing
    (instead of the database's "no such table" in the middle of the work)."""
    engine = current_state().db.engine
    with engine.connect() as conn:
        inspector = sa.inspect(conn)
        missing = [t.name for t in tables if not inspector.has_table(t.name, schema=t.schema)]
    if missing:
        raise Misconfigured(
            f"missing table(s) {', '.join(missing)}: run 'flask idempotency create-tables' "
            "or your migrations"
        )


def app_outbox() -> sa.Table:
    """The outbox table on the app's metadata."""
    return outbox_table(current_state().db.metadata)


def checked_publisher(app: Flask) -> Publisher:
    """The app's ``IDEMPOTENCY_PUBLISHER``, or exit 78 saying what is wrong with it."""
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


def iso(value: dt.datetime | None) -> str | None:
    """A time as JSON shows it (ISO 8601), or ``None``."""
    return value.isoformat() if value is not None else None


def key_argument(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """The key as the client sent it in the header: quoted (``'"order-42"'``) or bare."""
    if value is None:
        return None
    try:
        return parse_key(value)
    except InvalidKeyError as exc:
        raise click.BadParameter(exc.detail) from None


def _utf8(value: str, what: str) -> None:
    """Refuse text that is not UTF-8: bytes of the command line that are not
    (Python keeps them as lone surrogates) can name no stored scope, and the
    driver would fail to send them."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise click.BadParameter(f"{what} must be UTF-8 text") from None


def scope_argument(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """A scope exactly as stored: byte for byte, so no trimming or case folding."""
    if not value:
        raise click.BadParameter("the scope must not be empty")
    _utf8(value, "the scope")
    if "\x00" in value:
        raise click.BadParameter("the scope must not contain NUL")
    if len(value) > MAX_SCOPE_LENGTH:
        raise click.BadParameter(f"the scope must be at most {MAX_SCOPE_LENGTH} characters")
    return value


class Finite(click.FloatRange):
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


def scope_prefix_argument(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> str | None:
    """A scope prefix as stored, byte for byte; NUL refused (no scope holds one,
    and PostgreSQL refuses it in text)."""
    if value is None:
        return None
    if "\x00" in value:
        raise click.BadParameter("the scope prefix must not contain NUL")
    _utf8(value, "the scope prefix")
    return value


def gather_stats() -> dict[str, t.Any]:
    """What ``flask idempotency stats`` prints (see its help), as a dict."""
    state = current_state()
    require_tables(state.store.table)
    with state.db.engine.connect() as conn:
        now = state.now(conn)
        numbers = state.store.stats(conn, now)
        has_outbox = sa.inspect(conn).has_table(OUTBOX_TABLE_NAME)
        if inbox.table_exists(conn):
            numbers.update(inbox.stats(conn, now))
    numbers["oldest_in_progress"] = iso(numbers["oldest_in_progress"])
    if has_outbox:
        numbers.update(outbox_stats(resolve_app()))
    try:
        numbers["jobs"] = job_runs(resolve_app())  # None without the job locks' table
    except sa.exc.DBAPIError as exc:
        # An operator's read-only role may see the records and not the job locks:
        # the other figures still print, and what could not be read says why.
        if not dberrors.privilege_refused(exc):
            raise
        numbers["jobs"] = None
        numbers["errors"] = {"jobs": dberrors.summary(exc)}
    return numbers
