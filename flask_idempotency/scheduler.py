"""APScheduler wiring for the maintenance jobs: cleanup and lease recovery, and
the outbox relay when ``IDEMPOTENCY_PUBLISHER`` is set.

Every process may schedule the same jobs; a job run first takes its database
job lock (:mod:`flask_idempotency.locks`), which also remembers when the job
last started anywhere. So one runner at a time does the work, about once per
interval across all processes and hosts, and the other processes skip their
ticks: never more often than once per ``every`` minus a small slack
(:func:`~flask_idempotency.locks.interval_slack`), and no later than the next
tick of any live process once ``every`` has passed. A process that dies in a
run holds the lock until ``IDEMPOTENCY_JOB_LOCK`` expires. Runs either inside the serving processes
(``IDEMPOTENCY_SCHEDULER = True``: started on each process's first request, so
never at import, never in the Werkzeug reloader's watcher process, and once per
gunicorn worker after the fork) or as one dedicated process
(``flask idempotency scheduler``).
"""

from __future__ import annotations

import atexit
import datetime as dt
import logging
import os
import threading
import typing as t

from apscheduler.schedulers.background import BackgroundScheduler
from flask import Flask

from . import signals
from .jobs import KeepGoing, purge_expired, recover_abandoned
from .locks import JobLocks, new_holder_id
from .state import app_state

logger = logging.getLogger("flask_idempotency")

JobFunc = t.Callable[[Flask, KeepGoing], object]


def _relay_job(app: Flask, keep_going: KeepGoing) -> None:
    from .relay import relay_once

    # Drain: whole batches until one comes back short or the lock is lost.
    while relay_once(app) >= 100 and keep_going():
        pass


class JobScheduler:
    """The jobs of one app in one process. ``start()``, then ``shutdown()``."""

    def __init__(self, app: Flask) -> None:
        self.app = app
        self.state = app_state(app)
        self.holder = new_holder_id()
        self.locks = JobLocks(self.state.job_lock_table)
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
        if app.config.get("IDEMPOTENCY_PUBLISHER") is not None:
            self.add_job("relay", _relay_job, settings.relay_every)

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
        with self.app.app_context():
            engine = state.db.engine
            if not self.locks.acquire(engine, name, self.holder, ttl, clock(), every=every):
                logger.debug("job %s is running or ran recently elsewhere; skipping", name)
                return False
            error: Exception | None = None
            signals.job_started.send(self.app, name=name, holder=self.holder)
            try:
                func(self.app, lambda: self.locks.renew(engine, name, self.holder, ttl, clock()))
            except Exception as exc:
                error = exc
                logger.exception("job %s failed", name)
            finally:
                signals.job_finished.send(self.app, name=name, holder=self.holder, error=error)
                self.locks.release(engine, name, self.holder, clock())
                state.db.session.remove()
        return True

    def start(self) -> None:
        self._scheduler.start()
        logger.info("idempotency jobs scheduled in process %d", os.getpid())

    def shutdown(self, wait: bool = True) -> None:
        if self._scheduler.running:
            self._scheduler.shutdown(wait=wait)

    @property
    def running(self) -> bool:
        return bool(self._scheduler.running)


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

    def shutdown(self) -> None:
        with self._lock:
            if self.scheduler is not None and self._pid == os.getpid():
                self.scheduler.shutdown()
            self.scheduler, self._pid = None, None
