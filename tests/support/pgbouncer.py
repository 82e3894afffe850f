"""PgBouncer in transaction pooling mode in front of the suite's PostgreSQL.

Debian's ``pgbouncer`` package (``/usr/sbin/pgbouncer``, or ``pgbouncer`` on
``PATH``); :func:`missing` says why it cannot run here, for the skip reason.
It listens on a free port of 127.0.0.1 only, lets clients in without a password
(``auth_type = trust``) and passes the upstream's own credentials on. A role a
test creates logs in through it as itself, as behind a production PgBouncer with
``auth_query``: PgBouncer asks the server (as the upstream's user, ``auth_user``)
whether the role exists, so no role needs an ``auth_file`` line of its own.

PgBouncer refuses to run as root: as root it is started with ``-u``, as the owner
of the upstream's socket directory (the embedded pgserver's own user, the only
one that may open it) or as ``nobody`` for a TCP upstream.

A URL through it carries ``application_name=`` :data:`POOLED_APP` (which libpq
sends, and PgBouncer passes on), so the test app can tell it is behind a
transaction pooler and configure itself as a user would
(``tests.support.testapp.create_app``).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import typing as t
import uuid
from pathlib import Path

import sqlalchemy as sa

from flask_idempotency.testing._server import free_port

#: Where Debian installs it.
BINARY = "/usr/sbin/pgbouncer"
#: The ``application_name`` of every connection through the pooler.
POOLED_APP = "idempotency-tests-pgbouncer"
#: Server connections per (database, user): fewer than the test app's pool, so
#: transactions of different clients share server connections, as in production.
POOL_SIZE = 20


def binary() -> str | None:
    """The pgbouncer executable, or ``None``."""
    if os.access(BINARY, os.X_OK):
        return BINARY
    return shutil.which("pgbouncer")


def missing() -> str | None:
    """Why PgBouncer cannot run here, or ``None``."""
    if binary() is None:
        return (
            f"PgBouncer is not installed ({BINARY} missing, none on PATH): "
            "apt-get install pgbouncer to run the PostgreSQL tests through a transaction pooler"
        )
    return None


def is_pooled(url: str | sa.URL) -> bool:
    """Whether ``url`` goes through the tests' PgBouncer."""
    name = sa.make_url(url).query.get("application_name")
    return isinstance(name, str) and (name == POOLED_APP or name.startswith(f"{POOLED_APP}/"))


def named(url: str, name: str) -> str:
    """``url`` whose connections are named ``name`` in ``pg_stat_activity``. Through
    the pooler the name stays marked (``idempotency-tests-pgbouncer/<name>``), and
    it is the relay's LISTEN connection, on the direct URL, that is named ``name``
    (:func:`declared`): the one a test looks for, the app's own connections being
    the pooler's, shared."""
    parsed = sa.make_url(url)
    if is_pooled(parsed):
        name = f"{POOLED_APP}/{name}"
    return parsed.update_query_dict({"application_name": name}).render_as_string(False)


#: Set by the suite to its PostgreSQL's direct URL (psycopg2's spelling) once the
#: pooler runs, so that apps in subprocesses find it too.
DIRECT_ENV = "IDEMPOTENCY_TEST_DIRECT_POSTGRES_URL"


def declared(url: str) -> dict[str, t.Any]:
    """The extension's config for an app on ``url`` behind the tests' PgBouncer
    (``{}`` for a direct URL): the pooler declared, the relay's LISTEN on the
    direct URL (docs/poolers.md). The example app sets its engine up itself."""
    parsed = sa.make_url(url)
    if not is_pooled(parsed):
        return {}
    config: dict[str, t.Any] = {"IDEMPOTENCY_DATABASE_POOLER": "transaction"}
    direct = os.environ.get(DIRECT_ENV)
    if direct:
        listen = sa.make_url(direct).set(drivername=parsed.drivername)
        given = parsed.query.get("application_name")
        if isinstance(given, str) and given.startswith(f"{POOLED_APP}/"):  # named()
            listen = listen.update_query_dict({"application_name": given.split("/", 1)[1]})
        config["IDEMPOTENCY_RELAY_LISTEN_URL"] = listen.render_as_string(False)
    return config


def user_config(url: str) -> dict[str, t.Any]:
    """The config a user sets behind a transaction pooler (docs/poolers.md), for an
    app on ``url``; ``{}`` unless ``url`` goes through the tests' PgBouncer:
    :func:`declared`, and psycopg 3's automatic prepared statements off (with
    the test apps' pool size)."""
    parsed = sa.make_url(url)
    config = declared(url)
    if config and parsed.drivername == "postgresql+psycopg":
        config["SQLALCHEMY_ENGINE_OPTIONS"] = {
            "pool_size": 40,
            "max_overflow": 10,
            "connect_args": {"prepare_threshold": None},
        }
    return config


@contextlib.contextmanager
def role_with_settings(url: str, **settings: str) -> t.Iterator[str]:
    """``url`` as a role of its own whose sessions start with ``settings``
    (``ALTER ROLE ... SET lock_timeout = '300ms'``): how a user behind a
    transaction pooler gives its connections the server settings that a direct
    connection passes in ``options=`` (which PgBouncer refuses, and which would
    follow a shared server connection to another client). The role is a member
    of ``url``'s user, so it may do whatever that user may; it logs in through
    the pooler as itself (``auth_query``). Dropped afterwards, what it owned
    handed back to ``url``'s user."""
    parsed = sa.make_url(url)
    role = f"pooled_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(parsed, poolclass=sa.NullPool)
    with admin.begin() as conn:
        owner = conn.execute(sa.text("SELECT current_user")).scalar_one()
    try:
        with admin.begin() as conn:
            conn.execute(sa.text(f'CREATE ROLE {role} LOGIN IN ROLE "{owner}"'))
            for name, value in settings.items():
                quoted = value.replace("'", "''")
                conn.execute(sa.text(f"ALTER ROLE {role} SET {name} = '{quoted}'"))
        yield parsed.set(username=role).render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            exists = conn.execute(
                sa.text("SELECT 1 FROM pg_roles WHERE rolname = :role"), {"role": role}
            ).first()
            if exists:
                conn.execute(sa.text(f'REASSIGN OWNED BY {role} TO "{owner}"'))
                conn.execute(sa.text(f"DROP OWNED BY {role}"))
                conn.execute(sa.text(f"DROP ROLE {role}"))
        admin.dispose()


