"""``idem.function``: the decorator, and the decorated function it returns."""

from __future__ import annotations

import datetime as dt
import functools
import typing as t

from .._request.decorator import UNSET, LeaseArg, Unset, route_options
from .._request.fingerprint import SchemaArg
from .._request.route import RouteOptions
from .call import FunctionOutcome, call
from .options import FunctionOptions, KeyArg, ScopeArg, function_options

P = t.ParamSpec("P")
R = t.TypeVar("R")


class IdempotentFunction(t.Generic[P, R]):
    """A function decorated with ``@idem.function``: calling it runs it at most
    once per (scope, key); :meth:`outcome` also says whether it ran."""

    def __init__(self, fn: t.Callable[P, R], options: FunctionOptions) -> None:
        functools.update_wrapper(self, fn)
        self.__wrapped__ = fn
        self._options = options

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return call(self._options, self.__wrapped__, args, kwargs).value

    def outcome(self, *args: P.args, **kwargs: P.kwargs) -> FunctionOutcome[R]:
        """Call it as ``fn(...)`` does; the value, whether it was a repeat's
        (the function did not run), and the record's scope and key."""
        return call(self._options, self.__wrapped__, args, kwargs)

    def __get__(self, instance: t.Any, owner: type | None = None) -> t.Any:
        # A method: bound to its instance as a plain function would be (the
        # instance is then an argument like any other: name it in exclude=).
        if instance is None:
            return self
        return _Bound(self, instance)

    def __repr__(self) -> str:
        return f"<idempotent function {self._options.name}>"


class _Bound:
    """An idempotent method bound to its instance."""

    def __init__(self, function: IdempotentFunction[t.Any, t.Any], instance: t.Any) -> None:
        self._function = function
        self._instance = instance

    def __call__(self, *args: t.Any, **kwargs: t.Any) -> t.Any:
        return self._function(self._instance, *args, **kwargs)

    def outcome(self, *args: t.Any, **kwargs: t.Any) -> FunctionOutcome[t.Any]:
        return self._function.outcome(self._instance, *args, **kwargs)


class FunctionAPI:
    """``idem.function``, which :class:`~flask_idempotency.Idempotency` inherits."""

    def function(
        self,
        *,
        scope: ScopeArg,
        key: KeyArg,
        exclude: t.Sequence[str] = (),
        schema: SchemaArg = None,
        ttl: dt.timedelta | float | None = None,
        lease: LeaseArg = None,
        wait: dt.timedelta | float | Unset | None = UNSET,
    ) -> t.Callable[[t.Callable[P, R]], IdempotentFunction[P, R]]:
        """Make a function idempotent outside HTTP (a job, a command, a consumer):
        it runs at most once per (scope, key) within the retention window, its
        return value stored with its record; a repeat returns the stored value
        without running it. The record is claimed in the app's session and
        commits with the function's writes. See the guide, "Idempotent functions".

        :param scope: a str, or a callable taking the function's arguments and
            returning one (at most 512 characters).
        :param key: the name of the parameter whose value (a str, or an int as
            its decimal string) is the key, or a callable taking the function's
            arguments and returning it (at most 255 printable ASCII characters).
        :param exclude: parameters left out of the fingerprint; dotted paths
            reach into dict arguments. The other arguments (defaults applied)
            must match on a repeat, else
            :class:`~flask_idempotency.errors.KeyReusedError`.
        :param schema: marshmallow schema (instance or class) the return value
            is dumped through, and a repeat's value loaded through; without
            it the value is stored as JSON (a tuple comes back as a list).
        :param ttl: retention of the records (default ``IDEMPOTENCY_TTL``).
        :param lease: commit the in-progress record before the function runs,
            leased for this long (``True``: ``IDEMPOTENCY_LEASE``): for work that
            cannot fit one transaction, with ``idem.step`` recovery points.
        :param wait: how long a second caller waits for a first one still
            running before :class:`~flask_idempotency.errors.OperationInProgressError`
            (default ``IDEMPOTENCY_WAIT``; ``None``: the engine's own bound).
        """
        try:
            route = self._function_route(ttl, lease, wait)
            for name in ("ttl", "lease"):
                # Zero passes the routes' decorator (their app's settings refuse
                # it at init_app): refused here, not at the first call.
                given = route.overrides.get(name)
                if given is not None and given <= dt.timedelta(0):
                    raise ValueError(f"@idem.function: {name}= must be positive, got {given}")
        except (TypeError, ValueError) as exc:  # worded for routes: name the decorator
            raise type(exc)(str(exc).replace("@idem.idempotent", "@idem.function")) from None

        def decorator(fn: t.Callable[P, R]) -> IdempotentFunction[P, R]:
            options = function_options(
                fn, scope=scope, key=key, exclude=exclude, schema=schema, route=route
            )
            return IdempotentFunction(fn, options)

        return decorator

    @staticmethod
    def _function_route(
        ttl: dt.timedelta | float | None,
        lease: LeaseArg,
        wait: dt.timedelta | float | Unset | None,
    ) -> RouteOptions:
        """The record's settings (ttl, lease, wait) as a route's, which the claim
        machinery reads; checked as a route's are."""
        return route_options(
            schema=None,
            exclude=(),
            redact=(),
            required=None,
            ttl=ttl,
            scope=None,
            lease=lease,
            recover=False,
            key_format=None,
            key_max_length=None,
            methods=None,
            # The return value is stored as a 200 answer, whatever the app's statuses.
            stored_statuses=(200,),
            skip=None,
            replay_guard=None,
            replay_headers=None,
            # A finished call's record comes back from the claim, never an HTTP replay.
            manual=True,
            wait=wait,
            optimistic=False,
        )
