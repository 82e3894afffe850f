"""Finding, showing and releasing one record from the command line, by the key as
the client sent it and the scope as the README describes it.

Through ``app.test_cli_runner()`` against the real database (PostgreSQL and SQLite).
"""

from __future__ import annotations

import hashlib
import json
import typing as t

import pytest
from flask import Flask

from tests.conftest import Clock, ledger_count, record_rows
from tests.support.redact_app import MARKER, SCOPE, make_app
from tests.support.scopes import basic_scope

ENDPOINT = "t.scope_charge"


def cli(app: Flask, *args: str, input: str | None = None) -> t.Any:
    return app.test_cli_runner().invoke(args=["idempotency", *args], input=input)


def charge(client: t.Any, key: str, **kw: t.Any) -> t.Any:
    return client.post(
        "/scope/charge",
        json={"amount": 5},
        headers={"Idempotency-Key": key, **kw.pop("headers", {})},
        **kw,
    )


@pytest.mark.parametrize("sent", ["order-42", '"order-42"', ' "order-42" '])
def test_show_takes_the_key_as_sent_and_the_documented_basic_scope(
    app: Flask, client: t.Any, sent: str
) -> None:
    charge(client, '"order-42"', auth=("alice", "pw"))
    scope = basic_scope(app, "alice", "pw")

    result = cli(app, "show", scope, sent)

    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert (shown["scope"], shown["key"]) == (scope, "order-42")
    assert shown["status"] == "completed"
    assert shown["response_code"] == 201


def test_release_takes_a_quoted_key_and_keeps_a_completed_record(app: Flask, client: t.Any) -> None:
    charge(client, "order-42", headers={"Authorization": "Bearer tok"})
    scope = f"{ENDPOINT}|bearer:{hashlib.sha256(b'tok').hexdigest()}"

    result = cli(app, "release", scope, '"order-42"', "--yes")

    assert result.exit_code == 1, result.output
    assert "not released: it is completed" in result.output
    assert len(record_rows(app)) == 1
    again = charge(client, "order-42", headers={"Authorization": "Bearer tok"})
    assert again.headers["Idempotent-Replayed"] == "true"
    assert ledger_count(app, "scope/charge") == 1


@pytest.mark.parametrize(
    ("command", "args", "complaint"),
    [
        ("show", [f"{ENDPOINT}|basic:alice", '"order-42'], "no closing quote"),
        ("release", [f"{ENDPOINT}|basic:alice", "a,b", "--yes"], "comma"),
        ("release", [f"{ENDPOINT}|basic:alice", "k" * 256, "--yes"], "at most 255"),
        ("release", ["", "order-42", "--yes"], "must not be empty"),
        ("show", ["s" * 513, "order-42"], "at most 512"),
        ("list", ["--key", '""'], "must not be empty"),
    ],
)
def test_a_malformed_key_or_scope_is_a_usage_error_and_changes_nothing(
    app: Flask, client: t.Any, command: str, args: list[str], complaint: str
) -> None:
    charge(client, "order-42", auth=("alice", "pw"))

    result = cli(app, command, *args)

    assert result.exit_code == 2, result.output
    assert complaint in result.output
    assert len(record_rows(app)) == 1


def test_list_finds_a_record_by_the_clients_key(app: Flask, client: t.Any, clock: Clock) -> None:
    # A bearer scope cannot be built without the token: find it by the key.
    charge(client, "order-42", headers={"Authorization": "Bearer unknown-to-the-operator"})
    clock.advance(seconds=1)
    charge(client, "order-42", auth=("alice", "pw"))
    charge(client, "order-43", auth=("alice", "pw"))

    result = cli(app, "list", "--key", '"order-42"')

    assert result.exit_code == 0, result.output
    found = json.loads(result.output)
    assert [(r["scope"].split("|")[1].split(":")[0], r["key"]) for r in found] == [
        ("basic", "order-42"),  # newest first
        ("bearer", "order-42"),
    ]
    assert all(r["status"] == "completed" and r["expired"] is False for r in found)
    bearer_scope = found[1]["scope"]
    shown = cli(app, "show", bearer_scope, "order-42")
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["scope"] == bearer_scope


def test_list_by_scope_prefix_compares_byte_for_byte(app: Flask, client: t.Any) -> None:
    charge(client, "k1", auth=("alice", "pw"))
    charge(client, "k2", auth=("Alice", "pw"))
    charge(client, "k3", auth=("bob", "pw"))
    client.post("/scope/refund", headers={"Idempotency-Key": "k4"}, auth=("alice", "pw"))

    def listed(*args: str) -> list[tuple[str, str]]:
        result = cli(app, "list", *args)
        assert result.exit_code == 0, result.output
        return sorted((r["scope"], r["key"]) for r in json.loads(result.output))

    # A user's records, by the readable user name the Basic scope starts with.
    assert listed("--scope-prefix", f"{ENDPOINT}|basic:alice:") == [
        (basic_scope(app, "alice", "pw"), "k1")
    ]
    assert listed("--scope-prefix", f"{ENDPOINT}|basic:A") == [
        (basic_scope(app, "Alice", "pw"), "k2")
    ]
    assert [k for _, k in listed("--scope-prefix", f"{ENDPOINT}|")] == ["k2", "k1", "k3"]
    assert listed("--scope-prefix", "T.SCOPE") == []  # no case folding, SQLite included
    assert len(listed("--limit", "2")) == 2
    assert listed("--status", "in_progress") == []
    assert len(listed()) == 4


