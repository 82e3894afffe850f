"""Keys of rendered forms: one rendering, one operation, on every engine.

A small shop (tests/support/formapp.py) renders its checkout form with
``idempotency_field()``; the tests post what a browser posts (the form's fields,
no header, the session cookie the page set) and count the orders in the database.
The browser itself drives the example app in tests/browser.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import time
import typing as t

import pytest
from flask import Flask

from flask_idempotency.errors import PROBLEM_JSON
from tests.conftest import Clock
from tests.support import formapp

BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"


@pytest.fixture
def shop(database_url: str, clock: Clock) -> t.Iterator[Flask]:
    app = formapp.create_app(database_url, clock)
    yield app
    with app.app_context():
        app.extensions["form_test"]["db"].engine.dispose()


def rendered_key(page: str, name: str = "idempotency_key") -> str:
    found = re.search(rf'name="{name}"[^>]* value="([^"]+)"', page)
    assert found, page
    return found.group(1)


def fields(key: str, item: str = "book", quantity: str = "2", **more: str) -> dict[str, str]:
    return {"idempotency_key": key, "item": item, "quantity": quantity, **more}


def records(app: Flask) -> list[t.Any]:
    import sqlalchemy as sa

    with app.app_context():
        db = app.extensions["form_test"]["db"]
        table = db.metadata.tables["idempotency_keys"]
        rows = db.session.execute(sa.select(table.c.scope, table.c.key))
        # MySQL's columns are binary: bytes there, str elsewhere.
        return [tuple(v.decode() if isinstance(v, bytes) else v for v in row) for row in rows]


def test_each_submission_of_one_rendering_is_one_order(shop: Flask) -> None:
    browser = shop.test_client()
    key = rendered_key(browser.get("/checkout").text)
    first = browser.post("/checkout", data=fields(key), headers={"Accept": BROWSER_ACCEPT})
    assert first.status_code == 303
    # The reload and the double click: the same rendered form again, after the
    # POST's answer changed the session (flash).
    again = browser.post("/checkout", data=fields(key), headers={"Accept": BROWSER_ACCEPT})
    assert again.status_code == 303
    assert again.headers["Location"] == first.headers["Location"]
    assert again.headers["Idempotent-Replayed"] == "true"
    assert formapp.order_count(shop) == 1
    [(scope, stored_key)] = records(shop)
    assert "form-session:" in scope
    assert stored_key != key
    assert len(stored_key) == 36  # a UUID4: every IDEMPOTENCY_KEY_FORMAT but a regex accepts it


def test_two_renderings_are_two_orders(shop: Flask) -> None:
    browser = shop.test_client()
    one = rendered_key(browser.get("/checkout").text)
    two = rendered_key(browser.get("/checkout").text)
    assert one != two
    assert browser.post("/checkout", data=fields(one)).status_code == 303
    assert browser.post("/checkout", data=fields(two)).status_code == 303
    assert formapp.order_count(shop) == 2


def test_a_corrected_form_is_a_new_operation(shop: Flask) -> None:
    browser = shop.test_client()
    key = rendered_key(browser.get("/checkout").text)
    refused = browser.post("/checkout", data=fields(key, quantity="zero"))
    assert refused.status_code == 422
    assert "quantity must be" in refused.text
    fixed_key = rendered_key(refused.text)
    assert fixed_key != key
    done = browser.post("/checkout", data=fields(fixed_key, quantity="3"))
    assert done.status_code == 303
    assert formapp.order_count(shop) == 1
    # The first submission replays its own answer (the page with the new key).
    again = browser.post("/checkout", data=fields(key, quantity="zero"))
    assert again.status_code == 422
    assert rendered_key(again.text) == fixed_key


def test_the_key_field_does_not_count_in_the_fingerprint(shop: Flask) -> None:
    browser = shop.test_client()
    key = rendered_key(browser.get("/checkout").text)
    assert browser.post("/checkout", data=fields(key, csrf_token="a")).status_code == 303
    # The same form with another CSRF token (a re-rendered page): the same operation.
    again = browser.post("/checkout", data=fields(key, csrf_token="b"))
    assert again.status_code == 303
    assert again.headers["Idempotent-Replayed"] == "true"
    changed = browser.post("/checkout", data=fields(key, quantity="5"))
    assert changed.status_code == 422
    assert formapp.order_count(shop) == 1


@pytest.mark.parametrize("accept", [BROWSER_ACCEPT, "application/json", "*/*"])
def test_a_forged_key_is_refused(shop: Flask, accept: str) -> None:
    browser = shop.test_client()
    key = rendered_key(browser.get("/checkout").text)
    payload, signature = key.rsplit(".", 1)
    altered = payload + "." + ("A" if signature[0] != "A" else "B") + signature[1:]
    for forged in (altered, "fk1.nonsense", "not-a-token", key[:-3]):
        answer = browser.post("/checkout", data=fields(forged), headers={"Accept": accept})
        assert answer.status_code == 400
        if accept == BROWSER_ACCEPT:
            assert answer.mimetype == "text/html"
            assert "cannot be submitted" in answer.text
            assert "<script" not in answer.text
        else:
            assert answer.mimetype == PROBLEM_JSON
            assert answer.json["type"].endswith("/form-key-invalid")
    assert formapp.order_count(shop) == 0
    assert records(shop) == []


def test_an_expired_key_is_refused(database_url: str, clock: Clock) -> None:
    app = formapp.create_app(database_url, clock, IDEMPOTENCY_FORM_KEY_MAX_AGE=600)
    browser = app.test_client()
    key = rendered_key(browser.get("/checkout").text)
    clock.advance(seconds=601)
    answer = browser.post("/checkout", data=fields(key), headers={"Accept": BROWSER_ACCEPT})
    assert answer.status_code == 400
    assert answer.mimetype == "text/html"
    assert "expired" in answer.text
    assert "10 minutes" in answer.text
    api = browser.post("/checkout", data=fields(key))
    assert api.json["type"].endswith("/form-key-expired")
    assert formapp.order_count(app) == 0
    # Within the age, the same kind of form works.
    key = rendered_key(browser.get("/checkout").text)
    clock.advance(seconds=599)
    assert browser.post("/checkout", data=fields(key)).status_code == 303


def test_the_max_age_never_outlives_the_record(database_url: str, clock: Clock) -> None:
    app = formapp.create_app(
        database_url, clock, IDEMPOTENCY_FORM_KEY_MAX_AGE=7200, IDEMPOTENCY_TTL=3600
    )
    browser = app.test_client()
    key = rendered_key(browser.get("/checkout").text)
    clock.advance(seconds=3601)
    assert browser.post("/checkout", data=fields(key)).status_code == 400
    assert formapp.order_count(app) == 0


def test_another_callers_form_is_refused(shop: Flask) -> None:
    alice, mallory = shop.test_client(), shop.test_client()
    key = rendered_key(alice.get("/checkout").text)
    mallory.get("/checkout")  # a session of her own
    stolen = mallory.post("/checkout", data=fields(key))
    assert stolen.status_code == 400
    assert "another user or session" in stolen.json["detail"]
    no_session = shop.test_client().post("/checkout", data=fields(key))
    assert no_session.status_code == 400
    assert formapp.order_count(shop) == 0
    assert alice.post("/checkout", data=fields(key)).status_code == 303


def test_another_forms_key_is_refused(shop: Flask) -> None:
    browser = shop.test_client()
    key = rendered_key(browser.get("/checkout").text)
    answer = browser.post("/checkout-direct", data=fields(key))
    assert answer.status_code == 400
    assert "'checkout'" in answer.json["detail"]
    assert formapp.order_count(shop) == 0


def test_the_header_wins_and_fetch_sends_the_token(shop: Flask) -> None:
    browser = shop.test_client()
    key = rendered_key(browser.get("/checkout").text)
    # A header key is the client's own: the form field is not read.
    header = browser.post("/checkout", data=fields("junk"), headers={"Idempotency-Key": '"k1"'})
    assert header.status_code == 303
    # The rendered token as the header of a fetch(): verified, the same operation
    # as the form's own submission.
    fetched = browser.post("/checkout", data=fields(key), headers={"Idempotency-Key": key})
    assert fetched.status_code == 303
    again = browser.post("/checkout", data=fields(key))
    assert again.headers["Idempotent-Replayed"] == "true"
    # A character inside the signature: the last one carries bits base64 ignores.
    altered = key[:-5] + ("A" if key[-5] != "A" else "B") + key[-4:]
    forged = browser.post("/checkout", data=fields("x"), headers={"Idempotency-Key": altered})
    assert forged.status_code == 400
    assert formapp.order_count(shop) == 2


def test_fetch_with_json_and_the_rendered_key(shop: Flask) -> None:
    browser = shop.test_client()
    page = browser.get("/fetch").text
    key = json.loads(re.search(r"const key = (.*?);", page).group(1))  # type: ignore[union-attr]
    order = {"item": "a", "quantity": 1}
    first = browser.post("/api/orders", json=order, headers={"Idempotency-Key": key})
    again = browser.post("/api/orders", json=order, headers={"Idempotency-Key": f'"{key}"'})
    assert first.status_code == again.status_code == 201
    assert again.json == first.json
    assert again.headers["Idempotent-Replayed"] == "true"
    # A token rendered for the checkout form is refused here.
    other = rendered_key(browser.get("/checkout").text)
    refused = browser.post("/api/orders", json=order, headers={"Idempotency-Key": other})
    assert refused.status_code == 400
    assert refused.mimetype == PROBLEM_JSON
    assert formapp.order_count(shop) == 1


def test_a_custom_error_handler_renders_the_refusal(database_url: str, clock: Clock) -> None:
    from flask_idempotency import FormKeyError

    app = formapp.create_app(database_url, clock)

    @app.errorhandler(FormKeyError)
    def refused(error: FormKeyError) -> tuple[str, int]:
        return f"<p>sorry: {error.reason}</p>", 400

    browser = app.test_client()
    browser.get("/checkout")
    answer = browser.post("/checkout", data=fields("fk1.x"))
    assert answer.text == "<p>sorry: forged</p>"


def test_rotated_secret_keys_still_verify(database_url: str, clock: Clock) -> None:
    app = formapp.create_app(database_url, clock)
    browser = app.test_client()
    key = rendered_key(browser.get("/checkout").text)
    app.config["SECRET_KEY_FALLBACKS"] = ["form-test-secret"]
    app.config["SECRET_KEY"] = app.secret_key = "the-new-secret"
    # The session cookie is signed with the old key too: Flask reads it through
    # the fallbacks, and so does the form key.
    assert browser.post("/checkout", data=fields(key)).status_code == 303
    assert formapp.order_count(app) == 1


def test_no_secret_key(database_url: str, clock: Clock) -> None:
    app = formapp.create_app(database_url, clock)
    browser = app.test_client()
    key = rendered_key(browser.get("/checkout").text)
    app.config["SECRET_KEY"] = app.secret_key = None
    with pytest.raises(RuntimeError, match="SECRET_KEY"), app.test_request_context("/checkout"):
        app.jinja_env.globals["idempotency_field"]()
    answer = browser.post("/checkout", data=fields(key))
    assert answer.status_code == 503  # server-misconfigured: nothing stored, retry later
    assert answer.mimetype == PROBLEM_JSON
    assert formapp.order_count(app) == 0


def test_a_view_that_is_not_protected_is_named(shop: Flask) -> None:
    with shop.test_request_context("/orders/1"), pytest.raises(ValueError, match="not a view"):
        shop.jinja_env.globals["idempotency_field"]("order_page")


@pytest.mark.parametrize("order", ["before", "after"])
def test_flask_wtf_csrf_protect(database_url: str, clock: Clock, order: str) -> None:
    pytest.importorskip("flask_wtf", reason="Flask-WTF is in requirements-dev.txt")
    app = formapp.create_app(database_url, clock, csrf=order)
    browser = app.test_client()
    page = browser.get("/wtf").text
    key, csrf = rendered_key(page), rendered_key(page, "csrf_token")
    sent = {"idempotency_key": key, "csrf_token": csrf, "item": "pen", "quantity": "1"}
    assert browser.post("/wtf", data=sent).status_code == 303
    assert browser.post("/wtf", data=sent).headers["Idempotent-Replayed"] == "true"
    # A failed validation re-renders a new key and a new CSRF token.
    second = browser.get("/wtf").text
    bad = {**sent, "idempotency_key": rendered_key(second), "quantity": "0"}
    bad["csrf_token"] = rendered_key(second, "csrf_token")
    refused = browser.post("/wtf", data=bad)
    assert refused.status_code == 422
    fixed = {
        **bad,
        "idempotency_key": rendered_key(refused.text),
        "csrf_token": rendered_key(refused.text, "csrf_token"),
        "quantity": "4",
    }
    assert fixed["idempotency_key"] != bad["idempotency_key"]
    assert browser.post("/wtf", data=fixed).status_code == 303
    # Without its CSRF token, Flask-WTF refuses before the extension runs: nothing stored.
    third = rendered_key(browser.get("/wtf").text)
    before = len(records(app))
    assert (
        browser.post("/wtf", data={**sent, "idempotency_key": third, "csrf_token": ""}).status_code
        == 400
    )
    assert len(records(app)) == before
    assert formapp.order_count(app) == 2


def test_problem_pages_for_other_problems_of_a_form_request(shop: Flask) -> None:
    browser = shop.test_client()
    key = rendered_key(browser.get("/checkout").text)
    assert browser.post("/checkout", data=fields(key)).status_code == 303
    mismatch = browser.post(
        "/checkout", data=fields(key, quantity="9"), headers={"Accept": BROWSER_ACCEPT}
    )
    assert mismatch.status_code == 422
    assert mismatch.mimetype == "text/html"
    as_api = browser.post("/checkout", data=fields(key, quantity="9"))
    assert as_api.mimetype == PROBLEM_JSON
    assert json.loads(as_api.text)["status"] == 422


def test_an_expired_key_still_replays_its_order(database_url: str, clock: Clock) -> None:
    app = formapp.create_app(database_url, clock, IDEMPOTENCY_FORM_KEY_MAX_AGE=300)
    browser = app.test_client()
    key = rendered_key(browser.get("/checkout").text)
    first = browser.post("/checkout", data=fields(key))
    clock.advance(seconds=3600)
    # The reload of the result an hour later: the record is kept for the ttl, so
    # it replays; it never starts an order.
    again = browser.post("/checkout", data=fields(key))
    assert again.status_code == 303
    assert again.headers["Location"] == first.headers["Location"]
    assert again.headers["Idempotent-Replayed"] == "true"
    changed = browser.post("/checkout", data=fields(key, quantity="7"))
    assert changed.status_code == 422
    assert formapp.order_count(app) == 1


def test_clock_skew_between_hosts_cannot_outlive_the_record(
    database_url: str, clock: Clock
) -> None:
    ahead = Clock()
    ahead.now = clock.now + dt.timedelta(minutes=4)
    renderer = formapp.create_app(database_url, ahead, IDEMPOTENCY_TTL=3600)
    storer = formapp.create_app(database_url, clock, IDEMPOTENCY_TTL=3600, create=False)
    page = renderer.test_client()
    key = rendered_key(page.get("/checkout").text)
    browser = storer.test_client()
    browser.set_cookie("session", page.get_cookie("session").value)  # type: ignore[union-attr]
    assert browser.post("/checkout", data=fields(key)).status_code == 303
    clock.advance(minutes=62)  # past the record's ttl on the storing host
    again = browser.post("/checkout", data=fields(key))
    assert again.status_code == 400
    assert again.json["type"].endswith("/form-key-expired")
    assert formapp.order_count(storer) == 1
    # Issued further ahead than the tolerance: refused as not this server's.
    ahead.now = clock.now + dt.timedelta(minutes=6)
    future = rendered_key(page.get("/checkout").text)
    assert browser.post("/checkout", data=fields(future)).status_code == 400


def test_a_clients_own_key_that_starts_like_a_token(shop: Flask) -> None:
    api = shop.test_client()
    for _ in range(2):
        answer = api.post(
            "/api/orders",
            json={"item": "a", "quantity": 1},
            headers={"Idempotency-Key": "fk1.2f1c0a9e-order-77"},
        )
        assert answer.status_code == 201
    assert formapp.order_count(shop) == 1


def test_signed_payloads_of_another_shape_are_refused(shop: Flask) -> None:
    from itsdangerous import URLSafeSerializer

    browser = shop.test_client()
    real = rendered_key(browser.get("/checkout").text)
    signer = URLSafeSerializer("form-test-secret", salt="flask-idempotency.form-key")
    good = signer.loads(real[4:])
    shapes = [
        [good[0], good[1], good[2], 10**30],
        [good[0], good[1], good[2], -(10**30)],
        [good[0], good[1], good[2], 1.5],
        ["x" * 5000, good[1], good[2], good[3]],
        {"key": good[0]},
        [good[0], good[1], good[2]],
        [good[0], None, good[2], good[3]],
    ]
    for shape in shapes:
        token = "fk1." + signer.dumps(shape)
        answer = browser.post("/checkout", data=fields(token))
        assert answer.status_code == 400, shape
        assert answer.mimetype == PROBLEM_JSON
    assert formapp.order_count(shop) == 0


def test_forms_off(database_url: str, clock: Clock) -> None:
    app = formapp.create_app(database_url, clock, IDEMPOTENCY_FORM_FIELD=None)
    with app.test_request_context("/checkout"), pytest.raises(RuntimeError, match="FORM_FIELD"):
        app.jinja_env.globals["idempotency_field"]()


def test_a_form_too_large_is_a_problem(database_url: str, clock: Clock) -> None:
    app = formapp.create_app(database_url, clock, MAX_FORM_PARTS=5)
    browser = app.test_client()
    key = rendered_key(browser.get("/checkout").text)
    many = {**fields(key), **{f"f{i}": "x" for i in range(10)}}
    answer = browser.post("/checkout", data=many, content_type="multipart/form-data")
    assert answer.status_code == 413
    assert answer.mimetype == PROBLEM_JSON
    assert formapp.order_count(app) == 0


def test_a_key_format_does_not_refuse_form_keys(database_url: str, clock: Clock) -> None:
    app = formapp.create_app(database_url, clock, IDEMPOTENCY_KEY_FORMAT="uuid7")
    browser = app.test_client()
    key = rendered_key(browser.get("/checkout").text)
    assert browser.post("/checkout", data=fields(key)).status_code == 303
    assert formapp.order_count(app) == 1


def test_the_token_reveals_no_caller(shop: Flask) -> None:
    import hashlib

    from itsdangerous import URLSafeSerializer

    browser = shop.test_client()
    token = rendered_key(browser.get("/checkout").text)
    payload = URLSafeSerializer("form-test-secret", salt="flask-idempotency.form-key").loads(
        token[4:]
    )
    # The digest is keyed: the plain SHA-256 of any scope it could stand for is not it.
    candidates = ["checkout", "checkout|anonymous", "user:1"]
    assert all(hashlib.sha256(c.encode()).hexdigest()[:32] != payload[2] for c in candidates)


@pytest.mark.parametrize("key", [None, "header"])
def test_the_view_still_reads_a_form_body_as_sent(shop: Flask, key: str | None) -> None:
    headers = {"Idempotency-Key": '"w1"'} if key else {}
    body = "event=paid&amount=12"
    answer = shop.test_client().post(
        "/webhook", data=body, content_type="application/x-www-form-urlencoded", headers=headers
    )
    assert answer.json == {"raw": body, "form": {"event": "paid", "amount": "12"}}


def test_a_double_click_on_a_leased_route_waits_for_the_first(
    database_url: str, clock: Clock
) -> None:
    import threading

    app = formapp.create_app(database_url, clock, CHECKOUT_DELAY=1.0)
    page = app.test_client()
    key = rendered_key(page.get("/checkout-leased").text)
    cookie = page.get_cookie("session").value  # type: ignore[union-attr]
    answers: list[t.Any] = []

    def click() -> None:
        browser = app.test_client()
        browser.set_cookie("session", cookie)
        answers.append(
            browser.post("/checkout-leased", data=fields(key), headers={"Accept": BROWSER_ACCEPT})
        )

    first = threading.Thread(target=click)
    first.start()
    time.sleep(0.3)  # the second click, while the first runs its view
    click()
    first.join()
    assert sorted(a.status_code for a in answers) == [303, 303]
    assert len({a.headers["Location"] for a in answers}) == 1
    assert formapp.order_count(app) == 1


def test_two_tabs_rendered_at_once_from_one_session(shop: Flask) -> None:
    # A session without an owner yet (a sign-in sets it up, say): a flash will do.
    signed_in = shop.test_client()
    with signed_in.session_transaction() as session:
        session["user"] = "alice"
    # Two renders from the same incoming cookie, as two tabs opened together.
    cookie = signed_in.get_cookie("session").value  # type: ignore[union-attr]
    tabs = []
    for _ in range(2):
        tab = shop.test_client()
        tab.set_cookie("session", cookie)
        tabs.append(tab)
    keys = [rendered_key(tab.get("/checkout").text) for tab in tabs]
    # The browser keeps whichever cookie came last: both tabs' forms go through.
    last = tabs[1].get_cookie("session").value  # type: ignore[union-attr]
    for key in keys:
        submit = shop.test_client()
        submit.set_cookie("session", last)
        assert submit.post("/checkout", data=fields(key)).status_code == 303
    assert formapp.order_count(shop) == 2


def test_a_visitor_reads_pages_written_for_them(database_url: str, clock: Clock) -> None:
    app = formapp.create_app(database_url, clock, IDEMPOTENCY_REQUIRED=True)
    browser = app.test_client()
    html = {"Accept": BROWSER_ACCEPT}
    # A form without its key field (an old cached page) on a route that requires one.
    missing = browser.post("/checkout", data={"item": "a", "quantity": "1"}, headers=html)
    assert missing.status_code == 400
    assert missing.mimetype == "text/html"
    assert "Reload the page" in missing.text
    assert "header" not in missing.text
    key = rendered_key(browser.get("/checkout").text)
    assert browser.post("/checkout", data=fields(key), headers=html).status_code == 303
    changed = browser.post("/checkout", data=fields(key, quantity="3"), headers=html)
    assert changed.status_code == 422
    assert "already sent with other values" in changed.text
    assert "Idempotency" not in changed.text.split("</h1>", 1)[1]
    # An API client sending a form body gets problem+json, as ever.
    api = browser.post("/checkout", data=fields(key, quantity="3"))
    assert api.mimetype == PROBLEM_JSON
    assert formapp.order_count(app) == 1
