"""A small billing app whose work outside HTTP is idempotent: ``idem.function``.

- ``app``: the app, its ``charges`` table, and two idempotent functions:
  ``charge_invoice`` (one transaction) and ``settle_invoice`` (leased, with
  recovery points around a payment processor's HTTP API).
- ``job``: an APScheduler job that charges an invoice.
- ``command``: ``flask charge-invoice INVOICE AMOUNT``.
- ``consumer``: a kombu consumer of charge requests.

A scheduler that fires a job twice, an operator who runs a command again, a
broker that redelivers a message: each calls the function again with the same
invoice, and gets the stored result instead of a second charge.
Run from this folder (``docs/examples``) so that ``billing`` imports.
"""
