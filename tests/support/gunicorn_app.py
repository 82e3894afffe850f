"""The test app for gunicorn: ``gunicorn tests.support.gunicorn_app:app``.

The database URL comes from ``TEST_DATABASE_URL``; extra ``app.config`` (durations
in seconds) from ``TEST_APP_CONFIG`` as JSON.

With ``TEST_APP_METRIC`` set (the monitoring tests), the app also counts its own
responses through the OpenTelemetry API (``testapp.responses``,
``testapp_responses_total`` in Prometheus: a figure of the test's own, to prove the
scrape harness apart from the extension's instruments), and has a route whose view
commits and then raises (``POST /commits-then-raises``: a failed-after-commit).
"""

from __future__ import annotations

import json
import os
import typing as t

from flask import Response

from tests.support import testapp

app = testapp.create_app(
    os.environ["TEST_DATABASE_URL"], **json.loads(os.environ.get("TEST_APP_CONFIG", "{}"))
)

if os.environ.get("TEST_APP_METRIC"):
    from opentelemetry import metrics

    _responses = metrics.get_meter("tests.gunicorn_app").create_counter(
        "testapp.responses", unit="{response}", description="Responses the test app gave."
    )

    @app.after_request
    def _count_response(response: Response) -> Response:
        _responses.add(1, {"http.response.status_code": response.status_code})
        return response

    @app.post("/commits-then-raises")
    @testapp.idem.idempotent()
    def commits_then_raises() -> t.NoReturn:
        testapp.write_ledger("commits-then-raises")
        testapp.db.session.commit()
        raise RuntimeError("the view failed after its commit")
