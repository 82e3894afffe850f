"""Form bodies: judged by their fields whoever parsed them first, stored faithfully.

Flask-WTF's ``CSRFProtect`` (and any ``before_request`` hook that touches
``request.form``) parses a form before the extension reads the body; werkzeug
then has consumed the bytes. The fingerprint must count the same fields as for
an unparsed form, and a ``recover=True`` route must store a re-encoding the
recovery job can re-run. Request contexts of a plain app first; then the test
app on every engine, counting ledger rows.
"""

from __future__ import annotations

import hashlib
import io
import typing as t
import urllib.parse

import pytest
from flask import Flask, request
from werkzeug.datastructures import FileStorage, MultiDict

from flask_idempotency._request.fingerprint import request_fingerprint
from tests.conftest import Clock, ledger_count, record_rows, reset_tables
from tests.support import testapp
from tests.support.forms import URLENCODED, multipart

Form = tuple[bytes, str]


def urlencoded(*pairs: tuple[str, str]) -> Form:
    return urllib.parse.urlencode(pairs).encode(), URLENCODED


FORMS: dict[str, Form] = {
    "urlencoded": urlencoded(("amount", "100"), ("tag", "a"), ("tag", "b")),
    "urlencoded-one": urlencoded(("amount", "100")),
    "multipart-fields": multipart("b0", fields_=[("amount", "100"), ("tag", "a"), ("tag", "b")]),
    "multipart-file": multipart(
        "b1", fields_=[("amount", "100")], files=[("receipt", "r.txt", b"receipt bytes")]
    ),
    "multipart-files-only": multipart(
        "b2", files=[("a", "a.bin", b"\x00\x01--b2\r\n"), ("a", "", b"")]
    ),
    "multipart-empty": multipart("b3"),
    "urlencoded-empty-field": (b"&", URLENCODED),
}


def parse_form_first() -> None:
    """What ``CSRFProtect.protect()`` does in its ``before_request`` hook."""
    request.form.get("csrf_token")


def form_hash(app: Flask, form: Form, *, parsed_first: bool, exclude: t.Sequence[str] = ()) -> str:
    body, content_type = form
    with app.test_request_context(method="POST", path="/x", data=body, content_type=content_type):
        if parsed_first:
            parse_form_first()
        return request_fingerprint(None, exclude)[1]


@pytest.fixture
def plain_app() -> Flask:
    return Flask(__name__)


@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
def test_form_parsed_first_fingerprints_as_an_unparsed_one(plain_app: Flask, form: Form) -> None:
    assert form_hash(plain_app, form, parsed_first=True) == form_hash(
        plain_app, form, parsed_first=False
    )


@pytest.mark.parametrize(
    ("one", "two"),
    [
        (urlencoded(("amount", "100")), urlencoded(("amount", "999999"))),
        (urlencoded(("tag", "a"), ("tag", "b")), urlencoded(("tag", "b"), ("tag", "a"))),
        (
            multipart("b", files=[("f", "r.txt", b"one")]),
            multipart("b", files=[("f", "r.txt", b"two")]),
        ),
        (urlencoded(("amount", "100")), (b"", URLENCODED)),
    ],
    ids=["value", "value-order", "file-content", "empty"],
)
def test_different_forms_parsed_first_differ(plain_app: Flask, one: Form, two: Form) -> None:
    assert form_hash(plain_app, one, parsed_first=True) != form_hash(
        plain_app, two, parsed_first=True
    )


def test_form_parsed_first_honours_exclude(plain_app: Flask) -> None:
    def sent_at(value: str) -> str:
        form = urlencoded(("amount", "1"), ("client.sent_at", value))
        return form_hash(plain_app, form, parsed_first=True, exclude=[r"client\.sent_at"])

    assert sent_at("10:00") == sent_at("10:05")


