"""The outcome ``reconciled`` counts the answers a reconcile hook rebuilt and
stored: of two retries that rebuild at once, the one whose answer was stored
is ``reconciled``, the other replays it (as any retry that finds an answer)."""

import threading
import typing as t

from flask_idempotency.scope import ReconcileAttempt
from tests.conftest import Clock
from tests.support.flow import post
from tests.support.reconcile_shop import (
    Hook,
    assert_rebuilt,
    db,
    fail_after_commit,
    make_app,
    orders,
)

from .conftest import Otel


def test_two_retries_rebuilding_at_once_count_one_reconciled(
    otel: Otel, database_url: str, clock: Clock
) -> None:
    serial = database_url.startswith("sqlite")  # one writer: the second finds the answer
    gate = threading.Barrier(2, timeout=30)

    class Meeting(Hook):
        def __call__(self, attempt: ReconcileAttempt) -> t.Any:
            answer = super().__call__(attempt)
            if not serial:
                gate.wait()  # both rebuilt an answer; one will be stored
            return answer

    app = make_app(database_url, clock, Meeting())
    fail_after_commit(app, "/orders", "exception")
    [order_id] = orders(app)
    answers: list[t.Any] = []
    threads = [
        threading.Thread(target=lambda: answers.append(post(app.test_client(), "/orders", {})))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for answer in answers:
        assert_rebuilt(answer, order_id)
    outcomes = otel.outcomes()
    assert outcomes.pop(("reconciled", "/orders", "POST")) == 1
    assert outcomes.pop(("failed_after_commit", "/orders", "POST")) == 1
    # The other retry: a replay of the stored answer (waited for, or not).
    assert sum(outcomes.values()) == 1
    [(outcome, *_)] = outcomes
    assert outcome in ("replayed", "waited_replayed")
    with app.app_context():
        db.engine.dispose()
