"""The budget of one call: every attempt (urllib3's retries, a resend after
a body cut off, a redirect hop that sends the call's method again) draws on
one ``Retry``, per thread."""

from __future__ import annotations

import contextlib
import threading
import time
import typing as t

import requests
from urllib3.exceptions import MaxRetryError
from urllib3.response import BaseHTTPResponse, HTTPResponse
from urllib3.util.retry import Retry

from .retry import IdempotentRetry
from .tracing import Attempts


class RedirectBudgetExceeded(requests.TooManyRedirects, requests.exceptions.RetryError):
    """A redirect the call's budget does not allow following: one more hop that
    sends the call's method again (a 307 or 308; a 301 of any method but
    POST) would be past ``total`` (or the ``Retry``'s ``redirect`` count), or
    start after the deadline. It is requests' error for a redirect chain cut
    off and its error for retries run out; ``response`` is the redirect not
    followed. A hop that changes the method (a POST's 303 to a GET) is never
    refused for the budget."""


class Budget:
    """The retries one call has left (a ``Retry``, with its counts and history).

    Every attempt of the call draws on it: urllib3's retries, a resend after a
    body cut off mid-read, the redirect hops that send the call's method again.
    So ``total`` and the deadline bound the whole call, never one attempt's
    share of it.
    """

    __slots__ = ("attempts", "following", "method", "retry")

    def __init__(self, retry: Retry) -> None:
        self.retry = retry
        #: The requests the call sent so far (numbers its attempt spans).
        self.attempts = Attempts()
        #: The redirect the call's next send follows (set while requests'
        #: ``resolve_redirects`` runs): that send is a hop, counted first.
        self.following: requests.Response | None = None
        #: The method of the request whose redirects are followed: a hop that
        #: sends it again is a resend, counted; one with another method is not.
        self.method: str | None = None


class Budgets(threading.local):
    """Each thread's calls in progress on one session, innermost last.

    Per thread, because a session is shared by threads (a pool, a web
    server's workers): one thread's retries never spend another's budget.
    """

    def __init__(self) -> None:
        self.stack: list[Budget] = []

    @property
    def current(self) -> Budget | None:
        return self.stack[-1] if self.stack else None

    @contextlib.contextmanager
    def call(self, policy: Retry, *, join: bool) -> t.Iterator[Budget]:
        """The budget of the call in progress (``join``, when there is one), or a
        new one from ``policy`` for as long as the block runs, ended however
        it ends (an exception, ``KeyboardInterrupt`` in a backoff)."""
        current = self.current
        if join and current is not None:
            yield current
            return
        budget = Budget(fresh(policy))
        self.stack.append(budget)
        try:
            yield budget
        finally:
            self.stack.remove(budget)


def fresh(policy: Retry) -> Retry:
    """A copy of ``policy`` for a new call, its deadline's clock started now."""
    if isinstance(policy, IdempotentRetry):
        return policy.new(started=time.monotonic())
    return policy.new()


def count_hop(
    budget: Budget, following: requests.Response, request: requests.PreparedRequest
) -> None:
    """Count the redirect hop ``request`` (following ``following``) in ``budget``,
    as urllib3 counts a redirect: one of ``total`` and ``redirect``; an
    :class:`IdempotentRetry` checks its deadline too. Raise
    :class:`RedirectBudgetExceeded` when the hop may not start.

    Only a hop that sends the call's method again is counted: a 307 or 308,
    a 301 of any method but POST, a 302 or 303 of a HEAD (requests keeps
    those methods). A hop whose method requests changed to GET (a 302 or 303,
    a 301 of a POST) is no resend of the request but the fetch of its result,
    after the server acted: refusing it for the budget would report retries
    run out for an operation that succeeded. Such hops (and every hop after
    them) are bounded by requests' ``max_redirects`` alone, not by ``total``
    nor the deadline."""
    call_method = (budget.method or "").upper()
    if not call_method or (request.method or "").upper() != call_method:
        return
    raw = following.raw
    if not isinstance(raw, BaseHTTPResponse):  # an adapter of another kind
        raw = HTTPResponse(headers=dict(following.headers), status=following.status_code)
    method = following.request.method if following.request is not None else request.method
    try:
        budget.retry = budget.retry.increment(method, following.url, response=raw)
    except MaxRetryError as exc:
        raise RedirectBudgetExceeded(
            f"redirect to {request.url} not followed: {exc.reason}",
            response=following,
            request=request,
        ) from exc
