"""What the tests share and are not tests themselves: the test apps, servers run
in subprocesses (``python -m tests.support.live_server``, gunicorn on
``tests.support.gunicorn_app:app``), a TCP proxy, fake downstreams, gates that
park a view, private database servers, and helpers used by several test files."""
