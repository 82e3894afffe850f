"""What ``flask idempotency show`` prints of a record: its state always; its
contents (response body and header values, recovery points, the stored
request) only with ``--reveal``, and then with every field a route of the app
redacts masked where the content is JSON."""

from __future__ import annotations

import json
import typing as t

from . import _cli
from ._context import resolve_app
from ._request.redact import app_redacted, masked
from ._storage import Record


def _text(data: bytes | None, masks: t.Sequence[tuple[str, ...]]) -> str | None:
    """``data`` as text (JSON with the redacted paths masked), or its size."""
    if data is None:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return f"<{len(data)} bytes, not UTF-8>"
    if masks:
        try:
            parsed = json.loads(text)
        except ValueError:
            return text  # not JSON: shown as it is (docs/operations.md says so)
        return json.dumps(masked(parsed, masks), ensure_ascii=False)
    return text


def record_document(record: Record, *, reveal: bool) -> dict[str, t.Any]:
    """The JSON document ``show`` prints for ``record``."""
    document: dict[str, t.Any] = {
        "scope": record.scope,
        "key": record.key,
        "status": record.status,
        "request_hash": record.request_hash,
        "fencing_token": record.fencing_token,
        "response_code": record.response_code,
        "response_header_names": [name for name, _ in record.response_headers],
        "response_body_bytes": None if record.response_body is None else len(record.response_body),
        "body_omitted": record.body_omitted,
        "recovery_point_names": sorted(record.recovery_points),
        "recoverable": record.recoverable,
        "request_method": record.request_method,
        "request_body_bytes": None if record.request_body is None else len(record.request_body),
        "locked_until": _cli.iso(record.locked_until),
        "created_at": _cli.iso(record.created_at),
        "completed_at": _cli.iso(record.completed_at),
        "expires_at": _cli.iso(record.expires_at),
        "revealed": reveal,
    }
    if record.function_call:
        # An idempotent function's record: its path is the function's name.
        document["function"] = t.cast(str, record.request_path).removeprefix("@idem.function ")
    if record.unreadable is not None:
        # Its sealed data did not open (encryption at rest): what is in clear, and why.
        document["unreadable"] = record.unreadable
    if reveal:
        masks = app_redacted(resolve_app())
        document.update(
            response_headers=record.response_headers,
            response_body=_text(record.response_body, masks),
            # Each step's result, masked as a body is.
            recovery_points={
                name: masked(result, masks) for name, result in record.recovery_points.items()
            },
            request_path=record.request_path,
            request_content_type=record.request_content_type,
            request_body=_text(record.request_body, masks),
        )
    return document
