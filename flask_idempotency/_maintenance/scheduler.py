"""The implementation of :mod:`flask_idempotency.scheduler` (see its documentation)."""

from __future__ import annotations

import atexit
import datetime as dt
import logging
import os
import threading
import time
import typing as t

from apscheduler.schedulers.background import BackgroundScheduler
from flask import Flask

from .. import _telemetry as telemetry
from .. import signals
from .._context import app_state
from .._messaging.listener import Listener, RelistenBackoff
from .._storage import dberrors
from .._storage.locks import JobLocks, new_holder_id
from .._storage.schema import INBOX_TABLE_NAME, OUTBOX_TABLE_NAME
from .jobs import JOB_NAMES, KeepGoing, job_intervals, purge_expired, recover_abandoned

logger = logging.getLogger("flask_idempotency")

JobFunc = t.Callable[[Flask, KeepGoing], object]


def _relay_job(app: Flask, keep_going: KeepGoing) -> None:
    from .._messaging.relay import relay_batch

    # Drain: batches until one says there is no more (short, or the broker is
    # away) or the lock is lost; a failing event does not end the drain.
    while relay_batch(app).more and keep_going():
        pass


class JobScheduler:
    """The jobs of one app in one process. ``start()``, then ``shutdown()``."""

    def __init__(self, app: Flask) -> None:
        self.app = app
        self.state = app_state(app)
        self.holder = new_holder_id()
        # The database's clock coordinates the hosts; an app's own clock (tests)
        # stands in for it.
        self.locks = JobLocks(
            self.state.job_lock_table, clock=self.state.clock if self.state.custom_clock else None
        )
        self._scheduler = BackgroundScheduler(
            timezone=dt.timezone.utc,
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None},
        )
        settings = self.state.settings
        self.add_job(
            "purge", lambda app, keep: purge_expired(app, keep_going=keep), settings.purge_every
        )
        self.add_job(
            "recover",
            lambda app, keep: recover_abandoned(app, keep_going=keep),
            settings.recover_every,
        )
        self._relay_lock = threading.Lock()
        self._relay_running = False
        self._relay_again = False
        # Until when (time.monotonic()) wake-ups wait: the last relay run found
        # the broker unavailable.
        self._broker_away_until = 0.0
        self.waker: RelayWaker | None = None
        self.relays = app.config.get("IDEMPOTENCY_PUBLISHER") is not None
        # The tables found missing and reported at ERROR; a table is reported
        # again once it was found again (a second outage is news too).
        self._missing_reported: set[str] = set()
        if self.relays:
            # The poll; its tick goes through relay_now like a wake-up's.
            every = settings.relay_every
            self._scheduler.add_job(
                self._relay_tick,
                "interval",
                args=("relay", _relay_job, every),
                id="relay",
                seconds=every.total_seconds(),
            )

    def add_job(self, name: str, func: JobFunc, every: dt.timedelta) -> None:
        """Schedule ``func(app, keep_going)`` every ``every``, one runner at a time,
        about once per ``every`` across all processes that schedule it.

        ``keep_going()`` renews the job's lock and says whether to go on; a
        long job should call it between units of work.
        """
        self._scheduler.add_job(
            self.run_job,
            "interval",
            args=(name, func, every),
            id=name,
            seconds=every.total_seconds(),
        )

    def run_job(self, name: str, func: JobFunc, every: dt.timedelta | None = None) -> bool:
        """Run one tick of a job; ``True`` if it ran here.

        Skipped (``False``) while another run holds the job's lock, and, with
        ``every``, when the job last started anywhere less than ``every`` ago
        (minus the slack). Without ``every`` (a run asked for by hand) only a
        run in progress makes it skip.
        """
        state, clock, ttl = self.state, self.state.clock, self.state.settings.job_lock
        job = JOB_NAMES.get(name, name)
        with self.app.app_context():
            engine = state.db.engine
            try:
                acquired = self.locks.acquire(engine, name, self.holder, ttl, clock(), every=every)
            except Exception as exc:
                if self._report_missing(name, exc):
                    telemetry.job_ran(job, "error", None)
                    return False
                # The database refuses writes (a standby after a failover) or is
                # away: one line per tick, not a traceback; the next tick tries again.
                why = dberrors.describe(exc)
                if why is None:
                    raise
                logger.warning("job %s not run: %s", name, why)
                telemetry.job_ran(job, "error", None)
                return False
            self._missing_reported.discard(self.locks.table.name)
            if not acquired:
                logger.debug("job %s is running or ran recently elsewhere; skipping", name)
                telemetry.job_ran(job, "skipped", None)
                return False
            error: Exception | None = None
            signals.job_started.send(self.app, name=name, holder=self.holder)
            started = time.perf_counter()
            try:
                func(self.app, lambda: self.locks.renew(engine, name, self.holder, ttl, clock()))
            except Exception as exc:
                error = exc
                telemetry.job_ran(job, "error", time.perf_counter() - started)
                why = dberrors.describe(exc)
                if not self._report_missing(name, exc):
                    if why is None:
                        logger.exception("job %s failed", name)
                    else:
                        logger.warning("job %s failed: %s", name, why)
            else:
                telemetry.job_ran(job, "ok", time.perf_counter() - started)
                self._missing_reported.discard(state.store.table.name)
            finally:
                signals.job_finished.send(self.app, name=name, holder=self.holder, error=error)
                try:
                    self.locks.release(engine, name, self.holder, clock())
                except Exception as exc:
                    # Its lock frees when it expires (IDEMPOTENCY_JOB_LOCK).
                    why = dberrors.describe(exc)
                    if why is None:
                        raise
                    logger.warning("job %s: its lock was not released: %s", name, why)
                state.db.session.remove()
        return True

    def _report_missing(self, name: str, exc: Exception) -> bool:
        """Log ``exc`` as a table of the extension's missing, if it is one: at
        ERROR with the command that creates it the first time, then at DEBUG
        (a tick every few seconds would otherwise log a traceback each)."""
        state = self.state
        tables = [self.locks.table.name, state.store.table.name]
        tables += [INBOX_TABLE_NAME, OUTBOX_TABLE_NAME]
        missing = dberrors.missing_table(exc, tables)
        if missing is None:
            return False
        first = missing not in self._missing_reported
        self._missing_reported.add(missing)
        logger.log(
            logging.ERROR if first else logging.DEBUG,
            "job %s not run: the table %s is missing from the database: run "
            "'flask idempotency create-tables' or the app's migrations (logged once "
            "until the table is back; the job tries again at its next tick)",
            name,
            missing,
        )
        return True

    #: Seconds (at most ``IDEMPOTENCY_RELAY_EVERY``) during which wake-ups wait
    #: after a relay run found the broker unavailable: while it is away, a
    #: commit does not make a run (a connection attempt) of its own; the poll
    #: goes on, and a wake-up that waited runs when the pause ends.
    BROKER_PAUSE = 5.0

    def _relay_drain(self, app: Flask, keep_going: KeepGoing) -> None:
        from .._messaging.relay import relay_batch

        # As _relay_job, and remembering whether the broker was there.
        while True:
            run = relay_batch(app)
            if run.broker_unavailable:
                pause = min(self.BROKER_PAUSE, self.state.settings.relay_every.total_seconds())
                self._broker_away_until = time.monotonic() + pause
            else:
                self._broker_away_until = 0.0
            if not (run.more and keep_going()):
                return

    def broker_pause_left(self) -> float:
        """Seconds wake-ups still wait because the broker was unavailable (0: none)."""
        return max(0.0, self._broker_away_until - time.monotonic())

    def _relay_tick(self, name: str, func: JobFunc, every: dt.timedelta) -> None:
        self.relay_now(every)

    def relay_now(self, every: dt.timedelta | None = None) -> bool | None:
        """Run the relay job now, in this thread; what a wake-up calls.

        ``True`` if it ran here; ``False`` if it was skipped (another process's
        run holds the job lock, or, with ``every``, a run started less than
        ``every`` ago); ``None`` if a run of this scheduler is in progress, in
        which case that run goes round once more before it ends (when called
        without ``every``, as by a wake-up; a poll tick does not ask for that).
        """
        if every is None and self.broker_pause_left() > 0:
            # A wake-up while the broker is known away: skipped (the waker
            # tries it again once the pause is over; the poll goes on).
            return False
        with self._relay_lock:
            if self._relay_running:
                # A wake-up (no every) is news the run may have missed; a
                # poll tick is not.
                self._relay_again = self._relay_again or every is None
                return None
            self._relay_running, self._relay_again = True, False
        try:
            ran = self.run_job("relay", self._relay_drain, every)
            while True:
                with self._relay_lock:
                    if not self._relay_again:
                        self._relay_running = False
                        return ran
                    self._relay_again = False
                # Woken during the run: events may have committed after its
                # last read of the outbox.
                ran = self.run_job("relay", self._relay_drain) or ran
        except BaseException:
            with self._relay_lock:
                self._relay_running = False
            raise

    def summary(self) -> str:
        """``cleanup every 0:05:00, lease_recovery every 0:00:30, ...``."""
        return ", ".join(
            f"{JOB_NAMES.get(name, name)} every {every}"
            for name, every in job_intervals(self.app).items()
        )

    def start(self) -> None:
        """Start the jobs (and, for the relay, the wake-up thread)."""
        if self.relays and self.state.settings.relay_wake:
            self.waker = RelayWaker(self)
            self.waker.start()
        self._scheduler.start()
        logger.info("idempotency jobs scheduled in process %d: %s", os.getpid(), self.summary())

    def shutdown(self, wait: bool = True) -> None:
        """Stop the jobs and the wake-up thread (its LISTEN connection closes)."""
        if self.waker is not None:
            self.waker.stop(wait=wait)
            self.waker = None
        if self._scheduler.running:
            self._scheduler.shutdown(wait=wait)

    @property
    def running(self) -> bool:
        return bool(self._scheduler.running)


