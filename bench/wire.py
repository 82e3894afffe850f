"""A TCP proxy on 127.0.0.1 that counts database round trips on the wire.

A round trip (an exchange) is a turn of the conversation: the client sends, then
waits for the reply before it sends again. The proxy counts, per connection, each
time the client sends a request after having received a reply (or sends first);
bytes forwarded in several pieces within one turn count once.

It reads the client's side of the PostgreSQL protocol, so it counts the same way
for both drivers:

* psycopg2 speaks the simple query protocol: each statement (or ``;``-joined
  batch) is one ``Q`` message and one exchange, and so is its ``BEGIN`` (sent on
  its own before the transaction's first statement) and ``COMMIT``; so does
  psycopg 3's ``ClientCursor``, which the extension's claim goes through;
* psycopg 3 binds on the server (the extended protocol): a statement is
  ``Parse``/``Bind``/``Describe``/``Execute`` closed by a ``Sync``, one exchange;
  in pipeline mode several statements travel before one ``Sync``, and the server
  answers nothing before it (it flushes its output on ``Sync`` and ``Flush``), so
  the pipeline is one exchange. A ``Sync`` or ``Flush`` alone asks for nothing
  new (psycopg sends the ``Flush`` that ends a pipeline right after its
  ``Sync``, sometimes after the answer has begun): it never starts an exchange.

With :meth:`CountingProxy.reset` ``(capture=True)`` the statements the clients
send are kept, grouped by exchange, each marked with how it travelled: a simple
query as its text (values in it), an extended one as ``[parse] text`` (parsed
here, the values sent apart as ``$n``), ``[prepare NAME] text`` (psycopg 3
preparing it under a name) or ``[prepared NAME] text`` (executed from a
statement prepared earlier on the connection: no text sent, only its name).
Named statements are followed from the connection's start, so a statement
prepared before the capture still shows its text.

One thread per connection waits on both sockets, so the order of what it sees is
the order on the wire. An encrypted connection (the server accepting
``SSLRequest``) cannot be read: its turns are counted by bytes alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import selectors
import socket
import struct
import threading

import sqlalchemy as sa

from tests.support.tcp_proxy import upstream_of

# Requests that come before the startup message, without a type byte: answered by
# one byte ('S'/'G': encryption follows, 'N': go on in the clear).
_NEGOTIATIONS = {80877103, 80877104}  # SSLRequest, GSSENCRequest
# Messages that ask the server for nothing new: Sync and Flush.
_NO_REQUEST = (b"S", b"H")


@dataclasses.dataclass
class _Link:
    client: socket.socket
    upstream: socket.socket
    exchanges: int = 0
    #: The server answered since the client's last exchange began (or nothing was sent yet).
    replied: bool = True
    pending: bytes = b""  # client bytes of a message not yet whole
    startup: bool = True  # before the startup message: messages without a type byte
    negotiating: bool = False  # an SSLRequest or GSSENCRequest awaits its one-byte answer
    opaque: bool = False  # encrypted: not read, each turn counted
    #: Statements prepared under a name on this connection: their text.
    prepared: dict[str, str] = dataclasses.field(default_factory=dict)
    unnamed: str = ""  # the unnamed statement's text
    portal: str = ""  # what the last Bind bound, as shown
    parsed_here: set[str] = dataclasses.field(default_factory=set)  # named Parse, this exchange
    current: list[str] | None = None  # the captured exchange (while capturing)


class CountingProxy:
    """Forwards 127.0.0.1:``port`` to ``database_url``'s server, counting exchanges."""

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url
        self._upstream = upstream_of(database_url)
        self._lock = threading.Lock()
        self._links: list[_Link] = []
        self._capturing = False
        #: The exchanges captured since the last ``reset(capture=True)``, each the
        #: statements sent in it (see the module docstring for their marks).
        self.captured: list[list[str]] = []
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
                link.current = None
            self._capturing = capture
            self.captured = []

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
                if link.negotiating:  # the one-byte answer to SSLRequest/GSSENCRequest
                    link.negotiating = False
                    link.opaque = data[:1] != b"N"
                link.replied = True
                return
            if link.opaque:
                if link.replied:
                    self._begin_exchange(link)
                return
            link.pending = self._take_messages(link, link.pending + data)

    def _begin_exchange(self, link: _Link) -> None:
        link.exchanges += 1
        link.replied = False
        link.parsed_here = set()
        if self._capturing:
            link.current = []
            self.captured.append(link.current)

    def _take_messages(self, link: _Link, buffer: bytes) -> bytes:
        """Read every whole client message in ``buffer``; the rest back."""
        while True:
            if link.startup:  # Int32 length (itself included), Int32 code, ...
                if len(buffer) < 8:
                    return buffer
                length, code = struct.unpack("!II", buffer[:8])
                kind, body = b"", b""
            else:  # Byte1 kind, Int32 length (itself included), body
                if len(buffer) < 5:
                    return buffer
                length = struct.unpack("!I", buffer[1:5])[0] + 1
                kind, body = buffer[:1], buffer[5:length]
            if len(buffer) < length:
                return buffer
            buffer = buffer[length:]
            if link.startup:
                link.negotiating = code in _NEGOTIATIONS
                link.startup = link.negotiating
            if kind not in _NO_REQUEST and link.replied:
                self._begin_exchange(link)
            self._note(link, kind, body)
            if link.opaque or link.negotiating:
                return buffer  # nothing more is sent before the server's answer

    def _note(self, link: _Link, kind: bytes, body: bytes) -> None:
        """Follow the statements ``kind``/``body`` parses, binds and executes."""
        if kind == b"Q":  # Query: text
            text = _shown(_cstring(body, 0)[0])
            self._keep(link, *(part.strip() for part in text.split("; ") if part.strip()))
        elif kind == b"P":  # Parse: name, text, parameter types
            name, at = _cstring(body, 0)
            text = _shown(_cstring(body, at)[0])
            if name:
                link.prepared[name] = text
                link.parsed_here.add(name)
                self._keep(link, f"[prepare {name}] {text}")
            else:
                link.unnamed = text
        elif kind == b"B":  # Bind: portal, statement, parameters
            _, at = _cstring(body, 0)
            name = _cstring(body, at)[0]
            if not name:
                link.portal = f"[parse] {link.unnamed}"
            else:
                text = link.prepared.get(name, "(prepared before the proxy saw it)")
                link.portal = f"[prepared {name}] {text}"
        elif kind == b"E":  # Execute: the portal bound last (psycopg uses the unnamed one)
            self._keep(link, link.portal)
        elif kind == b"C" and body[:1] == b"S":  # Close a statement
            link.prepared.pop(_cstring(body, 1)[0], None)

    def _keep(self, link: _Link, *statements: str) -> None:
        if self._capturing and link.current is not None:
            link.current.extend(statements)


def _cstring(body: bytes, at: int) -> tuple[str, int]:
    """The NUL-terminated string at ``at`` in ``body``, and where the next field starts."""
    end = body.find(b"\0", at)
    end = len(body) if end < 0 else end
    return body[at:end].decode("utf-8", "replace"), end + 1


def _shown(text: str) -> str:
    return " ".join(text.split())
