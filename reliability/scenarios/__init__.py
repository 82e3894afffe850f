"""The scenarios, one module each; :data:`ALL` in the order the full run takes them.

Each module has ``NAME``, ``TITLE``, ``DESCRIPTION`` (Markdown, for the report) and
``run(ctx) -> list[Result]``.
"""

from __future__ import annotations

import importlib
import types

#: Module names under ``reliability.scenarios``, in run order.
ALL = ["kills", "nginx", "pg_restart", "soak", "hosts", "chain", "badinput", "memory"]


def load(name: str) -> types.ModuleType:
    return importlib.import_module(f"reliability.scenarios.{name}")