class RelayWaker:
    """The thread that runs a scheduler's relay job when events commit.

    While the broker is known away (the last run found it unavailable), a
    wake-up waits out :attr:`JobScheduler.BROKER_PAUSE`, then runs: one
    connection attempt per pause however many commits, not one per commit.

    It waits on a :class:`~flask_idempotency.relay.Listener` and calls
    :meth:`JobScheduler.relay_now` when woken. A wake-up whose run was skipped
    because another process's relay run holds the job lock is tried again
    every :attr:`RETRY` seconds until it runs, when this waker does not
    LISTEN: that run may have read the outbox before the commit, and nothing
    else tells it. (When it LISTENs, so does a waker in the holder's process,
    which makes its run go round again: every scheduler retrying would turn
    each commit into one run per process.) A LISTEN connection that breaks (a database
    restart) is opened again after a pause that grows with each failure in a
    row (:class:`~flask_idempotency.relay.RelistenBackoff`, 0.25 s to 5 s), and
    one that could not be opened every :attr:`RELISTEN` seconds until it works;
    meanwhile the in-process wake-ups and the poll go on.
    """

    RETRY = 0.25
    RELISTEN = 5.0

    def __init__(self, jobs: JobScheduler) -> None:
        self.jobs = jobs
        self._stop = threading.Event()
        self.listener = Listener(jobs.app)
        # Meant to LISTEN, whether the first LISTEN worked or not: one that
        # failed (the database away as it started) is tried again.
        self._wants_listen = self.listener.can_listen
        self._thread = threading.Thread(
            target=self._run, name="idempotency-relay-wake", daemon=True
        )

    @property
    def listening(self) -> bool:
        """Whether it LISTENs on PostgreSQL (commits in other processes wake it)."""
        return self.listener.listening

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        pending = False
        backoff = RelistenBackoff()
        relisten_at = time.monotonic() + self.RELISTEN
        try:
            while not self._stop.is_set():
                relisten = self._wants_listen and not self.listener.listening
                timeout = None
                if relisten:
                    timeout = max(0.0, relisten_at - time.monotonic())
                if pending:
                    retry = max(self.RETRY, self.jobs.broker_pause_left())
                    timeout = retry if timeout is None else min(timeout, retry)
                try:
                    woken = self.listener.wait(timeout)
                except Exception:
                    logger.warning("outbox relay wake-ups: LISTEN connection lost", exc_info=True)
                    # Back off before the next connection: a wait that fails at
                    # once every time must not become a loop of connects.
                    self.listener.close()
                    if self._stop.wait(backoff.delay(self.listener)):
                        break
                    self.listener = Listener(self.jobs.app)  # without LISTEN if it fails
                    relisten_at = time.monotonic() + self.RELISTEN
                    pending = True  # a notification may have been lost with it
                    continue
                if self._stop.is_set():
                    break
                if relisten and time.monotonic() >= relisten_at:
                    # Every RELISTEN seconds, however busy the in-process wake-ups.
                    self._replace_listener()
                    relisten_at = time.monotonic() + self.RELISTEN
                    if self.listener.listening:
                        logger.info("outbox relay wake-ups: LISTEN works again")
                        pending = True  # a commit elsewhere may have come meanwhile
                if woken or pending:
                    try:
                        # None: a run here goes round again; True: ran;
                        # False: skipped, another process's run holds the lock.
                        skipped = self.jobs.relay_now() is False
                        paused = self.jobs.broker_pause_left() > 0
                        pending = skipped and (paused or not self.listener.listening)
                    except Exception:
                        logger.exception("outbox relay run after a wake-up failed")
                        pending = False
        finally:
            self.listener.close()

    def _replace_listener(self) -> None:
        self.listener.close()
        # Without LISTEN if it fails again (logged at DEBUG: said once already).
        self.listener = Listener(self.jobs.app, retrying=True)

    def stop(self, wait: bool = True) -> None:
        """End the thread, which closes its listener (and LISTEN connection)."""
        self._stop.set()
        self.listener.interrupt()
        if not self._thread.is_alive() and self._thread.ident is None:
            self.listener.close()  # never started
        elif wait and self._thread is not threading.current_thread():
            self._thread.join()


class InProcessScheduler:
    """Starts one :class:`JobScheduler` per serving process, on its first request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid: int | None = None
        self.scheduler: JobScheduler | None = None

    def ensure_started(self, app: Flask) -> None:
        if self._pid == os.getpid():
            return
        with self._lock:
            if self._pid == os.getpid():
                return
            # After a fork the parent's scheduler thread does not exist here:
            # this process gets its own.
            scheduler = JobScheduler(app)
            scheduler.start()
            atexit.register(scheduler.shutdown, False)
            self.scheduler, self._pid = scheduler, os.getpid()
        # Through Flask's logger, which has a handler by default (under
        # `flask run` too), at WARNING so an app that configured no logging sees
        # it: jobs running in every serving process is worth knowing about.
        app.logger.warning(
            "Flask-Idempotency: IDEMPOTENCY_SCHEDULER started the maintenance jobs in "
            "this process (pid %d): %s; 'flask idempotency stats' shows when each last ran",
            os.getpid(),
            scheduler.summary(),
        )

    def shutdown(self) -> None:
        with self._lock:
            if self.scheduler is not None and self._pid == os.getpid():
                self.scheduler.shutdown()
            self.scheduler, self._pid = None, None
