"""In-process tests, laid out as the package is: ``request/``, ``storage/``,
``messaging/``, ``maintenance/`` for its private layers; the public modules
(keys, scope, client, CLI) at this level."""
