"""A PostgreSQL-aware TCP proxy that puts commits in doubt, on purpose.

It stands between the app and its PostgreSQL and reads the client's side of the
protocol (and the server's, where it waits for an answer). On a random share of
the ``COMMIT`` s that end a transaction carrying an ``Idempotency-Key``, it cuts
that connection on both sides without passing the server's answer on: the app
sees its connection drop after sending ``COMMIT``, the case a network or a
database restart makes rarely and this makes at will. Three ways, drawn per cut:

* ``answered``: the proxy waits for the server's answer to the ``COMMIT`` (up
  to ``ReadyForQuery``), keeps it, and then cuts: the commit happened (the
  answer it kept says so: ``COMMIT``, or ``ROLLBACK`` for a transaction already
  failed), and the app never hears it;
* ``sent``: the proxy cuts right after the ``COMMIT`` left, resetting the
  server's side (``SO_LINGER`` 0): whether the server read the ``COMMIT`` before
  the reset is a race, so the commit may or may not have happened (under load
  the proxy's thread is often slow enough between the two that it happened);
* ``withheld``: the proxy never forwards the ``COMMIT`` and cuts: the server
  rolls the transaction back when the connection goes. To the app this looks
  the same as the two above (its ``COMMIT`` went out, the connection dropped);
  the commit surely did not happen.

What a ``COMMIT`` looks like on the wire: psycopg2 sends its ``commit()`` as the
simple query ``COMMIT`` (a ``Q`` message), and so does psycopg 3 outside
pipeline mode; in pipeline mode psycopg 3 sends it as an extended query
(``Parse``/``Bind``/``Execute`` of ``COMMIT``, then ``Sync``), which is caught at
the ``Execute`` and cut once the chunk holding it has been forwarded. The keys of
a transaction are the UUIDs its statements and bound values carry since its
``BEGIN``: the reliability app's keys are UUIDs, so each cut names the request
it hit.

The proxy asks for no encryption (the URL it hands out says ``sslmode=disable``);
a connection that negotiates it anyway is forwarded unread and never cut. One
thread per connection waits on both sockets, so what it sees is in wire order.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import random
import re
import selectors
import socket
import struct
import threading
import time

import sqlalchemy as sa

from tests.support.tcp_proxy import upstream_of

MODES = ("answered", "sent", "withheld")

_UUID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_NEGOTIATIONS = {80877103, 80877104}  # SSLRequest, GSSENCRequest
#: How long ``answered`` waits for the server's answer before cutting anyway.
ANSWER_WAIT = 5.0


@dataclasses.dataclass
class Cut:
    """One ``COMMIT`` whose answer the app never got."""

    mode: str  # "answered", "sent" or "withheld"
    #: The UUIDs (keys) the transaction carried: one, for a request's commit.
    keys: frozenset[str]
    #: The transaction inserted into the ledger (the request's work), rather
    #: than only the record (a leased route's claim, a release).
    work: bool
    #: ``answered``: the server's answer (its command tag, ``ROLLBACK`` for a
    #: failed transaction, ``error`` or ``none`` when it sent none in time);
    #: ``sent``: ``None``, nobody knows; ``withheld``: ``"not sent"``.
    server_said: str | None
    at: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass
class _Link:
    client: socket.socket
    upstream: socket.socket
    pending: bytes = b""
    startup: bool = True
    negotiating: bool = False
    opaque: bool = False
    #: Since the transaction's BEGIN: keys seen, and whether it wrote the ledger.
    keys: set[bytes] = dataclasses.field(default_factory=set)
    work: bool = False
    prepared: dict[bytes, bytes] = dataclasses.field(default_factory=dict)
    unnamed: bytes = b""
    portal: bytes = b""
    cut: str | None = None  # the mode, once this chunk's COMMIT was drawn for a cut


class CommitCutter:
    """Forwards 127.0.0.1:``port`` to ``database_url``'s server, cutting ``rate``
    of the keyed ``COMMIT`` s (see the module docstring), at most ``limit`` of
    them; ``modes`` drawn from, seeded by ``seed``. ``table``: the table whose
    ``INSERT`` marks a transaction as carrying the work (:attr:`Cut.work`);
    ``work_only``: cut only those."""

    def __init__(
        self,
        database_url: str,
        *,
        rate: float,
        seed: int,
        modes: tuple[str, ...] = MODES,
        limit: int | None = None,
        table: str = "reliability_ledger",
        work_only: bool = False,
    ) -> None:
        self.database_url = database_url
        self.rate, self.modes, self.limit = rate, modes, limit
        self._drawn = 0
        self.work_only = work_only
        self._table = table.encode()
        self._rng = random.Random(seed)
        self._upstream = upstream_of(database_url)
        self._lock = threading.Lock()
        self._links: list[_Link] = []
        self._threads: list[threading.Thread] = []
        self._stopped = threading.Event()
        #: Every cut, in order.
        self.cuts: list[Cut] = []
        #: ``COMMIT`` s seen: of a keyed transaction (candidates), of any.
        self.commits: collections.Counter[str] = collections.Counter()
        #: Connections whose encryption kept them unread (never cut).
        self.opaque = 0
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self._listener.settimeout(0.1)
        self.port: int = self._listener.getsockname()[1]
        accept = threading.Thread(target=self._accept, daemon=True, name="pgproxy-accept")
        self._threads.append(accept)
        accept.start()

    def url(self) -> str:
        """The database URL, pointed at this proxy, in the clear."""
        url = sa.make_url(self.database_url)
        query = {k: v for k, v in url.query.items() if k != "host"}
        query.update(sslmode="disable", gssencmode="disable")
        return url.set(host="127.0.0.1", port=self.port, query=query).render_as_string(
            hide_password=False
        )

    def close(self) -> None:
        self._stopped.set()
        with self._lock:
            links = list(self._links)
        for link in links:
            _close(link.client, link.upstream)
        for thread in list(self._threads):
            thread.join(5)
        self._listener.close()

    def __enter__(self) -> CommitCutter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
            link = _Link(client, upstream)
            thread = threading.Thread(target=self._serve, args=(link,), daemon=True)
            with self._lock:
                self._links.append(link)
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(thread)
            thread.start()

    def _serve(self, link: _Link) -> None:
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(link.client, selectors.EVENT_READ, True)
                selector.register(link.upstream, selectors.EVENT_READ, False)
                while not self._stopped.is_set():
                    for ready, _ in selector.select(0.1):
                        from_client = bool(ready.data)
                        source = link.client if from_client else link.upstream
                        data = source.recv(65536)
                        if not data:
                            return
                        if not from_client:
                            self._from_server(link, data)
                            link.client.sendall(data)
                            continue
                        if not link.opaque:
                            link.pending = self._take_messages(link, link.pending + data)
                        if link.cut == "sent":
                            # A reset, not a FIN after the data, set before the
                            # COMMIT goes so the two follow closely: the server
                            # may read the COMMIT before the reset, or may not.
                            link.upstream.setsockopt(
                                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                            )
                        if link.cut != "withheld":
                            link.upstream.sendall(data)
                        if link.cut is not None:
                            self._cut(link, link.cut)
                            return
        except OSError:
            pass
        finally:
            _close(link.client, link.upstream)
            with self._lock:
                if link in self._links:
                    self._links.remove(link)

    def _from_server(self, link: _Link, data: bytes) -> None:
        if link.negotiating:  # the one-byte answer to SSLRequest / GSSENCRequest
            link.negotiating = False
            if data[:1] != b"N":
                link.opaque = True
                with self._lock:
                    self.opaque += 1

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
                if link.negotiating:
                    return buffer  # nothing more comes before the one-byte answer
                continue
            self._note(link, kind, body)

    def _note(self, link: _Link, kind: bytes, body: bytes) -> None:
        if kind == b"Q":  # Query: text
            self._statement(link, _cstring(body, 0)[0])
        elif kind == b"P":  # Parse: name, text, parameter types
            name, at = _cstring(body, 0)
            text = _cstring(body, at)[0]
            if name:
                link.prepared[name] = text
            else:
                link.unnamed = text
        elif kind == b"B":  # Bind: portal, statement, parameters (the values)
            _, at = _cstring(body, 0)
            name = _cstring(body, at)[0]
            link.portal = link.prepared.get(name, b"") if name else link.unnamed
            link.keys.update(_UUID.findall(body))
        elif kind == b"E":  # Execute the portal bound last
            self._statement(link, link.portal)
        elif kind == b"C" and body[:1] == b"S":  # Close a prepared statement
            link.prepared.pop(_cstring(body, 1)[0], None)

    def _statement(self, link: _Link, text: bytes) -> None:
        word = text.strip().rstrip(b";").strip().upper()
        if word in (b"BEGIN", b"START TRANSACTION") or word.startswith(b"BEGIN "):
            link.keys, link.work = set(), False
            return
        if word == b"COMMIT":
            with self._lock:
                self.commits["all"] += 1
                if link.keys:
                    self.commits["keyed"] += 1
                    room = self.limit is None or self._drawn < self.limit
                    wanted = link.work or not self.work_only
                    if room and wanted and self._rng.random() < self.rate:
                        self._drawn += 1
                        link.cut = self._rng.choice(self.modes)
            return
        if word in (b"ROLLBACK", b"ABORT"):
            link.keys, link.work = set(), False
            return
        link.keys.update(_UUID.findall(text))
        if b"INSERT INTO " + self._table in text:
            link.work = True

    def _cut(self, link: _Link, mode: str) -> None:
        """The ``COMMIT`` has been forwarded (or withheld): cut, after its answer
        (``answered``) or at once, resetting the server's side (``sent``)."""
        said: str | None = None
        if mode == "answered":
            said = _await_answer(link.upstream, ANSWER_WAIT)
        elif mode == "withheld":
            said = "not sent"
        else:  # sent: the reset goes now (SO_LINGER 0, set before the COMMIT went)
            link.upstream.close()
        _close(link.client, link.upstream)
        cut = Cut(mode, frozenset(k.decode() for k in link.keys), link.work, said, time.monotonic())
        with self._lock:
            self.cuts.append(cut)


