"""Repro: fault.database_down(mode="refuse") closes the proxy's listening
socket for the whole outage; the port is free for anyone meanwhile. If another
socket takes it (another test's free port, an outgoing connection), the
database never comes back: database_up() raises after 5 s, and the automatic
heal at the end of `seconds` raises in a Timer thread, unseen."""
import socket
import threading
import time

from flask_idempotency.testing._control import Control
from flask_idempotency.testing._fault import Fault, proxy_for
import tempfile

errors = []
threading.excepthook = lambda a: errors.append(f"{a.thread.name}: {a.exc_type.__name__}: {a.exc_value}")

fault = Fault(Control(tempfile.mkdtemp()), proxy_for("postgresql://postgres@127.0.0.1:5432/postgres"))
port = fault.proxy.port
fault.database_down(1, mode="refuse")
squatter = socket.socket()
squatter.bind(("127.0.0.1", port))   # someone else gets the free port meanwhile
squatter.listen()
time.sleep(7)                          # the outage was 1 s; the heal retried 5 s
print("timer thread errors:", errors)
try:
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    print("connect to the proxy port: accepted -- by the squatter, not the database")
except OSError as exc:
    print("connect:", exc)
t0 = time.monotonic()
try:
    fault.database_up()
except OSError as exc:
    print(f"database_up() raised after {time.monotonic()-t0:.1f}s: {exc}")
squatter.close()
fault.close()
