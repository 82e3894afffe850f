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

The protocol is read by :mod:`tests.support.pgwire` (as the reliability suite's
commit cutter reads it), one thread per connection waiting on both sockets, so the
order of what it sees is the order on the wire. An encrypted connection (the
server accepting ``SSLRequest``) cannot be read: its turns are counted by bytes
alone.
"""

from __future__ import annotations

import dataclasses
import socket

from tests.support.pgwire import Link, PgProxy

# Messages that ask the server for nothing new: Sync and Flush.
_NO_REQUEST = (b"S", b"H")


@dataclasses.dataclass(eq=False)
class _Link(Link):
    exchanges: int = 0
    #: The server answered since the client's last exchange began (or nothing was sent yet).
    replied: bool = True
    current: list[str] | None = None  # the captured exchange (while capturing)


class CountingProxy(PgProxy[_Link]):
    """Forwards 127.0.0.1:``port`` to ``database_url``'s server, counting exchanges."""

    thread_name = "wire"

    def __init__(self, database_url: str) -> None:
        self._counted: list[_Link] = []  # every connection, closed ones too
        self._capturing = False
        #: The exchanges captured since the last ``reset(capture=True)``, each the
        #: statements sent in it (see the module docstring for their marks).
        self.captured: list[list[str]] = []
        super().__init__(database_url)

    @property
    def exchanges(self) -> int:
        """Exchanges since the last :meth:`reset`, over every connection."""
        with self._lock:
            return sum(link.exchanges for link in self._counted)

    def reset(self, *, capture: bool = False) -> None:
        """Count from zero; keep the statements sent from now on if ``capture``."""
        with self._lock:
            for link in self._counted:
                link.exchanges = 0
                link.current = None
            self._capturing = capture
            self.captured = []

    # -- reading ---------------------------------------------------------------

    def _link(self, client: socket.socket, upstream: socket.socket) -> _Link:
        link = _Link(client, upstream)
        with self._lock:
            self._counted.append(link)
        return link

    def _from_server(self, link: _Link, data: bytes) -> None:
        with self._lock:
            link.wire.answered(data)
            link.replied = True

    def _from_client(self, link: _Link, data: bytes) -> bool:
        with self._lock:
            if link.wire.opaque and link.replied:  # unread: each turn counted
                self._begin_exchange(link)
            for kind, body in link.wire.messages(data):
                if kind not in _NO_REQUEST and link.replied:
                    self._begin_exchange(link)
                self._note(link, kind, body)
        return super()._from_client(link, data)

    def _begin_exchange(self, link: _Link) -> None:
        link.exchanges += 1
        link.replied = False
        if self._capturing:
            link.current = []
            self.captured.append(link.current)

    def _note(self, link: _Link, kind: bytes, body: bytes) -> None:
        """Keep, while capturing, the statements ``kind``/``body`` sends, as shown."""
        statement = link.wire.follow(kind, body)
        if statement is None or not self._capturing or link.current is None:
            return
        text = _shown(statement.text)
        name = statement.name.decode("utf-8", "replace")
        if statement.how == "query":
            link.current.extend(part.strip() for part in text.split("; ") if part.strip())
        elif statement.how == "parse":
            link.current.append(f"[parse] {text}")
        else:  # prepare, prepared
            link.current.append(f"[{statement.how} {name}] {text}")


def _shown(text: bytes | None) -> str:
    if text is None:
        return "(prepared before the proxy saw it)"
    return " ".join(text.decode("utf-8", "replace").split())
