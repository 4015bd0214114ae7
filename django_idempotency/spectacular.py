"""OpenAPI 3 for protected DRF operations, through drf-spectacular.

Imported by the app's ``ready()`` when ``drf_spectacular`` is installed: the
subclass of :class:`~drf_spectacular.extensions.OpenApiViewExtension` below
registers itself on import. It matches only views that are protected (an
``IdempotentMixin`` view, or an ``@api_view`` whose function carries
``@idempotent``) and gives each protected handler a schema class that adds,
to every operation whose method is protected, the key header, the
400/409/422 answers and the replay header. The only module importing
``drf_spectacular``; see the OpenAPI page of the docs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from functools import cache
from typing import Any

from drf_spectacular.drainage import isolate_view_method
from drf_spectacular.extensions import OpenApiViewExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.plumbing import ResolvedComponent, get_class, get_doc
from drf_spectacular.settings import spectacular_settings
from rest_framework.settings import api_settings
from rest_framework.views import APIView
from rest_framework.views import exception_handler as drf_exception_handler

from django_idempotency.conf import idempotency_settings, to_timedelta
from django_idempotency.drf import IdempotentMixin
from django_idempotency.options import DeclaredOptions
from django_idempotency.responses import TRANSIENT_STATUSES

ERROR_COMPONENT = "IdempotencyError"
_DOCUMENTED = ("required", "ttl", "methods", "atomic", "wait")


@dataclass(frozen=True)
class Protection:
    """What a client needs to know about one protected operation."""

    required: bool
    ttl: timedelta
    methods: frozenset[str]
    atomic: bool
    wait: float


def _effective(overrides: dict[str, Any]) -> Protection:
    conf = idempotency_settings

    def pick(name: str) -> Any:
        value = overrides.get(name)
        return getattr(conf, name) if value is None else value

    return Protection(
        required=bool(pick("required")),
        ttl=to_timedelta(pick("ttl")),
        methods=frozenset(method.upper() for method in pick("methods")),
        atomic=bool(pick("atomic")),
        wait=float(pick("wait")),
    )


def _candidates(func: Any, depth: int = 0) -> Iterator[Any]:
    """``func``, what it wraps, and the functions its closure calls.

    ``@api_view`` routes every method through one ``handler`` closure over the
    decorated function, so that is where ``@idempotent``'s mark is found.
    """
    if func is None or depth > 4:
        return
    yield func
    yield from _candidates(getattr(func, "__wrapped__", None), depth + 1)
    for cell in getattr(func, "__closure__", None) or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if callable(contents) and not isinstance(contents, type):
            yield from _candidates(contents, depth + 1)


def decorator_options(handler: Any) -> dict[str, Any] | None:
    """The options ``@idempotent`` was given, if ``handler`` runs a decorated view."""
    for candidate in _candidates(handler):
        options = getattr(candidate, "idempotency_options", None)
        if isinstance(options, DeclaredOptions):
            return options.given
    return None


def _handler_names(view_class: type[APIView], actions: dict[str, str] | None) -> list[str]:
    if actions:
        return sorted(set(actions.values()))
    return [name for name in view_class.http_method_names if hasattr(view_class, name)]


def is_protected_view(view_class: Any) -> bool:
    if not (isinstance(view_class, type) and issubclass(view_class, APIView)):
        return False
    if issubclass(view_class, IdempotentMixin):
        return True
    return any(
        decorator_options(getattr(view_class, name)) is not None
        for name in _handler_names(view_class, None)
    )


def protection_for(view: APIView, method: str) -> Protection | None:
    """How ``method`` on this view instance is protected, or ``None`` if it is not."""
    if not idempotency_settings.enabled:
        return None
    if isinstance(view, IdempotentMixin):
        overrides = {name: getattr(view, f"idempotency_{name}") for name in _DOCUMENTED}
    else:
        action = getattr(view, "action", None) or method.lower()
        found = decorator_options(getattr(view, action, None))
        if found is None:
            return None
        overrides = found
    protection = _effective(overrides)
    return protection if method.upper() in protection.methods else None


def describe_duration(duration: timedelta) -> str:
    seconds = int(duration.total_seconds())
    # "24 hours" reads better than "1 day" for the usual default.
    for unit, size, at_least in (("day", 86400, 2), ("hour", 3600, 1), ("minute", 60, 1)):
        if seconds >= size * at_least and seconds % size == 0:
            count = seconds // size
            return f"{count} {unit}{'s' if count != 1 else ''}"
    return f"{seconds} second{'s' if seconds != 1 else ''}"


class IdempotentSchemaMixin:
    """Adds the idempotency parts to the operation the view's own schema built."""

    def get_description(self) -> str:
        description: str = super().get_description()  # type: ignore[misc]
        if description and description == get_doc(IdempotentMixin):
            # drf-spectacular walks the view's bases for a docstring and found
            # the mixin's, which is about this package, not about the API.
            return project_doc(type(self.view))  # type: ignore[attr-defined]
        return description

    def get_operation(self, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
        operation: dict[str, Any] | None = super().get_operation(  # type: ignore[misc]
            *args, **kwargs
        )
        if operation is None:
            return None
        protection = protection_for(self.view, self.method)  # type: ignore[attr-defined]
        if protection is not None:
            _document(self, operation, protection)  # type: ignore[arg-type]
        return operation


def project_doc(view_class: type) -> str:
    """The docstring drf-spectacular would find for ``view_class`` without the mixin.

    The first one among the view's own classes, stopping, as drf-spectacular
    does, at the classes of DRF itself; ``""`` when the project wrote none.
    """
    excluded = set(spectacular_settings.GET_LIB_DOC_EXCLUDES())
    for cls in view_class.__mro__:
        if cls in excluded:
            break
        if cls is not IdempotentMixin and cls.__doc__:
            return get_doc(cls)
    return ""


@cache
def idempotent_schema_class(base: type[AutoSchema]) -> type[AutoSchema]:
    return type(f"Idempotent{base.__name__}", (IdempotentSchemaMixin, base), {})


class IdempotencyViewExtension(OpenApiViewExtension):
    """Hand each protected handler a schema class that documents the protection."""

    target_class = "rest_framework.views.APIView"
    match_subclasses = True
    # First among view extensions, so that another extension for the same view
    # is applied too (below) instead of replacing this one.
    priority = 1000

    @classmethod
    def _matches(cls, target: Any) -> bool:
        return super()._matches(target) and is_protected_view(get_class(target))

    def view_replacement(self) -> type[APIView]:
        base = self._other_replacement() or self.target
        replacement: type[APIView] = type(base.__name__, (base,), {"__doc__": base.__doc__})
        replacement.__module__ = base.__module__
        actions = getattr(self.target_callback, "actions", None)
        for name in _handler_names(replacement, actions):
            if not hasattr(replacement, name):
                continue
            method = isolate_view_method(replacement, name)
            kwargs = dict(getattr(method, "kwargs", None) or {})
            schema = kwargs.get("schema") or replacement.schema
            kwargs["schema"] = idempotent_schema_class(get_class(schema))
            method.kwargs = kwargs
        return replacement

    def _other_replacement(self) -> type[APIView] | None:
        others = sorted(OpenApiViewExtension._registry, key=lambda e: e.priority, reverse=True)
        for extension in others:
            if extension is not type(self) and extension._matches(self.target):
                return extension(self.target_callback).view_replacement()
        return None


# Building the operation's additions.


def _document(schema: AutoSchema, operation: dict[str, Any], protection: Protection) -> None:
    conf = idempotency_settings
    responses: dict[str, Any] = operation.setdefault("responses", {})
    replay_header = {
        "description": (
            "Present, with the value true, when this is the stored response to an "
            "earlier request with the same key, sent again instead of running the "
            "request twice."
        ),
        "schema": {"type": "string", "enum": ["true"]},
    }
    for code, response in responses.items():
        if _replayable(code):
            response.setdefault("headers", {}).setdefault(conf.replay_header, replay_header)

    parameters: list[dict[str, Any]] = operation.setdefault("parameters", [])
    if not any(p.get("in") == "header" and p.get("name") == conf.header for p in parameters):
        parameters.append(_header_parameter(protection))

    content = _error_content(schema)
    link = _link_header()
    _add_response(responses, "400", _bad_key_description(protection), content, link)
    in_flight = "A request with the same key is still being processed" + (
        f" (this request waited up to {protection.wait:g} seconds for it to finish)"
        if protection.atomic and protection.wait
        else ""
    )
    _add_response(
        responses,
        "409",
        f"{in_flight}. Retry after the number of seconds in Retry-After.",
        content,
        {
            "Retry-After": {
                "description": "Seconds to wait before retrying with the same key.",
                "schema": {"type": "integer", "minimum": 1},
            },
            **link,
        },
    )
    _add_response(
        responses,
        "422",
        "The key was already used for a different request (another method, path, "
        "query or body). Send a new key for a new request.",
        content,
        link,
    )


def _replayable(code: str) -> bool:
    if not code.isdigit():
        return True  # "default" or a range such as "2XX"
    status = int(code)
    return status < 500 and status not in TRANSIENT_STATUSES


def _header_parameter(protection: Protection) -> dict[str, Any]:
    conf = idempotency_settings
    ttl = describe_duration(protection.ttl)
    return {
        "in": "header",
        "name": conf.header,
        "required": protection.required,
        "schema": {
            "type": "string",
            "minLength": 1,
            "maxLength": conf.key_max_length,
            "pattern": "^[!-~]+$",
        },
        "description": (
            "A key unique to this request, such as a UUID, sent again with every "
            "retry of it. The first request with a key runs; a retry gets the "
            f"response the first one got, with {conf.replay_header}: true, and does "
            f"not run again. Keys expire {ttl} after the response is stored, or at "
            "most 1% of that sooner (counted from when the first request arrived): "
            "after that the same key starts a new request. Up to "
            f"{conf.key_max_length} visible ASCII characters, sent bare (abc-123) or "
            'quoted ("abc-123"; the quotes do not count).'
            + ("" if protection.required else " Without the header the request is not protected.")
        ),
        "x-idempotency-key-expires-after-seconds": int(protection.ttl.total_seconds()),
    }


def _bad_key_description(protection: Protection) -> str:
    conf = idempotency_settings
    malformed = (
        f"the {conf.header} header is empty, longer than {conf.key_max_length} "
        "characters, or not visible ASCII"
    )
    if protection.required:
        return f"The {conf.header} header is missing (this operation requires it), or {malformed}."
    return malformed[0].upper() + malformed[1:] + "."


def _add_response(
    responses: dict[str, Any],
    code: str,
    description: str,
    content: dict[str, Any],
    headers: dict[str, Any],
) -> None:
    existing = responses.get(code)
    if existing is not None:
        # The view documents this status already (a validation error, say):
        # keep its body, and say what else it can mean.
        existing["description"] = f"{existing.get('description', '')} {description}".strip()
        if headers:
            existing.setdefault("headers", {}).update(headers)
        return
    response: dict[str, Any] = {"description": description, "content": content}
    if headers:
        response["headers"] = headers
    responses[code] = response


def _link_header() -> dict[str, Any]:
    if idempotency_settings.problem_type_base_url is None:
        return {}
    return {
        "Link": {
            "description": 'The documentation of this error, rel="describedby".',
            "schema": {"type": "string"},
        }
    }


def _error_content(schema: AutoSchema) -> dict[str, Any]:
    """The body the project's ``EXCEPTION_HANDLER`` renders for these errors."""
    if api_settings.EXCEPTION_HANDLER is drf_exception_handler:
        component = ResolvedComponent(
            name=ERROR_COMPONENT,
            type=ResolvedComponent.SCHEMA,
            object=ERROR_COMPONENT,
            schema={
                "type": "object",
                "properties": {"detail": {"type": "string"}},
                "required": ["detail"],
            },
        )
        schema.registry.register_on_missing(component)
        body = component.ref
    else:
        # A project's own handler decides the shape; say so rather than guess.
        body = {"description": "Rendered by the project's REST_FRAMEWORK EXCEPTION_HANDLER."}
    media_types = schema.map_renderers("media_type") or ["application/json"]
    return {media_type: {"schema": body} for media_type in media_types}
