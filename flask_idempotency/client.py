"""An HTTP client that retries POSTs safely: one ``Idempotency-Key`` for all attempts.

Needs ``requests`` (``pip install "Flask-Idempotency[client]"``)::

    from flask_idempotency.client import IdempotentSession

    http = IdempotentSession(deadline=30)
    http.post("https://payments.example/charges", json=charge)  # key made here
    http.post(url, json=charge, idempotency_key=saved_key)  # a key kept elsewhere
    http.post(url, json=charge, step="charge")  # in an idempotent view: derived

The retries are urllib3's :class:`~urllib3.util.Retry` (mounted with an
``HTTPAdapter``), which resends the same prepared request, headers and key
included. What it adds, in :class:`IdempotentRetry`:

* 409 is retried only when it carries ``Retry-After`` (an operation in progress
  elsewhere); a 409 without it is a real conflict. ``Retry`` already treats its
  ``RETRY_AFTER_STATUS_CODES`` that way, so that set becomes 409, 429 and 503
  (not 413: no other 4xx is retried);
* a time budget, ``deadline`` seconds from the first attempt: no attempt starts
  after it, and a wait (backoff or ``Retry-After``) that would end after it is
  not begun; the last response (or error) is the answer. ``Retry`` counts
  attempts, not time, so :meth:`IdempotentRetry.increment` checks the budget
  and :meth:`IdempotentRetry.sleep` sleeps exactly the wait it checked;
* a backoff before the first retry too (urllib3 retries the first failure at
  once), and an unreadable ``Retry-After`` (``1.5``, ``soon``) treated as
  absent instead of raising.

And in :class:`IdempotentSession` and its adapter: urllib3 retries only
failures before the response's headers; a response cut off in its body (the
connection lost, a read timeout) is sent again too, since the server may have
acted on it. Every attempt of one call (urllib3's retries, those resends, the
redirect hops that send the call's method again) draws on one ``Retry``, so
``total`` and the deadline bound the call (such a hop past them raises
:class:`RedirectBudgetExceeded`). A hop that changes the method (the GET after
a 303, or after a 301 or 302 of a POST) fetches a result, no resend: only
requests' ``max_redirects`` bounds it.
Every way into the session (``request``, the verbs, ``send`` of a prepared
request) gives a POST or PATCH its key before the first
attempt; one that reaches the adapter without a key is not resent.
"""

from __future__ import annotations

import contextlib
import io
import random
import threading
import time
import typing as t
import uuid

try:
    import requests
    from requests.adapters import HTTPAdapter
    from requests.utils import rewind_body
    from urllib3.exceptions import InvalidHeader, MaxRetryError, ProtocolError, ResponseError
    from urllib3.response import BaseHTTPResponse, HTTPResponse
    from urllib3.util.retry import Retry
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        'flask_idempotency.client needs requests: pip install "Flask-Idempotency[client]"'
    ) from exc

from ._context import current_derived_key, in_keyed_request
from .keys import quote_key

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
    :class:`IdempotentSession` sets it as each request begins, otherwise it is
    the first retry) after which no new attempt starts.
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
        return _backoff(self, consecutive)

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


class RedirectBudgetExceeded(requests.TooManyRedirects, requests.exceptions.RetryError):
    """A redirect the call's budget does not allow following: one more hop that
    sends the call's method again (a 307 or 308; a 301 of any method but
    POST) would be past ``total`` (or the ``Retry``'s ``redirect`` count), or
    start after the deadline. It is requests' error for a redirect chain cut
    off and its error for retries run out; ``response`` is the redirect not
    followed. A hop that changes the method (a POST's 303 to a GET) is never
    refused for the budget."""