def test_release_leaves_alone_a_record_that_completed_during_the_prompt(
    database_url: str, clock: Clock
) -> None:
    """The operator is shown an in-progress record and asked to confirm; meanwhile
    the slow request completes. Even overriding its live lease nothing is deleted: the completed
    record stays, and the client's retry replays instead of charging again."""
    from tests.conftest import reset_tables
    from tests.support import testapp
    from tests.support.gates import Gates, send

    gates = Gates()
    app = testapp.create_app(database_url, clock=clock)

    @app.post("/slow-charge")
    @testapp.idem.idempotent(lease=30)
    def slow_charge() -> tuple[dict[str, t.Any], int]:
        gates.pause("slow")
        row = testapp.write_ledger("slow-charge")
        return {"id": row.id}, 201

    reset_tables(database_url)
    request = send(app, "/slow-charge", {}, key="stuck")
    assert gates.arrived("slow")
    [record] = record_rows(app)

    def confirm_after_completion(text: str) -> str:
        gates.open("slow")  # the request completes while the operator reads
        assert request.result().status_code == 201
        return "y\n"

    import click.testing

    runner = app.test_cli_runner()
    original = click.testing.CliRunner.isolation

    prompt_seen: list[str] = []

    def answer(*args: t.Any, **kwargs: t.Any) -> t.Any:
        prompt_seen.append("asked")
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            "click.confirm",
            lambda *a, **k: confirm_after_completion(str(a)) and True,
        )
        result = runner.invoke(
            args=["idempotency", "release", record["scope"], "stuck", "--override", "live-lease"]
        )
    assert result.exit_code != 0
    assert "changed while you confirmed" in result.output
    [kept] = record_rows(app)
    assert kept["status"] == "completed"
    retry = app.test_client().post("/slow-charge", json={}, headers={"Idempotency-Key": "stuck"})
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert ledger_count(app, "slow-charge") == 1


# -- show prints no contents unless asked (issue 27) --------------------------------


def test_show_prints_no_contents_without_reveal_and_masks_redacted_fields_with_it(
    fresh_database: str, clock: Clock
) -> None:
    """A completed record whose answer echoes a redacted card number, and one
    in progress that kept its request: without --reveal nothing of either body,
    header value, recovery point or stored request; with it, all of them, the
    redacted paths masked wherever the content is JSON."""
    made = make_app(fresh_database, clock=clock)
    made.app.config["PROPAGATE_EXCEPTIONS"] = False
    client = made.app.test_client()
    card = {"amount": 5, "card": {"number": MARKER, "exp": "12/30"}, "cvc": MARKER}
    headers = {"Idempotency-Key": "done"}
    assert client.post("/pay", json=card, headers=headers).status_code == 201
    crashed = {"Idempotency-Key": "crashed", "X-Crash": "1"}
    assert client.post("/pay", json=card, headers=crashed).status_code == 500

    for key in ("done", "crashed"):
        hidden = cli(made.app, "show", SCOPE, key)
        assert hidden.exit_code == 0, hidden.output
        assert MARKER not in hidden.output
        assert "visa" not in hidden.output  # the step's result
        shown = json.loads(hidden.output)
        assert shown["revealed"] is False
        assert shown["recovery_point_names"] == ["received"]
        assert not {"response_body", "response_headers", "recovery_points", "request_body"} & set(
            shown
        )

    done = json.loads(cli(made.app, "show", SCOPE, "done").output)
    assert done["response_body_bytes"] > 0
    assert done["response_header_names"] == ["Content-Type"]

    revealed = cli(made.app, "show", SCOPE, "done", "--reveal")
    assert revealed.exit_code == 0, revealed.output
    assert MARKER not in revealed.output
    shown = json.loads(revealed.output)
    assert json.loads(shown["response_body"]) == {"charged": 5, "card": {"number": "[redacted]"}}
    assert shown["response_headers"] == [["Content-Type", "application/json"]]
    assert shown["recovery_points"] == {
        "received": {"card": {"number": "[redacted]", "brand": "visa"}}
    }

    stored = json.loads(cli(made.app, "show", SCOPE, "crashed", "--reveal").output)
    assert MARKER not in json.dumps(stored)
    assert stored["request_path"] == "/pay"
    assert json.loads(stored["request_body"]) == {"amount": 5, "card": {"exp": "12/30"}}


def test_show_reveal_masks_a_redacted_field_under_its_data_key_and_attribute(
    fresh_database: str, clock: Clock
) -> None:
    """``redact=["owner_card.card_number"]`` on a route whose schema spells it
    ``ownerCard.cardNumber``: --reveal masks it under either spelling, at each
    level of the nested schema (the answer and the step's result)."""
    made = make_app(fresh_database, clock=clock)
    body = {"ownerCard": {"cardNumber": MARKER, "amount": 1}}
    answer = made.app.test_client().post(
        "/wallet-pay", json=body, headers={"Idempotency-Key": "w1"}
    )
    assert answer.status_code == 201, answer.get_data(as_text=True)
    revealed = cli(made.app, "show", SCOPE, "w1", "--reveal")
    assert revealed.exit_code == 0, revealed.output
    assert MARKER not in revealed.output
    shown = json.loads(revealed.output)
    assert json.loads(shown["response_body"]) == {
        "ownerCard": {"cardNumber": "[redacted]", "amount": 1}
    }
    assert shown["recovery_points"] == {"received": {"owner_card": {"card_number": "[redacted]"}}}
