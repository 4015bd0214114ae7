"""``idempotent_function``: any function's body once per key, its value given to every later call.

For message consumers, off-request webhooks, outbox relays and tasks: the key comes from the
arguments (a message id), the scope defaults to the function's dotted name, the fingerprint
covers the arguments, and the stored "response" is the return value as JSON.
:func:`django_idempotency.contrib.celery.idempotent_task` is the same for Celery.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from asgiref.sync import iscoroutinefunction
from django.core.serializers.json import DjangoJSONEncoder

from django_idempotency import adapters, engine
from django_idempotency.asynchronous import run_async
from django_idempotency.conf import idempotency_settings
from django_idempotency.exceptions import ArgumentsMismatch, CallInFlight, UnstorableResult
from django_idempotency.fingerprint import canonical_json
from django_idempotency.info import IdempotencyInfo
from django_idempotency.options import CALL_OPTION_NAMES, DeclaredOptions
from django_idempotency.scopes import fit_key_column
from django_idempotency.store import StoredResponse

F = TypeVar("F", bound=Callable[..., Any])
KeyFunction = Callable[..., str]
#: A function's or task's recovery policy: ``f(abandoned) -> value | None``.
Recover = Callable[[Any], Any]

#: A function's stored "response": its return value as JSON.
RESULT_STATUS = 200
RESULT_HEADERS = [["Content-Type", "application/json"]]
#: The body ended on purpose without a value (Celery's ``Ignore``, which ``self.replace()``
#: raises): a later call, a redelivered task's included, ends the same way.
ENDED_STATUS = 204
#: The body returned, but its value could not be kept (not JSON, or the database refused
#: it: too large for it, or failing at that moment): a later call is told so, and the body
#: runs again only if an operator releases or deletes the record.
UNSTORED_STATUS = 507


def _encode(value: Any) -> StoredResponse:
    try:
        payload = json.dumps(value, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise UnstorableResult(
            f"The function returned {type(value).__name__}, which cannot be stored as "
            f"JSON ({exc}). Return a JSON-serialisable value (dict, list, str, number, "
            "bool or None): later calls get the stored value back."
        ) from exc
    return StoredResponse(RESULT_STATUS, RESULT_HEADERS, payload)


def decode(stored: StoredResponse) -> Any:
    """The value a later call gets from a function's stored record."""
    if stored.status_code == UNSTORED_STATUS:
        raise UnstorableResult(
            "The first call with this key ran and returned, but its value could not be "
            "stored (not JSON, or the database refused it; the log says why), so later "
            "calls cannot be given it. The body does not run again for this key; return "
            "a JSON value small enough to store, such as an id, or ask an operator to "
            "delete its record (manage.py idempotency_keys delete)."
        )
    if stored.status_code == ENDED_STATUS:
        # End as the first did, so that what follows the call in its caller, which never ran
        # the first time, does not run now (a redelivered task, a second publish). Only an
        # adapter that ends tasks on purpose (Celery's) writes this record.
        for adapter in adapters.in_use(importing=True):
            if adapter.end_on_purpose is not None:
                adapter.end_on_purpose()
        raise RuntimeError(
            "The first call with this key ended its task on purpose, and no task framework "
            "that ends tasks so is loaded here: install Celery, as where the first call ran."
        )
    return None if stored.body is None else json.loads(bytes(stored.body))


def _ending(exc: BaseException) -> engine.Ending:
    """How a body ended, counting a task framework's control flow, which its adapter knows.

    Celery's: ``Ignore`` completes on purpose; a soft time limit leaves the effect unknown.
    """
    # Celery's adapter is registered here, once Celery is in use, not at start-up.
    for adapter in adapters.in_use():
        if adapter.ending is not None:
            ending = adapter.ending(exc)
            if ending is not None:
                return ending
    return engine.plain_ending(exc)


#: How the engine keeps a function's value and what its callers meet.
VALUES = engine.Kind(
    encode=_encode,
    decode=decode,
    in_flight=lambda retry_after: CallInFlight(retry_after=retry_after),
    mismatch=ArgumentsMismatch,
    ending=_ending,
    ended_on_purpose=StoredResponse(ENDED_STATUS, [], None),
    without_body=lambda stored: StoredResponse(UNSTORED_STATUS, [], None),
    unstorable=lambda: StoredResponse(UNSTORED_STATUS, [], None),
    # The first call gets what every later call will: the value read back.
    fresh=lambda result, stored: decode(stored),
    # f(abandoned): None takes over, a value completes the key, raising holds it.
    ask=lambda policy, request, abandoned: policy(abandoned),
)


