"""A fake downstream service (a card processor, an email provider) that records calls.

It runs an HTTP server on 127.0.0.1 in a thread of the test process. Each call
carries an ``Idempotency-Key``; the service deduplicates by it, as a real one
does: the first call with a key makes the effect (a charge), later calls with
the same key get the same answer and make nothing. Tests assert on ``calls``
(every request seen, per key) and ``effects`` (what really happened, per key).
"""

from __future__ import annotations

import collections
import json
import threading
import typing as t
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Downstream:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()
        self.effects: dict[tuple[str, str], dict[str, t.Any]] = {}
        self.failures_left: collections.Counter[str] = collections.Counter()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    def start(self) -> Downstream:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fail_next(self, operation: str, times: int = 1) -> None:
        """The next ``times`` calls of ``operation`` answer 503 and make nothing."""
        with self.lock:
            self.failures_left[operation] += times

    def calls_for(self, operation: str) -> int:
        return sum(n for (op, _), n in self.calls.items() if op == operation)

    def effects_for(self, operation: str) -> int:
        return sum(1 for (op, _) in self.effects if op == operation)

    def _handle(self, operation: str, key: str, body: dict[str, t.Any]) -> tuple[int, t.Any]:
        with self.lock:
            self.calls[(operation, key)] += 1
            if self.failures_left[operation] > 0:
                self.failures_left[operation] -= 1
                return 503, {"error": "temporarily unavailable"}
            if (operation, key) not in self.effects:
                self.effects[(operation, key)] = {
                    "id": f"{operation}_{len(self.effects) + 1}",
                    "request": body,
                }
            return 200, {"id": self.effects[(operation, key)]["id"]}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        downstream = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                key = self.headers.get("Idempotency-Key", "")
                status, answer = downstream._handle(self.path.strip("/"), key, body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: t.Any) -> None:
                return None

        return Handler
