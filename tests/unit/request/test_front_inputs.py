"""What the request's front reads (body, query arguments, key header, the scope's
cookie and Authorization) is what the request object says, however it got it: a
request class or a hook that gives arguments, cookies or headers of its own, and
a middleware that serves a second request from a copy of an environ. A retry of
a record made before the front read the environ directly must still match it.
"""

from __future__ import annotations

import hashlib
import io
import typing as t

from flask import Flask, request
from flask.wrappers import Request
from werkzeug.datastructures import Headers, ImmutableMultiDict
from werkzeug.utils import cached_property

from flask_idempotency._request.body import read_body
from flask_idempotency._request.fingerprint import request_fingerprint
from flask_idempotency._request.wsgi import request_header_values
from flask_idempotency.scope import default_scope

POST: dict[str, t.Any] = {"method": "POST", "data": b"x", "content_type": "text/plain"}


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_a_request_served_from_a_copy_of_an_environ_is_judged_by_its_own_body() -> None:
    app = Flask(__name__)
    with app.test_request_context("/", method="POST", data=b"first"):
        assert read_body() == b"first"
        # A batch or sub-request middleware: the same environ, another body.
        copied = dict(request.environ, CONTENT_LENGTH="6")
        copied["wsgi.input"] = io.BytesIO(b"second")
    with app.request_context(copied):
        assert read_body() == b"second"
        assert request.get_data() == b"second"


class Defaults(Request):
    """A request class that fills in a query argument the URL may leave out."""

    @cached_property
    def args(self) -> ImmutableMultiDict[str, str]:  # type: ignore[override]
        return ImmutableMultiDict({"page_size": "50", **super().args.to_dict()})


def test_query_arguments_a_hook_gives_count_in_the_fingerprint() -> None:
    app = Flask(__name__)
    with app.test_request_context("/pay?region=eu", **POST):
        _, sent = request_fingerprint(None, ())
    with app.test_request_context("/pay", **POST):
        request.args = ImmutableMultiDict({"region": "eu"})
        _, given = request_fingerprint(None, ())
    assert given == sent


def test_query_arguments_a_request_class_gives_count_in_the_fingerprint() -> None:
    app = Flask(__name__)
    with app.test_request_context("/pay?page_size=50", **POST):
        _, sent = request_fingerprint(None, ())
    app.request_class = Defaults
    with app.test_request_context("/pay", **POST):
        _, given = request_fingerprint(None, ())
    assert given == sent


class HeaderSession(Request):
    """A request class that takes the session from a header (a mobile client's)."""

    @cached_property
    def cookies(self) -> ImmutableMultiDict[str, str]:  # type: ignore[override]
        sent = self.headers.get("X-Session")
        return ImmutableMultiDict({"session": sent}) if sent else super().cookies


def test_a_session_cookie_a_request_class_gives_scopes_its_caller() -> None:
    app = Flask(__name__)
    app.request_class = HeaderSession
    with app.test_request_context("/pay", headers={"X-Session": "opaque"}, **POST):
        # Not the anonymous scope "/pay", which every such caller would share.
        assert default_scope() == f"/pay|session:{sha256('opaque')}"


def test_a_session_cookie_a_hook_gives_scopes_its_caller() -> None:
    app = Flask(__name__)
    with app.test_request_context("/pay", **POST):
        request.cookies = ImmutableMultiDict({"session": "opaque"})
        assert default_scope() == f"/pay|session:{sha256('opaque')}"


def test_headers_a_hook_gives_name_the_key_and_the_caller() -> None:
    app = Flask(__name__)
    with app.test_request_context("/pay", headers={"Idempotency-Key": "sent"}, **POST):
        request.headers = Headers({"Idempotency-Key": "given", "Authorization": "Bearer t"})
        assert request_header_values(request, "Idempotency-Key") == ["given"]
        assert default_scope() == f"/pay|bearer:{sha256('t')}"


def test_the_key_header_of_a_plain_request_is_read_from_its_environ() -> None:
    app = Flask(__name__)
    with app.test_request_context("/pay", headers={"Idempotency-Key": "sent"}, **POST):
        assert request_header_values(request, "Idempotency-Key") == ["sent"]
        assert request_header_values(request, "Idempotency_Key") == []
