"""An HTTP client that retries POSTs safely: one ``Idempotency-Key`` for all attempts.

Needs ``requests``, the ``client`` extra (see the installation page)::

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

import typing as t
import uuid

try:
    # The client's optional dependency: without it, the error names the extra.
    import requests
    from urllib3.util.retry import Retry
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "flask_idempotency.client needs requests: install the package's client extra "
        '(pip install "path/to/flask-idempotency[client]", see docs/installation.md), '
        "or pip install requests"
    ) from exc

from ._client.budget import Budgets, RedirectBudgetExceeded, count_hop
from ._client.retry import KEYED_METHODS, RETRY_METHODS, RETRY_STATUSES, IdempotentRetry
from ._client.transport import BudgetAdapter, buffer_body, has_header, is_name, replayable
from ._context import current_derived_key, in_keyed_request
from .keys import quote_key

__all__ = [
    "KEYED_METHODS",
    "RETRY_METHODS",
    "RETRY_STATUSES",
    "IdempotentRetry",
    "IdempotentSession",
    "RedirectBudgetExceeded",
]


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
        self._budgets = Budgets()
        adapter = BudgetAdapter(max_retries=retry, budgets=self._budgets, header=header)
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
        left_out = [k for k, v in headers.items() if v is None and is_name(k, self._header)]
        if has_header(headers, self._header):
            if idempotency_key is not None or step is not None:
                raise TypeError(
                    f"the {self._header} header and idempotency_key=/step= both name a key: "
                    "pass one"
                )
        elif (
            not left_out
            and idempotency_key is None
            and step is None
            and has_header(self.headers, self._header)
        ):
            pass  # the session's headers carry the caller's key: sent as is
        else:
            key = self._key_for(name.upper(), idempotency_key, step)
            if key is not None:
                for k in left_out:
                    del headers[k]
                headers[self._header] = quote_key(key)
        if "data" in kwargs:
            kwargs["data"] = replayable(kwargs["data"])
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
        if method in KEYED_METHODS and not has_header(request.headers, self._header):
            key = self._key_for(method, None, None)
            assert key is not None  # POST and PATCH always get one
            request.headers[self._header] = quote_key(key)
        buffer_body(request)
        # Joined when request() or a redirect sends: one budget for the call.
        with self._budgets.call(self._retry_policy, join=True) as budget:
            following, budget.following = budget.following, None
            if following is not None:
                count_hop(budget, following, request)
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
        sends ``req``'s method again (see :func:`count_hop`)."""
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
        if in_keyed_request():
            raise ValueError(
                "inside an idempotent view, name the downstream call: step='...' (a key "
                "derived from the view's operation) or idempotency_key='...'"
            )
        return str(uuid.uuid4())
