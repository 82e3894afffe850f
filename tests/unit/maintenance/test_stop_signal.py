"""SIGTERM stops ``flask idempotency scheduler`` and ``relay`` wherever it lands.

The handler runs on the main thread between two bytecodes, possibly while that
thread is inside ``Event.wait()`` and holds the event's lock. A handler that
called ``stop.set()`` there waited for that lock for ever: a scheduler ignored
SIGTERM for good (seen in a test run), and a deploy's stop would have had to
kill it."""

from __future__ import annotations

import threading

from flask_idempotency._maintenance.runner import set_from_signal


def test_the_stop_is_set_while_the_main_thread_holds_the_events_lock() -> None:
    stop = threading.Event()
    done = threading.Event()

    def main_thread_in_wait() -> None:
        # As the signal finds the main thread: inside wait(), the lock held.
        with stop._cond:  # type: ignore[attr-defined]
            set_from_signal(stop)
        done.set()

    runner = threading.Thread(target=main_thread_in_wait, daemon=True)
    runner.start()
    # With stop.set() in place of set_from_signal, the thread never gets here.
    assert done.wait(10), "setting the stop waited for the lock its own thread holds"
    assert stop.wait(10)
