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

And in :class:`IdempotentSession`: urllib3 retries only failures before the
response's headers; a response cut off in its body (the connection lost, a
read timeout) is sent again by the session, within the same ``total`` and
deadline, since the server may have acted on it.
"""

from __future__ import annotations

import random
import threading
import time
import typing as t
import uuid

try:
    import requests
    from requests.adapters import HTTPAdapter
    from urllib3.exceptions import InvalidHeader, MaxRetryError, ResponseError
    from urllib3.util.retry import Retry
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        'flask_idempotency.client needs requests: pip install "Flask-Idempotency[client]"'
    ) from exc

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
        like ``1.5`` or ``soon``: the backoff applies instead of an error)."""
        try:
            return super().get_retry_after(response)
        except InvalidHeader:
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
        wait = new._wait_before_next(response)
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


class _BudgetAdapter(HTTPAdapter):
    """An ``HTTPAdapter`` whose retry budget starts when each request is sent.

    ``HTTPAdapter.send`` reads ``self.max_retries`` once per request: a fresh
    copy stamped with the time is what starts the deadline's clock.
    """

    _retry: Retry

    def __init__(self, *, budget: threading.local, **kwargs: t.Any) -> None:
        self._budget = budget
        super().__init__(**kwargs)

    @property
    def max_retries(self) -> Retry:
        if isinstance(self._retry, IdempotentRetry):
            # One deadline for every send of one session call (see _BodyLost).
            started = getattr(self._budget, "started", None) or time.monotonic()
            return self._retry.new(started=started)
        return self._retry

    @max_retries.setter
    def max_retries(self, value: Retry) -> None:
        self._retry = value


