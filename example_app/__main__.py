"""``python -m example_app``: serve the payments service on 127.0.0.1:5000.

``python -m example_app demo`` instead starts it on a free port, sends a charge,
retries it, reuses its key with another amount, and prints what happened.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import typing as t
import urllib.error
import urllib.request
import uuid

from werkzeug.serving import make_server

from . import create_app


def _post(base: str, body: dict[str, t.Any], key: str) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(
        base + "/payments",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Idempotency-Key": key},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def demo() -> int:
    """Run the retry story against a live server and check the ledger."""
    app = create_app()
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # keep the story readable
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    key = str(uuid.uuid4())
    charge = {"customer_id": "cus_demo", "amount": 1250, "currency": "EUR"}
    try:
        with urllib.request.urlopen(base + "/ledger") as response:
            before = json.load(response)["count"]
        steps = [
            ("first attempt", charge),
            ("retry (client timed out)", {**charge, "client_sent_at": "2026-01-01T00:00:05Z"}),
            ("same key, different amount", {**charge, "amount": 9999}),
        ]
        for title, body in steps:
            status, headers, payload = _post(base, body, key)
            replayed = headers.get("Idempotent-Replayed", "false")
            print(f"{title:28} -> {status} replayed={replayed} {payload.decode().strip()}")
        with urllib.request.urlopen(base + "/ledger") as response:
            after = json.load(response)["count"]
        print(f"ledger rows added for key {key}: {after - before}")
        return 0 if after - before == 1 else 1
    finally:
        server.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m example_app", description=__doc__)
    parser.add_argument("command", nargs="?", choices=["serve", "demo"], default="serve")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5000)
    args = parser.parse_args()
    if args.command == "demo":
        return demo()
    app = create_app()
    print(
        f"payments service on http://{args.host}:{args.port}  (database: "
        f"{app.config['SQLALCHEMY_DATABASE_URI']})"
    )
    app.run(host=args.host, port=args.port, threaded=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