def _quote(value: str) -> str:
    """A libpq connection-string value, quoted."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class PgBouncer:
    """A PgBouncer process in front of the PostgreSQL of ``upstream`` (a SQLAlchemy
    URL: TCP, or a Unix socket in ``?host=``). :meth:`url` spells a URL through it."""

    def __init__(self, upstream: str, *, pool_mode: str = "transaction") -> None:
        self.upstream = sa.make_url(upstream)
        self.pool_mode = pool_mode
        self.port = 0
        self.dir: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    def _server(self) -> tuple[str, str | None]:
        """The upstream's connection string (without the database), and the owner
        of its socket directory when it is a Unix socket."""
        up = self.upstream
        host = up.query.get("host") or up.host or "127.0.0.1"
        if isinstance(host, tuple):
            host = host[0]
        parts = [f"host={_quote(host)}", f"port={up.port or 5432}"]
        if up.password:
            # PgBouncer has no password of a client's to pass on (auth_type =
            # trust): every client reaches the server as the upstream's user then.
            parts.append(f"user={_quote(up.username or 'postgres')}")
            parts.append(f"password={_quote(str(up.password))}")
        else:
            # Each client reaches it as itself; a role missing from auth_file
            # (one a test created) is looked up by auth_query (PgBouncer's
            # default: pg_shadow), run as the upstream's user.
            parts.append(f"auth_user={_quote(up.username or 'postgres')}")
        owner = pwd.getpwuid(os.stat(host).st_uid).pw_name if host.startswith("/") else None
        return " ".join(parts), owner

    def _search_path(self) -> str | None:
        """The schema a configured PostgreSQL's URL puts first (``options=-csearch_path=``):
        PgBouncer ignores the ``options`` startup parameter, so it is set on each
        server connection instead."""
        options = self.upstream.query.get("options")
        if isinstance(options, tuple):
            options = " ".join(options)
        for option in (options or "").split():
            if option.startswith("-csearch_path="):
                return option.removeprefix("-csearch_path=")
        return None

    def start(self) -> PgBouncer:
        exe = binary()
        if exe is None:
            raise RuntimeError(missing())
        server, owner = self._server()
        database = self.upstream.database or "postgres"
        entry = f"{server} dbname={_quote(database)}"
        search_path = self._search_path()
        if search_path is not None:
            entry += f" connect_query={_quote(f'SET search_path TO {search_path}')}"
        self.dir = Path(tempfile.mkdtemp(prefix="idempotency-pgbouncer-"))
        self.port = free_port()
        users = self.dir / "users.txt"
        users.write_text(f'"{self.upstream.username or "postgres"}" ""\n')
        ini = self.dir / "pgbouncer.ini"
        ini.write_text(
            "\n".join(
                [
                    "[databases]",
                    f"{database} = {entry}",
                    f"* = {server}",  # databases made by a test (fresh_database)
                    "[pgbouncer]",
                    "listen_addr = 127.0.0.1",
                    f"listen_port = {self.port}",
                    "unix_socket_dir =",
                    "auth_type = trust",
                    f"auth_file = {users}",
                    f"pool_mode = {self.pool_mode}",
                    f"default_pool_size = {POOL_SIZE}",
                    "max_client_conn = 2000",
                    "max_db_connections = 0",
                    # Not options: a test that sets its own (-c lock_timeout=...)
                    # fails at once, "unsupported startup parameter", instead of
                    # running without it (and waiting on a lock for ever).
                    "ignore_startup_parameters = extra_float_digits",
                    "log_connections = 0",
                    "log_disconnections = 0",
                    "",
                ]
            )
        )
        command = [exe]
        if os.geteuid() == 0:  # "PgBouncer should not run as root"
            user = owner or "nobody"
            os.chmod(self.dir, 0o755)
            for path in (users, ini):
                os.chmod(path, 0o644)
            command += ["-u", user]
        command.append(str(ini))
        log = open(self.dir / "pgbouncer.log", "wb")  # noqa: SIM115 (the process owns it)
        self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"PgBouncer did not start: {self.log()}") from None
                time.sleep(0.05)

    def log(self) -> str:
        """What PgBouncer wrote (its log)."""
        if self.dir is None:
            return ""
        path = self.dir / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def url(self, driver: str, database: str | None = None) -> str:
        """The upstream's database (or ``database``) through the pooler, spelled for
        ``driver`` (``postgresql+psycopg2``...), marked :data:`POOLED_APP`."""
        url = sa.URL.create(
            driver,
            username=self.upstream.username or "postgres",
            host="127.0.0.1",
            port=self.port,
            database=database or self.upstream.database or "postgres",
            query={"application_name": POOLED_APP},
        )
        return url.render_as_string(hide_password=False)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


def run(upstream: str, **kwargs: t.Any) -> PgBouncer:
    """A started :class:`PgBouncer` in front of ``upstream``."""
    return PgBouncer(upstream, **kwargs).start()
