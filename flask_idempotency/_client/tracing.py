"""One CLIENT span per attempt, with the W3C trace context in its headers.

urllib3 retries inside ``urlopen``, resending the same headers, so the place
that sees every attempt is the connection: :class:`TracedHTTPConnection`
starts the attempt's span as the request goes out (injecting that span's
``traceparent``, and ``tracestate``, into a copy of the headers) and ends it
when the response's status line and headers are in, or on the error. The
session's adapter mounts pools of these connections, and numbers the attempts
of one call (urllib3's retries, the adapter's resends, redirect hops) through
:data:`CALL`. Without ``opentelemetry-api`` the connections are urllib3's in
all but a function call per attempt.
"""

from __future__ import annotations

import contextlib
import contextvars
import typing as t

from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.poolmanager import PoolManager

from .._telemetry import propagation

if t.TYPE_CHECKING:
    from urllib3.response import HTTPResponse


class Attempts:
    """The count of the attempts one call has sent so far."""

    __slots__ = ("sent",)

    def __init__(self) -> None:
        self.sent = 0

    def next(self) -> int:
        self.sent += 1
        return self.sent


#: The call whose attempts this thread (context) is sending: set by the adapter.
CALL: contextvars.ContextVar[Attempts | None] = contextvars.ContextVar(
    "flask_idempotency_client_call", default=None
)


@contextlib.contextmanager
def numbering(attempts: Attempts) -> t.Iterator[None]:
    """Number the attempts sent in the block with ``attempts`` (one call's)."""
    token = CALL.set(attempts)
    try:
        yield
    finally:
        CALL.reset(token)


if t.TYPE_CHECKING:
    _Connection = HTTPConnection
else:
    _Connection = object


class _Traced(_Connection):
    """The attempt span of a connection: started by ``request``, ended by
    ``getresponse`` (or the error, or the next request, or ``close``)."""

    _attempt: propagation.Attempt | None = None
    _answering = False  # in getresponse, which closes a connection the server ends

    def request(  # type: ignore[override]
        self,
        method: str,
        url: str,
        body: t.Any = None,
        headers: t.Mapping[str, str] | None = None,
        **kwargs: t.Any,
    ) -> None:
        self._end()  # a request that never got to its response
        call = CALL.get()
        number = call.next() if call is not None else 1
        self._attempt, sent = propagation.start_attempt(
            method, number, headers, host=self.host, port=self.port
        )
        try:
            super().request(method, url, body=body, headers=sent, **kwargs)
        except BaseException as exc:
            self._end(error=exc)
            raise

    def getresponse(self) -> HTTPResponse:  # type: ignore[override]
        self._answering = True
        try:
            response = super().getresponse()
        except BaseException as exc:
            self._end(error=exc)
            raise
        finally:
            self._answering = False
        self._end(status=response.status)
        return response

    def close(self) -> None:
        if not self._answering:
            self._end()  # a request that will get no response on this connection
        super().close()

    def _end(self, *, status: int | None = None, error: BaseException | None = None) -> None:
        attempt, self._attempt = self._attempt, None
        if attempt is not None:
            attempt.end(status=status, error=error)


class TracedHTTPConnection(_Traced, HTTPConnection):
    """urllib3's ``HTTPConnection``, each request one attempt span."""


class TracedHTTPSConnection(_Traced, HTTPSConnection):
    """urllib3's ``HTTPSConnection``, each request one attempt span."""


class TracedHTTPConnectionPool(HTTPConnectionPool):
    ConnectionCls = TracedHTTPConnection


class TracedHTTPSConnectionPool(HTTPSConnectionPool):
    ConnectionCls = TracedHTTPSConnection


def trace_pools(manager: PoolManager) -> PoolManager:
    """Make ``manager`` (a pool manager, or an HTTP proxy's) open traced pools."""
    manager.pool_classes_by_scheme = {
        "http": TracedHTTPConnectionPool,
        "https": TracedHTTPSConnectionPool,
    }
    return manager