class _Budget:
    """The retries one call has left (a ``Retry``, with its counts and history).

    Every attempt of the call draws on it: urllib3's retries, a resend after a
    body cut off mid-read, the redirect hops that send the call's method again.
    So ``total`` and the deadline bound the whole call, never one attempt's
    share of it.
    """

    __slots__ = ("following", "method", "retry")

    def __init__(self, retry: Retry) -> None:
        self.retry = retry
        #: The redirect the call's next send follows (set while requests'
        #: ``resolve_redirects`` runs): that send is a hop, counted first.
        self.following: requests.Response | None = None
        #: The method of the request whose redirects are followed: a hop that
        #: sends it again is a resend, counted; one with another method is not.
        self.method: str | None = None


class _Budgets(threading.local):
    """Each thread's calls in progress on one session, innermost last.

    Per thread, because a session is shared by threads (a pool, a web
    server's workers): one thread's retries never spend another's budget.
    """

    def __init__(self) -> None:
        self.stack: list[_Budget] = []

    @property
    def current(self) -> _Budget | None:
        return self.stack[-1] if self.stack else None

    @contextlib.contextmanager
    def call(self, policy: Retry, *, join: bool) -> t.Iterator[_Budget]:
        """The budget of the call in progress (``join``, when there is one), or a
        new one from ``policy`` for as long as the block runs, ended however
        it ends (an exception, ``KeyboardInterrupt`` in a backoff)."""
        current = self.current
        if join and current is not None:
            yield current
            return
        budget = _Budget(_fresh(policy))
        self.stack.append(budget)
        try:
            yield budget
        finally:
            self.stack.remove(budget)


def _fresh(policy: Retry) -> Retry:
    """A copy of ``policy`` for a new call, its deadline's clock started now."""
    if isinstance(policy, IdempotentRetry):
        return policy.new(started=time.monotonic())
    return policy.new()


class _BudgetAdapter(HTTPAdapter):
    """The session's ``HTTPAdapter``: every attempt of one call draws on one
    budget, a response cut off in its body is sent again, and a request that
    cannot be sent again safely is not.

    What may be resent: the same prepared request (key, body, headers), and
    only when it carries its key or needs none (not POST or PATCH) and its
    body can be sent twice. Otherwise only a failure to connect is retried
    (nothing reached the server); a read error or a retryable status ends the
    call. The session gives every POST and PATCH a key before this point, so
    that applies to a request sent to the adapter by other code
    (``session.get_adapter(url).send(...)``).
    """

    _retry: Retry

    def __init__(self, *, budgets: _Budgets, header: str, **kwargs: t.Any) -> None:
        self._budgets = budgets
        self._header = header
        super().__init__(**kwargs)

    @property
    def max_retries(self) -> Retry:
        # HTTPAdapter.send reads this for each urlopen: the call's budget so far.
        budget = self._budgets.current
        return budget.retry if budget is not None else self._retry

    @max_retries.setter
    def max_retries(self, value: Retry) -> None:
        self._retry = value

    def send(
        self,
        request: requests.PreparedRequest,
        stream: bool = False,
        timeout: t.Any = None,
        verify: bool | str = True,
        cert: t.Any = None,
        proxies: t.Mapping[str, str] | None = None,
    ) -> requests.Response:
        """``HTTPAdapter.send``, reading the body here (unless ``stream``) so that
        a response cut off after its headers is sent again: urllib3 retries only
        failures before the headers, and the server may have acted. The resend
        is one more read error in the call's ``Retry``: within ``total``,
        ``read``, the allowed methods and the deadline, after its backoff."""
        with self._budgets.call(self._retry, join=True) as budget:
            method = (request.method or "").upper()
            if not _resendable(request, method, self._header):
                budget.retry = _connect_retries_only(budget.retry, method)
            while True:
                response = super().send(
                    request,
                    stream=True,
                    timeout=timeout,
                    verify=verify,
                    cert=cert,
                    proxies=proxies,
                )
                used = getattr(response.raw, "retries", None)
                if isinstance(used, Retry):  # what urllib3 spent on this attempt
                    budget.retry = used
                if stream:
                    return response  # the caller reads it: nothing to resend then
                try:
                    response.content  # noqa: B018 - reads and keeps the body
                except (requests.exceptions.ChunkedEncodingError, requests.ConnectionError) as exc:
                    response.close()
                    after = _after_body_lost(budget.retry, method, request.url, exc)
                    if after is None:
                        raise
                    budget.retry = after
                else:
                    return response
                budget.retry.sleep()
                if getattr(request, "_body_position", None) is not None:
                    rewind_body(request)  # a file body: from where the first attempt read it


