"""Database servers of a test's own, for tests that change server state.

Making a server read-only, promoting a standby or restarting with other options
would disturb every other user of a shared server, so these tests start their
own: :class:`PgCluster` (a PostgreSQL cluster from pgserver's binaries, which
the dev requirements install: a primary, and a hot standby made from it with
``pg_basebackup``) and :class:`PrivateMariaDB` (a ``mariadbd`` with its own data
directory, port and socket, where one is installed). Each listens on
127.0.0.1 (or an address given, inside a network namespace of the caller's)
and is stopped and deleted by :meth:`stop`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import typing as t
from pathlib import Path

import sqlalchemy as sa

from flask_idempotency.testing._server import free_port as free_port

#: Servers refuse to run as root; as root they run as this user (pgserver's own).
SERVER_USER = "pgserver"


def _server_user() -> pwd.struct_passwd | None:
    """The user to run PostgreSQL as: ``None`` (ourselves) unless we are root."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(SERVER_USER)
    except KeyError:
        subprocess.run(["useradd", "-s", "/bin/sh", SERVER_USER], check=True, capture_output=True)
        return pwd.getpwnam(SERVER_USER)


def _pg_bin() -> Path:
    """pgserver's PostgreSQL binaries, found without importing pgserver (whose
    import wants a runtime directory, and warns without one)."""
    spec = importlib.util.find_spec("pgserver")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("pgserver is not installed (pip install -r requirements-dev.txt)")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def _wait(check: t.Callable[[], bool], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {within} s")
        time.sleep(0.1)


def _answers(url: str) -> bool:
    """Whether the server at ``url`` takes a connection and answers a query."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        return True
    except sa.exc.OperationalError:
        return False
    finally:
        engine.dispose()


class PgCluster:
    """One PostgreSQL cluster in a directory of its own.

    ``prefix`` is put before every server command (``["ip", "netns", "exec",
    "ns"]`` runs it in a network namespace); ``host`` is the address it
    listens on.
    """

    def __init__(
        self, data_dir: Path, *, host: str = "127.0.0.1", prefix: t.Sequence[str] = ()
    ) -> None:
        self.data_dir = data_dir
        self.host = host
        self.port = free_port()
        self.prefix = list(prefix)
        self.user = _server_user()
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def create(
        cls, *, host: str = "127.0.0.1", prefix: t.Sequence[str] = (), trust: str | None = None
    ) -> PgCluster:
        """A new, empty cluster (not started); ``trust`` is a network (CIDR) whose
        clients log in without a password, besides 127.0.0.1."""
        base = Path(tempfile.mkdtemp(prefix="idem-pg-"))
        cluster = cls(base / "data", host=host, prefix=prefix)
        cluster._own(base)
        cluster._run(
            _pg_bin() / "initdb",
            "-D",
            str(cluster.data_dir),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=utf8",
            "--no-sync",
            namespaced=False,
        )
        if trust is not None:
            with (cluster.data_dir / "pg_hba.conf").open("a") as hba:
                hba.write(f"host all all {trust} trust\nhost replication all {trust} trust\n")
        return cluster

    def _own(self, path: Path) -> None:
        os.chmod(path, 0o755)
        if self.user is not None:
            os.chown(path, self.user.pw_uid, self.user.pw_gid)

    def _command(self, *args: str | Path, namespaced: bool = True) -> list[str]:
        """``args`` as the server's user (through ``setpriv``, which execs: the
        process we start is the server), in the cluster's namespace when
        ``namespaced``."""
        command = [str(arg) for arg in args]
        if self.user is not None:
            name = self.user.pw_name
            command = ["setpriv", f"--reuid={name}", f"--regid={name}", "--init-groups", *command]
        return [*self.prefix, *command] if namespaced else command

    def _run(self, *args: str | Path, namespaced: bool = True) -> None:
        done = subprocess.run(
            self._command(*args, namespaced=namespaced), capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"{args[0]} failed ({done.returncode}):\n{done.stderr[-3000:]}")

    def _log(self) -> str:
        path = self.data_dir.parent / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self, **settings: str | int) -> PgCluster:
        """Start the server (in the foreground of a child process) and wait until it
        accepts connections; ``settings`` are ``-c name=value`` options."""
        options = {
            "listen_addresses": self.host,
            "port": self.port,
            "unix_socket_directories": str(self.data_dir.parent),
            "fsync": "off",
            "max_connections": 100,
            "wal_level": "replica",
            **settings,
        }
        command = [str(_pg_bin() / "postgres"), "-D", str(self.data_dir)]
        for name, value in options.items():
            command += ["-c", f"{name}={value}"]
        log = (self.data_dir.parent / "server.log").open("ab")
        self.proc = subprocess.Popen(
            self._command(*command), stdin=subprocess.DEVNULL, stdout=log, stderr=log
        )
        log.close()
        _wait(self._accepting, 30, f"PostgreSQL did not start:\n{self._log()}")
        return self

    def _accepting(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"PostgreSQL exited at start:\n{self._log()}")
        return _answers(self.url())

    def url(self, driver: str = "psycopg2", database: str = "postgres") -> str:
        return f"postgresql+{driver}://postgres@{self.host}:{self.port}/{database}"

    def standby(self) -> PgCluster:
        """A hot standby of this (running) cluster, made with ``pg_basebackup``, not
        started."""
        base = Path(tempfile.mkdtemp(prefix="idem-pg-standby-"))
        standby = PgCluster(base / "data", host=self.host, prefix=self.prefix)
        standby._own(base)
        self._run(
            _pg_bin() / "pg_basebackup",
            "-D",
            str(standby.data_dir),
            "-R",  # standby.signal and primary_conninfo: a standby of this one
            "-X",
            "stream",
            "-h",
            self.host,
            "-p",
            str(self.port),
            "-U",
            "postgres",
        )
        return standby

    def promote(self) -> None:
        """``pg_ctl promote``: the standby becomes a primary (a failover)."""
        self._run(_pg_bin() / "pg_ctl", "promote", "-w", "-D", str(self.data_dir), namespaced=False)

    def in_recovery(self) -> bool:
        engine = sa.create_engine(self.url(), poolclass=sa.pool.NullPool)
        try:
            with engine.connect() as conn:
                return bool(conn.execute(sa.text("SELECT pg_is_in_recovery()")).scalar_one())
        finally:
            engine.dispose()

    def halt(self, mode: str = "fast") -> None:
        """Stop the server and keep the cluster: ``fast`` (SIGINT: sessions ended,
        a clean checkpoint) or ``immediate`` (SIGQUIT: no checkpoint, crash
        recovery at the next start). :meth:`start` brings it back on the same port."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT if mode == "fast" else signal.SIGQUIT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def stop(self) -> None:
        """Stop (fast shutdown; killed after 20 s) and delete the cluster."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # fast shutdown
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.data_dir.parent, ignore_errors=True)


def mariadb_binaries() -> tuple[str, str] | None:
    """``(mariadbd, mariadb-install-db)`` where both are installed, else ``None``."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"])
    server = shutil.which("mariadbd", path=path)
    install = shutil.which("mariadb-install-db", path=path)
    return (server, install) if server and install else None


