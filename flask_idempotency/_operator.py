"""What an operator calls on the extension object: readiness, the record table's
figures, erasure. :class:`~flask_idempotency.Idempotency` inherits them from
:class:`OperatorAPI`."""

from __future__ import annotations

import datetime as dt
import typing as t

from flask import Flask, Response, jsonify

from . import _config
from ._context import app_state, find_app_state, resolve_app
from ._maintenance import erasure, gauges, health, readiness_http
from ._maintenance.gauges import KeyStats
from ._storage.schema import OUTBOX_TABLE_NAME


class OperatorAPI:
    """The methods of :class:`~flask_idempotency.Idempotency` an operator (or
    an orchestrator's probe) calls outside a protected view."""

    # -- readiness ----------------------------------------------------------------

    def readiness(
        self, *, timeout: dt.timedelta | float | None = None
    ) -> tuple[bool, dict[str, t.Any]]:
        """Whether this process can use the record's database now, and why not.

        Runs ``SELECT 1 FROM idempotency_keys LIMIT 1`` through the app's engine,
        then checks that the database accepts writes (a check that changes
        nothing: see "Readiness" in the guide to outages), in a background thread, and waits for
        it at most ``timeout`` (default ``IDEMPOTENCY_READY_TIMEOUT``, 2 s) from
        the probe's start, so it answers in time even when the database hangs.
        At most one probe per app and process is in flight: while one hangs,
        every call answers ``(False, ...)`` without starting another, until it
        returns.

        ``details`` is JSON-ready: ``ready``, ``database`` (``"ok"``,
        ``"timeout"``, ``"unavailable"``, ``"read_only"``, ``"forbidden"``
        (the app's role may not write the table: a GRANT missing),
        ``"missing_table"`` (the record's table, or the outbox's, which
        ``init_app`` puts on the metadata, does not exist: every request that
        emits would fail; ``reason`` names it), ``"conflict"``
        or ``"error"``), ``table``, ``timeout_ms``, ``probe_id``, and
        ``duration_ms`` (or ``running_ms`` while the probe is still running),
        ``error`` (the exception's class name) when it failed and ``reason``
        (fixed words naming the setting) when the database is read-only. Call
        it in an app context.
        """
        state = app_state()
        limit = (
            state.settings.ready_timeout
            if timeout is None
            else _config.positive_duration(timeout, "timeout", maximum=_config.MAX_ENGINE_TIMEOUT)
        )
        probe = health.probe_for(resolve_app())
        outbox = state.db.metadata.tables.get(OUTBOX_TABLE_NAME)
        also = (outbox,) if outbox is not None else ()
        return probe.check(state.db.engine, state.store.table, limit, also)

    # -- figures ------------------------------------------------------------------

    def stats(self) -> KeyStats:
        """The record table's figures now: :class:`~flask_idempotency.jobs.KeyStats`
        (records live, in progress, past their lease, completed, expired awaiting
        cleanup, the oldest in progress), read by the database's clock. The first
        three are the figures the gauges (``idempotency.records.*``) report, from
        the same query. Two short reads on the app's engine, when you call it; a
        database error propagates (a missing table: ``create-tables``). Call it
        in an app context. The outbox's figures are
        :func:`flask_idempotency.relay.outbox_stats`.
        """
        return gauges.key_stats(resolve_app())

    def erase(
        self, scope: str, key: str | None = None, **options: t.Unpack[erasure.Options]
    ) -> erasure.ErasureReport:
        """Erase what is kept of ``scope``'s operations (only ``key``'s, if given) and their
        outbox events: each record a tombstone until it expires, answered 410 ``key-erased``;
        a live lease and a pending event skipped and counted. ``batch=`` rows per transaction;
        ``settle=`` (seconds or a timedelta, default none): wait, then erase what requests
        running at the start stored. A :class:`~flask_idempotency.jobs.ErasureReport`;
        see the Erasure page."""
        return erasure.erase(resolve_app(), scope, key, **options)

    def readiness_view(self) -> Response:
        """A readiness endpoint: ``app.add_url_rule("/readyz", view_func=idem.readiness_view)``.

        200 ``application/json`` with :meth:`readiness`'s details when the
        record's table answers in time and the database accepts writes;
        otherwise 503 problem+json (type
        ``.../database-unavailable``, ``Retry-After``) with the same details.
        Never cached. Keep a liveness check that does not touch the database
        apart from it, so an orchestrator takes the host out of rotation
        instead of restarting it.
        """
        ready, details = self.readiness()
        if not ready:
            raise readiness_http.not_ready_error(details)
        response = jsonify(details)
        response.headers["Cache-Control"] = "no-store"
        return response

    def serve_readiness(
        self, app: Flask, *, port: int, host: str = "0.0.0.0", path: str = "/readyz"
    ) -> readiness_http.ReadinessServer:
        """Answer readiness on ``host:port`` from a thread of this process, so the
        answer does not wait for a free worker.

        When the database hangs, every worker of a host waits on it, and a
        readiness view on the app's own port waits in the queue with the
        requests: the load balancer learns only from its own timeout. This
        server answers from a thread of its own, within
        ``IDEMPOTENCY_READY_TIMEOUT``, whatever the workers are doing. ``GET
        path`` answers as :meth:`readiness_view` does (200 JSON, or 503
        problem+json with ``Retry-After``), from the same probe.

        Call it in each serving process, after the fork: with gunicorn, from the
        ``post_worker_init`` hook (``idem.serve_readiness(worker.wsgi,
        port=8081)`` in ``gunicorn.conf.py``). Every worker binds the same port
        (``SO_REUSEPORT``, Linux and the BSDs) and the kernel spreads checks
        over them. A second call in the same process returns the running
        server; a forked child closes the parent's socket and starts its own
        when it calls. ``port=0`` picks a free port (``.port`` says which).
        Threads of their own need a worker class that lets them run while a
        request waits on the database: gunicorn's sync and gthread workers do;
        under gevent or eventlet, the database driver must cooperate (psycopg
        3, or psycopg2 with psycogreen).
        """
        if not isinstance(app, Flask):
            raise TypeError(
                f"serve_readiness needs the Flask app, not {type(app).__name__} (pass the app "
                "your middleware wraps)"
            )
        if find_app_state(app) is None:
            raise RuntimeError("serve_readiness: call idem.init_app(app, db) first")

        def check() -> tuple[bool, dict[str, t.Any]]:
            with app.app_context():
                return self.readiness()

        return readiness_http.serve(app, check, host=host, port=port, path=path)
