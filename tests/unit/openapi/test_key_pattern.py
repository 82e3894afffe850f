"""A ``key_format`` regular expression in the spec: OpenAPI's ``pattern`` is an
ECMA-262 regular expression, the server's is Python's. The spec's pattern is a
valid ECMA-262 one that accepts exactly the keys the server does (checked with
node's ``RegExp``, with the ``u`` flag and without, and with Python's ``re``,
as Python validators read it), or it is left out and
``x-idempotency`` states the server's own (``key_pattern``, its dialect and the
flags it was compiled with)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import typing as t

import pytest
from apispec import APISpec
from apispec_webframeworks.flask import FlaskPlugin
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_idempotency import Idempotency
from flask_idempotency._ecma import ecma_pattern
from flask_idempotency.keys import KEY_FORMATS
from flask_idempotency.openapi import IdempotencyPlugin
from tests.unit.openapi.checks import key_parameter, operation, valid

#: Keys to try every pattern on (printable ASCII, as keys are).
KEYS = [
    *("a", "abc", "ABC", "abcx", "ABCx", "ord-1", "ord-12", "ORD-1", "live-a", "test-a"),
    *("x", "xx", "a b", "#- !", "a.b", "ab", "aab", "{", "}", "]", "]a", "a{}", "a/b", "'\"`"),
    *("8e03978e-40d5-43e8-bc93-6894a57f9324", "01936f5e-6b7a-7cc3-9d2e-5f0a8b1c2d3e"),
]

#: Python patterns and their ECMA-262 translation, spelling aside the same.
TRANSLATED = {
    r"ord-[0-9]+": "^(?=[ -~]*$)(?:ord-[0-9]+)$",
    r"\Aord-[0-9]+\Z": "^(?=[ -~]*$)(?:^ord-[0-9]+$)$",
    r"(?P<p>ord)-[0-9]+": "^(?=[ -~]*$)(?:(ord)-[0-9]+)$",
    r"(?P<c>[a-z])-(?P=c)": r"^(?=[ -~]*$)(?:([a-z])-(?:\1))$",
    r"(?P<y>ab)-(?P=y)1": r"^(?=[ -~]*$)(?:(ab)-(?:\1)1)$",
    r"([a-z])\1": r"^(?=[ -~]*$)(?:([a-z])\1)$",
    r"(?!test-)[a-z-]+": "^(?=[ -~]*$)(?:(?!test-)[a-z-]+)$",
    r"a{,2}b": "^(?=[ -~]*$)(?:a{0,2}b)$",
    r"a{}": r"^(?=[ -~]*$)(?:a\{\})$",
    r"[]a]+": r"^(?=[ -~]*$)(?:[\]a]+)$",
    r"[^]a]": r"^(?=[ -~]*$)(?:[^\]a])$",
    r"a]": r"^(?=[ -~]*$)(?:a\])$",
    r"\#\-\ \!": "^(?=[ -~]*$)(?:#- !)$",
    r"[\w\-.]+": r"^(?=[ -~]*$)(?:[\w\-.]+)$",
    r"\x61\u0062": r"^(?=[ -~]*$)(?:\x61\u0062)$",
    r"[a-z]{3}x?": "^(?=[ -~]*$)(?:[a-z]{3}x?)$",
}
#: Python patterns no ECMA-262 pattern is known to read exactly alike.
UNTRANSLATED = [
    r"(?i)[a-z]{3}x",  # an inline flag
    r"(?x) ord - [0-9]+",
    r"(?i:o)rd",
    r"(?#the prefix)ord",  # a comment
    r"(?>ord)-\d",  # an atomic group
    r"ord-\d++",  # a possessive quantifier
    r"(o)?(?(1)rd|x)",  # a conditional
    r"(?P<o>o)?(?P=o)",  # a reference to a group that may take no part
    r"(o)|\1",
    r"\101",  # octal
    r"\N{LATIN SMALL LETTER A}",
]


def check_in_node(cases: list[tuple[str, str]]) -> None:
    """Each (Python, ECMA-262) pair accepts the same ``KEYS``, in node, both flags."""
    if shutil.which("node") is None:
        pytest.skip("node is not installed: no ECMA-262 engine to check the patterns with")
    expected = [
        [ecma, [re.compile(python).fullmatch(key) is not None for key in KEYS]]
        for python, ecma in cases
    ]
    script = """
