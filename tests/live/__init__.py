"""Tests that start real processes: live servers, gunicorn, ``flask`` commands,
relays and schedulers, network partitions, the README's blocks."""
