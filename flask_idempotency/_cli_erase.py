"""Erasure commands of the `flask idempotency` group (cli.py registers them)."""

from __future__ import annotations
