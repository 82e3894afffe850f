"""PostgreSQL's wire protocol, the client's side, read as it passes through a
proxy on 127.0.0.1: the one reader behind the benchmarks' counting proxy
(``bench/wire.py``) and the reliability suite's commit cutter
(``reliability/pgproxy.py``).

* :class:`ClientStream` cuts one connection's client bytes into whole
  messages, however they arrive, and follows the statements they parse, bind
  and execute: a simple query (``Q``) runs its text; an extended one runs at
  ``Execute`` the statement its last ``Bind`` bound, the unnamed one (parsed
  just before) or one prepared under a name, followed from the connection's
  start. Before the startup message the client's requests have no type byte;
  an ``SSLRequest`` or ``GSSENCRequest`` answered other than ``N`` makes the
  rest of the connection encrypted, and it is no longer read (``opaque``).
* :class:`PgProxy` forwards 127.0.0.1:``port`` to a database URL's server with
  one thread per connection waiting on both sockets, so the order of what a
  subclass sees is the order on the wire; a subclass reads (and may hold back)
  what passes.

No library is used for this: the few message kinds read here take a length
prefix and a NUL-terminated string or two, and the PostgreSQL packages on the
index are servers or drivers, not readers of a stream in passing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import selectors
import socket
import struct
import threading
import typing as t

import sqlalchemy as sa

from tests.support.tcp_proxy import upstream_of

#: Requests before the startup message (no type byte) answered by one byte:
#: ``S``/``G`` (encryption follows) or ``N`` (go on in the clear).
NEGOTIATIONS = frozenset({80877103, 80877104})  # SSLRequest, GSSENCRequest


@dataclasses.dataclass(frozen=True)
class Statement:
    """A statement the client sent: its text (``None`` for a name prepared
    before the proxy saw the connection) and how it travelled: ``query`` (a
    simple query, values in the text, maybe several ``;``-joined),
    ``parse`` (the unnamed statement, values sent apart as ``$n``),
    ``prepare`` (parsed under ``name``, not run yet) or ``prepared`` (run by
    ``name``: no text sent)."""

    text: bytes | None
    how: str
    name: bytes = b""


class ClientStream:
    """The client's side of one connection, read message by message."""

    def __init__(self) -> None:
        self.pending = b""  # bytes of a message not yet whole
        self.startup = True  # before the startup message: messages without a type byte
        self.negotiating = False  # an encryption request awaits its one-byte answer
        self.opaque = False  # encrypted: not read
        self.prepared: dict[bytes, bytes] = {}  # statements prepared under a name
        self.unnamed = b""  # the unnamed statement's text
        self.portal: Statement | None = None  # what the last Bind bound

    def answered(self, data: bytes) -> bool:
        """The server sent ``data``; whether it made the connection opaque
        (an encryption request answered other than ``N``)."""
        if not self.negotiating:
            return False
        self.negotiating = False
        self.opaque = data[:1] != b"N"
        return self.opaque

    def messages(self, data: bytes) -> list[tuple[bytes, bytes]]:
        """The messages ``data`` completes, in order, as ``(kind, body)``
        (kind ``b""`` before the startup message); the rest of ``data`` is
        kept for the next call. None once opaque; none past an encryption
        request, since the client sends nothing more before its answer."""
        if self.opaque:
            return []
        buffer, whole = self.pending + data, []
        while True:
            if self.startup:  # Int32 length (itself included), Int32 code, ...
                if len(buffer) < 8:
                    break
                length, code = struct.unpack("!II", buffer[:8])
                kind, body = b"", b""
            else:  # Byte1 kind, Int32 length (itself included), body
                if len(buffer) < 5:
                    break
                length = struct.unpack("!I", buffer[1:5])[0] + 1
                kind, body = buffer[:1], buffer[5:length]
            if len(buffer) < length:
                break
            buffer = buffer[length:]
            whole.append((kind, body))
            if self.startup:
                self.negotiating = code in NEGOTIATIONS
                self.startup = self.negotiating
                if self.negotiating:
                    break
        self.pending = buffer
        return whole

    def follow(self, kind: bytes, body: bytes) -> Statement | None:
        """What message ``kind``/``body`` sends to run (a simple query, or an
        ``Execute``: the statement bound last) or prepares under a name;
        ``None`` for any other message (a ``Bind`` or ``Close`` is noted)."""
        if kind == b"Q":  # Query: text
            return Statement(cstring(body, 0)[0], "query")
        if kind == b"P":  # Parse: name, text, parameter types
            name, at = cstring(body, 0)
            text = cstring(body, at)[0]
            if not name:
                self.unnamed = text
                return None
            self.prepared[name] = text
            return Statement(text, "prepare", name)
        if kind == b"B":  # Bind: portal, statement, parameters
            name = cstring(body, cstring(body, 0)[1])[0]
            self.portal = (
                Statement(self.prepared.get(name), "prepared", name)
                if name
                else Statement(self.unnamed, "parse")
            )
        elif kind == b"E":  # Execute the portal bound last (the drivers use the unnamed one)
            return self.portal
        elif kind == b"C" and body[:1] == b"S":  # Close a prepared statement
            self.prepared.pop(cstring(body, 1)[0], None)
        return None


