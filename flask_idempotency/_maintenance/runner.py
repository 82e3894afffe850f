"""The foreground runners behind ``flask idempotency scheduler`` and ``flask
idempotency relay``: the jobs or the outbox relay in this process until
SIGTERM or SIGINT, with a line per run and an outage logged when it starts and
when it ends, not at every poll.

The commands check the app first (tables, publisher) and turn what these
return into exit codes; these only run.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import signal
import sys
import threading
import time
import typing as t

import sqlalchemy as sa
from flask import Flask

from .. import _telemetry as telemetry
from .. import signals
from .._messaging.listener import Listener, RelistenBackoff
from .._messaging.relay import RelayRun, relay_batch
from .._storage.dberrors import summary
from .scheduler import JobFunc, JobScheduler

logger = logging.getLogger("flask_idempotency")

#: Where a runner's report lines go (stdout, unless ``-q``).
Report = t.Callable[[str], None]


class Trouble:
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


def database_problem(exc: BaseException) -> str:
    """The line for a database failure: the driver's first line, never the
    statement (the traceback at DEBUG)."""
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


class LoggedJobs(JobScheduler):
    """A :class:`~flask_idempotency.scheduler.JobScheduler` that logs a line per
    run: the job, what it did and how long it took, at INFO (an idle relay run
    at DEBUG: it runs every second); a run that could not start because the
    database failed, as one line while that lasts."""

    def __init__(self, app: Flask) -> None:
        super().__init__(app)
        self.trouble = Trouble()

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
            self.trouble.problem(f"job {name}", database_problem(exc))
            return False
        self.trouble.fine(f"job {name}")
        for level, line in done:  # none when it failed (logged) or was skipped
            logger.log(level, "job %s: %s", name, line)
        return bool(ran)


def set_from_signal(event: threading.Event) -> None:
    """Set ``event`` from a signal handler: on another thread, never in the
    handler itself. The handler runs on the main thread between two of its
    bytecodes, possibly inside ``event.wait()`` while that holds the event's
    (non-reentrant) lock; ``event.set()`` there would wait for that lock for
    ever, and the process would ignore SIGTERM (seen: a scheduler that never
    stopped). The thread takes the lock once the main thread lets it go."""
    threading.Thread(target=event.set, name="idempotency-stop", daemon=True).start()


def run_scheduler(app: Flask, report: Report) -> None:
    """Run every job of ``app`` until SIGTERM or SIGINT; the jobs' lines logged."""
    jobs = LoggedJobs(app)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        set_from_signal(stop)

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
        report(f"idempotency scheduler running as {jobs.holder}{wakes}; SIGTERM or Ctrl-C stops it")
        sys.stdout.flush()
        while not stop.wait(1.0):
            pass
    finally:
        jobs.shutdown(wait=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signals.event_published.disconnect(_count_published, app)
        logger.removeFilter(summaries)
        report("idempotency scheduler stopped")


#: Seconds between attempts to LISTEN again after the connection was lost.
RELISTEN_EVERY = 5.0


def relay_line(run: RelayRun) -> str:
    """What one relay batch did, in words."""
    if not run.taken:
        return "nothing pending"
    text = f"published {run.published}"
    if run.failed:
        text += f", {run.failed} failed (retried later)"
    return text


@dataclasses.dataclass(frozen=True)
class RelayTotals:
    """What :func:`relay_pending` did: events published, failed, and whether the
    broker was unavailable in some batch."""

    published: int
    failed: int
    broker_unavailable: bool


def relay_pending(app: Flask, batch: int) -> RelayTotals:
    """Publish what is pending now, batch after batch, until a batch comes back
    short or the broker is away (the rest waits for a later run)."""
    published = failed = 0
    unavailable = False
    while True:
        run = relay_batch(app, batch=batch)
        published += run.published
        failed += run.failed
        unavailable = unavailable or run.broker_unavailable
        if not run.more:  # short, or the broker is away: the rest waits
            break
    return RelayTotals(published, failed, unavailable)


def run_relay(app: Flask, *, batch: int, poll: float, wake: bool, report: Report) -> None:
    """Relay ``app``'s outbox until SIGTERM or SIGINT: a batch, then a wait of
    at most ``poll`` seconds, shorter when a commit (or a NOTIFY) wakes it;
    outages of the broker and the database are logged and ridden out."""
    stop = threading.Event()
    listener = Listener(app, wake=wake)
    # Meant to LISTEN, whether the first LISTEN worked or not: one that failed
    # (the database away as it started) is tried again every RELISTEN_EVERY.
    wants_listen, relisten_at = listener.can_listen, 0.0
    trouble = Trouble()

    def on_signal(signum: int, frame: object) -> None:
        set_from_signal(stop)
        listener.interrupt()  # a write to its pipe: safe in a handler

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    how = "LISTEN idempotency_outbox and polling" if listener.listening else "polling"
    how += "" if wake else " only (IDEMPOTENCY_RELAY_WAKE is off)"
    report(f"outbox relay running ({how}); SIGTERM or Ctrl-C stops it")
    sys.stdout.flush()
    relisten = RelistenBackoff()
    try:
        while not stop.is_set():
            more = broker_away = False
            started = time.perf_counter()
            try:
                run = relay_batch(app, batch=batch)
            except sa.exc.SQLAlchemyError as exc:
                telemetry.job_ran("outbox_relay", "error", time.perf_counter() - started)
                trouble.problem("outbox relay", database_problem(exc))
            except Exception as exc:  # the publisher or a bug: said once, not every poll
                telemetry.job_ran("outbox_relay", "error", time.perf_counter() - started)
                logger.debug("outbox relay run failed", exc_info=exc)
                trouble.problem("outbox relay", f"the run failed: {type(exc).__name__}: {exc}")
            else:
                # A run of the dedicated relay counts as the scheduler's relay job's does.
                telemetry.job_ran("outbox_relay", "ok", time.perf_counter() - started)
                more = run.more
                trouble.fine("outbox relay")
                if run.broker_unavailable:
                    broker_away = True
                    trouble.problem("outbox broker", "unavailable; the events wait for it")
                else:
                    trouble.fine("outbox broker")
                level = logging.INFO if run.taken else logging.DEBUG
                logger.log(level, "outbox relay: %s", relay_line(run))
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
                    trouble.problem("outbox relay LISTEN", database_problem(exc))
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
        report("outbox relay stopped")
