"""The testing kit's pytest plugin under the package's name: loading this module
loads :mod:`flask_idempotency_pytest` (the plugin itself, a module of its own so
that the entry point imports nothing of the package in runs that do not use the
kit). ``-p flask_idempotency.testing.plugin`` and ``pytest_plugins =
["flask_idempotency.testing.plugin"]`` keep working, and with the entry point
next to them the plugin is registered once.
"""

from __future__ import annotations

__all__: list[str] = []

#: pytest loads the plugin by this name; once registered (by the entry point,
#: ``-p`` or another ``pytest_plugins``), it is not registered again.
pytest_plugins = ["flask_idempotency_pytest"]
