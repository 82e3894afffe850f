"""What a view calls on the extension object while it runs: the current
request's payload, key, scope and previous record, the replay, recovery points,
derived keys, the outbox and the headers that forward the key.

:class:`~flask_idempotency.Idempotency` inherits them from :class:`ViewAPI`;
they read the current request through :mod:`._context`, never ``g``.
"""

from __future__ import annotations

import typing as t

from flask import Response

from ._context import (
    OPTIMISTIC_WHY,
    RequestState,
    current_derived_key,
    current_request_state,
    downstream_state,
)
from ._messaging import outbox
from ._request.responses import replay_answer
from ._request.steps import run_step
from .keys import quote_key

if t.TYPE_CHECKING:
    from ._storage.schema import Record

T = t.TypeVar("T")


class ViewAPI:
    """The methods and properties of :class:`~flask_idempotency.Idempotency`
    that a view uses during a request (``idem.payload``, ``idem.step(...)``,
    ``idem.emit(...)``...)."""

    @staticmethod
    def _request_state() -> RequestState | None:
        return current_request_state()

    @property
    def payload(self) -> t.Any:
        """The current request's payload: the schema's loaded data, parsed JSON or bytes."""
        state = self._request_state()
        return state.payload if state is not None else None

    @property
    def key(self) -> str | None:
        """The current request's idempotency key (unquoted), or ``None``."""
        state = self._request_state()
        return state.key if state is not None else None

    @property
    def scope(self) -> str | None:
        """The current request's scope, or ``None`` when it carries no key."""
        state = self._request_state()
        return state.scope if state is not None else None

    @property
    def previous(self) -> Record | None:
        """In manual mode, the completed record of this operation (status, body,
        headers, times) when the request is a retry; ``None`` otherwise."""
        state = self._request_state()
        return state.previous if state is not None else None

    def replay(self) -> Response:
        """In manual mode, the answer the extension would have given: the stored
        response, with ``Idempotent-Replayed: true`` (a stored ``failed-after-commit``,
        returned by the view, is answered as the app answers its problems, with
        the headers the view added)."""
        previous = self.previous
        if previous is None:
            raise RuntimeError("idem.replay() needs a retry of a completed operation (manual mode)")
        return replay_answer(previous)

    def step(self, name: str, fn: t.Callable[[], T]) -> T:
        """Run ``fn`` once per operation as the recovery point ``name``.

        On a leased route, the first attempt calls ``fn`` and saves its
        (JSON-serializable) result on the record in a short transaction of its
        own; an attempt that resumes the record after a crash or a released
        failure gets the saved result without calling ``fn``. Raises
        :class:`~flask_idempotency.LeaseLostError` when another request has taken
        the record over. Keep database writes out of ``fn``. In a request without
        a key (a route that does not require one) there is nothing to resume:
        ``fn`` simply runs.

        A result that is not JSON data, or is larger than the database takes
        in one statement (MySQL's ``max_allowed_packet``, SQLite's length
        limit, PostgreSQL's 1 GB), cannot be saved, yet ``fn`` has run: the
        step is marked done without a result (no retry runs ``fn`` again), the
        cause is logged at ERROR on the ``flask_idempotency`` logger, and
        :class:`~flask_idempotency.errors.StepNotStoredError` (500
        ``step-not-stored``) is raised, for this request and every retry with
        the key until an operator releases it (``--override recovery-points``:
        the retry then runs ``fn`` again) or it expires.
        """
        state = self._request_state()
        if state is None:
            raise RuntimeError("idem.step() can only be called inside an idempotent view")
        if state.optimistic:
            raise RuntimeError(f"idem.step() is refused: {OPTIMISTIC_WHY}")
        return run_step(state, name, fn)

    def derived_key(self, step: str) -> str:
        """The idempotency key to send downstream for ``step`` of this operation.

        SHA-256 of the scope, the key, the operation's start and ``step``: the
        same on every retry and resume of this operation, unique per step, per
        scope, and per operation (a new operation on a key whose record expired
        gets new downstream keys, so a downstream that remembers keys longer
        than we do never answers it with the old operation's result). It is
        :func:`flask_idempotency.derive_key` of the scoped parent key
        (:func:`flask_idempotency.keys.scoped_parent_key`) and ``step``.
        """
        return current_derived_key(step)

    def emit(
        self,
        topic: str,
        payload: t.Any,
        headers: t.Mapping[str, str] | None = None,
        *,
        name: str | None = None,
    ) -> str:
        """Add an event to the outbox in the current transaction; its event id.

        The row is inserted through the app's session, so it commits with the
        view's writes and the record, or rolls back with them; the relay
        publishes it after the commit, at least once. The id names the logical
        event: ``derived_key("event:" + name)`` with a ``name``, else derived
        from the topic and the payload (and how many identical events this
        attempt emitted before it). So a retried or resumed operation gives each
        event the id it had, whatever it emits first; re-emitting an event
        already committed adds nothing, and an id already used by another topic
        or payload raises :class:`~flask_idempotency.errors.EventIdConflictError`.
        Allowed on optimistic routes (random ids there, as without a key). See
        :mod:`flask_idempotency.outbox`.
        """
        return outbox.emit(topic, payload, headers, name=name)

    def forward_headers(self, step: str | None = None) -> dict[str, str]:
        """The headers that carry this operation's key to an outgoing call.

        Without ``step``: the client's key, unchanged, for a downstream that shares
        this service's key space (``{"Idempotency-Key": '"<key>"'}``, the header
        named by ``IDEMPOTENCY_HEADER``). With ``step``: :meth:`derived_key` of
        it, for one call among several. The value is always an RFC 8941 string
        (quoted), the form the IETF draft specifies and this extension reads
        back as the same key, whatever characters the key holds. Refused like
        :meth:`derived_key`: outside an idempotent view, on optimistic routes,
        and (400 ``missing-key``) in a request without a key.
        """
        state = downstream_state("idem.forward_headers()")
        header = state.flow.settings.header if state.flow is not None else "Idempotency-Key"
        assert state.key is not None
        if step is None:
            return {header: quote_key(state.key)}
        return {header: quote_key(current_derived_key(step))}
