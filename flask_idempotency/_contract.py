"""The HTTP contract's fixed rules: which answers are stored and replayed, and which
response headers never are. Settings (:mod:`flask_idempotency.config`) narrow
these; nothing widens them."""

from __future__ import annotations

#: 4xx answers that say "not now" rather than "no": replaying them would turn a
#: transient refusal into a permanent one, so they are never stored.
TRANSIENT_4XX = frozenset({408, 409, 423, 425, 429})

REPLAYED_HEADER = "Idempotent-Replayed"

#: Response headers that are never stored or replayed, whatever the configuration
#: says: they carry credentials or per-client state that must not leak to another
#: request, or belong to one connection (hop-by-hop: a PEP 3333 server refuses
#: them from an application). Headers a response's ``Connection`` names are
#: hop-by-hop too, and are left out with it.
NEVER_REPLAYED = frozenset(
    {
        "set-cookie",
        "authorization",
        "proxy-authorization",
        "www-authenticate",
        "proxy-authenticate",
        "cookie",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",  # RFC 2616's spelling, which wsgiref still refuses
        "upgrade",
        "idempotent-replayed",
    }
)

ALWAYS_REPLAYED = ("Content-Type", "Location")


def is_storable(status: int) -> bool:
    """2xx, 3xx and deterministic 4xx responses are stored; 5xx and transient 4xx are not."""
    if 200 <= status < 400:
        return True
    return 400 <= status < 500 and status not in TRANSIENT_4XX