const [cases, keys] = JSON.parse(require('fs').readFileSync(0, 'utf8'));
const wrong = [];
for (const [pattern, expected] of cases) {
  for (const flags of ['u', '']) {
    try {
      const got = keys.map((key) => new RegExp(pattern, flags).test(key));
      if (JSON.stringify(got) !== JSON.stringify(expected)) wrong.push([pattern, flags, got]);
    } catch (error) { wrong.push([pattern, flags, String(error)]); }
  }
}
console.log(JSON.stringify(wrong));
"""
    done = subprocess.run(
        ["node", "-e", script],
        input=json.dumps([expected, KEYS]),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert json.loads(done.stdout) == []


@pytest.mark.parametrize(("python", "ecma"), TRANSLATED.items())
def test_a_pattern_that_translates_is_written_in_ecma_262(python: str, ecma: str) -> None:
    assert ecma_pattern(re.compile(python)) == ecma


@pytest.mark.parametrize("python", UNTRANSLATED)
def test_a_pattern_that_may_read_otherwise_is_not_translated(python: str) -> None:
    assert ecma_pattern(re.compile(python)) is None


def test_compile_flags_that_change_a_match_leave_the_pattern_out() -> None:
    assert ecma_pattern(re.compile("[a-z]{3}", re.IGNORECASE)) is None
    assert ecma_pattern(re.compile("ord - [0-9]+  # a comment", re.VERBOSE)) is None
    # Keys hold no line break: these change nothing a key may match.
    assert (
        ecma_pattern(re.compile("o.d$", re.DOTALL | re.MULTILINE | re.ASCII))
        == "^(?=[ -~]*$)(?:o.d$)$"
    )


def test_the_translations_accept_exactly_the_keys_python_does() -> None:
    for python, ecma in TRANSLATED.items():
        # Python's re reads them alike too (a validator's ``format: regex``,
        # jsonschema's ``pattern``).
        for key in KEYS:
            server = re.compile(python).fullmatch(key) is not None
            assert (re.search(ecma, key) is not None) is server, (python, key)
    check_in_node(list(TRANSLATED.items()))


def spec_for(key_format: t.Any) -> dict[str, t.Any]:
    app = Flask("patterns")
    app.config.update(SQLALCHEMY_DATABASE_URI="sqlite://")
    idem = Idempotency(app, SQLAlchemy(app))

    @app.post("/orders")
    @idem.idempotent(key_format=key_format)
    def place() -> dict[str, str]:
        """Place.
        ---
        post:
          responses:
            201:
              description: placed
        """
        return {}

    spec = APISpec("Shop", "1", "3.1.0", plugins=[FlaskPlugin(), IdempotencyPlugin(app)])
    with app.test_request_context():
        spec.path(view=place, app=app)
    return valid(spec.to_dict())


@pytest.mark.parametrize("key_format", [r"\Aord-[0-9]+\Z", r"(?P<p>ord)-[0-9]+", "uuid4"])
def test_the_specs_pattern_is_the_servers_in_ecma_262(key_format: str) -> None:
    op = operation(spec_for(key_format), "/orders", "post")
    pattern = key_parameter(op)["schema"]["pattern"]
    if key_format == "uuid4":
        server = KEY_FORMATS["uuid4"].pattern.pattern
    else:
        server = key_format
        assert op["x-idempotency"]["key_pattern"] == server
        assert op["x-idempotency"]["key_pattern_dialect"] == "python"
    check_in_node([(server, pattern)])


@pytest.mark.parametrize(
    ("key_format", "flags"),
    [
        (re.compile("[a-z]{3}", re.IGNORECASE), ["IGNORECASE"]),
        (re.compile("ord - [0-9]+  # a comment", re.VERBOSE), ["VERBOSE"]),
        ("(?i)[a-z]{3}x", None),  # the flag is in the pattern itself
    ],
)
def test_an_untranslatable_pattern_is_stated_in_pythons_dialect(
    key_format: t.Any, flags: list[str] | None
) -> None:
    op = operation(spec_for(key_format), "/orders", "post")
    assert "pattern" not in key_parameter(op)["schema"]
    extension = op["x-idempotency"]
    assert extension["key_format"] == "regex"
    source = key_format if isinstance(key_format, str) else key_format.pattern
    assert extension["key_pattern"] == source
    assert extension["key_pattern_dialect"] == "python"
    assert extension.get("key_pattern_flags") == flags


def test_the_pattern_admits_only_printable_ascii_whatever_the_format_says() -> None:
    """The server refuses a key that is not printable ASCII before any format."""
    pattern = ecma_pattern(re.compile(".+"))
    assert pattern is not None
    assert re.search(pattern, "order 1~") is not None
    for refused in ("café", "a\tb", ""):
        assert re.search(pattern, refused) is None, refused
