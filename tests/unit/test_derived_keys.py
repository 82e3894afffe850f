"""derive_key(parent_key, step): the contract other services implement.

Every expected value below was computed outside this package, e.g.
``printf 'K\\0charge' | sha256sum``.
"""

from __future__ import annotations

import hashlib

import pytest

import flask_idempotency
from flask_idempotency.keys import (
    derive_key,
    derive_scoped_key,
    parse_key,
    quote_key,
    scoped_parent_key,
)


def test_derive_key_test_vector() -> None:
    # printf 'K\0charge' | sha256sum
    expected = "adc0d55521747c0987f0a1d53171f400f3bedbcb89de36e8b6bec611747e26f4"
    assert flask_idempotency.derive_key("K", "charge") == expected
    assert derive_key("K", "charge") == expected


def test_derive_key_encodes_utf8() -> None:
    # printf 'K\0\xc3\xa9' | sha256sum
    expected = "c9140457f67557e1185605389b0942805b7e0279976544594448152386d22ff6"
    assert derive_key("K", "\u00e9") == expected


@pytest.mark.parametrize(
    ("parent", "step"), [("K", "charge"), ("", "s"), ("a\x00b", "c"), ("x" * 300, "email")]
)
def test_derive_key_is_the_documented_formula(parent: str, step: str) -> None:
    formula = hashlib.sha256((parent + "\x00" + step).encode("utf-8")).hexdigest()
    assert derive_key(parent, step) == formula
    assert len(formula) == 64
    assert formula == formula.lower()


@pytest.mark.parametrize("step", ["", "a\x00b", "\x00"])
def test_derive_key_refuses_an_empty_step_or_nul(step: str) -> None:
    with pytest.raises(ValueError, match="step"):
        derive_key("K", step)


@pytest.mark.parametrize(
    ("scope", "key", "step", "operation", "expected"),
    [
        # printf 'tenant\0key-1\0charge' | sha256sum
        (
            "tenant",
            "key-1",
            "charge",
            "",
            "b58a3988b943e415bbb5a5a7a0038e86d35762bb373df1dec7b3157f2207850a",
        ),
        # printf 'tenant\0key-1\0op\0charge' | sha256sum
        (
            "tenant",
            "key-1",
            "charge",
            "op",
            "73105879e296f82972b456efdb75e781e83aa0b3cadf16f0b9fe8de17414916a",
        ),
        # A scope holding an undecodable URL byte (surrogateescape): the value the
        # implementation before derive_key gave, unchanged.
        (
            "/p\udcff",
            "k",
            "charge",
            "2026-12-01T07:00:00.000000",
            "499556ef9046348dabd7e76bd40906f27c5f3801095aebe32cd9bbf673668d42",
        ),
    ],
)
def test_idem_derived_keys_are_unchanged(
    scope: str, key: str, step: str, operation: str, expected: str
) -> None:
    assert derive_scoped_key(scope, key, step, operation=operation) == expected


def test_idem_derived_key_is_derive_key_of_the_scoped_parent() -> None:
    parent = scoped_parent_key("tenant", "key-1", operation="op")
    assert parent == "tenant\x00key-1\x00op"
    assert derive_key(parent, "charge") == derive_scoped_key(
        "tenant", "key-1", "charge", operation="op"
    )
    assert scoped_parent_key("tenant", "key-1") == "tenant\x00key-1"


@pytest.mark.parametrize("key", ["abc", 'a,b "c" \\ d', "8e03978e-40d5-43e8-bc93-6894a57f9324"])
def test_quote_key_round_trips_through_parse_key(key: str) -> None:
    assert parse_key(quote_key(key)) == key
