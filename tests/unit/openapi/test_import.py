"""apispec is the ``openapi`` extra's: importing the package (every public module
but :mod:`flask_idempotency.openapi`) never imports it."""

from __future__ import annotations

import subprocess
import sys

from tests.unit.test_package import public_modules


def test_the_package_imports_no_apispec() -> None:
    modules = [name for name in public_modules() if name != "flask_idempotency.openapi"]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError:\n"  # another extra's module, not installed here
        "        pass\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'apispec'))\n"
    )
    ran = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert ran.stdout.strip() == "[]", ran.stdout
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import flask_idempotency.openapi, sys; print('apispec' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert loaded.stdout.strip() == "True"