def cstring(body: bytes, at: int) -> tuple[bytes, int]:
    """The NUL-terminated bytes at ``at`` in ``body``, and where the next field starts."""
    end = body.find(b"\0", at)
    end = len(body) if end < 0 else end
    return body[at:end], end + 1


@dataclasses.dataclass(eq=False)
class Link:
    """One proxied connection: the app's socket, the server's, and the
    client's side as read."""

    client: socket.socket
    upstream: socket.socket
    wire: ClientStream = dataclasses.field(default_factory=ClientStream)


L = t.TypeVar("L", bound=Link)


class PgProxy(t.Generic[L]):
    """Forwards 127.0.0.1:``port`` to ``database_url``'s server. A subclass
    makes each connection's :class:`Link` (:meth:`_link`) and reads what passes
    (:meth:`_from_client`, :meth:`_from_server`)."""

    thread_name = "pgwire"

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url
        self._upstream = upstream_of(database_url)
        self._lock = threading.Lock()
        self._links: list[L] = []  # the connections open
        self._threads: list[threading.Thread] = []
        self._stopped = threading.Event()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self._listener.settimeout(0.1)
        self.port: int = self._listener.getsockname()[1]
        accept = threading.Thread(
            target=self._accept, daemon=True, name=f"{self.thread_name}-accept"
        )
        self._threads.append(accept)
        accept.start()

    def url(self, **query: str) -> str:
        """The database URL, pointed at this proxy, with ``query`` added."""
        url = sa.make_url(self.database_url)
        kept = {k: v for k, v in url.query.items() if k != "host"}
        return url.set(host="127.0.0.1", port=self.port, query={**kept, **query}).render_as_string(
            hide_password=False
        )

    def close(self) -> None:
        self._stopped.set()
        with self._lock:
            links = list(self._links)
        for link in links:
            close_sockets(link.client, link.upstream)
        for thread in list(self._threads):
            thread.join(5)
        self._listener.close()

    def __enter__(self) -> t.Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what a subclass reads ---------------------------------------------------

    def _link(self, client: socket.socket, upstream: socket.socket) -> L:
        raise NotImplementedError

    def _from_client(self, link: L, data: bytes) -> bool:
        """``data`` came from the app: forward it; whether to go on serving."""
        link.upstream.sendall(data)
        return True

    def _from_server(self, link: L, data: bytes) -> None:
        """``data`` came from the server, and goes to the app after this."""
        link.wire.answered(data)

    # -- machinery ---------------------------------------------------------------

    def _connect_upstream(self) -> socket.socket:
        if isinstance(self._upstream, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(5)
            sock.connect(self._upstream)
        else:
            sock = socket.create_connection(self._upstream, timeout=5)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        return sock

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            client.settimeout(None)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                upstream = self._connect_upstream()
            except OSError:
                client.close()  # the app sees its connection refused
                continue
            link = self._link(client, upstream)
            thread = threading.Thread(target=self._serve, args=(link,), daemon=True)
            with self._lock:
                self._links.append(link)
                self._threads = [th for th in self._threads if th.is_alive()]
                self._threads.append(thread)
            thread.start()

    def _serve(self, link: L) -> None:
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(link.client, selectors.EVENT_READ, True)
                selector.register(link.upstream, selectors.EVENT_READ, False)
                while not self._stopped.is_set():
                    for ready, _ in selector.select(0.1):
                        from_client = bool(ready.data)
                        data = (link.client if from_client else link.upstream).recv(65536)
                        if not data:
                            return
                        if from_client:
                            if not self._from_client(link, data):
                                return
                        else:
                            self._from_server(link, data)
                            link.client.sendall(data)
        except OSError:
            pass
        finally:
            close_sockets(link.client, link.upstream)
            with self._lock:
                if link in self._links:
                    self._links.remove(link)


def close_sockets(*socks: socket.socket) -> None:
    """Shut down (waking a thread blocked on it) and close each of ``socks``."""
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()
