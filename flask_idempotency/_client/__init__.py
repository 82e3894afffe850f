"""The internals of :mod:`flask_idempotency.client`: the retry policy, the
budget every attempt of one call draws on, the adapter that resends, and the
bodies and headers it reads. Needs ``requests`` (the client's extra);
:mod:`flask_idempotency.client` imports it first, with the message that names
the extra.
"""