def test_file_a_hook_already_read_counts_whole(plain_app: Flask) -> None:
    form = FORMS["multipart-file"]
    untouched = form_hash(plain_app, form, parsed_first=False)
    body, content_type = form
    with plain_app.test_request_context(
        method="POST", path="/x", data=body, content_type=content_type
    ):
        assert request.files["receipt"].read(7) == b"receipt"
        assert request_fingerprint(None, ())[1] == untouched
        assert request.files["receipt"].read() == b" bytes"  # left where the hook left it


# -- the stored request of recover=True routes ---------------------------------------


def stored(app: Flask, form: Form, *, parsed_first: bool) -> tuple[bytes, str | None]:
    from flask_idempotency._request.fingerprint import stored_request_body

    body, content_type = form
    with app.test_request_context(method="POST", path="/x", data=body, content_type=content_type):
        if parsed_first:
            parse_form_first()
        request_fingerprint(None, ())
        return stored_request_body()


def seen(app: Flask, form: Form) -> tuple[dict[str, list[str]], list[tuple[str, ...]], str]:
    """What a view sees of a form: fields, files (name, filename, type, digest), fingerprint."""
    body, content_type = form
    with app.test_request_context(method="POST", path="/x", data=body, content_type=content_type):
        files = [
            (name, s.filename or "", s.content_type or "", hashlib.sha256(s.read()).hexdigest())
            for name, s in request.files.items(multi=True)
        ]
        return request.form.to_dict(flat=False), files, request_fingerprint(None, ())[1]


@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
def test_unparsed_form_is_stored_as_sent(plain_app: Flask, form: Form) -> None:
    assert stored(plain_app, form, parsed_first=False) == form


HANDWRITTEN = (
    b"--b\r\nContent-Disposition: form-data; name*=UTF-8''new%0D%0Aline\r\n\r\nv\r\n"
    b"--b\r\nContent-Disposition: form-data\r\n\r\nnameless\r\n"
    b"--b\r\nContent-Disposition: form-data; name=f; filename*=UTF-8''a%0Ab.txt\r\n"
    b"Content-Type: text/plain; charset=latin-1\r\n\r\nx\r\n"
    b"--b\r\nContent-Disposition: form-data; name=latin\r\n"
    b"Content-Type: text/plain; charset=iso-8859-1\r\n\r\n\xe9\r\n"
    b"--b--\r\n",
    "multipart/form-data; boundary=b",
)


@pytest.mark.parametrize("form", [*FORMS.values(), HANDWRITTEN], ids=[*FORMS.keys(), "handwritten"])
def test_form_parsed_first_is_stored_as_a_faithful_reencoding(plain_app: Flask, form: Form) -> None:
    body, content_type = stored(plain_app, form, parsed_first=True)
    assert body
    assert content_type is not None
    assert seen(plain_app, (body, content_type)) == seen(plain_app, form)


def test_empty_form_parsed_first_is_stored_empty(plain_app: Flask) -> None:
    assert stored(plain_app, (b"", URLENCODED), parsed_first=True) == (b"", URLENCODED)


TRICKY = [
    "plain",
    'quote"d',
    "back\\slash",
    "semi;colon=x",
    "per%22cent",
    "caf\u00e9 \U0001f600",
    "",
    "dotted.name",
]


@pytest.mark.parametrize("text", TRICKY)
def test_reencoded_multipart_keeps_tricky_names_and_values(plain_app: Flask, text: str) -> None:
    data = MultiDict(
        [
            (text, text),
            (text, "second"),
            ("file", FileStorage(io.BytesIO(b"--x\r\n" + text.encode()), filename=text or "f")),
            (
                text,
                FileStorage(io.BytesIO(b"\xff\x00"), filename=text, content_type="image/png"),
            ),
        ]
    )
    with plain_app.test_request_context(method="POST", path="/x", data=data):
        original = request.content_type
        original_body = request.get_data()
    form = (original_body, t.cast(str, original))
    body, content_type = stored(plain_app, form, parsed_first=True)
    assert content_type is not None
    assert content_type.startswith("multipart/form-data; boundary=")
    assert seen(plain_app, (body, content_type)) == seen(plain_app, form)


