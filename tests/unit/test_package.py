"""What the distribution says of itself (its version, its licence), its public surface,
and the layout rules the package keeps (issue 16): one owner of the request state,
every statement in the storage layer, modules a reader takes in."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import re
import typing as t
import warnings
from pathlib import Path

import pytest

import flask_idempotency

ROOT = Path(__file__).resolve().parents[2]


def test_the_version_is_the_distributions() -> None:
    assert flask_idempotency.__version__ == importlib.metadata.version("Flask-Idempotency")


def test_the_licence_setup_py_names_is_shipped() -> None:
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("MIT License")
    assert 'license="MIT"' in (ROOT / "setup.py").read_text(encoding="utf-8")


# -- the public surface --------------------------------------------------------------


PACKAGE = ROOT / "flask_idempotency"

#: Each public module and the names it exports: the documented API (docs/api.md).
#: A change here is a change of the public API, and CHANGES.md must say so.
PUBLIC: dict[str, set[str]] = {
    "flask_idempotency": {
        "COMPLETED",
        "IN_PROGRESS",
        "BrokerUnavailable",
        "ConflictError",
        "DatabaseUnavailableError",
        "EventIdConflictError",
        "FormKeyError",
        "FunctionOutcome",
        "Idempotency",
        "IdempotencyError",
        "InvalidKeyError",
        "KeyReusedError",
        "LeaseLostError",
        "LengthRequiredError",
        "MalformedBodyError",
        "MissingKeyError",
        "NothingToRecoverError",
        "PayloadTooLargeError",
        "ProblemError",
        "Record",
        "TransactionConflictError",
        "UnsupportedMediaTypeError",
        "ValidationProblem",
        "derive_key",
        "signals",
    },
    "flask_idempotency.models": {
        "COMPLETED",
        "ERASED",
        "INBOX_TABLE_NAME",
        "IN_PROGRESS",
        "JOB_LOCK_TABLE_NAME",
        "OUTBOX_TABLE_NAME",
        "Record",
        "TABLE_NAME",
        "inbox_table",
        "job_lock_table",
        "outbox_table",
        "record_table",
    },
    "flask_idempotency.outbox": {"CHANNEL", "OutboxEvent", "add_event"},
    "flask_idempotency.inbox": {
        "DEFAULT_TTL",
        "MAX_ID_LENGTH",
        "consumer",
        "mark_processed",
        "process",
    },
    "flask_idempotency.relay": {
        "BrokerUnavailable",
        "Publisher",
        "RelayRun",
        "outbox_stats",
        "purge_published",
        "relay_batch",
        "relay_once",
        "retry_parked",
    },
    "flask_idempotency.jobs": {
        "ErasureReport",
        "KeyStats",
        "PurgeReport",
        "RecoveryReport",
        "purge_expired",
        "recover_abandoned",
    },
    "flask_idempotency.scheduler": {"JobScheduler"},
    "flask_idempotency.extension": {"Idempotency"},
    "flask_idempotency.cli": {"idempotency_cli"},
    "flask_idempotency.client": {
        "IdempotentRetry",
        "IdempotentSession",
        "KEYED_METHODS",
        "RETRY_METHODS",
        "RETRY_STATUSES",
        "RedirectBudgetExceeded",
    },
    "flask_idempotency.keys": {
        "KEY_FORMATS",
        "KeyFormat",
        "MAX_KEY_LENGTH",
        "derive_key",
        "derive_scoped_key",
        "parse_key",
        "quote_key",
        "scoped_parent_key",
    },
    "flask_idempotency.openapi": {"IdempotencyPlugin"},
    "flask_idempotency.forms": {
        "IdempotencyKeyField",
        "form_field",
        "form_key",
    },
    "flask_idempotency.scope": {
        "FORM_OWNER_SESSION_KEY",
        "MAX_SCOPE_LENGTH",
        "ReconcileAttempt",
        "ReplayAttempt",
        "default_scope",
    },
    "flask_idempotency.config": {
        "DEFAULTS",
        "PREFIX",
        "SETTINGS",
        "Setting",
    },
    "flask_idempotency.errors": {
        "FormKeyError",
        "FormKeyExpiredError",
        "BrokerUnavailable",
        "ConflictError",
        "DatabaseUnavailableError",
        "EventIdConflictError",
        "FailedAfterCommitError",
        "IdempotencyError",
        "InvalidKeyError",
        "KeyReusedError",
        "LeaseLostError",
        "LengthRequiredError",
        "MalformedBodyError",
        "MissingKeyError",
        "NothingToRecoverError",
        "OperationInProgressError",
        "PROBLEM_JSON",
        "PROBLEM_TYPE_BASE",
        "PayloadTooLargeError",
        "ProblemError",
        "ReplayRefusedError",
        "RulesChangedError",
        "KeyErasedError",
        "RecordUnreadableError",
        "ServerMisconfiguredError",
        "StalledMessage",
        "StepNotStoredError",
        "TransactionConflictError",
        "UnsupportedMediaTypeError",
        "ValidationProblem",
    },
    "flask_idempotency.signals": {
        "event_parked",
        "event_published",
        "event_skipped_duplicate",
        "job_finished",
        "job_started",
        "key_claimed",
        "payload_mismatch",
        "record_completed",
        "request_conflict",
        "response_replayed",
        "step_saved",
    },
    "flask_idempotency.testing": {
        "Database",
        "Downstream",
        "DownstreamCall",
        "Effect",
        "Fault",
        "HeldRequest",
        "KitConfig",
        "Response",
        "ServedApp",
        "assert_exactly_one",
        "concurrent_duplicates",
        "reuse_key",
    },
    "flask_idempotency.publishers": {
        "CallablePublisher",
        "KombuPublisher",
        "ListPublisher",
    },
}


def public_modules() -> list[str]:
    """Every module whose name has no leading underscore, at the package's top."""
    names = ["flask_idempotency"]
    for path in sorted(PACKAGE.glob("*.py")):
        if not path.name.startswith("_"):
            names.append("flask_idempotency." + path.stem)
    return names


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_the_exports_are_the_documented_ones(name: str) -> None:
    module = importlib.import_module(name)
    assert set(module.__all__) == PUBLIC[name]