class PrivateMariaDB:
    """A ``mariadbd`` of our own: data directory, port and socket; root without a
    password on 127.0.0.1."""

    def __init__(self) -> None:
        binaries = mariadb_binaries()
        if binaries is None:
            raise RuntimeError("mariadbd and mariadb-install-db are not installed")
        self.server, install = binaries
        self.base = Path(tempfile.mkdtemp(prefix="idem-mariadb-"))
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        # Its own tmpdir: at start mariadbd deletes every "#sql*" file in its
        # tmpdir, and in /tmp those are the live temporary tables of the other
        # servers on the machine (a shared one's DESCRIBE then failed, errno 2).
        (self.base / "tmp").mkdir()
        subprocess.run(
            [
                install,
                "--no-defaults",
                f"--datadir={self.base / 'data'}",
                f"--tmpdir={self.base / 'tmp'}",
                "--user=root" if os.geteuid() == 0 else f"--user={pwd.getpwuid(os.geteuid())[0]}",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
            ],
            check=True,
            capture_output=True,
        )

    def start(self, *options: str) -> PrivateMariaDB:
        """Start with extra ``--options`` (``--innodb-read-only``) and wait until it
        answers."""
        command = [
            self.server,
            "--no-defaults",
            f"--datadir={self.base / 'data'}",
            f"--tmpdir={self.base / 'tmp'}",
            f"--port={self.port}",
            "--bind-address=127.0.0.1",
            f"--socket={self.base / 'mariadb.sock'}",
            f"--pid-file={self.base / 'mariadb.pid'}",
            "--skip-log-bin",
            "--innodb-buffer-pool-size=16M",
            *options,
        ]
        if os.geteuid() == 0:
            command.append("--user=root")
        log = (self.base / "server.log").open("ab")
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        log.close()
        _wait(self._accepting, 60, "MariaDB did not start")
        return self

    def _accepting(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            log = (self.base / "server.log").read_text(errors="replace")
            raise RuntimeError(f"mariadbd exited at start:\n{log[-3000:]}")
        return _answers(self.url(""))

    def url(self, database: str, user: str = "root") -> str:
        return f"mysql+pymysql://{user}@127.0.0.1:{self.port}/{database}?charset=utf8mb4"

    def execute(self, *statements: str) -> None:
        """Run statements as root."""
        engine = sa.create_engine(self.url(""), poolclass=sa.pool.NullPool)
        try:
            with engine.begin() as conn:
                for statement in statements:
                    conn.execute(sa.text(statement))
        finally:
            engine.dispose()

    def restart(self, *options: str) -> PrivateMariaDB:
        self.shutdown()
        return self.start(*options)

    def shutdown(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stop(self) -> None:
        """Shut down and delete its files."""
        with contextlib.suppress(Exception):
            self.shutdown()
        shutil.rmtree(self.base, ignore_errors=True)
