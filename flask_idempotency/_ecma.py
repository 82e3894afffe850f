"""A key format's Python regular expression as an ECMA-262 pattern, OpenAPI's
(JSON Schema's) dialect, where one says exactly the same, else ``None``.

What the two read alike is copied; what only the spelling differs in is
rewritten (``\\A`` as ``^``, ``\\Z`` as ``$``, ``(?P<n>...)`` as a numbered
group ``(...)`` and ``(?P=n)`` as its number, ``{,n}`` as ``{0,n}``, a literal
``{``, ``}`` or ``]`` escaped, an escaped punctuation mark that ECMA may not
escape written bare); and a pattern with anything else (a flag such as
``re.I`` or ``re.X``, an inline flag, a comment, an atomic group, a possessive
quantifier, a conditional, an octal or ``\\N{...}`` escape, a reference to a
group that may not have taken part) is not translated: a spec without a
pattern is vaguer, one with a wrong pattern refuses or invites keys the server
does not.

The output is a valid pattern with the ``u`` flag and without it, and for
Python's ``re`` too (a Python validator reads it so), with one meaning on every
key: keys are printable ASCII (``keys.printable``), so a pattern's ``\\d``,
``\\w``, ``\\s`` and ``\\b`` (Unicode in Python, ASCII in ECMA-262) and its
``.``, ``^`` and ``$`` (line breaks aside) agree.
"""

from __future__ import annotations

import re

# Keys hold no line break, so these flags change nothing a key may match.
_HARMLESS_FLAGS = re.UNICODE | re.ASCII | re.DOTALL | re.MULTILINE
# What ECMA-262 lets a pattern escape with the ``u`` flag (its SyntaxCharacter and ``/``).
_SYNTAX = frozenset("^$\\.*+?()[]{}|/")
_CLASSES = frozenset("dDwWsS")
_CONTROLS = frozenset("nrtfv")
_QUANTIFIER = re.compile(r"\{([0-9]*)(?:(,)([0-9]*))?\}")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HEX = re.compile(r"[0-9a-fA-F]+")
_LOOKAROUND = -1


# Raised (and caught) within: the pattern may not mean the same in ECMA-262.
_Untranslatable = ValueError
_DIGITS = frozenset("0123456789")


def ecma_pattern(pattern: re.Pattern[str]) -> str | None:
    """``pattern`` as an anchored ECMA-262 pattern matching exactly the keys
    ``pattern.fullmatch`` does; ``None`` when no exact translation is known."""
    if pattern.flags & ~_HARMLESS_FLAGS:
        return None
    try:
        body = _Translation(pattern.pattern).run()
    except _Untranslatable:
        return None
    # OpenAPI patterns search; the key must match as a whole (fullmatch), and
    # be printable ASCII whatever the format says (keys.printable: ".+" is not
    # a licence for "café").
    return f"^(?=[ -~]*$)(?:{body})$"


