"""What the distribution says of itself: its version and its licence."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import flask_idempotency

ROOT = Path(__file__).resolve().parents[2]


def test_the_version_is_the_distributions() -> None:
    assert flask_idempotency.__version__ == importlib.metadata.version("Flask-Idempotency")


def test_the_licence_setup_py_names_is_shipped() -> None:
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("MIT License")
    assert 'license="MIT"' in (ROOT / "setup.py").read_text(encoding="utf-8")