def _count_hop(
    budget: _Budget, following: requests.Response, request: requests.PreparedRequest
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


def _resendable(request: requests.PreparedRequest, method: str, header: str) -> bool:
    """Whether sending ``request`` again is safe: a POST or PATCH only with its
    key, and any request only with a body that reads the same the second time."""
    if method in KEYED_METHODS and not _has_header(request.headers, header):
        return False
    body = request.body
    if _in_memory(body):
        return True
    # A file requests could note the position of (it rewinds it); not an
    # iterator, nor a stream whose position is unknown.
    return isinstance(getattr(request, "_body_position", None), int)


#: An allowed-methods set no request matches (``<`` is not allowed in a
#: method name); an empty one would mean "every method" to urllib3.
_NO_METHODS = frozenset({"<none>"})


def _connect_retries_only(retry: Retry, method: str) -> Retry:
    """``retry`` for a request that must not be sent twice: a failure to connect
    (nothing was sent) is still retried; a read error, a retryable status and
    any other error are not."""
    allowed = frozenset(retry.allowed_methods or RETRY_METHODS) - {method}
    return retry.new(allowed_methods=allowed or _NO_METHODS, other=0)


def _after_body_lost(retry: Retry, method: str, url: str | None, error: Exception) -> Retry | None:
    """``retry`` after a response whose body could not be read, or ``None`` when
    the call may not resend (the method, ``total``, ``read`` or the deadline)."""
    try:
        return retry.increment(method, url, error=ProtocolError(f"response body lost: {error}"))
    except (MaxRetryError, ProtocolError):
        return None


class IdempotentSession(requests.Session):
    """A ``requests.Session`` that retries safely, with one key for all attempts.

    The key of a request is chosen once, before its first attempt, and every
    resend carries it (urllib3's retries, a resend after a cut-off body and a
    307/308 redirect all send the same prepared request):

    1. an ``Idempotency-Key`` header the caller passes in ``headers=`` or sets in
       the session's ``headers``: as is, its name in any case, name and value
       ``str`` or ``bytes`` (given as ``None``, requests' way to leave a header
       out, it counts as not given, the session's too);
    2. ``idempotency_key="..."``: that key (for operations that outlive the
       process: keep the key, send it again later);
    3. ``step="charge"``: inside an idempotent view, ``idem.derived_key("charge")``
       (the same on every retry and resume of the view's operation);
    4. otherwise, for POST and PATCH outside an idempotent view: a new UUID4.
       Inside an idempotent view with a key a POST or PATCH without one of the
       above raises :class:`ValueError`: a fresh key on each run of the view
       would make the downstream act once per retry of the view.

    This holds on every way into the session: :meth:`request`, ``get``,
    ``post`` and the other verbs, and :meth:`send` of a prepared request
    (requests' "prepared requests" pattern, or a library handed the session),
    which gives a POST or PATCH without the header a key by rules 1 and 4,
    written into the prepared request (sending it again is the same
    operation). A POST or PATCH that reaches the session's adapter without a
    key by another way is never resent, except after a failure to connect.

    Keys the session makes are sent as RFC 8941 strings (``"..."``), the form
    the IETF draft specifies and Flask-Idempotency reads.

    Retried: connection errors, read errors and timeouts (also while the body
    is read, unless ``stream=True``: then the caller reads it, after the call),
    429, 502, 503, 504, and 409 with ``Retry-After``; never another 4xx.
    ``Retry-After`` is honoured (up to ``retry_after_max``; an unreadable value
    counts as absent), otherwise exponential backoff with jitter up to
    ``backoff_max``, from the first retry on (``backoff_factor``, twice that,
    ...); at most ``total`` retries within ``deadline`` seconds, for the whole
    call: every resend, whatever its cause, and each redirect hop that sends
    the call's method again (307, 308; a 301 of a PUT, DELETE, GET...)
    count against the same ``total`` and deadline (such a hop past them is
    not started: :class:`RedirectBudgetExceeded`). A hop that changes the
    method, the GET after a POST's 303 (or 302, 301), is no resend: it is
    followed whatever is left of ``total`` and the deadline, within requests'
    ``max_redirects`` (``TooManyRedirects`` past it). When retries run out the last
    response is returned (or the last connection error raised). Pass
    ``retry=`` for a ``Retry`` of your own.

    Every attempt sends the same body: a ``data=`` generator or unseekable
    stream (or such a body in a prepared request) is read into memory before
    the first attempt (seekable files are rewound); a bytes-like body
    (``bytearray``, ``memoryview``, ``array``) is sent as is. The keyless-POST check
    reads the Flask app context: a call made from another thread (a pool the
    view hands work to) is not inside the view, so pass ``step=`` or
    ``idempotency_key=`` there yourself.

    One session may be shared by threads: each call's key and retry budget
    are its own. An exception during a backoff (``KeyboardInterrupt``) ends
    the call; the next call starts with a new key and a full budget.
    """

    def __init__(
        self,
        *,
        header: str = "Idempotency-Key",
        total: int = 5,
        backoff_factor: float = 0.5,
        backoff_max: float = 10.0,
        backoff_jitter: float = 0.5,
        retry_after_max: float = 60.0,
        deadline: float | None = 60.0,
        retry: Retry | None = None,
    ) -> None:
        super().__init__()
        self._header = header
        if retry is None:
            retry = IdempotentRetry(
                total=total,
                allowed_methods=RETRY_METHODS,
                status_forcelist=RETRY_STATUSES,
                backoff_factor=backoff_factor,
                backoff_max=backoff_max,
                backoff_jitter=backoff_jitter,
                retry_after_max=retry_after_max,
                respect_retry_after_header=True,
                raise_on_status=False,
                deadline=deadline,
            )
        self._retry_policy = retry
        self._budgets = _Budgets()
        adapter = _BudgetAdapter(max_retries=retry, budgets=self._budgets, header=header)
        self.mount("http://", adapter)
        self.mount("https://", adapter)

    @property
    def idempotency_header(self) -> str:
        """The header the key is sent in (``header=``)."""
        return self._header

    def request(
        self,
        method: str | bytes,
        url: str | bytes,
        *args: t.Any,
        idempotency_key: str | None = None,
        step: str | None = None,
        **kwargs: t.Any,
    ) -> requests.Response:
        if args:
            raise TypeError("pass the arguments after the URL by name (params=, data=...)")
        name = method.decode() if isinstance(method, bytes) else method
        headers = dict(kwargs.pop("headers", None) or {})
        # The header given as None leaves it out, the session's too (requests'
        # rule): no key given, one is made.
        left_out = [k for k, v in headers.items() if v is None and _is_name(k, self._header)]
        if _has_header(headers, self._header):
            if idempotency_key is not None or step is not None:
                raise TypeError(
                    f"the {self._header} header and idempotency_key=/step= both name a key: "
                    "pass one"
                )
        elif (
            not left_out
            and idempotency_key is None
            and step is None
            and _has_header(self.headers, self._header)
        ):
            pass  # the session's headers carry the caller's key: sent as is
        else:
            key = self._key_for(name.upper(), idempotency_key, step)
            if key is not None:
                for k in left_out:
                    del headers[k]
                headers[self._header] = quote_key(key)
        if "data" in kwargs:
            kwargs["data"] = _replayable(kwargs["data"])
        # A budget of its own, even when called from inside another call (a
        # response hook): each call has its own total and deadline.
        with self._budgets.call(self._retry_policy, join=False):
            return super().request(method, url, headers=headers, **kwargs)

    def send(self, request: requests.PreparedRequest, **kwargs: t.Any) -> requests.Response:
        """requests' ``send``, made as safe as :meth:`request`: a POST or PATCH
        without the key header gets a key now, before its first attempt,
        written into ``request`` (as :meth:`request` would choose it, without
        ``idempotency_key=`` or ``step=``: set the header to pass one); a body
        that cannot be sent twice is read into memory. Then the same retries."""
        method = (request.method or "").upper()
        if method in KEYED_METHODS and not _has_header(request.headers, self._header):
            key = self._key_for(method, None, None)
            assert key is not None  # POST and PATCH always get one
            request.headers[self._header] = quote_key(key)
        _buffer_body(request)
        # Joined when request() or a redirect sends: one budget for the call.
        with self._budgets.call(self._retry_policy, join=True) as budget:
            following, budget.following = budget.following, None
            if following is not None:
                _count_hop(budget, following, request)
            return super().send(request, **kwargs)

    def resolve_redirects(
        self,
        resp: requests.Response,
        req: requests.PreparedRequest,
        *args: t.Any,
        **kwargs: t.Any,
    ) -> t.Iterator[t.Any]:
        """requests' redirect hops, each sent by :meth:`send`, which counts it in
        the call's budget (``total``, the deadline) before it starts when it
        sends ``req``'s method again (see :func:`_count_hop`)."""
        hops = super().resolve_redirects(resp, req, *args, **kwargs)
        budget = self._budgets.current
        if budget is None or kwargs.get("yield_requests"):
            yield from hops  # nothing sent here (requests' look at the next hop)
            return
        outer_method = budget.method
        budget.following = resp
        budget.method = req.method
        try:
            for hop in hops:
                budget.following = hop  # the response the next hop, if any, follows
                yield hop
        finally:
            budget.following = None
            budget.method = outer_method

    # post/put/patch restated only so that type checkers know idempotency_key=
    # and step=; each is requests' own, by way of request().
    def post(
        self,
        url: str | bytes,
        data: t.Any = None,
        json: t.Any = None,
        *,
        idempotency_key: str | None = None,
        step: str | None = None,
        **kwargs: t.Any,
    ) -> requests.Response:
        """POST with the key as :meth:`request` chooses it."""
        return self.request(
            "POST", url, data=data, json=json, idempotency_key=idempotency_key, step=step, **kwargs
        )

    def put(
        self,
        url: str | bytes,
        data: t.Any = None,
        *,
        idempotency_key: str | None = None,
        step: str | None = None,
        **kwargs: t.Any,
    ) -> requests.Response:
        """PUT with the key as :meth:`request` chooses it."""
        return self.request(
            "PUT", url, data=data, idempotency_key=idempotency_key, step=step, **kwargs
        )

    def patch(
        self,
        url: str | bytes,
        data: t.Any = None,
        *,
        idempotency_key: str | None = None,
        step: str | None = None,
        **kwargs: t.Any,
    ) -> requests.Response:
        """PATCH with the key as :meth:`request` chooses it."""
        return self.request(
            "PATCH", url, data=data, idempotency_key=idempotency_key, step=step, **kwargs
        )

    def _key_for(self, method: str, key: str | None, step: str | None) -> str | None:
        if key is not None:
            if step is not None:
                raise TypeError("pass idempotency_key= or step=, not both")
            return key
        if step is not None:
            return current_derived_key(step)
        if method not in KEYED_METHODS:
            return None
        if _in_keyed_idempotent_request():
            raise ValueError(
                "inside an idempotent view, name the downstream call: step='...' (a key "
                "derived from the view's operation) or idempotency_key='...'"
            )
        return str(uuid.uuid4())


def _backoff(retry: Retry, consecutive: int) -> float:
    """The wait before the ``consecutive``-th retry in a row (0: none)."""
    if consecutive < 1 or retry.backoff_factor <= 0:
        return 0.0
    value = retry.backoff_factor * 2 ** (consecutive - 1)
    if retry.backoff_jitter:
        value += random.random() * retry.backoff_jitter
    return float(max(0.0, min(retry.backoff_max, value)))


def _in_memory(body: t.Any) -> bool:
    """Whether ``body`` is bytes in memory, sent whole by every attempt: ``None``,
    ``str``, or anything with the buffer protocol (``bytes``, ``bytearray``,
    ``memoryview``, ``array.array``), which urllib3 sends as its bytes. Not one
    with ``read`` too (an ``mmap``): urllib3 reads that as a file."""
    if body is None or isinstance(body, bytes | str):
        return True
    if hasattr(body, "read"):
        return False
    try:
        view = memoryview(body)  # no copy: a view of the caller's buffer
    except TypeError:
        return False
    view.release()
    return True


def _replayable(data: t.Any) -> t.Any:
    """``data`` as a body every retry can resend: a generator or an unseekable
    stream is read into memory first (urllib3 cannot rewind them, and a retry
    would send an empty body under the same key); anything else is unchanged,
    a bytes-like body too (sent as is, not copied)."""
    if isinstance(data, (dict, list, tuple)) or _in_memory(data):
        return data
    read = getattr(data, "read", None)
    if read is not None:
        seekable = getattr(data, "seekable", None)
        if callable(seekable) and seekable():
            return data
    if read is not None or isinstance(data, t.Iterable):
        return _read_all(data)
    return data


def _read_all(data: t.Any) -> bytes:
    """The bytes of a stream (``read()``) or of an iterable of chunks, each
    ``str`` or bytes-like (an ``int`` is refused, not made into that many zero
    bytes as ``bytes(n)`` would)."""
    read = getattr(data, "read", None)
    if read is not None:
        content = read()
        if isinstance(content, bytes):
            return content
        data = [content]
    buffer = io.BytesIO()  # its value is taken without another copy of the whole
    for chunk in data:
        # TypeError for what is not bytes-like, as urllib3 would raise.
        buffer.write(chunk.encode("utf-8") if isinstance(chunk, str) else chunk)
    return buffer.getvalue()


def _buffer_body(request: requests.PreparedRequest) -> None:
    """Read a prepared body that cannot be sent twice (an iterator, a stream
    whose position requests could not note) into memory, before the first
    attempt, so that every resend carries the same bytes under the same key."""
    body = request.body
    if _in_memory(body):
        return  # bytes, str or a bytes-like buffer: sent as is by every attempt
    if isinstance(getattr(request, "_body_position", None), int):
        return  # a file: rewound before a resend, by urllib3 and the adapter
    content = _read_all(body)
    request.body = content
    request.headers.pop("Transfer-Encoding", None)  # a length now, not chunks
    request.prepare_content_length(content)
    setattr(request, "_body_position", None)  # noqa: B010 - not in requests' stubs


def _has_header(headers: t.Mapping[t.Any, t.Any], name: str) -> bool:
    """Whether ``headers`` gives ``name`` a value (not ``None``): a plain dict or
    requests' case-insensitive one, its names ``str`` or ``bytes`` (requests
    takes both) in any case."""
    return any(v is not None and _is_name(k, name) for k, v in headers.items())


def _is_name(candidate: t.Any, name: str) -> bool:
    """Whether the header name ``candidate`` (``str`` or ``bytes``) is ``name``,
    in any case."""
    if isinstance(candidate, bytes | bytearray):
        candidate = bytes(candidate).decode("latin-1")
    return isinstance(candidate, str) and candidate.lower() == name.lower()


def _in_keyed_idempotent_request() -> bool:
    return in_keyed_request()
