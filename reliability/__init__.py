"""The fault suite: ``python -m reliability`` runs every scenario and writes
``RELIABILITY.md``; ``python -m reliability --short`` is the version CI runs.

See ``reliability/README.md`` for what each scenario does and what it needs.
"""
