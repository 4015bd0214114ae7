"""Per-view options, and those of idempotent functions and tasks.

Each option is validated by its settings row where it is written (view
decorated, class created, function decorated), and resolved over the settings at each call.
Dotted paths are checked for shape then but imported at the first request
or by a system check: importing a project's module while its views module
is being imported invites import cycles.
"""

from __future__ import annotations

import difflib
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Set
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from typing import Any, TypedDict

from django.conf import settings

from django_idempotency.conf import (
    BY_NAME,
    OPTION_ONLY,
    SETTINGS,
    KeyFunction,
    RequestFunction,
    Setting,
    StoreFunction,
    idempotency_settings,
)

#: Per-view options; each defaults to the setting of the same name, if it has one.
OPTIONS: dict[str, Setting] = {s.option_name: s for s in (*SETTINGS, *OPTION_ONLY) if s.option}
OPTION_NAMES: tuple[str, ...] = tuple(OPTIONS)


class CallOptions(TypedDict, total=False):
    """The options of a function or task besides its key, each defaulting to its setting.

    ``atomic``, ``ttl`` (a timedelta or seconds), ``wait`` (seconds) and
    ``lease`` (a timedelta or seconds).
    """

    atomic: bool | None
    ttl: timedelta | float | None
    wait: float | None
    lease: timedelta | float | None


CALL_OPTION_NAMES: tuple[str, ...] = tuple(CallOptions.__annotations__)

# Every view's options, for the checks' deferred imports and to forget
# resolved values on a settings change. Weak: a view that is gone takes them.
_ALL: weakref.WeakSet[DeclaredOptions] = weakref.WeakSet()
# Guards _ALL: DRF may build options per request while a settings change lists them.
_ALL_LOCK = threading.Lock()


def _all() -> list[DeclaredOptions]:
    with _ALL_LOCK:
        return list(_ALL)


@dataclass(frozen=True)
class Options:
    """The options one request runs with: the view's own over the settings."""

    required: bool
    ttl: timedelta
    methods: frozenset[str]
    scope: RequestFunction
    fingerprint: RequestFunction
    atomic: bool
    wait: float
    lease: timedelta
    #: Lease mode: what to do with an abandoned claim, ``None`` to take it over.
    recover: Callable[..., Any] | None
    #: Reads the key from the request; ``None``: the key is the ``HEADER``.
    key: KeyFunction | None
    #: Narrows which responses complete the key; ``None``: all that 4.3 stores.
    store: StoreFunction | None = None

    @cached_property
    def handler_names(self) -> tuple[str, ...]:
        """The names of the handlers of ``methods`` on a class-based view, found once."""
        return tuple(sorted(method.lower() for method in self.methods))


def suggest(name: str, known: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


class DeclaredOptions:
    """The options one view, function or task was given, validated once.

    ``label(name)`` says where an option was written, for messages; ``None``
    leaves an option to its setting. ``allowed`` names the options that
    apply; ``also`` the caller's other keyword arguments, for the
    suggestions in the unknown-option message.
    """

    def __init__(
        self,
        given: Mapping[str, Any],
        label: Callable[[str], str],
        allowed: tuple[str, ...] = OPTION_NAMES,
        also: tuple[str, ...] = (),
    ) -> None:
        unknown = sorted(set(given) - set(allowed))
        if unknown:
            valid = (*also, *allowed)
            hint = suggest(unknown[0], valid)
            raise TypeError(
                f"Unknown idempotency option(s): {', '.join(unknown)}.{hint} "
                f"Valid options are: {', '.join(valid)}."
            )
        self._label = label
        self._given = {name: value for name, value in given.items() if value is not None}
        self._clean: dict[str, Any] = {}
        #: What :meth:`resolve` gave; ``None`` again whenever the settings change.
        self.resolved: Options | None = None
        for name, value in self._given.items():
            setting = OPTIONS[name]
            if setting.imports and isinstance(value, str):
                problem = setting.problem(value, resolve=False)
                if problem is not None:
                    setting.refuse(label(name), problem)
            else:
                self._clean[name] = setting.clean(value, label(name))
        with _ALL_LOCK:
            _ALL.add(self)

    @property
    def given(self) -> dict[str, Any]:
        """The options as written (those left to their setting omitted)."""
        return dict(self._given)

    @property
    def atomic(self) -> bool:
        """The mode: the view's own, or the ``ATOMIC`` setting's, read now."""
        atomic: bool | None = self._clean.get("atomic")
        return idempotency_settings.atomic if atomic is None else atomic

    def deferred_imports(self) -> Iterator[tuple[str, Setting, str]]:
        """``(label, setting, dotted path)`` of each option imported at first use."""
        for name, value in self._given.items():
            if name not in self._clean:
                yield self._label(name), OPTIONS[name], value

    def resolve(self) -> Options:
        """The options for one request: settings read now, dotted paths imported on first use.

        Kept in :attr:`resolved` until the settings change.
        """
        resolved = self.resolved
        if resolved is not None:
            return resolved
        generation = idempotency_settings.generation
        options = self._resolve()

        def keep() -> None:
            self.resolved = options

        idempotency_settings.keep_if_current(generation, keep)
        return options

    def _resolve(self) -> Options:
        values: dict[str, Any] = {}
        for name, setting in OPTIONS.items():
            if name in self._clean:
                values[name] = self._clean[name]
            elif name in self._given:
                # Imports are cached, so only the first request pays for this.
                values[name] = setting.clean(self._given[name], self._label(name))
            elif setting.name in BY_NAME:
                values[name] = getattr(idempotency_settings, name)
            else:
                values[name] = setting.default  # an option with no setting
        return Options(**values)


def _forget_resolved() -> None:
    for options in _all():
        options.resolved = None


idempotency_settings.on_reload.append(_forget_resolved)


def all_deferred_imports() -> list[tuple[str, Setting, str]]:
    found = {item for options in _all() for item in options.deferred_imports()}
    return sorted(found, key=lambda item: (item[0], item[2]))


def check_options(options: Mapping[str, Any], view: Any = None) -> DeclaredOptions:
    """Validate ``@idempotent`` keyword arguments when the view is decorated."""
    where = "" if view is None else f" on {view.__module__}.{view.__qualname__}"
    return DeclaredOptions(options, lambda name: f"@idempotent({name}=...){where}")


class NonAtomicRequests(Set[str]):
    """A view's ``_non_atomic_requests``: every database in lease mode, none in atomic mode.

    Lease mode must commit its claim before the view runs, which
    ``ATOMIC_REQUESTS`` would prevent. The mode is read at each request, not
    at import, so a bad setting is reported by the system checks rather
    than by a traceback while the URLconf is imported.
    """

    def __init__(self, options: DeclaredOptions, also: Set[str] = frozenset()) -> None:
        self._options = options
        #: What the view was already marked with (``transaction.non_atomic_requests``).
        self._also = frozenset(also)

    def _aliases(self) -> frozenset[str]:
        if self._options.atomic:
            return self._also
        return frozenset(settings.DATABASES)

    def __contains__(self, alias: object) -> bool:
        return alias in self._aliases()

    def __iter__(self) -> Iterator[str]:
        return iter(self._aliases())

    def __len__(self) -> int:
        return len(self._aliases())

    @classmethod
    def _from_iterable(cls, aliases: Any) -> frozenset[str]:  # type: ignore[override]
        # What set operations (``|``, ``-``) build: a plain set, decided now.
        return frozenset(aliases)

    def __repr__(self) -> str:
        return f"NonAtomicRequests({set(self._aliases())!r})"
