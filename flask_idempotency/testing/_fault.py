"""The ``fault`` fixture's object: one-shot fault points in the served app."""

from __future__ import annotations

import threading
import time
import uuid

import sqlalchemy as sa

from ._control import Control
from ._proxy import TcpProxy, upstream_of

#: The longest a held request waits for its release.
HOLD_LIMIT = 30.0


class HeldRequest:
    """The first keyed request to claim its key, held after the claim until
    :meth:`release` (or 30 s at most). A context manager: leaving it releases."""

    def __init__(self, control: Control, timeout: float) -> None:
        self._control = control
        self.token = uuid.uuid4().hex
        control.arm("hold_first", {"token": self.token, "timeout": min(timeout, HOLD_LIMIT)})

    def wait_reached(self, timeout: float = 30) -> bool:
        """Wait until a request is held; whether one was (``False`` after ``timeout`` s)."""
        path = self._control.held(self.token, "reached")
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    @property
    def reached(self) -> bool:
        return self._control.held(self.token, "reached").exists()

    def release(self) -> None:
        """Let the held request go on (and disarm the hold if none was held yet)."""
        self._control.disarm("hold_first")
        self._control.held(self.token, "release").write_text("go", encoding="utf-8")

    def __enter__(self) -> HeldRequest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Fault:
    """Arms one-shot faults in the served app (through the control directory)
    and cuts its database (through the kit's TCP proxy).

    Each ``kill_*`` fault fires once, in whichever worker reaches its point
    first, and kills that process with SIGKILL: no cleanup, no response, as a
    crash. Arming a fault again replaces the one armed. :meth:`fired` tells
    whether it did fire. If the database could not be brought back after
    :meth:`database_down` by itself, the next call here raises that error (and
    so does the fixture's teardown).
    """

    def __init__(self, control: Control, proxy: TcpProxy | None) -> None:
        self._control = control
        self.proxy = proxy
        self._up_timer: threading.Timer | None = None
        self._heal_error: BaseException | None = None

    def _check_healed(self) -> None:
        """Raise the error the timed heal met (once)."""
        error, self._heal_error = self._heal_error, None
        if error is not None:
            raise RuntimeError(
                f"the kit could not bring the database back after database_down(): {error!r}"
            ) from error

    def kill_after_commit(self, nth: int = 1) -> None:
        """Kill the process right after the ``nth`` commit of a request (any
        session), before the response is written. A leased route commits its
        claim first: its view's commit is the second."""
        self._check_healed()
        self._control.arm("kill_after_commit", {"nth": nth})

    def kill_before_commit(self, nth: int = 1) -> None:
        """Kill the process at the ``nth`` commit of a request, before it reaches
        the database: the view ran, nothing of its transaction is committed."""
        self._check_healed()
        self._control.arm("kill_before_commit", {"nth": nth})

    def kill_after_step(self, name: str) -> None:
        """Kill the process right after recovery point ``name`` (``idem.step``) was
        saved on the record (the :data:`~flask_idempotency.signals.step_saved`
        signal)."""
        self._check_healed()
        self._control.arm("kill_after_step", {"name": name})

    def kill_after_call(self) -> None:
        """Kill the process right after it received the answer of a call to the
        fake downstream, before the app used it (any client over ``http.client``:
        urllib, urllib3, requests)."""
        self._check_healed()
        self._control.arm("kill_after_call")

    def hold_first(self, timeout: float = HOLD_LIMIT) -> HeldRequest:
        """Hold the first keyed request that claims its key (the
        :data:`~flask_idempotency.signals.key_claimed` signal) until released."""
        self._check_healed()
        return HeldRequest(self._control, timeout)

    def database_down(self, seconds: float, mode: str = "refuse") -> None:
        """Make the database unreachable for ``seconds``: ``"refuse"`` resets every
        connection and refuses new ones (a restart, a firewall's reject);
        ``"blackhole"`` accepts and forwards nothing (a partition: calls hang
        until the app's own timeouts end them). Back by itself after ``seconds``,
        or at :meth:`database_up`. Needs a server database (not SQLite)."""
        self._check_healed()
        if self.proxy is None:
            raise RuntimeError("database_down() needs a server database; SQLite is a local file")
        if mode not in ("refuse", "blackhole"):
            raise ValueError(f"mode must be 'refuse' or 'blackhole', not {mode!r}")
        self._cancel_timer()
        if mode == "refuse":
            self.proxy.cut()
        else:
            self.proxy.blackhole()
        self._up_timer = threading.Timer(seconds, self._timed_up)
        self._up_timer.daemon = True
        self._up_timer.start()

    def database_up(self) -> None:
        """Make the database reachable again now."""
        self._cancel_timer()
        self._check_healed()
        if self.proxy is not None:
            self.proxy.heal()

    def _timed_up(self) -> None:
        # In the timer's thread: an error here would go unseen; kept for the
        # test's next call (or the teardown) to raise.
        try:
            if self.proxy is not None:
                self.proxy.heal()
        except BaseException as exc:
            self._heal_error = exc

    def fired(self, name: str) -> bool:
        """Whether the armed fault ``name`` (``"kill_after_commit"``, ...,
        ``"hold_first"``) was consumed."""
        self._check_healed()
        return self._control.fired(name)

    def _cancel_timer(self) -> None:
        timer, self._up_timer = self._up_timer, None
        if timer is not None:
            timer.cancel()

    def close(self) -> None:
        """Disarm everything, close the proxy; raise a heal error not seen yet."""
        self._cancel_timer()
        for name in ("kill_after_commit", "kill_before_commit", "kill_after_step"):
            self._control.disarm(name)
        self._control.disarm("kill_after_call")
        self._control.disarm("hold_first")
        if self.proxy is not None:
            self.proxy.close()
        self._check_healed()

    def __repr__(self) -> str:
        return f"<Fault control={self._control.root}>"


def proxy_for(url: str) -> TcpProxy | None:
    """A TCP proxy in front of the server ``url`` names; ``None`` for SQLite."""
    parsed = sa.make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return None
    return TcpProxy(upstream_of(url))
