"""What each host of ``python -m bench.partition`` serves: the example's payments
service, with the README's fail-fast engine settings
(:func:`example_app.app.engine_options`) and nothing else changed.

``EXAMPLE_DATABASE_URL`` names the database; ``BENCH_PARTITION_CONFIG`` (JSON) adds
app config (``IDEMPOTENCY_*`` settings under test).
"""

from __future__ import annotations

import json
import os

from flask import Flask

from example_app import app as example

CONFIG_ENV = "BENCH_PARTITION_CONFIG"


def create_app() -> Flask:
    return example.create_app(json.loads(os.environ.get(CONFIG_ENV, "{}")))
