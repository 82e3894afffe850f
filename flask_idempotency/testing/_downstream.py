"""The ``downstream`` fixture's object: a fake HTTP service that records calls.

It behaves like an idempotent downstream (a card processor): the first
successful call with an ``Idempotency-Key`` makes an effect, later calls with
that key get the same answer and make nothing; a call without a key makes an
effect each time. The key is read from the header the served app forwards it in
(its ``IDEMPOTENCY_HEADER``; ``Idempotency-Key`` too). Calls the served app makes
for a client request, on the request's thread over ``http.client``, carry
``Idempotency-Kit-Origin`` (the client's key), so effects count per client key;
a call without it cannot be attributed to a key.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time
import typing as t
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ._control import ORIGIN_HEADER

#: The longest a stall or late answer holds a call (a bound on every wait).
MAX_HOLD = 120.0


@dataclasses.dataclass(frozen=True)
class DownstreamCall:
    """One call the fake downstream received."""

    method: str
    path: str
    headers: dict[str, str]
    #: Its ``Idempotency-Key`` header, or ``None``.
    key: str | None
    #: The served app's client key it was made for (``Idempotency-Kit-Origin``), or ``None``.
    origin: str | None
    body: bytes
    #: When it arrived (``time.time()``).
    time: float
    #: The status answered.
    status: int
    #: The effect it made or repeated (see :class:`Effect`), ``None`` when it failed.
    effect: int | None
    #: The header ``key`` is read from (the served app's ``IDEMPOTENCY_HEADER``).
    key_header: str = "Idempotency-Key"

    def json(self) -> t.Any:
        return json.loads(self.body)


@dataclasses.dataclass(frozen=True)
class Effect:
    """What the downstream really did once: ``number`` counts from 1."""

    number: int
    path: str
    key: str | None
    origin: str | None
    answer: t.Any


Answer = t.Mapping[str, t.Any] | t.Callable[[Effect], t.Any]


class Downstream:
    """The fake service on ``url`` (127.0.0.1, a free port). Every hold is
    bounded and ends when the service closes.

    ``key_header`` names the header a call's key is read from (then
    ``Idempotency-Key``); the ``api`` fixture sets it to the app's
    ``IDEMPOTENCY_HEADER``, the header ``idem.forward_headers()`` uses.
    """

    def __init__(self, key_header: str = "Idempotency-Key") -> None:
        self.key_header = key_header
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._calls: list[DownstreamCall] = []
        self._effects: dict[tuple[str, str | None, int], Effect] = {}
        self._by_key: dict[tuple[str, str], Effect] = {}
        self._failures: collections.deque[int] = collections.deque()
        self._stalls: collections.deque[float] = collections.deque()
        self._late: collections.deque[float] = collections.deque()
        self._answers: dict[str, tuple[int, Answer | None]] = {}
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self._server.server_port}"

    # -- what a test commands --------------------------------------------------

    def fail_next(self, n: int = 1, status: int = 503) -> None:
        """The next ``n`` calls answer ``status`` and make no effect."""
        with self._lock:
            self._failures.extend([status] * n)

    def stall_next(self, seconds: float) -> None:
        """The next call is held ``seconds`` before it is handled (and makes its
        effect then, whether its caller still waits or not)."""
        with self._lock:
            self._stalls.append(min(seconds, MAX_HOLD))

    def answer_late(self, seconds: float) -> None:
        """The next call makes its effect at once and is answered ``seconds`` later."""
        with self._lock:
            self._late.append(min(seconds, MAX_HOLD))

    def answer(self, path: str, json: Answer | None = None, *, status: int = 200) -> None:
        """How successful calls to ``path`` are answered: ``status`` and the JSON
        ``json`` (a mapping, or a function of the :class:`Effect`). By default
        200 and ``{"id": "effect-<n>", "effect": <n>}``."""
        with self._lock:
            self._answers[path] = (status, json)

    # -- what a test reads -----------------------------------------------------

    def calls(
        self, path: str | None = None, key: str | None = None, *, origin: str | None = None
    ) -> list[DownstreamCall]:
        """The calls received, oldest first; only those to ``path``, with
        Idempotency-Key ``key``, or made for client key ``origin``, if given."""
        with self._lock:
            calls = list(self._calls)
        return [
            c
            for c in calls
            if (path is None or c.path == path)
            and (key is None or c.key == key)
            and (origin is None or c.origin == origin)
        ]

    def effects(self, origin_key: str | None = None, path: str | None = None) -> list[Effect]:
        """The effects made, oldest first; only those made by calls for the
        client key ``origin_key`` (and to ``path``), if given."""
        with self._lock:
            calls = list(self._calls)
            effects = dict(self._effects)
        numbers = {
            c.effect
            for c in calls
            if c.effect is not None
            and (origin_key is None or c.origin == origin_key)
            and (path is None or c.path == path)
        }
        return sorted((e for e in effects.values() if e.number in numbers), key=lambda e: e.number)

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    # -- the service -----------------------------------------------------------

    def _handle(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, bytes, float]:
        key_header = self.key_header
        key = _header(headers, key_header)
        if key is None and key_header.lower() != "idempotency-key":
            key = _header(headers, "Idempotency-Key")
        origin = _header(headers, ORIGIN_HEADER)
        with self._lock:
            stall = self._stalls.popleft() if self._stalls else 0.0
        if stall:
            self._closing.wait(stall)
        with self._lock:
            arrived = time.time()
            late = 0.0
            if self._failures:
                status, effect, answer = self._failures.popleft(), None, {"error": "unavailable"}
            else:
                late = self._late.popleft() if self._late else 0.0
                status = self._answers.get(path, (200, None))[0]
                effect = self._effect_for(path, key, origin)
                answer = effect.answer
            self._calls.append(
                DownstreamCall(
                    method=method,
                    path=path,
                    headers=headers,
                    key=key,
                    origin=origin,
                    body=body,
                    time=arrived,
                    status=status,
                    effect=effect.number if effect is not None else None,
                    key_header=key_header,
                )
            )
        data = json.dumps(answer).encode("utf-8")
        return status, data, late

    def _effect_for(self, path: str, key: str | None, origin: str | None) -> Effect:
        if key is not None and (path, key) in self._by_key:
            return self._by_key[(path, key)]  # the same key: the same effect, answered again
        number = len(self._effects) + 1
        effect = Effect(number=number, path=path, key=key, origin=origin, answer=None)
        template = self._answers.get(path, (200, None))[1]
        if template is None:
            answer: t.Any = {"id": f"effect-{number}", "effect": number}
        elif callable(template):
            answer = template(effect)
        else:
            answer = dict(template)
        effect = dataclasses.replace(effect, answer=answer)
        self._store(effect)
        return effect

    def _store(self, effect: Effect) -> None:
        self._effects[(effect.path, effect.key, effect.number)] = effect
        if effect.key is not None:
            self._by_key[(effect.path, effect.key)] = effect

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        downstream = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                path = self.path.split("?", 1)[0]
                headers = {k: v for k, v in self.headers.items()}
                status, data, late = downstream._handle(self.command, path, headers, body)
                if late:
                    downstream._closing.wait(late)
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the caller gave up waiting; the effect stands

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any

            def log_message(self, format: str, *args: t.Any) -> None:
                return None

        return Handler


def _header(headers: t.Mapping[str, str], name: str) -> str | None:
    for k, v in headers.items():
        if k.lower() == name.lower():
            value = v.strip()
            if len(value) >= 2 and value.startswith('"') and value.endswith('"'):
                # An RFC 8941 string (idem.forward_headers() sends that form).
                value = value[1:-1].replace('\\"', '"').replace("\\\\", "\\")
            return value or None
    return None