@pytest.mark.parametrize("name", public_modules())
def test_every_public_module_says_what_it_exports(name: str) -> None:
    if name == "flask_idempotency.client":
        pytest.importorskip("requests")
    module = importlib.import_module(name)
    assert module.__doc__, f"{name} has no docstring"
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    for attribute in exported:
        assert not attribute.startswith("_")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an export is never a deprecated forward
            assert getattr(module, attribute) is not None


def test_a_name_exported_twice_is_one_object() -> None:
    seen: dict[str, t.Any] = {}
    for name in public_modules():
        if name == "flask_idempotency.client":
            continue
        module = importlib.import_module(name)
        for attribute in getattr(module, "__all__", ()):
            value = getattr(module, attribute)
            if attribute in seen and not isinstance(value, str):
                assert seen[attribute] is value, f"{name}.{attribute} is another object"
            seen.setdefault(attribute, value)


def test_every_error_is_an_idempotency_error() -> None:
    from flask_idempotency import errors

    found = [
        value
        for value in vars(errors).values()
        if isinstance(value, type)
        and issubclass(value, BaseException)
        and value.__module__ == errors.__name__
    ]
    assert len(found) > 15
    for error in found:
        assert issubclass(error, errors.IdempotencyError), error
    # No module of the package defines an exception class anywhere else (the
    # base and the internal ones live in _failures.py, which errors.py exports).
    for path in PACKAGE.rglob("*.py"):
        if path.name in ("errors.py", "_failures.py"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(base) for base in node.bases}
                assert not bases & {"Exception", "BaseException", "RuntimeError"}, (
                    f"{path.relative_to(ROOT)}: {node.name} is an error outside errors.py"
                )


def test_old_deep_paths_still_resolve_with_a_warning() -> None:
    """Names a user may have imported from the flat layout (0.0) keep working for a
    release, and say they are not public (CHANGES.md says what to use)."""
    from flask_idempotency import relay, scheduler

    with pytest.warns(DeprecationWarning, match="not part of the public API"):
        assert (
            relay.Listener
            is importlib.import_module(
                "flask_idempotency._messaging.listener"
                if (PACKAGE / "_messaging" / "listener.py").exists()
                else "flask_idempotency._messaging.relay"
            ).Listener
        )
    with pytest.warns(DeprecationWarning, match="not part of the public API"):
        assert scheduler.RelayWaker is not None
    with pytest.raises(AttributeError):
        _ = relay.no_such_name


# -- the layout: one home per thing -----------------------------------------------


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_only_the_context_reads_the_request_state() -> None:
    owner = PACKAGE / "_context.py"
    for path in sources():
        text = path.read_text(encoding="utf-8")
        if path != owner:
            assert '"_idempotency"' not in text, path
            assert "g._idempotency" not in text, path
            # ``g`` may be read for other extensions' state (Flask-HTTPAuth's user),
            # never written, and never for ours.
            assert not re.search(r"\bg\.(pop|setdefault|_\w+)\b|setattr\(g,", text), path
            assert "app.extensions[" not in text, path
            assert 'extensions.get("idempotency' not in text, path


SQL = re.compile(
    r"\bsa\.(select|insert|update|delete|text|func)\b|\.execute\(|\bdialect\.name\b"
    r"|MYSQL_DIALECTS|\berrno\b|\bpgcode\b|\bsqlstate\b|exec_driver_sql"
)


def test_every_statement_and_engine_code_is_in_the_storage_layer() -> None:
    outside = []
    for path in sources():
        # The testing kit counts rows and makes databases for tests: SQL of a test
        # tool against a test's database, not the extension's statements.
        if "_storage" in path.parts or "testing" in path.parts:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if SQL.search(line) and not line.lstrip().startswith("#"):
                outside.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not outside, "\n".join(outside)


def test_no_module_is_longer_than_a_reader_takes_in() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in sources()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > 450
    }
    assert not long, long


def test_the_layers_import_only_downward() -> None:
    """The import-linter contract in pyproject.toml holds (CI runs it too)."""
    import subprocess
    import sys

    command = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run(
        [str(command)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "broken" in done.stdout  # the summary line, "N kept, 0 broken"