class _Translation:
    """One left-to-right pass over the Python pattern's source."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.at = 0
        self.out: list[str] = []
        # Per open group: its number, 0 for a group that captures nothing, or
        # _LOOKAROUND.
        self.open: list[int] = []
        self.groups = 0
        self.names: dict[str, int] = {}
        # Groups that take part in every match, once closed: a reference to one
        # means the same in both dialects (ECMA-262 matches an empty string for a
        # group that took no part, Python fails).
        self.always: set[int] = set()
        self.alternatives = False
        self.references = False

    def run(self) -> str:
        while self.at < len(self.source):
            char = self.source[self.at]
            self.at += 1
            if char == "\\":
                self.escape()
            elif char == "[":
                self.character_class()
            elif char == "(":
                self.group()
            elif char == ")":
                self.close()
            elif char in "*+?":
                self.out.append(char)
                self.repeat_mode()
            elif char == "{":
                self.brace()
            elif char in "}]":
                self.out.append("\\" + char)
            else:
                if char == "|" and not self.open:
                    self.alternatives = True
                self.out.append(char)
        if self.references and self.alternatives:
            raise _Untranslatable  # a referenced group may lie in another branch
        return "".join(self.out)

    def peek(self, length: int = 1) -> str:
        return self.source[self.at : self.at + length]

    def repeat_mode(self) -> None:
        """After a quantifier: lazy (``?``) reads alike; possessive (``+``) does not."""
        if self.peek() == "?":
            self.out.append("?")
            self.at += 1
        elif self.peek() == "+":
            raise _Untranslatable

    def brace(self) -> None:
        found = _QUANTIFIER.match(self.source, self.at - 1)
        if found is None or not (found[1] or found[2]):
            self.out.append("\\{")  # a literal brace in Python, an error in ECMA (u)
            return
        low, comma, high = found.groups()
        self.out.append("{" + (low or "0") + (comma or "") + (high or "") + "}")
        self.at = found.end()
        self.repeat_mode()

    def group(self) -> None:
        if self.peek() != "?":
            self.groups += 1
            self.open.append(self.groups)
            self.out.append("(")
            return
        self.at += 1
        for opener in (":", "=", "!", "<=", "<!"):
            if self.source.startswith(opener, self.at):
                self.at += len(opener)
                self.open.append(0 if opener == ":" else _LOOKAROUND)
                self.out.append("(?" + opener)
                return
        if self.source.startswith("P<", self.at):
            name = self.name(self.at + 2, ">")
            self.groups += 1
            self.names[name] = self.groups
            self.open.append(self.groups)
            # Numbered as it was: a name changes no match, and Python's ``re``
            # (a validator's ``format: regex``, jsonschema's ``pattern``) reads
            # "(?<n>" as no pattern at all.
            self.out.append("(")
        elif self.source.startswith("P=", self.at):
            number = self.names.get(self.name(self.at + 2, ")"), 0)
            if number > 9:
                raise _Untranslatable  # "\\10" may read as an octal escape
            self.reference(number)
            # Grouped: a digit after it must not join the number ("\\11").
            self.out.append(f"(?:\\{number})")
        else:  # flags, a comment, an atomic group, a conditional
            raise _Untranslatable

    def name(self, start: int, end: str) -> str:
        stop = self.source.find(end, start)
        name = self.source[start:stop]
        if stop < 0 or not _NAME.fullmatch(name):
            raise _Untranslatable
        self.at = stop + 1
        return name

    def close(self) -> None:
        number = self.open.pop()
        self.out.append(")")
        repeated = self.peek() in ("*", "+", "?", "{")
        if number == _LOOKAROUND and repeated:
            raise _Untranslatable  # a repeated assertion: a syntax error in ECMA (u)
        if number > 0 and not self.open and not repeated:
            self.always.add(number)

    def reference(self, number: int) -> None:
        if number not in self.always:
            raise _Untranslatable
        self.references = True

    def escape(self) -> None:
        char = self.peek()
        self.at += 1
        if not char:
            raise _Untranslatable
        if char in "AZz":
            self.out.append("^" if char == "A" else "$")
        elif char in _CLASSES or char in "bB":
            self.out.append("\\" + char)
        elif char in _DIGITS:
            if char == "0" or self.peek() in _DIGITS:
                raise _Untranslatable  # octal, or a reference past 9
            self.reference(int(char))
            self.out.append("\\" + char)
        else:
            self.out.append(self.common_escape(char, in_class=False))

    def common_escape(self, char: str, *, in_class: bool) -> str:
        """An escape that reads the same in and out of a class (a control
        character, a code, a punctuation mark)."""
        if char in _CONTROLS:
            return "\\" + char
        if char == "a":
            return "\\x07"
        if char in "xu":
            digits = 2 if char == "x" else 4
            code = self.peek(digits)
            if len(code) != digits or not _HEX.fullmatch(code):
                raise _Untranslatable
            self.at += digits
            return f"\\{char}{code}"
        if not char or char.isalnum():  # \U, \N{...} and what Python refuses
            raise _Untranslatable
        if char in _SYNTAX or (in_class and char == "-"):
            return "\\" + char
        return char  # ECMA (u) refuses an escaped "#" or "-": the mark alone means it

    def character_class(self) -> None:
        self.out.append("[")
        if self.peek() == "^":
            self.out.append("^")
            self.at += 1
        if self.peek() == "]":  # first, a literal in Python; "[]" matches nothing in ECMA
            self.out.append("\\]")
            self.at += 1
        while self.at < len(self.source):
            char = self.source[self.at]
            self.at += 1
            if char == "]":
                self.out.append("]")
                return
            if char == "\\":
                escaped = self.peek()
                self.at += 1
                if escaped in _CLASSES or escaped == "b":  # \b: a backspace in both
                    self.out.append("\\" + escaped)
                elif escaped in _DIGITS:
                    raise _Untranslatable
                else:
                    self.out.append(self.common_escape(escaped, in_class=True))
            elif char == "[":
                self.out.append("\\[")  # a literal in both; escaped for ECMA's v flag too
            else:
                self.out.append(char)
        raise _Untranslatable
