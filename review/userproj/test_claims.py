"""Claims checked: TimeoutError on no answer in time; ConnectionError after kill."""
import uuid

import pytest


@pytest.fixture
def idempotency_config(idempotency_config):
    return idempotency_config.replace(app="ledger_app:create_app", server="werkzeug")


def test_timeout_and_connection_errors(api, db, fault):
    with fault.hold_first(timeout=5) as held:
        with pytest.raises(TimeoutError):
            api.post("/pay", json={"amount": 1}, key=str(uuid.uuid4()), timeout=1)
        assert held.reached
    api.kill()
    with pytest.raises(ConnectionError):
        api.get("/")
