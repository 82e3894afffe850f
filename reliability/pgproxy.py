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
a connection that negotiates it anyway is forwarded unread and never cut. The
protocol is read by :mod:`tests.support.pgwire` (as the benchmarks' counting
proxy reads it), one thread per connection waiting on both sockets, so what it
sees is in wire order.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import re
import socket
import struct
import time
import typing as t

from tests.support.pgwire import Link, PgProxy, close_sockets, cstring

MODES = ("answered", "sent", "withheld")

_UUID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
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


@dataclasses.dataclass(eq=False)
class _Link(Link):
    #: Since the transaction's BEGIN: keys seen, and whether it wrote the ledger.
    keys: set[bytes] = dataclasses.field(default_factory=set)
    work: bool = False
    cut: str | None = None  # the mode, once this chunk's COMMIT was drawn for a cut


class CommitCutter(PgProxy[_Link]):
    """Forwards 127.0.0.1:``port`` to ``database_url``'s server, cutting ``rate``
    of the keyed ``COMMIT`` s (see the module docstring), at most ``limit`` of
    them; ``modes`` drawn from, seeded by ``seed``. ``table``: the table whose
    ``INSERT`` marks a transaction as carrying the work (:attr:`Cut.work`);
    ``work_only``: cut only those; ``record_only``: only the others (a
    completion after the view committed its work itself). ``skip``: the first
    ``skip`` candidates pass uncut. ``plan``: instead of drawing, the mode for
    each candidate in turn (``None``: it passes); past its end none is cut."""

    thread_name = "pgproxy"

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
        record_only: bool = False,
        skip: int = 0,
        plan: t.Sequence[str | None] | None = None,
    ) -> None:
        self.rate, self.modes, self.limit = rate, modes, limit
        self._drawn = 0
        self.work_only, self.record_only = work_only, record_only
        self._skip = skip
        self._plan = list(plan) if plan is not None else None
        self._table = table.encode()
        self._rng = random.Random(seed)
        #: Every cut, in order.
        self.cuts: list[Cut] = []
        #: ``COMMIT`` s seen: of a keyed transaction (candidates), of any.
        self.commits: collections.Counter[str] = collections.Counter()
        #: Connections whose encryption kept them unread (never cut).
        self.opaque = 0
        super().__init__(database_url)

    def url(self, **query: str) -> str:
        """The database URL, pointed at this proxy, in the clear."""
        return super().url(sslmode="disable", gssencmode="disable", **query)

    # -- reading -----------------------------------------------------------------

    def _link(self, client: socket.socket, upstream: socket.socket) -> _Link:
        return _Link(client, upstream)

    def _from_server(self, link: _Link, data: bytes) -> None:
        if link.wire.answered(data):
            with self._lock:
                self.opaque += 1

    def _from_client(self, link: _Link, data: bytes) -> bool:
        for kind, body in link.wire.messages(data):
            if kind == b"B":  # the values bound: a key may be one of them
                link.keys.update(_UUID.findall(body))
            statement = link.wire.follow(kind, body)
            if statement is not None and statement.how != "prepare":
                self._statement(link, statement.text or b"")
        if link.cut == "sent":
            # A reset, not a FIN after the data, set before the COMMIT goes so
            # the two follow closely: the server may read the COMMIT before the
            # reset, or may not.
            link.upstream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        if link.cut != "withheld":
            link.upstream.sendall(data)
        if link.cut is None:
            return True
        self._cut(link, link.cut)
        return False

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
                    wanted = not (self.work_only and not link.work) and not (
                        self.record_only and link.work
                    )
                    if wanted and self._skip > 0:
                        self._skip -= 1
                        wanted = False
                    if wanted and self._plan is not None:
                        link.cut = self._plan.pop(0) if self._plan else None
                        self._drawn += link.cut is not None
                    elif room and wanted and self._rng.random() < self.rate:
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
        close_sockets(link.client, link.upstream)
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
                said = cstring(body, 0)[0].decode("ascii", "replace")
            elif kind == b"E":
                said = "error"
            elif kind == b"Z":  # ReadyForQuery: the answer is whole
                return said
    return said