def _await_answer(upstream: socket.socket, wait: float) -> str:
    """Read the server's answer to the forwarded ``COMMIT`` up to its
    ``ReadyForQuery``: its command tag, ``error``, or ``none`` (no answer in
    ``wait`` seconds, or the connection gone)."""
    deadline = time.monotonic() + wait
    buffer, said = b"", "none"
    while time.monotonic() < deadline:
        upstream.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            data = upstream.recv(65536)
        except OSError:
            return said
        if not data:
            return said
        buffer += data
        while len(buffer) >= 5:
            length = struct.unpack("!I", buffer[1:5])[0] + 1
            if len(buffer) < length:
                break
            kind, body, buffer = buffer[:1], buffer[5:length], buffer[length:]
            if kind == b"C":  # CommandComplete: the tag
                said = _cstring(body, 0)[0].decode("ascii", "replace")
            elif kind == b"E":
                said = "error"
            elif kind == b"Z":  # ReadyForQuery: the answer is whole
                return said
    return said


def _cstring(body: bytes, at: int) -> tuple[bytes, int]:
    """The NUL-terminated bytes at ``at`` in ``body``, and where the next field starts."""
    end = body.find(b"\0", at)
    end = len(body) if end < 0 else end
    return body[at:end], end + 1


def _close(*socks: socket.socket) -> None:
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()
