"""A host cut off from its database, on real gunicorn hosts and a real network
partition: what a load balancer and the other hosts need from it.

Two app hosts (gunicorn, sync workers, the example service with the README's
fail-fast settings, readiness on a port of its own, a claim idle bound) and a
PostgreSQL, each in a network namespace of its own (bench/netns.py; Linux, as
root, else skipped). Each worker of host 1 is in the middle of a charge, its
claim held uncommitted, when host 1 is partitioned from the database: every
packet between them is lost in silence, so only the configured timeouts end the
waits. Then:

* host 1's readiness port answers 503 problem+json while every worker of host
  1 hangs (and its app-port ``/readyz`` waits in the queue);
* the hung charges answer 503 problem+json within the load balancer's
  deadline, not a timeout;
* their retries on host 2 are not held behind the claims host 1 left: each
  runs, once (with the server's idle bound gone, host 2 waits
  ``IDEMPOTENCY_WAIT`` and answers 409);

and after healing, host 1 is ready again. Counted in ledger rows per key.
"""

from __future__ import annotations

import json
import threading
import time
import typing as t
import uuid

import pytest
import sqlalchemy as sa

from bench import netns
from bench.partition import APP_PORT, Host, Options, _get, _post
from tests.support.private_servers import PgCluster

WORKERS = 2
READY_PORT = 8081
#: How long the view works after its claim: the cut comes in the middle of it.
WORK = 3.0
#: The load balancer's deadline for an answer. Above what the configured
#: bounds allow a hung charge (WORK + tcp_user_timeout 2 s), below what the
#: kernel's own retransmission limits take (minutes), and below gunicorn's
#: worker timeout (30 s).
DEADLINE = 12.0


@pytest.fixture(params=["psycopg2", "psycopg"])
def partitioned(
    request: pytest.FixtureRequest,
) -> t.Iterator[tuple[netns.Topology, str, list[Host]]]:
    reason = netns.available()
    if reason is not None:
        pytest.skip(f"network namespaces: {reason}")
    topology = netns.Topology(hosts=2).create()
    cluster: PgCluster | None = None
    hosts: list[Host] = []
    try:
        with topology.in_switch():
            cluster = PgCluster.create(
                host=netns.DB_ADDRESS,
                prefix=topology.exec_prefix(topology.database),
                trust="10.231.0.0/16",
            ).start()
            url = cluster.url(request.param)
            from bench.partition import _create_tables

            _create_tables(url)
            options = Options(
                workers=WORKERS,
                ready_port=READY_PORT,
                work=WORK,
                config={
                    "IDEMPOTENCY_CLAIM_IDLE_TIMEOUT": 5,
                    "IDEMPOTENCY_WAIT": 20,
                    "IDEMPOTENCY_READY_TIMEOUT": 2,
                },
            )
            hosts = [Host(topology, n, url, options) for n in (1, 2)]
            for host in hosts:
                host.wait_serving(topology)
        yield topology, url, hosts
    finally:
        for host in hosts:
            host.stop()
            host.log.unlink(missing_ok=True)
        if cluster is not None:
            cluster.stop()
        topology.destroy()


def _claims_held(url: str, address: str) -> int:
    """Host 1's transactions idle on the server right after their claim."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return int(
                conn.execute(
                    sa.text(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE client_addr = CAST(:a AS inet) "
                        # the claim's last statement: its batch (psycopg2), the
                        # record's read (psycopg 3's pipeline)
                        "AND state = 'idle in transaction' AND query LIKE '%idempotency_keys%'"
                    ),
                    {"a": address},
                ).scalar_one()
            )
    finally:
        engine.dispose()


def _ledger(url: str) -> dict[str, int]:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT description, count(*) FROM ledger GROUP BY description")
            )
            return {str(key): int(n) for key, n in rows}
    finally:
        engine.dispose()


def _ready(topology: netns.Topology, n: int) -> tuple[str, dict[str, t.Any]]:
    import http.client

    conn = http.client.HTTPConnection(topology.front(n), READY_PORT, timeout=DEADLINE)
    try:
        conn.request("GET", "/readyz")
        response = conn.getresponse()
        return f"{response.status} {response.getheader('Content-Type')}", json.loads(
            response.read()
        )
    finally:
        conn.close()


@pytest.mark.slow
def test_a_host_cut_off_from_its_database(
    partitioned: tuple[netns.Topology, str, list[Host]],
) -> None:
    topology, url, _ = partitioned
    with topology.in_switch():
        assert _ready(topology, 1)[0] == "200 application/json"
        keys = [f"cut-{n}-{uuid.uuid4()}" for n in range(WORKERS)]
        first: dict[str, str] = {}

        def charge(key: str) -> None:
            first[key] = _post(topology.front(1), key, DEADLINE)[0]

        senders = [threading.Thread(target=charge, args=(key,)) for key in keys]
        for sender in senders:
            sender.start()
        deadline = time.monotonic() + 20
        while _claims_held(url, topology.back(1)) < WORKERS:  # every worker in its view
            assert time.monotonic() < deadline, "host 1's workers never claimed"
            time.sleep(0.05)
        topology.cut(1)

        # Every worker of host 1 hangs; its app-port /readyz waits in the queue,
        # its readiness port answers.
        queued: list[str] = []
        on_app_port = threading.Thread(
            target=lambda: queued.append(_get(topology.front(1), APP_PORT, "/readyz", 60))
        )
        on_app_port.start()
        status, problem = _ready(topology, 1)
        assert status == "503 application/problem+json"
        assert problem["database"] in ("timeout", "unavailable")
        assert on_app_port.is_alive()
        assert queued == []

        # The hung charges answer 503 within the load balancer's deadline.
        for sender in senders:
            sender.join()
        assert first == dict.fromkeys(keys, "503")

        # Their retries on host 2 are not held behind host 1's claims: each runs once.
        for key in keys:
            assert _post(topology.front(2), key, 60)[0] == "201"
        assert _post(topology.front(1), "during-the-cut", DEADLINE)[0] == "503"

        topology.heal(1)
        deadline = time.monotonic() + 60
        while _ready(topology, 1)[0] != "200 application/json":
            assert time.monotonic() < deadline, "host 1 not ready again after healing"
            time.sleep(0.5)
        on_app_port.join(60)
        assert _post(topology.front(1), "after-healing", DEADLINE)[0] == "201"
        for key in keys:  # the retry after all: replayed, nothing new
            assert _post(topology.front(1), key, DEADLINE)[0] == "201"
        ledger = _ledger(url)
        assert {key: ledger.get(key, 0) for key in keys} == dict.fromkeys(keys, 1)
        assert ledger.get("during-the-cut", 0) == 0
        assert ledger.get("after-healing") == 1
