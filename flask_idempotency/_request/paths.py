"""Excluded fields: the dotted paths of ``exclude=`` and dropping them from a
payload (:mod:`.fingerprint` applies them before it normalizes anything)."""

from __future__ import annotations

import dataclasses
import functools
import typing as t

from .canonical import dataclass_fields, plain

Path = tuple[str, ...]

# -- excluded fields --------------------------------------------------------------


def exclude_paths(exclude: t.Iterable[str], option: str = "exclude") -> tuple[Path, ...]:
    r"""The paths ``exclude`` names: each name split at its dots, where ``\.`` is a
    dot inside a name and ``\\`` a backslash (``r"client\.sent_at"`` is one name).

    Raises ``TypeError`` for anything but a collection of strings, and
    ``ValueError`` for a backslash before anything else; the errors name
    ``option`` (``redact`` takes its paths the same way).
    """
    if isinstance(exclude, str):
        raise TypeError(f"{option} must be a list of field names, not the string {exclude!r}")
    names = tuple(exclude)
    if not all(isinstance(name, str) for name in names):
        raise TypeError(f"{option} must be a list of field names, not {names!r}")
    return _parsed_paths(names, option)


@functools.lru_cache(maxsize=512)
def _parsed_paths(names: tuple[str, ...], option: str) -> tuple[Path, ...]:
    return tuple(_split_path(name, option) for name in names)


def _split_path(name: str, option: str) -> Path:
    parts: list[str] = []
    current: list[str] = []
    chars = iter(name)
    for char in chars:
        if char == "\\":
            escaped = next(chars, "")
            if escaped not in (".", "\\"):
                raise ValueError(
                    f"{option} name {name!r} has an unknown escape: write \\. for a dot "
                    "inside a name and \\\\ for a backslash"
                )
            current.append(escaped)
        elif char == ".":
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return tuple(parts)


def without_fields(value: t.Any, exclude: t.Iterable[str]) -> t.Any:
    """A plain copy of ``value`` without the paths in ``exclude``.

    A path walks into dicts by key and applies to every element of a list, so
    ``items.note`` drops ``note`` from each item. The excluded values are
    dropped before the rest is normalized: they are never looked at.
    """
    return plain(_without(value, exclude_paths(exclude)))


def _without(node: t.Any, paths: t.Sequence[Path]) -> t.Any:
    if not paths:
        return node
    if isinstance(node, (list, tuple)):
        return [_without(item, paths) for item in node]
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        node = dataclass_fields(node)
    if not isinstance(node, t.Mapping):
        return node
    dropped, deeper = _split_paths(paths)
    return {
        k: _without(v, deeper.get(str(k), [])) for k, v in node.items() if str(k) not in dropped
    }


def _split_paths(paths: t.Iterable[Path]) -> tuple[set[str], dict[str, list[Path]]]:
    """The names dropped at this level, and the rest of the longer paths by name."""
    dropped = set()
    deeper: dict[str, list[Path]] = {}
    for head, *rest in paths:
        if rest:
            deeper.setdefault(head, []).append(tuple(rest))
        else:
            dropped.add(head)
    return dropped, deeper
