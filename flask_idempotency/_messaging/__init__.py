"""Messaging: the outbox's writes in the business transaction (``outbox``), the
relay that publishes committed events (``relay``: one batch; ``listener``: the
wake-ups; ``admin``: the operator functions) and the inbox that dedupes what a
consumer receives (``inbox``). The public faces are
:mod:`flask_idempotency.outbox`, :mod:`flask_idempotency.relay` and
:mod:`flask_idempotency.inbox`; the statements are in the storage layer.
"""
