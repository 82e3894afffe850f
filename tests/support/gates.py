"""Gated views and requests in threads: the test decides when each view goes on.

A view calls ``gates.pause("A")``; the test waits until "A" is there
(:meth:`Gates.arrived`), arranges what it wants (another request, the clock,
a job), then lets it go (:meth:`Gates.open`). Real threads, the real database.
"""

from __future__ import annotations

import collections
import json
import threading
import typing as t

from flask import Flask

WAIT = 30.0


class Gates:
    def __init__(self) -> None:
        self._here: collections.defaultdict[str, threading.Event] = collections.defaultdict(
            threading.Event
        )
        self._go: collections.defaultdict[str, threading.Event] = collections.defaultdict(
            threading.Event
        )
        self._lock = threading.Lock()

    def _events(self, name: str) -> tuple[threading.Event, threading.Event]:
        with self._lock:
            return self._here[name], self._go[name]

    def pause(self, name: str) -> None:
        """Called by a view: say it is here, then wait to be let go."""
        here, go = self._events(name)
        here.set()
        if not go.wait(WAIT):
            raise RuntimeError(f"gate {name!r} was never opened")

    def arrived(self, name: str, timeout: float = WAIT) -> bool:
        return self._events(name)[0].wait(timeout)

    def open(self, name: str) -> None:
        self._events(name)[1].set()

    def open_all(self) -> None:
        with self._lock:
            for event in self._go.values():
                event.set()


class Sent:
    """A request running in a thread; :meth:`result` joins it."""

    def __init__(self, app: Flask, path: str, body: t.Any, headers: dict[str, str]) -> None:
        self.response: t.Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.response = app.test_client().post(
                    path, data=json.dumps(body), content_type="application/json", headers=headers
                )
            except BaseException as exc:  # reported by result()
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def done(self, timeout: float = 0.0) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def result(self, timeout: float = WAIT) -> t.Any:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise AssertionError("the request did not finish")
        if self.error is not None:
            raise self.error
        return self.response


def send(app: Flask, path: str, body: t.Any, key: str = "K", **headers: str) -> Sent:
    return Sent(app, path, body, {"Idempotency-Key": key, **headers})
