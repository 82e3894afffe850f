"""Names reached by their old deep paths, kept working for one release with a warning.

Before 0.1 the package was flat, and code may import implementation names from
the public modules (``flask_idempotency.relay.Listener``). A public module's
``__getattr__`` made here still finds such a name in its implementation module
and warns once per name; CHANGES.md says what to import instead.
"""

from __future__ import annotations

import importlib
import typing as t
import warnings


def forward(public: str, *private: str) -> t.Callable[[str], t.Any]:
    """A module ``__getattr__`` for ``public`` that finds names not in its
    ``__all__`` in the modules ``private`` (the first that has the name) and
    warns that they are not public."""

    def __getattr__(name: str) -> t.Any:
        if name.startswith("__"):
            raise AttributeError(name)
        for module_name in private:
            module = importlib.import_module(module_name)
            if hasattr(module, name):
                value = getattr(module, name)
                break
        else:
            raise AttributeError(f"module {public!r} has no attribute {name!r}")
        warnings.warn(
            f"{public}.{name} is not part of the public API and will be removed in 0.2; "
            "see CHANGES.md (0.1) for what to use instead",
            DeprecationWarning,
            stacklevel=2,
        )
        return value

    return __getattr__