@pytest.mark.parametrize("text", [*TRICKY, "new\r\nline"])
def test_reencoded_urlencoded_keeps_tricky_names_and_values(plain_app: Flask, text: str) -> None:
    form = urlencoded((text, text), ("a", "1"), (text, "2"))
    body, content_type = stored(plain_app, form, parsed_first=True)
    assert content_type == URLENCODED
    assert seen(plain_app, (body, content_type)) == seen(plain_app, form)


# -- through the app, on every engine ------------------------------------------------


def csrf_like_app(database_url: str) -> Flask:
    app = testapp.create_app(database_url, clock=Clock())
    app.before_request(parse_form_first)

    @app.post("/form-pay")
    @testapp.idem.idempotent()
    def form_pay() -> tuple[dict[str, t.Any], int]:
        amount = int(request.form["amount"])
        receipt = request.files.get("receipt")
        row = testapp.write_ledger("form-pay", amount)
        return {"id": row.id, "amount": amount, "receipt": receipt and receipt.read().decode()}, 201

    reset_tables(database_url)
    return app


@pytest.mark.parametrize(
    ("first", "other"),
    [
        (urlencoded(("amount", "100")), urlencoded(("amount", "999999"))),
        (
            multipart("b1", fields_=[("amount", "100")], files=[("receipt", "r", b"one")]),
            multipart("b2", fields_=[("amount", "100")], files=[("receipt", "r", b"two")]),
        ),
    ],
    ids=["urlencoded", "multipart"],
)
def test_form_parsed_before_the_extension_is_judged_by_its_fields(
    database_url: str, first: Form, other: Form
) -> None:
    app = csrf_like_app(database_url)
    client = app.test_client()

    def send(form: Form) -> t.Any:
        body, content_type = form
        return client.post(
            "/form-pay", data=body, content_type=content_type, headers={"Idempotency-Key": "K"}
        )

    answer = send(first)
    assert answer.status_code == 201
    assert send(other).status_code == 422
    replay = send(first)
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.get_data() == answer.get_data()
    assert ledger_count(app, "form-pay") == 1
    assert len(record_rows(app)) == 1


def test_recovery_job_reruns_a_form_parsed_first(database_url: str, clock: Clock) -> None:
    app = testapp.create_app(database_url, clock=clock)
    app.before_request(parse_form_first)
    seen_forms: list[t.Any] = []

    @app.post("/form-recover")
    @testapp.idem.idempotent(lease=30, recover=True)
    def form_recover() -> tuple[dict[str, t.Any], int]:
        testapp.idem.step("psp", lambda: "charged")  # the record stays for the job
        receipt = request.files["receipt"]
        seen_forms.append((request.form.to_dict(flat=False), receipt.filename, receipt.read()))
        if len(seen_forms) == 1:
            raise RuntimeError("the worker died")
        row = testapp.write_ledger("form-recover", int(request.form["amount"]))
        return {"id": row.id}, 201

    reset_tables(database_url)
    app.config["PROPAGATE_EXCEPTIONS"] = False
    client = app.test_client()
    body, content_type = multipart(
        "b1",
        fields_=[("amount", "100"), ("tag", "a"), ("tag", "b")],
        files=[("receipt", "r.txt", b"receipt\r\n--b0")],
    )
    send = {"data": body, "content_type": content_type, "headers": {"Idempotency-Key": "R"}}
    assert client.post("/form-recover", **send).status_code == 500
    [record] = record_rows(app)
    assert record["request_body"]  # what the job will re-run

    clock.advance(seconds=31)
    from flask_idempotency._maintenance.jobs import recover_abandoned

    assert recover_abandoned(app).completed == 1
    assert seen_forms[1] == seen_forms[0]
    assert ledger_count(app, "form-recover") == 1
    replay = client.post("/form-recover", **send)
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert ledger_count(app, "form-recover") == 1
