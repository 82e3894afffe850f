"""Repro: a factory without parameters (and a Flask instance) get the kit's
config "applied after" (docs/testing-kit.md), but the extension read its
settings at init_app: IDEMPOTENCY_* in app_config are silently ignored."""
import sys
sys.path.insert(0, "review/userproj")
from flask_idempotency.testing._app import load_app

app = load_app("notes_app:create_app", {"IDEMPOTENCY_WAIT": 1, "IDEMPOTENCY_HEADER": "Idempotency-Key",
                                         "SQLALCHEMY_DATABASE_URI": "sqlite://"})
print("app.config:", app.config["IDEMPOTENCY_WAIT"], app.config["IDEMPOTENCY_HEADER"])
print("what the extension uses:", app.test_client().get("/wait").json)