def declare(where: str, **given: Any) -> DeclaredOptions:
    """A function's or task's options, validated now by the settings table's rules."""
    label = lambda name: f"{where}({name}=...)"  # noqa: E731
    return DeclaredOptions(given, label, CALL_OPTION_NAMES, also=("key", "recover"))


def declare_task(key: object, **given: Any) -> DeclaredOptions:
    """A task's ``key=`` and options, validated when decorated, alike for both task frameworks."""
    if key is not None and not callable(key):
        raise TypeError(
            f"idempotent_task(key=...) must be a callable of the task's arguments, not {key!r}."
        )
    return declare("idempotent_task", **given)


def checked_recover(recover: object, where: str) -> None:
    """Refuse a ``recover=`` that is not a callable when the function is decorated."""
    if recover is not None and not callable(recover):
        raise TypeError(
            f"{where}(recover=...) must be a callable f(abandoned) -> value | None, "
            f"not {recover!r}."
        )


def checked_key(value: object, owner: str) -> str:
    """What a ``key=`` callable returned, checked (``run_once`` stores a long key as its digest).

    Not the HTTP key rules: the project's code chose it, so no minimum length or charset.
    """
    if not isinstance(value, str) or not value:
        raise TypeError(
            f"The key function of {owner} must return a non-empty string, "
            f"not {type(value).__name__}."
        )
    return value


def arguments_fingerprint(arguments: Mapping[str, Any], owner: str) -> str:
    """SHA-256 over the arguments, canonicalised as JSON request bodies are.

    So ``charge(10)`` and ``charge(10.0)``, or keywords in another order, are the same work,
    and any change of meaning is not.
    """
    try:
        document = json.dumps(dict(arguments), cls=DjangoJSONEncoder, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"The arguments of {owner} must be JSON-serialisable to be fingerprinted: {exc}"
        ) from exc
    canonical = canonical_json(document.encode())
    assert canonical is not None  # it was just written as JSON
    return hashlib.sha256(b"call:" + canonical.encode()).hexdigest()


def by_name(
    function: Callable[..., Any], args: Any, kwargs: Any, *, skip_first: bool = False
) -> dict[str, Any]:
    """The arguments by parameter name, defaults filled in, a bound task left out.

    So ``charge(7)``, ``charge(order_id=7)`` and ``charge(7, retries=3)`` (the default) match.
    """
    try:
        call = inspect.signature(function).bind(*args, **kwargs)
    except TypeError:
        # The call itself is wrong; the body will say so when it runs.
        return {"args": list(args), "kwargs": kwargs}
    call.apply_defaults()
    arguments = dict(call.arguments)
    if skip_first:
        arguments.pop(next(iter(arguments)))
    return arguments


def run_once(
    *,
    scope: str,
    key: str,
    arguments: Mapping[str, Any],
    body: Callable[[IdempotencyInfo], Any],
    options: DeclaredOptions,
    sender: Any,
    kind: engine.Kind = VALUES,
    recover: Callable[..., Any] | None = None,
) -> Any:
    """Run ``body`` once per (scope, key); return its value, stored or fresh.

    Raises the kind's in-flight error while the original still runs past ``wait`` (or inside
    its lease), and its mismatch error when the key was used with other arguments.
    """
    info = IdempotencyInfo(
        key=fit_key_column(key),
        scope=fit_key_column(scope),
        fingerprint=arguments_fingerprint(arguments, scope),
    )
    call = engine.Call(info, options.resolve(), kind, sender, recover=recover)
    return call.run(lambda: body(info))


def refuse_a_generator(function: Callable[..., Any]) -> None:
    """Refuse, where it is decorated, a function whose body would run after its call returned."""
    if inspect.isgeneratorfunction(function) or inspect.isasyncgenfunction(function):
        raise TypeError(
            f"{getattr(function, '__qualname__', function)!r} is a generator function: its "
            "body runs as the generator "
            "is iterated, after the call has returned, so the call's key would be completed "
            "with a generator no one ran, which cannot be stored. Protect the function that "
            "iterates it, or return a list."
        )


