"""The retry policy: urllib3's ``Retry`` with 409 + ``Retry-After`` retried,
a time budget, and a backoff before the first retry too."""

from __future__ import annotations

import random
import time
import typing as t

from urllib3.exceptions import InvalidHeader, MaxRetryError, ResponseError
from urllib3.util.retry import Retry

if t.TYPE_CHECKING:
    from typing_extensions import Self

#: Retried whatever the response says: too many requests, and the gateway errors.
RETRY_STATUSES = frozenset({429, 502, 503, 504})
#: Retried on connection and read errors, and on the statuses above.
RETRY_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE", "POST", "PATCH"})
#: The methods that get a key of their own when the caller gives none.
KEYED_METHODS = frozenset({"POST", "PATCH"})


class IdempotentRetry(Retry):
    """``Retry`` with 409 + ``Retry-After`` retried and a total time budget.

    ``deadline``: seconds from ``started`` (a :func:`time.monotonic` value; the
    :class:`~flask_idempotency.client.IdempotentSession` sets it as each request
    begins, otherwise it is the first retry) after which no new attempt starts.
    """

    # Retry retries these only when the response has Retry-After (is_retry):
    # exactly the rule for 409. 413 is left out: no 4xx other than 409/429.
    RETRY_AFTER_STATUS_CODES = frozenset({409, 429, 503})

    def __init__(
        self,
        *args: t.Any,
        deadline: float | None = None,
        started: float | None = None,
        **kwargs: t.Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.deadline = deadline
        self.started = started
        #: The wait the budget was checked against, slept by :meth:`sleep`.
        self.planned_wait: float | None = None

    def new(self, **kw: t.Any) -> Self:
        kw.setdefault("deadline", self.deadline)
        kw.setdefault("started", self.started)
        return super().new(**kw)

    def get_backoff_time(self) -> float:
        """``backoff_factor * 2 ** (n - 1)`` before the n-th consecutive retry,
        plus up to ``backoff_jitter``, at most ``backoff_max``. urllib3 does not
        wait before the first retry; an idempotent retry does, so that a
        downstream in trouble is not hit again at once."""
        consecutive = 0
        for attempt in reversed(self.history):
            if attempt.redirect_location is not None:
                break
            consecutive += 1
        return backoff(self, consecutive)

    def get_retry_after(self, response: t.Any) -> float | None:
        """``Retry-After`` in seconds; ``None`` when absent or unreadable (a value
        like ``1.5`` or ``soon``: the backoff applies instead of an error).
        Unreadable includes what urllib3 hands to ``int()`` or to a date
        conversion that fails: more digits than Python converts to an int,
        a date whose year is out of range (``ValueError``, ``OverflowError``,
        ``OSError`` from the platform's time functions)."""
        try:
            return super().get_retry_after(response)
        except (InvalidHeader, ValueError, OverflowError, OSError):
            return None

    def _wait_before_next(self, response: t.Any) -> float:
        if self.respect_retry_after_header and response is not None:
            retry_after = self.get_retry_after(response)
            if retry_after:
                return retry_after
        return self.get_backoff_time()

    def increment(
        self,
        method: str | None = None,
        url: str | None = None,
        response: t.Any = None,
        error: Exception | None = None,
        _pool: t.Any = None,
        _stacktrace: t.Any = None,
    ) -> Self:
        new = super().increment(method, url, response, error, _pool, _stacktrace)
        if self.deadline is None:
            return new
        if new.started is None:
            new.started = time.monotonic()
        # A redirect hop goes at once (requests does not wait on a 3xx).
        redirected = bool(new.history) and new.history[-1].redirect_location is not None
        wait = 0.0 if redirected else new._wait_before_next(response)
        if time.monotonic() + wait > new.started + self.deadline:
            reason = error or ResponseError(f"the retry deadline of {self.deadline} s")
            raise MaxRetryError(_pool, url or "", reason) from reason
        new.planned_wait = wait
        return new

    def sleep(self, response: t.Any = None) -> None:
        if self.planned_wait is None:
            super().sleep(response)
        elif self.planned_wait > 0:
            time.sleep(self.planned_wait)


def backoff(retry: Retry, consecutive: int) -> float:
    """The wait before the ``consecutive``-th retry in a row (0: none)."""
    if consecutive < 1 or retry.backoff_factor <= 0:
        return 0.0
    value = retry.backoff_factor * 2 ** (consecutive - 1)
    if retry.backoff_jitter:
        value += random.random() * retry.backoff_jitter
    return float(max(0.0, min(retry.backoff_max, value)))
