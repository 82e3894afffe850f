"""A TCP proxy on 127.0.0.1 that counts database round trips on the wire.

A round trip (an exchange) is a turn of the conversation: the client sends, then
waits for the reply before it sends again. The proxy counts, per connection, each
time the client sends after having received a reply (or sends first); bytes
forwarded in several pieces within one turn count once. psycopg2 speaks the
simple query protocol, so each statement is one exchange, and so is its ``BEGIN``
(sent on its own before the transaction's first statement) and ``COMMIT``.

With :meth:`CountingProxy.capture` on, the text of each simple query (``Q``
message) the clients send is kept, to show what one request's exchanges are.

One thread per connection waits on both sockets, so the order of what it sees is
the order on the wire.
"""

from __future__ import annotations

import contextlib
import dataclasses
import selectors
import socket
import struct
import threading

import sqlalchemy as sa

from tests.tcp_proxy import upstream_of


@dataclasses.dataclass
class _Link:
    client: socket.socket
    upstream: socket.socket
    exchanges: int = 0
    awaiting_reply: bool = False
    pending: bytes = b""  # client bytes of a message not yet whole (while capturing)


class CountingProxy:
    """Forwards 127.0.0.1:``port`` to ``database_url``'s server, counting exchanges."""

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url
        self._upstream = upstream_of(database_url)
        self._lock = threading.Lock()
        self._links: list[_Link] = []
        self._capturing = False
        self.statements: list[str] = []
        self._stopped = threading.Event()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(0.1)
        self.port: int = self._listener.getsockname()[1]
        self._threads = [threading.Thread(target=self._accept, daemon=True, name="wire-accept")]
        self._threads[0].start()

    def url(self) -> str:
        """The database URL, pointed at this proxy."""
        url = sa.make_url(self.database_url)
        query = {k: v for k, v in url.query.items() if k != "host"}
        return url.set(host="127.0.0.1", port=self.port, query=query).render_as_string(
            hide_password=False
        )

    @property
    def exchanges(self) -> int:
        """Exchanges since the last :meth:`reset`, over every connection."""
        with self._lock:
            return sum(link.exchanges for link in self._links)

    def reset(self, *, capture: bool = False) -> None:
        """Count from zero; keep the statements sent from now on if ``capture``."""
        with self._lock:
            for link in self._links:
                link.exchanges = 0
                link.pending = b""
            self._capturing = capture
            self.statements = []

    def close(self) -> None:
        self._stopped.set()
        for thread in self._threads:
            thread.join(5)
        self._listener.close()

    def __enter__(self) -> CountingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- machinery ---------------------------------------------------------------

    def _connect_upstream(self) -> socket.socket:
        if isinstance(self._upstream, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(self._upstream)
        else:
            sock = socket.create_connection(self._upstream)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                upstream = self._connect_upstream()
            except OSError:
                client.close()  # the client sees the connection refused
                continue
            link = _Link(client, upstream)
            with self._lock:
                self._links.append(link)
            thread = threading.Thread(target=self._serve, args=(link,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, link: _Link) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(link.client, selectors.EVENT_READ, True)
            selector.register(link.upstream, selectors.EVENT_READ, False)
            try:
                while not self._stopped.is_set():
                    for ready, _ in selector.select(0.1):
                        from_client = bool(ready.data)
                        source = link.client if from_client else link.upstream
                        data = source.recv(65536)
                        if not data:
                            return
                        self._seen(link, data, from_client=from_client)
                        (link.upstream if from_client else link.client).sendall(data)
            except OSError:
                pass
            finally:
                for sock in (link.client, link.upstream):
                    with contextlib.suppress(OSError):
                        sock.close()

    def _seen(self, link: _Link, data: bytes, *, from_client: bool) -> None:
        with self._lock:
            if not from_client:
                link.awaiting_reply = False
                return
            if not link.awaiting_reply:
                link.exchanges += 1
                link.awaiting_reply = True
            if self._capturing:
                link.pending += data
                link.pending = self._take_queries(link.pending)

    def _take_queries(self, buffer: bytes) -> bytes:
        """Keep the text of every whole ``Q`` message in ``buffer``; the rest back."""
        while len(buffer) >= 5:
            kind, length = buffer[:1], struct.unpack("!I", buffer[1:5])[0]
            if len(buffer) < 1 + length:
                break
            if kind == b"Q":
                text = buffer[5 : 1 + length].rstrip(b"\0").decode("utf-8", "replace")
                self.statements.append(" ".join(text.split()))
            buffer = buffer[1 + length :]
        return buffer
