"""A TCP proxy on 127.0.0.1 that tests can cut, blackhole and heal (the kit's
``fault.database_down``, and the suite's outage tests).

It stands between an app and its real database, so a test can produce the
failures a network or a database restart produces, on real sockets:

* :meth:`TcpProxy.cut`: every connection is closed and new ones are refused
  (the database restarting, or a firewall rejecting); the port stays the
  proxy's meanwhile (bound, not listening), so nothing else can take it and
  the database always comes back on it;
* :meth:`TcpProxy.blackhole`: connections are accepted and kept, but nothing is
  forwarded either way (a network partition: requests hang, nothing fails);
* :meth:`TcpProxy.heal`: forwarding resumes; connections held by the blackhole
  carry on as if the network came back;
* :meth:`TcpProxy.trap_commit`: let the next ``COMMIT`` through (or not) and
  then cut, to lose a commit's reply.

Threads, one per direction of each connection: simple to reason about, and the
few dozen connections a test opens are no load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time

import sqlalchemy as sa

# psycopg2 commits with the simple query "COMMIT": 'Q', length 11, text, NUL.
COMMIT_MESSAGE = b"Q\x00\x00\x00\x0bCOMMIT\x00"

Upstream = tuple[str, int] | str  # (host, port), or the path of a Unix socket


@dataclasses.dataclass
class _Connection:
    client: socket.socket
    upstream: socket.socket | None = None
    closed: bool = False

    def close(self) -> None:
        self.closed = True
        for sock in (self.client, self.upstream):
            if sock is None:
                continue
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in recv()
            with contextlib.suppress(OSError):
                sock.close()


def _connect(upstream: Upstream) -> socket.socket:
    if isinstance(upstream, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        sock.connect(upstream)
    else:
        sock = socket.create_connection(upstream, timeout=5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(None)
    return sock


class TcpProxy:
    """Forwards 127.0.0.1:``port`` to ``upstream`` until told otherwise."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self._lock = threading.Lock()  # guards the listener and the connection list
        self._flowing = threading.Event()
        self._flowing.set()
        self._connections: list[_Connection] = []
        self._stopped = False
        self._trap: tuple[bool, float] | None = None
        self._hold: float | None = None
        self._listener: socket.socket | None = self._listen(0)
        self.port: int = self._listener.getsockname()[1]
        # While cut: the port, bound and not listening (connects are refused).
        self._placeholder: socket.socket | None = None
        self.accepted = 0  # connections accepted, ever
        self.cuts = 0  # times cut() ran
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True, name="proxy")
        self._acceptor.start()

    # -- what a test does ------------------------------------------------------

    def url(self, database_url: str) -> str:
        """``database_url`` with its host and port replaced by this proxy's."""
        url = sa.engine.make_url(database_url)
        query = {k: v for k, v in url.query.items() if k != "host"}
        return url.set(host="127.0.0.1", port=self.port, query=query).render_as_string(
            hide_password=False
        )

    def cut(self) -> None:
        """Close every connection and refuse new ones until :meth:`heal`."""
        with self._lock:
            self.cuts += 1
            self._flowing.clear()
            if self._listener is not None:
                # Hold the port before the listener goes: no moment where
                # another socket could bind it (SO_REUSEPORT lets the two share).
                if self._placeholder is None and not self._stopped:
                    self._placeholder = self._hold_port()
                self._listener.close()  # a connect now gets ECONNREFUSED
                self._listener = None
            connections, self._connections = self._connections, []
        for conn in connections:
            conn.close()

    def blackhole(self) -> None:
        """Accept connections, keep them, forward nothing, until :meth:`heal`."""
        with self._lock:
            self._flowing.clear()
            self._ensure_listening()

    def heal(self) -> None:
        """Forward again; held connections resume where they stopped."""
        with self._lock:
            self._trap = None
            self._ensure_listening()
            self._flowing.set()

    def trap_commit(self, *, deliver: bool, then_cut_after: float = 0.3) -> None:
        """On the next ``COMMIT`` from any client: hold every reply, deliver the
        ``COMMIT`` to the database or not (``deliver``), and cut
        ``then_cut_after`` seconds later. With ``deliver=True`` the transaction
        commits and its client never hears so."""
        with self._lock:
            self._trap = (deliver, then_cut_after)

    def hold_commit(self, seconds: float) -> None:
        """On the next ``COMMIT`` from any client: cut that client off at once (it
        hears "connection lost"), keep the ``COMMIT`` on the wire ``seconds``, then
        deliver it to the database, which commits then unless the transaction was
        ended meanwhile."""
        with self._lock:
            self._hold = seconds

    def flap(self, *, down: float, up: float, until: threading.Event) -> threading.Thread:
        """Cut for ``down`` seconds, heal for ``up`` seconds, until ``until`` is set."""

        def run() -> None:
            while not until.wait(up):
                self.cut()
                time.sleep(down)
                self.heal()

        thread = threading.Thread(target=run, daemon=True, name="proxy-flap")
        thread.start()
        return thread

    def close(self) -> None:
        self._stopped = True
        self.cut()
        with self._lock:
            self._release_port()
        self._flowing.set()  # release threads still waiting to forward
        self._acceptor.join(5)

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- machinery -------------------------------------------------------------

    @staticmethod
    def _socket() -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        return sock

    def _listen(self, port: int) -> socket.socket:
        sock = self._socket()
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        sock.settimeout(0.05)
        return sock

    def _hold_port(self) -> socket.socket | None:
        """A socket bound to the proxy's port, not listening; ``None`` where the
        platform cannot share a port (no SO_REUSEPORT): the port is free then."""
        if not hasattr(socket, "SO_REUSEPORT"):
            return None
        sock = self._socket()
        try:
            sock.bind(("127.0.0.1", self.port))
        except OSError:
            sock.close()
            return None
        return sock

    def _release_port(self) -> None:
        placeholder, self._placeholder = self._placeholder, None
        if placeholder is not None:
            placeholder.close()

    def _ensure_listening(self) -> None:
        if self._listener is not None:
            return
        if self._placeholder is not None:
            # Listen next to the placeholder, then let it go.
            self._listener = self._listen(self.port)
            self._release_port()
            return
        # The same port again: the app's URL names it. SO_REUSEADDR lets the
        # bind through while closed connections linger in TIME_WAIT.
        deadline = time.monotonic() + 5
        while True:
            try:
                self._listener = self._listen(self.port)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _accept_loop(self) -> None:
        while not self._stopped:
            with self._lock:
                listener = self._listener
                if listener is not None:
                    try:
                        client, _ = listener.accept()
                    except (TimeoutError, OSError):
                        client = None
                    if client is not None:
                        client.settimeout(None)
                        conn = _Connection(client)
                        self._connections.append(conn)
                        self.accepted += 1
                        threading.Thread(target=self._serve, args=(conn,), daemon=True).start()
            if listener is None:
                time.sleep(0.02)

    def _wait_flowing(self, conn: _Connection) -> bool:
        while not conn.closed:
            if self._flowing.wait(0.05):
                return not conn.closed
        return False

    def _serve(self, conn: _Connection) -> None:
        # A connection accepted in a blackhole reaches the database only when
        # the network heals, like a SYN retransmitted after a partition.
        if not self._wait_flowing(conn):
            conn.close()
            return
        try:
            conn.upstream = _connect(self.upstream)
        except OSError:
            conn.close()
            return
        if conn.closed:  # cut while connecting
            conn.close()
            return
        threading.Thread(
            target=self._pump, args=(conn, conn.upstream, conn.client, False), daemon=True
        ).start()
        self._pump(conn, conn.client, conn.upstream, True)

    def _pump(
        self, conn: _Connection, src: socket.socket, dst: socket.socket, to_upstream: bool
    ) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if not self._wait_flowing(conn):
                    break
                if to_upstream and COMMIT_MESSAGE in data and self._hold_commit(conn, dst, data):
                    break
                if to_upstream and COMMIT_MESSAGE in data and self._spring_trap(dst, data):
                    continue
                dst.sendall(data)
        except OSError:
            pass
        finally:
            conn.close()

    def _hold_commit(self, conn: _Connection, dst: socket.socket, data: bytes) -> bool:
        """``True`` when a hold took this COMMIT (delivered late, the client cut)."""
        with self._lock:
            hold, self._hold = self._hold, None
        if hold is None:
            return False
        with contextlib.suppress(OSError):
            conn.client.shutdown(socket.SHUT_RDWR)
        time.sleep(hold)
        with contextlib.suppress(OSError):
            dst.sendall(data)
            time.sleep(0.2)  # the database's answer goes nowhere
        return True

    def _spring_trap(self, dst: socket.socket, data: bytes) -> bool:
        """``True`` when a trap took this COMMIT (sent or swallowed it)."""
        with self._lock:
            trap, self._trap = self._trap, None
            if trap is None:
                return False
            # Hold every reply first, so the database's answer to this COMMIT
            # cannot slip through before the cut.
            self._flowing.clear()
        deliver, delay = trap
        if deliver:
            dst.sendall(data)
        timer = threading.Timer(delay, self.cut)
        timer.daemon = True
        timer.start()
        return True


def upstream_of(database_url: str) -> Upstream:
    """Where a PostgreSQL or MySQL URL points: a Unix socket path, or (host, port)."""
    url = sa.engine.make_url(database_url)
    port = url.port or (3306 if url.get_backend_name() in ("mysql", "mariadb") else 5432)
    host = url.query.get("host") or url.host or "/tmp"
    if isinstance(host, tuple):
        host = host[0]
    if host.startswith("/"):
        return f"{host}/.s.PGSQL.{port}"
    return (host, port)