@dataclass(frozen=True)
class ProtectedFunction:
    """A protected function as its decorator declared it, and the steps of each of its calls.

    ``idempotent_function`` and both ``idempotent_task`` run every call with it, each keeping
    its framework's own around it (Celery's bound task and retries, the Tasks one's context).
    """

    function: Callable[..., Any]
    scope: str
    key: KeyFunction | None
    options: DeclaredOptions
    recover: Recover | None
    kind: engine.Kind = VALUES
    #: What a wrong key is said to come from (``checked_key``); the scope unless given.
    owner: str = ""

    def key_of(
        self,
        args: Any,
        kwargs: Any,
        default: Callable[[], str] | None = None,
        *,
        skip_first: bool = False,
    ) -> str:
        """The key of a call: ``key=``'s of its own arguments, checked, or ``default()``."""
        if self.key is None:
            assert default is not None  # a function's key= is required, a task's has a default
            return default()
        own = args[1:] if skip_first else args
        return checked_key(self.key(*own, **kwargs), self.owner or self.scope)

    def run(
        self,
        key: str,
        args: Any,
        kwargs: Any,
        body: Callable[[IdempotencyInfo], Any],
        *,
        skip_first: bool = False,
        kind: engine.Kind | None = None,
    ) -> Any:
        """:func:`run_once`, the arguments by name (``skip_first``: a bound task, a context)."""
        return run_once(
            scope=self.scope,
            key=key,
            arguments=by_name(self.function, args, kwargs, skip_first=skip_first),
            body=body,
            options=self.options,
            sender=self.function,
            kind=self.kind if kind is None else kind,
            recover=self.recover,
        )

    def call(
        self,
        args: Any,
        kwargs: Any,
        body: Callable[[IdempotencyInfo | None], Any],
        default_key: Callable[[], str] | None = None,
        *,
        skip_first: bool = False,
    ) -> Any:
        """One call: ``body(None)`` unprotected while the package is disabled, else once per key."""
        if not idempotency_settings.enabled:
            return body(None)
        key = self.key_of(args, kwargs, default_key, skip_first=skip_first)
        return self.run(key, args, kwargs, body, skip_first=skip_first)


def idempotent_function(
    # Positional only: a bare ``@idempotent_function`` is told it lacks ``key``, not that
    # it gave a positional argument too many.
    func: None = None,
    /,
    *,
    key: KeyFunction,
    scope: str | None = None,
    atomic: bool = True,
    ttl: timedelta | float | None = None,
    wait: float | None = None,
    lease: timedelta | float | None = None,
    recover: Recover | None = None,
) -> Callable[[F], F]:
    """Run a function's body once per key; later calls get its first return value.

    ``key`` is called with the function's arguments and returns the key (a message id).
    ``scope`` defaults to the function's dotted name. Atomic mode (the default) runs the body
    in the claim's transaction, so its writes and the stored value commit together; lease mode
    (``atomic=False``) is for bodies that call other systems. The value must be
    JSON-serialisable and comes back as JSON gives it (a tuple as a list). The same key with
    other arguments raises :class:`~django_idempotency.exceptions.ArgumentsMismatch`; a call
    while the original runs past ``wait``, :class:`~django_idempotency.exceptions.CallInFlight`.
    An ``async def`` function is protected alike and awaited.

    ``recover`` (lease mode) is asked ``recover(abandoned)`` when a call finds the claim of
    one that stopped unfinished: ``None`` takes it over (the body runs again, with the
    checkpoints recorded so far), a value completes the key with it, and raising holds the
    claim (``django_idempotency.recovery.hold_call``).
    """
    if func is not None:
        raise TypeError("idempotent_function takes keywords only: @idempotent_function(key=...).")
    if not callable(key):
        raise TypeError(
            "idempotent_function(key=...) must be a callable of the function's arguments "
            f"returning its key, not {key!r}."
        )
    if scope is not None and (not isinstance(scope, str) or not scope):
        raise TypeError(
            f"idempotent_function(scope=...) must be a non-empty string, not {scope!r}."
        )
    options = declare("idempotent_function", atomic=atomic, ttl=ttl, wait=wait, lease=lease)
    checked_recover(recover, "idempotent_function")

    def decorate(function: F) -> F:
        refuse_a_generator(function)
        name = scope or f"{function.__module__}.{function.__qualname__}"
        if scope is None and "<locals>" in function.__qualname__:
            # Every function a factory builds has this qualified name: one closure would be
            # answered with another's value.
            raise TypeError(
                f"idempotent_function on {function.__qualname__!r}, a function defined inside "
                "another, needs scope=: each function it builds would otherwise share the "
                "scope " + repr(name) + ". Pass scope= naming what this one does (a tenant's "
                "or a queue's name, say)."
            )

        protection = ProtectedFunction(function, name, key, options, recover)

        if iscoroutinefunction(function):

            @functools.wraps(function)
            async def protected_async(*args: Any, **kwargs: Any) -> Any:
                async def body() -> Any:
                    return await function(*args, **kwargs)

                return await run_async(
                    lambda sync_body: protection.call(args, kwargs, lambda info: sync_body()), body
                )

            return protected_async  # type: ignore[return-value]

        @functools.wraps(function)
        def protected(*args: Any, **kwargs: Any) -> Any:
            return protection.call(args, kwargs, lambda info: function(*args, **kwargs))

        return protected  # type: ignore[return-value]

    return decorate
