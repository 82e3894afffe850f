"""Tests that start real processes: servers in subprocesses, gunicorn, networks.

``LiveServer`` is importable from here too, as it was when ``tests/live.py`` held it:
the review scripts in ``../shared/repros/`` import it by that path.
"""

from tests.support.live import LiveServer as LiveServer
