"""The session's adapter: resends a response cut off in its body, within the
call's budget, and never resends what is not safe to send twice; and the
header and body checks that decide it."""

from __future__ import annotations

import io
import typing as t

import requests
from requests.adapters import HTTPAdapter
from requests.utils import rewind_body
from urllib3.exceptions import MaxRetryError, ProtocolError
from urllib3.util.retry import Retry

from .budget import Budgets
from .retry import KEYED_METHODS, RETRY_METHODS
from .tracing import numbering, trace_pools


class BudgetAdapter(HTTPAdapter):
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

    Its pools (and an HTTP proxy's) open :mod:`.tracing`'s connections: each
    attempt is a CLIENT span with the trace context in its headers.
    """

    _retry: Retry

    def __init__(self, *, budgets: Budgets, header: str, **kwargs: t.Any) -> None:
        self._budgets = budgets
        self._header = header
        super().__init__(**kwargs)

    def init_poolmanager(self, *args: t.Any, **kwargs: t.Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        trace_pools(self.poolmanager)

    def proxy_manager_for(self, proxy: str, **proxy_kwargs: t.Any) -> t.Any:
        manager = super().proxy_manager_for(proxy, **proxy_kwargs)
        if not proxy.lower().startswith("socks"):  # SOCKS pools are urllib3's own
            trace_pools(manager)
        return manager

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
        with (
            self._budgets.call(self._retry, join=True) as budget,
            numbering(budget.attempts),  # the attempt spans' numbers
        ):
            method = (request.method or "").upper()
            if not resendable(request, method, self._header):
                budget.retry = connect_retries_only(budget.retry, method)
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
                    after = after_body_lost(budget.retry, method, request.url, exc)
                    if after is None:
                        raise
                    budget.retry = after
                else:
                    return response
                budget.retry.sleep()
                if getattr(request, "_body_position", None) is not None:
                    rewind_body(request)  # a file body: from where the first attempt read it


def resendable(request: requests.PreparedRequest, method: str, header: str) -> bool:
    """Whether sending ``request`` again is safe: a POST or PATCH only with its
    key, and any request only with a body that reads the same the second time."""
    if method in KEYED_METHODS and not has_header(request.headers, header):
        return False
    body = request.body
    if in_memory(body):
        return True
    # A file requests could note the position of (it rewinds it); not an
    # iterator, nor a stream whose position is unknown.
    return isinstance(getattr(request, "_body_position", None), int)


#: An allowed-methods set no request matches (``<`` is not allowed in a
#: method name); an empty one would mean "every method" to urllib3.
_NO_METHODS = frozenset({"<none>"})


def connect_retries_only(retry: Retry, method: str) -> Retry:
    """``retry`` for a request that must not be sent twice: a failure to connect
    (nothing was sent) is still retried; a read error, a retryable status and
    any other error are not."""
    allowed = frozenset(retry.allowed_methods or RETRY_METHODS) - {method}
    return retry.new(allowed_methods=allowed or _NO_METHODS, other=0)


def after_body_lost(retry: Retry, method: str, url: str | None, error: Exception) -> Retry | None:
    """``retry`` after a response whose body could not be read, or ``None`` when
    the call may not resend (the method, ``total``, ``read`` or the deadline)."""
    try:
        return retry.increment(method, url, error=ProtocolError(f"response body lost: {error}"))
    except (MaxRetryError, ProtocolError):
        return None


def in_memory(body: t.Any) -> bool:
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


def replayable(data: t.Any) -> t.Any:
    """``data`` as a body every retry can resend: a generator or an unseekable
    stream is read into memory first (urllib3 cannot rewind them, and a retry
    would send an empty body under the same key); anything else is unchanged,
    a bytes-like body too (sent as is, not copied)."""
    if isinstance(data, (dict, list, tuple)) or in_memory(data):
        return data
    read = getattr(data, "read", None)
    if read is not None:
        seekable = getattr(data, "seekable", None)
        if callable(seekable) and seekable():
            return data
    if read is not None or isinstance(data, t.Iterable):
        return read_all(data)
    return data


def read_all(data: t.Any) -> bytes:
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


def buffer_body(request: requests.PreparedRequest) -> None:
    """Read a prepared body that cannot be sent twice (an iterator, a stream
    whose position requests could not note) into memory, before the first
    attempt, so that every resend carries the same bytes under the same key."""
    body = request.body
    if in_memory(body):
        return  # bytes, str or a bytes-like buffer: sent as is by every attempt
    if isinstance(getattr(request, "_body_position", None), int):
        return  # a file: rewound before a resend, by urllib3 and the adapter
    content = read_all(body)
    request.body = content
    request.headers.pop("Transfer-Encoding", None)  # a length now, not chunks
    request.prepare_content_length(content)
    setattr(request, "_body_position", None)  # noqa: B010 - not in requests' stubs


def has_header(headers: t.Mapping[t.Any, t.Any], name: str) -> bool:
    """Whether ``headers`` gives ``name`` a value (not ``None``): a plain dict or
    requests' case-insensitive one, its names ``str`` or ``bytes`` (requests
    takes both) in any case."""
    return any(v is not None and is_name(k, name) for k, v in headers.items())


def is_name(candidate: t.Any, name: str) -> bool:
    """Whether the header name ``candidate`` (``str`` or ``bytes``) is ``name``,
    in any case."""
    if isinstance(candidate, bytes | bytearray):
        candidate = bytes(candidate).decode("latin-1")
    return isinstance(candidate, str) and candidate.lower() == name.lower()
