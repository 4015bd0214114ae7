"""Per-view options: ``@idempotent(ttl=...)`` and ``IdempotentMixin.idempotency_ttl``.

Each option is a row of the settings table (:mod:`django_idempotency.conf`)
and is validated by that row's rule when the view is decorated or its class
is created, so a wrong value fails where it is written, not on every
request. Dotted paths (``scope``, ``fingerprint``) are checked for shape
then but imported later, by a system check or at the first request:
importing a project's module while its views module is still being
imported invites import cycles (see docs/decorator.rst).
"""

from __future__ import annotations

import difflib
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django_idempotency.conf import SETTINGS, RequestFunction, Setting, idempotency_settings

#: Per-view options; each defaults to the setting of the same name.
OPTIONS: dict[str, Setting] = {s.option_name: s for s in SETTINGS if s.option}
OPTION_NAMES: tuple[str, ...] = tuple(OPTIONS)

# Every view's options, so that the system checks can import the dotted
# paths that views defer to their first request (see checks.py). Weak: a
# view that is gone takes its options with it.
_ALL: weakref.WeakSet[ViewOptions] = weakref.WeakSet()


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


def suggest(name: str, known: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


class ViewOptions:
    """The options one view was given, validated once.

    ``label(name)`` says where an option was written, for messages, e.g.
    ``@idempotent(ttl=...)`` or ``OrderViewSet.idempotency_ttl``. ``None``
    leaves an option to its setting.
    """

    def __init__(self, given: Mapping[str, Any], label: Callable[[str], str]) -> None:
        unknown = sorted(set(given) - set(OPTION_NAMES))
        if unknown:
            hint = suggest(unknown[0], OPTION_NAMES)
            raise TypeError(
                f"Unknown idempotency option(s): {', '.join(unknown)}.{hint} "
                f"Valid options are: {', '.join(OPTION_NAMES)}."
            )
        self._label = label
        self._given = {name: value for name, value in given.items() if value is not None}
        self._clean: dict[str, Any] = {}
        # The last resolve() and the settings generation it was made under:
        # options change only when the settings do (override_settings).
        self._resolved: tuple[int, Options] | None = None
        for name, value in self._given.items():
            setting = OPTIONS[name]
            if setting.imports and isinstance(value, str):
                problem = setting.problem(value, resolve=False)
                if problem is not None:
                    setting.refuse(label(name), problem)
            else:
                self._clean[name] = setting.clean(value, label(name))
        _ALL.add(self)

    @property
    def given(self) -> dict[str, Any]:
        """The options as written (those left to their setting omitted)."""
        return dict(self._given)

    @property
    def atomic(self) -> bool | None:
        """The view's own mode, or None when it follows the ``ATOMIC`` setting."""
        return self._clean.get("atomic")

    def deferred_imports(self) -> Iterator[tuple[str, Setting, str]]:
        """``(label, setting, dotted path)`` of each option imported at first use."""
        for name, value in self._given.items():
            if name not in self._clean:
                yield self._label(name), OPTIONS[name], value

    def resolve(self) -> Options:
        """The options for one request: settings read now, dotted paths imported on first use.

        Resolved once per settings generation and reused: only a settings
        change (``override_settings``, which reloads them) can change them.
        """
        generation = idempotency_settings.generation
        resolved = self._resolved
        if resolved is not None and resolved[0] == generation:
            return resolved[1]
        options = self._resolve()
        self._resolved = (generation, options)
        return options

    def _resolve(self) -> Options:
        values: dict[str, Any] = {}
        for name, setting in OPTIONS.items():
            if name in self._clean:
                values[name] = self._clean[name]
            elif name in self._given:
                # Imports are cached, so only the first request pays for this.
                values[name] = setting.clean(self._given[name], self._label(name))
            else:
                values[name] = getattr(idempotency_settings, name)
        return Options(**values)


def all_deferred_imports() -> list[tuple[str, Setting, str]]:
    found = {item for options in list(_ALL) for item in options.deferred_imports()}
    return sorted(found, key=lambda item: (item[0], item[2]))


def check_options(options: Mapping[str, Any], view: Any = None) -> ViewOptions:
    """Validate ``@idempotent`` keyword arguments when the view is decorated."""
    where = "" if view is None else f" on {view.__module__}.{view.__qualname__}"
    return ViewOptions(options, lambda name: f"@idempotent({name}=...){where}")


def resolve_options(overrides: Mapping[str, Any] | ViewOptions) -> Options:
    if not isinstance(overrides, ViewOptions):
        overrides = check_options(overrides)
    return overrides.resolve()
