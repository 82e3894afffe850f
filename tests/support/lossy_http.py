"""A TCP proxy in front of an HTTP server that loses answers: the request
reaches the server whole, the server answers (so it has committed), and the
proxy resets the client's connection instead of passing the answer on. The
client sees a connection reset with no response: the case an idempotency key
is for."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading


class LossyHttpProxy:
    """Forwards 127.0.0.1:``port`` to ``upstream``; :meth:`lose_next` answers
    are dropped (counted in :attr:`lost`), the rest pass unchanged."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.lost = 0
        self._to_lose = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._stopped = False
        threading.Thread(target=self._accept, daemon=True, name="lossy-http").start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def lose_next(self, count: int = 1) -> None:
        """Drop the next ``count`` answers, whichever connections they are on."""
        with self._lock:
            self._to_lose += count

    def close(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self._listener.close()

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            client.close()
            return
        server.settimeout(None)
        threading.Thread(target=self._pump, args=(client, server), daemon=True).start()
        try:
            while data := server.recv(65536):
                if self._take_loss():
                    # The connection ends before a byte of the answer: the
                    # client cannot mistake it for a response. (The shutdown
                    # wakes the other direction's thread; a close alone would
                    # wait for it.)
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    client.shutdown(socket.SHUT_RDWR)
                    break
                client.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (client, server):
                with contextlib.suppress(OSError):
                    sock.close()

    def _take_loss(self) -> bool:
        with self._lock:
            if self._to_lose <= 0:
                return False
            self._to_lose -= 1
            self.lost += 1
            return True

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
