"""The served app's main process: ``python -m flask_idempotency.testing._launch
gunicorn [gunicorn's arguments]`` or ``... werkzeug``. It first ties its life
to the test process's (:mod:`._lifeline`; the test process's pid is in
``IDEMPOTENCY_KIT_PARENT``), then runs the server in this process."""

from __future__ import annotations

import os
import sys

from ._control import PARENT_ENV
from ._lifeline import die_with_parent


def main(argv: list[str]) -> None:
    parent = os.environ.get(PARENT_ENV)
    die_with_parent(int(parent) if parent else None)
    server, args = argv[0], argv[1:]
    if server == "gunicorn":
        from gunicorn.app.wsgiapp import run  # type: ignore[import-untyped]

        sys.argv = ["gunicorn", *args]
        run()
    elif server == "werkzeug":
        from ._serve import main as serve

        serve()
    else:
        raise SystemExit(f"unknown server {server!r}: gunicorn or werkzeug")


if __name__ == "__main__":
    main(sys.argv[1:])
