"""What ``@idem.function(...)`` fixed for one function, checked when it is
decorated: its scope and key (from its arguments), its arguments' fingerprint,
and how its return value is stored and read back.

The arguments count as a route's JSON body does: bound to the signature with
defaults applied, the excluded ones dropped (dotted paths reach into dict
arguments, :mod:`.._request.paths`), canonical JSON (:mod:`.._request.canonical`),
hashed with the function's qualified name in place of a route's path, keyed
by ``IDEMPOTENCY_FINGERPRINT_KEY`` when it is set and then bound to the scope
and key (:func:`.._request.fingerprint.bound_to`), as a route's are.
"""

from __future__ import annotations

import dataclasses
import decimal
import inspect
import json
import typing as t

from marshmallow import Schema, ValidationError

from .._request.canonical import UnknownValueError, canonical_json
from .._request.fingerprint import SchemaArg, bound_to, compute, resolve_schema
from .._request.paths import exclude_paths, without_fields
from .._request.route import RouteOptions, view_name
from ..errors import MalformedBodyError
from ..keys import MAX_KEY_LENGTH, printable
from ..scope import MAX_SCOPE_LENGTH

#: The "method" a function's fingerprint counts where a route's has its HTTP method.
_CALL = "CALL"
_JSON = "application/json"

ScopeArg = str | t.Callable[..., str]
KeyArg = str | t.Callable[..., t.Any]


@dataclasses.dataclass(frozen=True, eq=False)
class FunctionOptions:
    """One decorated function's options (hashed by identity, as routes are)."""

    name: str
    signature: inspect.Signature
    scope: ScopeArg
    key: KeyArg
    exclude: tuple[str, ...]
    schema: Schema | None
    #: The record's settings: ttl, lease, wait, as a route's (``commit_claim``
    #: is ``lease=``); the claim machinery reads them from here.
    route: RouteOptions

    # -- the call's scope, key and fingerprint ------------------------------------

    def bind(self, args: tuple[t.Any, ...], kwargs: dict[str, t.Any]) -> dict[str, t.Any]:
        """The call's arguments by parameter name, defaults applied; a ``**kwargs``
        parameter's items count as parameters of their own (so ``exclude`` names
        them alike). A call the signature refuses raises its ``TypeError`` now."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments: dict[str, t.Any] = {}
        for name, value in bound.arguments.items():
            if self.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                # A positional-only parameter's name given as a keyword lands
                # here: as one name, one would hide the other in the fingerprint.
                clash = sorted(set(value) & set(self.signature.parameters))
                if clash:
                    raise TypeError(
                        f"@idem.function {self.name}: the keyword argument {clash[0]!r} has the "
                        "name of a positional-only parameter; the fingerprint (and key=, "
                        "exclude=) could not tell them apart. Give it another name."
                    )
                arguments.update(value)
            else:
                arguments[name] = value
        return arguments

    def scope_of(self, args: tuple[t.Any, ...], kwargs: dict[str, t.Any]) -> str:
        scope = self.scope if isinstance(self.scope, str) else self.scope(*args, **kwargs)
        return check_scope(scope, self.name)

    def key_of(
        self, args: tuple[t.Any, ...], kwargs: dict[str, t.Any], arguments: dict[str, t.Any]
    ) -> str:
        if isinstance(self.key, str):
            value, what = arguments.get(self.key), f"argument {self.key!r}"
        else:
            value, what = self.key(*args, **kwargs), "key callable's result"
        return check_key(value, self.name, what)

    def fingerprint(
        self, arguments: dict[str, t.Any], scope: str, key: str, secret: bytes | None
    ) -> str:
        """The hash of this call: the function's name and its counted arguments."""
        try:
            body = canonical_json(without_fields(arguments, self.exclude))
        except UnknownValueError as exc:
            where = ".".join(str(p) for p in exc.path) or "?"
            raise TypeError(
                f"@idem.function {self.name}: argument {where} is a {exc.type_name}, which the "
                "fingerprint cannot represent (plain data, Decimal, datetime, date, time, "
                "timedelta, UUID, Enum, bytes, dataclasses); pass one of those or name it "
                "in exclude="
            ) from None
        except (MalformedBodyError, RecursionError, ValueError, OverflowError) as exc:
            detail = exc.detail if isinstance(exc, MalformedBodyError) else str(exc)
            raise ValueError(
                f"@idem.function {self.name}: its arguments cannot be fingerprinted: {detail}"
            ) from None
        return compute(_CALL, self.name, (), body, _JSON, key=secret, bound=bound_to(scope, key))

    # -- the stored value ---------------------------------------------------------

    def dump(self, value: t.Any) -> bytes:
        """The return value as stored: JSON (through the schema, if given).
        ``TypeError`` naming the function when it cannot be."""
        try:
            data = self.schema.dump(value) if self.schema is not None else value
            stored = json.dumps(
                data, default=_decimal_as_text, allow_nan=False, separators=(",", ":")
            ).encode("utf-8")
            if self.schema is not None:
                # What a repeat will load: a value its schema refuses (a dump_only
                # field, a validator) would fail every repeat for the retention.
                self.schema.load(json.loads(stored))
            return stored
        except (TypeError, ValueError, RecursionError, AttributeError, ValidationError) as exc:
            how = f"through {type(self.schema).__qualname__}" if self.schema else "as JSON"
            raise TypeError(
                f"@idem.function {self.name}: its return value (a {type(value).__qualname__}) "
                f"cannot be stored {how} ({exc}). Return JSON data, or give schema= a "
                "marshmallow schema that dumps it and loads it back."
            ) from exc

    def load(self, stored: bytes) -> t.Any:
        """The stored return value, as a repeat returns it."""
        data = json.loads(stored)
        return self.schema.load(data) if self.schema is not None else data


