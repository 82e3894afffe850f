"""APScheduler wiring for the maintenance jobs: cleanup and lease recovery, and
the outbox relay when ``IDEMPOTENCY_PUBLISHER`` is set.

Every process may schedule the same jobs; a job run first takes its database
job lock (a row of ``idempotency_job_locks``), which also remembers when the job
last started anywhere. So one runner at a time does the work, about once per
interval across all processes and hosts, and the other processes skip their
ticks: never more often than once per ``every`` minus a small slack
(a tenth of ``every``, at most one second), and no later than the next
tick of any live process once ``every`` has passed. A process that dies in a
run holds the lock until ``IDEMPOTENCY_JOB_LOCK`` expires. Runs either inside the serving processes
(``IDEMPOTENCY_SCHEDULER = True``: started on each process's first request, so
never at import, never in the Werkzeug reloader's watcher process, and once per
gunicorn worker after the fork) or as one dedicated process
(``flask idempotency scheduler``).

The relay job (:func:`_relay_job`) also runs as soon as events commit, not
only every ``IDEMPOTENCY_RELAY_EVERY``: a thread of the scheduler
(:class:`RelayWaker`) waits on a :class:`~flask_idempotency.relay.Listener`,
which a commit in this process that carried events wakes at once and, on
PostgreSQL, a commit in any process through ``LISTEN idempotency_outbox`` (one
more connection per scheduler). ``IDEMPOTENCY_RELAY_WAKE = False`` turns the
wake-ups off; the interval is always there as the fallback, so a lost wake-up
only delays an event to the next poll. One relay run at a time per scheduler:
a wake-up during a run makes that run go round once more instead of starting
a second one (the run may have read the outbox before the commit).
"""

from __future__ import annotations

from ._deprecated import forward
from ._maintenance.scheduler import JobScheduler as JobScheduler

__all__ = ["JobScheduler"]

__getattr__ = forward(__name__, "flask_idempotency._maintenance.scheduler")
