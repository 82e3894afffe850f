"""The test app for gunicorn: ``gunicorn tests.support.gunicorn_app:app``.

The database URL comes from ``TEST_DATABASE_URL``; extra ``app.config`` (durations
in seconds) from ``TEST_APP_CONFIG`` as JSON.
"""

from __future__ import annotations

import json
import os

from tests.support import testapp

app = testapp.create_app(
    os.environ["TEST_DATABASE_URL"], **json.loads(os.environ.get("TEST_APP_CONFIG", "{}"))
)
