"""Form bodies as a browser sends them (urlencoded, multipart), for the
fingerprint and form tests."""

from __future__ import annotations

import typing as t

URLENCODED = "application/x-www-form-urlencoded"


def multipart(
    boundary: str,
    fields_: t.Sequence[tuple[str, str]] = (),
    files: t.Sequence[tuple[str, str, bytes]] = (),
) -> tuple[bytes, str]:
    """A multipart/form-data body with the given boundary, and its content type."""
    parts = []
    for name, value in fields_:
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode()
            + value.encode()
            + b"\r\n"
        )
    for name, filename, content in files:
        parts.append(
            (
                f"--{boundary}\r\nContent-Disposition: form-data; "
                f'name="{name}"; filename="{filename}"\r\n'
                "Content-Type: application/octet-stream\r\n\r\n"
            ).encode()
            + content
            + b"\r\n"
        )
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"
