"""The request path: what runs for one request to a decorated view.

``decorator`` wraps the view; ``flow`` is the state machine (read the key, the
scope and the fingerprint, claim, run the view, finish or replay or refuse),
with the claim in ``claim``, the record's end in ``finish``, the optimistic
variant in ``optimistic`` and recovery points in ``steps``. ``session_guard``
and ``claim_guard`` keep the claim in step with the view's own commits;
``responses`` captures and replays answers; ``fingerprint``, ``body``,
``forms`` and ``canonical`` turn the request into its payload and fingerprint;
``rules`` gives the version of a route's fingerprint rules and the request's
digest, by which a retry across a deploy that changed them is judged;
``route`` holds a decorated view's options. It sits above the request context
and the storage layer, and below messaging (the layers contract in
pyproject.toml).
"""