class IdempotentSession(requests.Session):
    """A ``requests.Session`` that retries safely, with one key for all attempts.

    The key of a request is chosen once, before its first attempt, and every
    retry resends it (urllib3 resends the same request):

    1. an ``Idempotency-Key`` header the caller passes in ``headers=``: as is;
    2. ``idempotency_key="..."``: that key (for operations that outlive the
       process: keep the key, send it again later);
    3. ``step="charge"``: inside an idempotent view, ``idem.derived_key("charge")``
       (the same on every retry and resume of the view's operation);
    4. otherwise, for POST and PATCH outside an idempotent view: a new UUID4.
       Inside an idempotent view with a key a POST or PATCH without one of the
       above raises :class:`ValueError`: a fresh key on each run of the view
       would make the downstream act once per retry of the view.

    Keys the session makes are sent as RFC 8941 strings (``"..."``), the form
    the IETF draft specifies and Flask-Idempotency reads.

    Retried: connection errors, read errors and timeouts (also while the body
    is read, unless ``stream=True``: then the caller reads it, after the call),
    429, 502, 503, 504, and 409 with ``Retry-After``; never another 4xx.
    ``Retry-After`` is honoured (up to ``retry_after_max``; an unreadable value
    counts as absent), otherwise exponential backoff with jitter up to
    ``backoff_max``, from the first retry on (``backoff_factor``, twice that,
    ...); at most ``total`` retries within ``deadline`` seconds. When retries
    run out the last response is returned (or the last connection error
    raised). Pass ``retry=`` for a ``Retry`` of your own.

    Every attempt sends the same body: a ``data=`` generator or unseekable
    stream is read into memory before the first attempt (seekable files are
    rewound). The keyless-POST check reads the Flask app context: a call made
    from another thread (a pool the view hands work to) is not inside the view,
    so pass ``step=`` or ``idempotency_key=`` there yourself.
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
        self.idempotency_header = header
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
        self._budget = threading.local()
        adapter = _BudgetAdapter(max_retries=retry, budget=self._budget)
        self.mount("http://", adapter)
        self.mount("https://", adapter)

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
        if not any(h.lower() == self.idempotency_header.lower() for h in headers):
            key = self._key_for(name.upper(), idempotency_key, step)
            if key is not None:
                headers[self.idempotency_header] = quote_key(key)
        elif idempotency_key is not None or step is not None:
            raise TypeError(
                f"the {self.idempotency_header} header and idempotency_key=/step= both "
                "name a key: pass one"
            )
        if "data" in kwargs:
            kwargs["data"] = _replayable(kwargs["data"])
        started = self._budget.started = time.monotonic()
        lost = 0
        try:
            while True:
                try:
                    return super().request(method, url, headers=headers, **kwargs)
                except _BodyLost as exc:
                    lost += 1
                    wait = self._wait_after_body_loss(name.upper(), lost, started)
                    if wait is None:
                        raise exc.error from None
                    time.sleep(wait)
        finally:
            self._budget.started = None

    def send(self, request: requests.PreparedRequest, **kwargs: t.Any) -> requests.Response:
        """requests' ``send``, reading the body here (unless ``stream=True``) so
        that a response cut off after its headers is sent again, as urllib3
        retries only failures before the headers. The server may have acted:
        the same request, key included, goes again."""
        if kwargs.get("stream"):
            return super().send(request, **kwargs)
        response = super().send(request, **{**kwargs, "stream": True})
        try:
            response.content  # noqa: B018 - reads and keeps the body
        except (requests.exceptions.ChunkedEncodingError, requests.ConnectionError) as exc:
            response.close()
            if getattr(self._budget, "started", None) is None:
                raise  # send() called directly: no request() loop to resend it
            raise _BodyLost(exc) from exc
        return response

    def _wait_after_body_loss(self, method: str, lost: int, started: float) -> float | None:
        """The wait before resending after the ``lost``-th cut-off body, or
        ``None`` to give up: within ``total`` and the deadline, as for other
        retries."""
        retry = self._retry_policy
        if retry.allowed_methods is not None and method not in retry.allowed_methods:
            return None
        if retry.total is not None and retry.total is not False and lost > int(retry.total):
            return None
        wait = _backoff(retry, lost)
        deadline = getattr(retry, "deadline", None)
        if deadline is not None and time.monotonic() + wait > started + deadline:
            return None
        return wait

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
            from .extension import current_derived_key

            return current_derived_key(step)
        if method not in KEYED_METHODS:
            return None
        if _in_keyed_idempotent_request():
            raise ValueError(
                "inside an idempotent view, name the downstream call: step='...' (a key "
                "derived from the view's operation) or idempotency_key='...'"
            )
        return str(uuid.uuid4())


class _BodyLost(Exception):
    """A response whose body could not be read (``error``): the attempt failed
    after the headers, and may be sent again."""

    def __init__(self, error: requests.RequestException) -> None:
        super().__init__(str(error))
        self.error = error


def _backoff(retry: Retry, consecutive: int) -> float:
    """The wait before the ``consecutive``-th retry in a row (0: none)."""
    if consecutive < 1 or retry.backoff_factor <= 0:
        return 0.0
    value = retry.backoff_factor * 2 ** (consecutive - 1)
    if retry.backoff_jitter:
        value += random.random() * retry.backoff_jitter
    return float(max(0.0, min(retry.backoff_max, value)))


def _replayable(data: t.Any) -> t.Any:
    """``data`` as a body every retry can resend: a generator or an unseekable
    stream is read into memory first (urllib3 cannot rewind them, and a retry
    would send an empty body under the same key); anything else is unchanged."""
    if data is None or isinstance(data, (bytes, bytearray, str, dict, list, tuple)):
        return data
    read = getattr(data, "read", None)
    if read is not None:
        seekable = getattr(data, "seekable", None)
        if callable(seekable) and seekable():
            return data
        content = read()
        return content.encode("utf-8") if isinstance(content, str) else content
    if isinstance(data, t.Iterable):
        chunks = [c.encode("utf-8") if isinstance(c, str) else bytes(c) for c in data]
        return b"".join(chunks)
    return data


def _in_keyed_idempotent_request() -> bool:
    from flask import g, has_app_context

    if not has_app_context():
        return False
    state = g.get("_idempotency")
    return state is not None and getattr(state, "key", None) is not None
