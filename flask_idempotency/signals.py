"""Signals, in Flask's blinker namespace. Each is sent with the app as sender.

Keyword arguments: ``scope`` and ``key`` always; ``record`` (a
:class:`~flask_idempotency.models.Record`) for ``response_replayed``,
``request_conflict`` and ``payload_mismatch``; ``response`` for
``record_completed``; ``fencing_token`` for ``key_claimed`` and
``record_completed``; ``name`` and ``result`` for ``step_saved``. The job
signals carry ``name`` and ``holder``.

A receiver may log what it gets: a record's repr (and an outbox event's) shows
the sizes of its bodies, never their contents. ``step_saved``'s ``result`` is
the step's result itself.
"""

from __future__ import annotations

from blinker import Namespace

__all__ = [
    "event_parked",
    "event_published",
    "event_skipped_duplicate",
    "job_finished",
    "job_started",
    "key_claimed",
    "payload_mismatch",
    "record_completed",
    "request_conflict",
    "response_replayed",
    "step_saved",
]

_signals = Namespace()

#: A request claimed its key and is about to run the view.
key_claimed = _signals.signal("idempotency-key-claimed")
#: A stored response was replayed; the view did not run.
response_replayed = _signals.signal("idempotency-response-replayed")
#: A duplicate found the key in progress and got 409.
request_conflict = _signals.signal("idempotency-request-conflict")
#: The key was reused with a different payload and got 422.
payload_mismatch = _signals.signal("idempotency-payload-mismatch")
#: The record and the business rows were committed with the stored response.
record_completed = _signals.signal("idempotency-record-completed")
#: A recovery point of a leased route was saved: ``idem.step(name, fn)`` called
#: ``fn`` and its result (``result``, as a resumed attempt will get it) is
#: committed on the record. Sent in the request, after that commit and before
#: ``idem.step`` returns; a step answered from an earlier attempt's saved result
#: sends nothing.
step_saved = _signals.signal("idempotency-step-saved")
#: A scheduled job took its lock and starts a run here (``name``, ``holder``).
job_started = _signals.signal("idempotency-job-started")
#: That run ended, just before its lock is freed (``name``, ``holder``, ``error``).
job_finished = _signals.signal("idempotency-job-finished")
#: The outbox relay published an event and marked it (``event``: an ``OutboxEvent``).
event_published = _signals.signal("idempotency-event-published")
#: An event failed ``IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS`` times and was parked
#: (``event``, ``error``); ``flask idempotency outbox-retry`` un-parks it.
event_parked = _signals.signal("idempotency-event-parked")
#: The inbox skipped a delivery of an event already processed (``consumer``,
#: ``event_id``); sent with the current app, or ``None`` outside an app context.
event_skipped_duplicate = _signals.signal("idempotency-event-skipped-duplicate")
