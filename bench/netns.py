"""App hosts and a database in network namespaces of their own, and a partition
between one host and the database that neither side can tell from silence.

Linux only, as root, with ``ip`` (iproute2). Nothing outside the namespaces
made here is touched: the root namespace gets no address, route or device.

Topology (``<p>`` is a prefix unique to the run)::

    <p>sw   the switch: bridge "front" 10.231.1.254 (the clients), bridge "back"
            10.231.2.254 (the operator's view of the database)
    <p>db   the database, 10.231.2.1 on "back"
    <p>h1.. app hosts, 10.231.1.N on "front" (clients reach them here) and
            10.231.2.(10+N) on "back" (they reach the database here)

The caller's threads enter ``<p>sw`` with :meth:`Topology.enter_switch` (the
clients and the operator live there); servers are started inside their
namespace with :meth:`Topology.exec_prefix`.

:meth:`Topology.cut` partitions one host from the database as a network does:
each side's neighbour entry for the other is pointed at a MAC address nobody
has, so every packet between them (SYNs, data, ACKs, keepalives) is sent and
lost in silence. An established connection sees no reset and no error: only
``tcp_user_timeout`` and keepalives end it; a new connection waits for
``connect_timeout``. (``ip route add blackhole`` would not do: Linux fails a
local ``connect()`` through a blackhole route at once with EINVAL, which is a
refusal, not a partition.) :meth:`Topology.heal` restores the real entries.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import typing as t
import uuid

CLONE_NEWNET = 0x40000000
FRONT = "10.231.1"
BACK = "10.231.2"
DB_ADDRESS = f"{BACK}.1"
#: Locally administered, unused: frames sent here reach no one.
NOWHERE = "02:00:5e:ff:ff:{:02x}"


def available() -> str | None:
    """``None`` when namespaces can be made here, else why not."""
    if not os.path.exists("/proc/self/ns/net"):
        return "not Linux (no network namespaces)"
    if os.geteuid() != 0:
        return "needs root (ip netns add)"
    if shutil.which("ip") is None:
        return "needs iproute2's ip"
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _setns(name: str) -> None:
    """Move the calling thread (and the threads it starts later) into ``name``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)


class Topology:
    """The namespaces of one run; :meth:`destroy` removes every one of them."""

    def __init__(self, hosts: int = 3, prefix: str | None = None) -> None:
        self.hosts = hosts
        self.prefix = prefix or f"ip{uuid.uuid4().hex[:5]}"
        self.made: list[str] = []
        self._cut: set[int] = set()

    @property
    def switch(self) -> str:
        return f"{self.prefix}sw"

    @property
    def database(self) -> str:
        return f"{self.prefix}db"

    def host(self, n: int) -> str:
        """The namespace of host ``n`` (1-based)."""
        return f"{self.prefix}h{n}"

    @staticmethod
    def front(n: int) -> str:
        """Host ``n``'s address for clients."""
        return f"{FRONT}.{n}"

    @staticmethod
    def back(n: int) -> str:
        """Host ``n``'s address towards the database."""
        return f"{BACK}.{10 + n}"

    def exec_prefix(self, namespace: str) -> list[str]:
        return ["ip", "netns", "exec", namespace]

    def create(self) -> Topology:
        try:
            self._create()
        except BaseException:
            self.destroy()
            raise
        return self

    def _add(self, name: str) -> None:
        _ip("netns", "add", name)
        self.made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _plug(self, namespace: str, device: str, bridge: str, address: str) -> None:
        """A veth from ``namespace`` (as ``device``) into the switch's ``bridge``."""
        port = f"p{len(self.made)}{device}{uuid.uuid4().hex[:4]}"[:15]
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", device)
        _ip("-n", self.switch, "link", "set", device, "netns", namespace)
        _ip("-n", self.switch, "link", "set", port, "master", bridge, "up")
        _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", device)
        _ip("-n", namespace, "link", "set", device, "up")

    def _create(self) -> None:
        self._add(self.switch)
        for bridge, address in (("front", f"{FRONT}.254"), ("back", f"{BACK}.254")):
            _ip("-n", self.switch, "link", "add", bridge, "type", "bridge")
            _ip("-n", self.switch, "addr", "add", f"{address}/24", "dev", bridge)
            _ip("-n", self.switch, "link", "set", bridge, "up")
        self._add(self.database)
        self._plug(self.database, "back0", "back", DB_ADDRESS)
        for n in range(1, self.hosts + 1):
            self._add(self.host(n))
            self._plug(self.host(n), "front0", "front", self.front(n))
            self._plug(self.host(n), "back0", "back", self.back(n))

    def enter_switch(self) -> None:
        """Move the calling thread into the switch namespace: its sockets reach the
        hosts (front) and the database (back). Threads it starts later go too."""
        _setns(self.switch)

    @contextlib.contextmanager
    def in_switch(self) -> t.Iterator[None]:
        """The calling thread in the switch namespace for the block, then back in
        the one it was in (sockets opened inside stay in the switch's)."""
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            _setns(self.switch)
            try:
                yield
            finally:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(home, CLONE_NEWNET) != 0:
                    errno = ctypes.get_errno()
                    raise OSError(errno, f"setns back: {os.strerror(errno)}")
        finally:
            os.close(home)

    def cut(self, n: int) -> None:
        """Partition host ``n`` from the database, silently, both ways."""
        _ip("-n", self.host(n), "neigh", "replace", DB_ADDRESS, "lladdr", NOWHERE.format(n),
            "dev", "back0", "nud", "permanent")  # fmt: skip
        _ip("-n", self.database, "neigh", "replace", self.back(n), "lladdr",
            NOWHERE.format(100 + n), "dev", "back0", "nud", "permanent")  # fmt: skip
        self._cut.add(n)

    def heal(self, n: int) -> None:
        """End host ``n``'s partition: both sides learn the real addresses again."""
        with contextlib.suppress(RuntimeError):
            _ip("-n", self.host(n), "neigh", "del", DB_ADDRESS, "dev", "back0")
        with contextlib.suppress(RuntimeError):
            _ip("-n", self.database, "neigh", "del", self.back(n), "dev", "back0")
        self._cut.discard(n)

    def destroy(self) -> None:
        """Delete every namespace made (their devices and processes' sockets go with
        them; processes started in them must be stopped by their owner)."""
        for name in reversed(self.made):
            with contextlib.suppress(RuntimeError):
                _ip("netns", "delete", name)
        self.made.clear()

    def __enter__(self) -> Topology:
        return self.create()

    def __exit__(self, *exc: t.Any) -> None:
        self.destroy()
