"""The control directory the test process and the served process share.

Faults are armed by the test as files in ``armed/``; the served process
consumes one by renaming it into ``fired/`` (``os.rename`` is atomic, so among
several workers and threads exactly one takes an armed fault). The served
process appends what its requests committed to ``trace.jsonl``, one JSON object a
line, each batch in one ``write`` to a file opened with ``O_APPEND`` (so lines of
concurrent workers never interleave). Nothing here imports Flask or SQLAlchemy.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import decimal
import json
import os
import typing as t
import uuid
from pathlib import Path

#: The environment variables the served process reads.
CONTROL_ENV = "IDEMPOTENCY_KIT_CONTROL"
APP_ENV = "IDEMPOTENCY_KIT_APP"
CONFIG_ENV = "IDEMPOTENCY_KIT_CONFIG"
DOWNSTREAM_ENV = "IDEMPOTENCY_KIT_DOWNSTREAM"
PORT_ENV = "IDEMPOTENCY_KIT_PORT"
#: The test process's pid: the served app dies with it.
PARENT_ENV = "IDEMPOTENCY_KIT_PARENT"

#: The header the served process adds to its calls to the fake downstream: the
#: incoming request's Idempotency-Key, so calls can be counted per client key.
ORIGIN_HEADER = "Idempotency-Kit-Origin"
#: The path the served process answers itself once the app is built.
READY_PATH = "/__idempotency_kit__/ready"

TRACE_FILE = "trace.jsonl"
LOG_FILE = "server.log"


def _encode(value: t.Any) -> t.Any:
    """A primary key's value as JSON that keeps its type (a UUID must come back
    a UUID: compared as text with a uuid column, PostgreSQL refuses, SQLite's
    CHAR(32) form never matches)."""
    if isinstance(value, uuid.UUID):
        return {"$uuid": str(value)}
    if isinstance(value, dt.datetime):
        return {"$datetime": value.isoformat()}
    if isinstance(value, dt.date):
        return {"$date": value.isoformat()}
    if isinstance(value, dt.time):
        return {"$time": value.isoformat()}
    if isinstance(value, decimal.Decimal):
        return {"$decimal": str(value)}
    if isinstance(value, bytes | bytearray | memoryview):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return {"$str": str(value)}  # an enum, a custom type: its text


_DECODERS: dict[str, t.Callable[[str], t.Any]] = {
    "$uuid": uuid.UUID,
    "$datetime": dt.datetime.fromisoformat,
    "$date": dt.date.fromisoformat,
    "$time": dt.time.fromisoformat,
    "$decimal": decimal.Decimal,
    "$bytes": base64.b64decode,
    "$str": str,
}


def _decode(value: t.Any) -> t.Any:
    if isinstance(value, dict) and len(value) == 1:
        ((tag, text),) = value.items()
        if tag in _DECODERS:
            return _DECODERS[tag](text)
    return value


@dataclasses.dataclass(frozen=True)
class TraceEntry:
    """What a request committed, one line of the trace. ``kind``:

    * ``"row"``: a row inserted (through the ORM, or a Core insert whose primary
      key SQLAlchemy knows), named by ``table``, ``columns`` and ``pk``;
    * ``"event"``: an outbox event (``pk`` is its event id);
    * ``"write"``: a statement that changed rows without naming them (an UPDATE,
      a DELETE, an insert without a known key, SQL text), ``verb`` and
      ``rowcount`` (-1: unknown);
    * ``"retract"``: the commit of ``batch`` failed, its lines do not count.

    ``key`` is ``None`` for a write made outside any request while a keyed
    request was in flight (a thread the view started): not attributable.
    ``batch`` names the commit a line was written at.
    """

    request: str
    key: str | None
    kind: str
    table: str
    columns: tuple[str, ...]
    pk: tuple[t.Any, ...]
    pid: int
    verb: str = ""
    rowcount: int = -1
    batch: str = ""

    def as_json(self) -> str:
        data = dataclasses.asdict(self)
        data["pk"] = [_encode(v) for v in self.pk]
        return json.dumps(data, default=str)

    @classmethod
    def from_json(cls, line: str) -> TraceEntry:
        data = json.loads(line)
        return cls(
            request=data["request"],
            key=data["key"],
            kind=data["kind"],
            table=data["table"],
            columns=tuple(data["columns"]),
            pk=tuple(_decode(v) for v in data["pk"]),
            pid=data["pid"],
            verb=data.get("verb", ""),
            rowcount=data.get("rowcount", -1),
            batch=data.get("batch", ""),
        )


class Control:
    """The control directory at ``root``; created on first use."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        for sub in ("armed", "fired", "held", "booted"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    # -- faults ----------------------------------------------------------------

    def arm(self, name: str, params: t.Mapping[str, t.Any] | None = None) -> None:
        """Arm fault ``name`` (replacing an armed one of that name)."""
        target = self.root / "armed" / f"{name}.json"
        scratch = self.root / "armed" / f".{name}.{uuid.uuid4().hex}.tmp"
        scratch.write_text(json.dumps(dict(params or {})), encoding="utf-8")
        os.replace(scratch, target)  # never seen half written

    def disarm(self, name: str) -> None:
        (self.root / "armed" / f"{name}.json").unlink(missing_ok=True)

    def peek(self, name: str) -> dict[str, t.Any] | None:
        """The parameters of armed fault ``name``, or ``None`` (not armed)."""
        try:
            text = (self.root / "armed" / f"{name}.json").read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        return t.cast(dict[str, t.Any], json.loads(text))

    def consume(self, name: str) -> dict[str, t.Any] | None:
        """Take armed fault ``name``: its parameters if this caller got it, else
        ``None`` (not armed, or another process or thread took it first)."""
        fired = self.root / "fired" / f"{name}.{os.getpid()}.{uuid.uuid4().hex}.json"
        try:
            os.rename(self.root / "armed" / f"{name}.json", fired)
        except FileNotFoundError:
            return None
        return t.cast(dict[str, t.Any], json.loads(fired.read_text(encoding="utf-8")))

    def fired(self, name: str) -> bool:
        return any((self.root / "fired").glob(f"{name}.*.json"))

    # -- the held request ------------------------------------------------------

    def held(self, token: str, what: str) -> Path:
        return self.root / "held" / f"{token}.{what}"

    # -- the served processes --------------------------------------------------

    def mark_booted(self) -> None:
        """This process built the app and serves it."""
        (self.root / "booted" / str(os.getpid())).touch()

    def booted(self) -> int:
        """How many processes marked themselves booted since :meth:`clear_booted`."""
        return sum(1 for _ in (self.root / "booted").iterdir())

    def clear_booted(self) -> None:
        for path in (self.root / "booted").iterdir():
            path.unlink(missing_ok=True)

    # -- the trace -------------------------------------------------------------

    def append_trace(self, entries: t.Sequence[TraceEntry]) -> None:
        if not entries:
            return
        data = "".join(entry.as_json() + "\n" for entry in entries).encode("utf-8")
        fd = os.open(self.root / TRACE_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def read_trace(self) -> list[TraceEntry]:
        try:
            text = (self.root / TRACE_FILE).read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        # A process killed mid-write leaves at most a partial last line.
        entries = []
        for line in text.splitlines():
            try:
                entries.append(TraceEntry.from_json(line))
            except (ValueError, KeyError):
                continue
        retracted = {e.batch for e in entries if e.kind == "retract"}
        return [
            e for e in entries if e.kind != "retract" and (e.batch not in retracted or not e.batch)
        ]

    @property
    def log_path(self) -> Path:
        return self.root / LOG_FILE
