"""Probe: one kill_after_commit, 32 concurrent requests (different keys) over
4 gunicorn workers x 8 threads: the fault must fire exactly once."""
import threading
import uuid

import pytest


@pytest.fixture
def idempotency_config(idempotency_config):
    return idempotency_config.replace(app="ledger_app:create_app", workers=4, threads=8)


@pytest.mark.parametrize("round_", range(3))
def test_fires_once(api, db, fault, round_):
    fault.kill_after_commit()
    barrier = threading.Barrier(32)
    out = []

    def go():
        barrier.wait(10)
        try:
            out.append(api.post("/pay", json={"amount": 1}, key=str(uuid.uuid4())).status_code)
        except ConnectionError:
            out.append("died")

    ts = [threading.Thread(target=go) for _ in range(32)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    fired_lines = api.logs().count("fault kill_after_commit fired")
    fired_files = list((fault._control.root / "fired").glob("kill_after_commit.*"))
    print(f"\nfired log lines={fired_lines} files={len(fired_files)} answers={sorted(map(str, out))[:3]}.. died={out.count('died')}")
    assert fired_lines == 1 and len(fired_files) == 1
