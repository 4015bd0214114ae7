"""Per-view options (``@idempotent(ttl=...)``, ``IdempotentMixin.idempotency_ttl``) and
the options of functions and tasks (``idempotent_function(ttl=...)``).

Each option is a row of the settings table (:mod:`django_idempotency.conf`)
and is validated by that row's rule when the view is decorated, its class
is created or the function is decorated, so a wrong value fails where it is
written, not on every request; at each call :meth:`DeclaredOptions.resolve`
gives every option its value, the setting's where none was given. Nothing
else re-derives them: the engine, the OpenAPI extension and the checks all
read them here. ``key`` and ``store`` are options with no setting
(``OPTION_ONLY``): left out, the key is the ``HEADER`` and every response
SPEC 4.3 stores completes it. Dotted paths (``scope``, ``fingerprint``,
``key``) are checked for shape
then but imported later, by a system check or at the first request:
importing a project's module while its views module is still being
imported invites import cycles (see docs/decorator.rst).
"""

from __future__ import annotations

import difflib
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Set
from dataclasses import dataclass
from datetime import timedelta
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
    """The options a task takes besides its key: what a function or a task may be given.

    The rest is about requests. Each is validated by its setting's row and
    defaults to that setting: ``atomic``, ``ttl`` (a timedelta or seconds),
    ``wait`` (seconds) and ``lease`` (a timedelta or seconds).
    """

    atomic: bool | None
    ttl: timedelta | float | None
    wait: float | None
    lease: timedelta | float | None


CALL_OPTION_NAMES: tuple[str, ...] = tuple(CallOptions.__annotations__)

# Every view's options, so that the system checks can import the dotted
# paths that views defer to their first request (see checks.py), and a
# settings change forgets what each resolved. Weak: a view that is gone
# takes its options with it.
_ALL: weakref.WeakSet[DeclaredOptions] = weakref.WeakSet()
# Held while one is added or all are listed: DRF builds a view's options per
# request when they are properties, while a settings change lists them all.
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


def suggest(name: str, known: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


class DeclaredOptions:
    """The options one view, function or task was given, validated once.

    ``label(name)`` says where an option was written, for messages, e.g.
    ``@idempotent(ttl=...)`` or ``OrderViewSet.idempotency_ttl``. ``None``
    leaves an option to its setting. ``allowed`` names the options that
    apply (a task has no ``methods``); ``also`` names the caller's other
    keyword arguments (a task's ``key`` and ``recover``), so that a near
    miss of one is suggested and every valid name is listed.
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
        #: The options resolved under the settings as they are, once asked
        #: (:meth:`resolve`); ``None`` again whenever the settings change
        #: (``override_settings``), the only thing that can change them.
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

        Resolved once and kept in :attr:`resolved` until the settings
        change, so that a request reads ``declared.resolved or
        declared.resolve()``.
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

    Lease mode must commit its claim before the view runs, which a
    request-wide transaction (``ATOMIC_REQUESTS``) would prevent. Django
    asks ``alias in view._non_atomic_requests`` at each request, so the
    mode is read then, not when the view module is imported: a bad
    ``IDEMPOTENCY`` setting is reported by the system checks rather than
    by a traceback while the URLconf is imported.
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