def _decimal_as_text(value: t.Any) -> t.Any:
    # A schema's Decimal field dumps Decimals; as text they load back exactly.
    if isinstance(value, decimal.Decimal):
        return str(value)
    raise TypeError(f"a {type(value).__qualname__} is not JSON data")


_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _variadic(param: inspect.Parameter) -> str:
    stars = "**" if param.kind is inspect.Parameter.VAR_KEYWORD else "*"
    return f"{stars}{param.name}"


def check_scope(scope: t.Any, name: str) -> str:
    """``scope`` if it is a usable scope (a route's limits), else the error naming ``name``."""
    if not isinstance(scope, str) or not scope:
        raise TypeError(f"@idem.function {name}: the scope must be a non-empty str, got {scope!r}")
    if "\x00" in scope or len(scope) > MAX_SCOPE_LENGTH:
        raise ValueError(
            f"@idem.function {name}: the scope must be at most {MAX_SCOPE_LENGTH} characters, "
            "without NUL"
        )
    return scope


def check_key(value: t.Any, name: str, what: str) -> str:
    """The key ``value`` gives (an int as its decimal string), else the error."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise TypeError(
            f"@idem.function {name}: the key ({what}) must be a str or an int, got {value!r}"
        )
    if not value or len(value) > MAX_KEY_LENGTH or not printable(value):
        raise ValueError(
            f"@idem.function {name}: the key ({what}) must be 1 to {MAX_KEY_LENGTH} printable "
            f"ASCII characters, as an Idempotency-Key header's, got {value!r}"
        )
    return value


def function_options(
    fn: t.Callable[..., t.Any],
    *,
    scope: ScopeArg,
    key: KeyArg,
    exclude: t.Sequence[str],
    schema: SchemaArg,
    route: RouteOptions,
) -> FunctionOptions:
    """The options of ``fn``, every one checked now (a wrong one is the
    decorator's error, not the first call's)."""
    name = view_name(fn)
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise TypeError(
            f"@idem.function {name}: async functions are not supported; the record is "
            "claimed in the app's (synchronous) SQLAlchemy session"
        )
    if not callable(fn):
        raise TypeError(f"@idem.function decorates a function, not {fn!r}")
    signature = inspect.signature(fn)
    params = signature.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if isinstance(scope, str):
        check_scope(scope, name)
    elif not callable(scope):
        raise TypeError(f"@idem.function {name}: scope= must be a str or a callable, not {scope!r}")
    if isinstance(key, str):
        if key in params and params[key].kind in _VARIADIC:
            raise ValueError(
                f"@idem.function {name}: key={key!r} names its {_variadic(params[key])} "
                "parameter, not one value; name an item of **kwargs, or give key= a callable"
            )
        if key not in params and not takes_any:
            raise ValueError(
                f"@idem.function {name}: key={key!r} names no parameter of it "
                f"(it has {', '.join(params) or 'none'})"
            )
    elif not callable(key):
        raise TypeError(
            f"@idem.function {name}: key= must be a parameter's name or a callable, not {key!r}"
        )
    if isinstance(exclude, str):
        raise TypeError(
            f"@idem.function {name}: exclude= is a list of parameter names, not the string "
            f"{exclude!r} (write exclude=({exclude!r},))"
        )
    excluded = tuple(exclude)
    for path in exclude_paths(excluded):
        if path[0] not in params and not takes_any:
            raise ValueError(f"@idem.function {name}: exclude names no parameter {path[0]!r}")
        param = params.get(path[0])
        if param is not None and (
            param.kind is inspect.Parameter.VAR_KEYWORD
            or (param.kind is inspect.Parameter.VAR_POSITIONAL and len(path) > 1)
        ):
            # **kwargs items count as parameters of their own (name them); the
            # paths reach into dicts, not into the *args tuple.
            raise ValueError(
                f"@idem.function {name}: exclude={'.'.join(map(str, path))!r} reaches into its "
                f"{_variadic(param)} parameter; "
                + (
                    "its items count as parameters: name them (exclude=('trace',))"
                    if param.kind is inspect.Parameter.VAR_KEYWORD
                    else "exclude all of it, or take the value as a parameter of its own"
                )
            )
    return FunctionOptions(
        name=name,
        signature=signature,
        scope=scope,
        key=key,
        exclude=excluded,
        schema=resolve_schema(schema),
        route=dataclasses.replace(route, view_name=f"@idem.function {name}", function=True),
    )
