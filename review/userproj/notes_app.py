"""A user's own app, not the example: no-parameter factory, Core inserts,
a non-default key header, scope from a header, outbox events, a downstream call."""
import os

import requests
import sqlalchemy as sa
from flask import Flask, current_app, request
from flask_sqlalchemy import SQLAlchemy

from flask_idempotency import Idempotency

db = SQLAlchemy()
idem = Idempotency()

notes = sa.Table(
    "notes",
    db.metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("tenant", sa.String(64)),
    sa.Column("body", sa.String(200)),
)


def create_app():
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = os.environ.get("NOTES_DB", "sqlite:///notes.sqlite3")
    app.config["IDEMPOTENCY_HEADER"] = "X-Request-Id"
    app.config["DOWNSTREAM_URL"] = "http://127.0.0.1:1"
    db.init_app(app)
    idem.init_app(app, db)

    @app.post("/notes")
    @idem.idempotent(scope=lambda: "tenant:" + request.headers.get("X-Tenant", "none"))
    def create_note():
        body = request.get_json()["body"]
        db.session.execute(sa.insert(notes).values(tenant=request.headers.get("X-Tenant"), body=body))
        idem.emit("note.created", {"body": body})
        r = requests.post(current_app.config["DOWNSTREAM_URL"] + "/index", json={"body": body},
                          headers=idem.forward_headers(), timeout=5)
        return {"ok": True, "indexed": r.json()["id"]}, 201

    @app.post("/notes-parallel")
    @idem.idempotent(scope=lambda: "tenant:" + request.headers.get("X-Tenant", "none"))
    def create_note_parallel():
        # The same view, its downstream call made in a worker thread (a common
        # pattern to call several services at once).
        from concurrent.futures import ThreadPoolExecutor
        body = request.get_json()["body"]
        db.session.execute(sa.insert(notes).values(tenant=request.headers.get("X-Tenant"), body=body))
        url, headers = current_app.config["DOWNSTREAM_URL"] + "/index", idem.forward_headers()
        with ThreadPoolExecutor(2) as pool:
            r = pool.submit(requests.post, url, json={"body": body}, headers=headers, timeout=5).result()
        return {"ok": True, "indexed": r.json()["id"]}, 201

    @app.get("/wait")
    def wait():
        s = app.extensions["idempotency"].settings
        return {"wait": s.wait.total_seconds() if s.wait else None, "header": s.header, "config_wait": app.config["IDEMPOTENCY_WAIT"]}

    return app
