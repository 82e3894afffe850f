"""Maintenance: the jobs (cleanup, lease recovery), their APScheduler wiring in a
serving process or a process of their own (``scheduler``, ``runner``), and the
readiness probe and its HTTP server (``health``, ``readiness_http``). The
public faces are :mod:`flask_idempotency.jobs`, :mod:`flask_idempotency.scheduler`,
``idem.readiness()`` and the ``flask idempotency`` commands.
"""
