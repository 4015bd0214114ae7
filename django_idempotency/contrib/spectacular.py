"""OpenAPI 3 for protected DRF operations, through drf-spectacular.

Imported by the app's ``ready()`` when ``drf_spectacular`` is installed; the
view extension below registers itself on import. Protection is decided as
at run time (:func:`~django_idempotency.protection.view_protection`); each
protected operation documents the key header, the 400/409/422 answers and
the replay header.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from functools import cache, lru_cache
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.urls import URLResolver, get_resolver
from drf_spectacular.drainage import isolate_view_method, warn
from drf_spectacular.extensions import OpenApiViewExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.plumbing import ResolvedComponent, get_class, get_doc
from drf_spectacular.settings import spectacular_settings
from rest_framework.settings import api_settings
from rest_framework.views import APIView
from rest_framework.views import exception_handler as drf_exception_handler

from django_idempotency.adapters import Layer
from django_idempotency.conf import idempotency_settings
from django_idempotency.contrib.drf import IdempotentMixin, handler_name
from django_idempotency.middleware import installed as middleware_installed
from django_idempotency.options import Options
from django_idempotency.protection import view_protection
from django_idempotency.responses import PROBLEM_CONTENT_TYPE, TRANSIENT_STATUSES

ERROR_COMPONENT = "IdempotencyError"
PROBLEM_COMPONENT = "IdempotencyProblem"
# Set on the view class drf-spectacular inspects: the view function the URL resolves to.
_CALLBACK = "_idempotency_schema_callback"


@dataclass(frozen=True)
class Protected:
    """How one operation is protected."""

    #: The options of the outermost layer whose ``methods`` include the operation's.
    options: Options
    #: Whether a request without a key is refused: by any layer that protects the method.
    required: bool
    problem_details: bool


def layers(callback: Any, view: APIView, method: str, path_regex: str) -> list[Layer]:
    """What protects ``method`` of the view function ``callback``, outermost first.

    The view's own layers, else the middleware's when it protects this
    operation. ``view`` is the instance being documented, whose
    ``as_view()`` arguments and properties the mixin reads.
    """
    try:
        protected = view_protection(callback, method, instance=view)
    except Exception as exc:
        # A property that needs a real request: document the class's options.
        warn(f"{type(view).__qualname__}: an idempotency option property raised {exc!r}.")
        protected = view_protection(callback, method)
    if protected.layers:
        return list(protected.layers)
    if protected.middleware is not None and _middleware_protects(method, path_regex):
        try:
            _, options = protected.middleware()
        except ImproperlyConfigured as refusal:
            # Every request with a key is refused (check E007): nothing to document.
            warn(str(refusal))
            return []
        return [Layer(options)]
    return []


def protection(found: list[Layer], method: str) -> Protected | None:
    """How the operation is protected by ``found``, or ``None`` if it is not.

    The first layer protecting the method claims the key; any of them that
    is ``required`` refuses a request without one.
    """
    if not idempotency_settings.enabled:
        return None
    resolved = [(layer, layer.options.resolve()) for layer in found]
    protecting = [(layer, options) for layer, options in resolved if method in options.methods]
    if not protecting:
        return None
    claiming, options = protecting[0]
    return Protected(
        options=options,
        required=any(each.required for _, each in protecting),
        problem_details=claiming.problem_details,
    )


def _middleware_protects(method: str, path_regex: str) -> bool:
    """Whether ``IdempotencyMiddleware`` is installed and protects this method at this URL.

    Every method in ``METHODS``, except under the admin's namespace.
    """
    conf = idempotency_settings
    return (
        middleware_installed()
        and method in conf.methods
        and path_regex not in _admin_path_regexes(get_resolver())
    )


@lru_cache(maxsize=8)
def _admin_path_regexes(resolver: URLResolver) -> frozenset[str]:
    """The URL patterns under an ``admin`` namespace, joined as drf-spectacular joins them."""
    found: set[str] = set()

    def walk(patterns: Any, prefix: str, admin: bool) -> None:
        for pattern in patterns:
            regex = prefix + str(pattern.pattern)
            if isinstance(pattern, URLResolver):
                walk(pattern.url_patterns, regex, admin or pattern.app_name == "admin")
            elif admin:
                found.add(regex)

    walk(resolver.url_patterns, "", False)
    return frozenset(found)


def _handlers(callback: Any) -> dict[str, str]:
    """The handler each method of the view function runs: ``{"POST": "create", ...}``."""
    view_class = callback.cls
    actions = getattr(callback, "actions", None)
    methods = actions if actions is not None else view_class.http_method_names
    found = {}
    for method in methods:
        name = handler_name(callback, method)
        if name is not None and hasattr(view_class, name):
            found[method.upper()] = name
    return found


def _may_be_protected(callback: Any) -> bool:
    """Whether some operation of the view function may be protected (``layers`` decides)."""
    if not idempotency_settings.enabled:
        return False
    if middleware_installed():
        return True
    return any(view_protection(callback, method).layers for method in _handlers(callback))


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
            # The mixin's docstring, found among the bases, is not about the API.
            return project_doc(type(self.view))  # type: ignore[attr-defined]
        return description

    def get_operation(self, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
        operation: dict[str, Any] | None = super().get_operation(  # type: ignore[misc]
            *args, **kwargs
        )
        if operation is None:
            return None
        view: APIView = self.view  # type: ignore[attr-defined]
        callback = getattr(type(view), _CALLBACK, None)
        if callback is None:
            return operation
        method = self.method.upper()  # type: ignore[attr-defined]
        found = layers(callback, view, method, self.path_regex)  # type: ignore[attr-defined]
        protected = protection(found, method)
        if protected is not None:
            _document(self, operation, protected)  # type: ignore[arg-type]
        return operation


def project_doc(view_class: type) -> str:
    """The docstring drf-spectacular would find for ``view_class`` without the mixin, or ``""``."""
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
    # First, so that another extension for the same view is applied too (below).
    priority = 1000

    def view_replacement(self) -> type[APIView]:
        base = self._other_replacement() or self.target
        callback = self.target_callback
        if not _may_be_protected(callback):
            return base
        replacement: type[APIView] = type(base.__name__, (base,), {"__doc__": base.__doc__})
        replacement.__module__ = base.__module__
        setattr(replacement, _CALLBACK, callback)
        for name in set(_handlers(callback).values()):
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


def _document(schema: AutoSchema, operation: dict[str, Any], protected: Protected) -> None:
    conf = idempotency_settings
    options = protected.options
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

    # With ``key=`` the key comes from the request itself: no header to document.
    from_header = options.key is None
    parameters: list[dict[str, Any]] = operation.setdefault("parameters", [])
    header_listed = any(
        each.get("in") == "header" and each.get("name") == conf.header for each in parameters
    )
    if from_header and not header_listed:
        parameters.append(_header_parameter(options, protected.required))

    content = _error_content(schema, protected.problem_details)
    link = _link_header()
    _add_response(
        responses, "400", _bad_key_description(protected.required, from_header), content, link
    )
    in_flight = "A request with the same key is still being processed" + (
        f" (this request waited up to {options.wait:g} seconds for it to finish)"
        if options.atomic and options.wait
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


def _header_parameter(options: Options, required: bool) -> dict[str, Any]:
    conf = idempotency_settings
    ttl = describe_duration(options.ttl)
    return {
        "in": "header",
        "name": conf.header,
        "required": required,
        "schema": {
            "type": "string",
            "minLength": conf.key_min_length,
            "maxLength": conf.key_max_length,
            "pattern": "^[!-~]+$",
        },
        "description": (
            "A key unique to this request, such as a UUID, sent again with every "
            "retry of it. The first request with a key runs; a retry gets the "
            f"response the first one got, with {conf.replay_header}: true, and does "
            f"not run again. Keys expire {ttl} after the response is stored, or at "
            "most 1% of that sooner (counted from when the first request arrived): "
            "after that the same key starts a new request. "
            f"{_key_lengths()} visible ASCII characters, sent bare (abc-123) or "
            'quoted ("abc-123"; the quotes do not count).'
            + ("" if required else " Without the header the request is not protected.")
        ),
        "x-idempotency-key-expires-after-seconds": int(options.ttl.total_seconds()),
    }


def _key_lengths() -> str:
    """How long a key may be, as the key rules check it (``KEY_MIN_LENGTH``, ``KEY_MAX_LENGTH``)."""
    conf = idempotency_settings
    if conf.key_min_length == conf.key_max_length:
        return f"Exactly {conf.key_max_length}"
    if conf.key_min_length > 1:
        return f"From {conf.key_min_length} to {conf.key_max_length}"
    return f"Up to {conf.key_max_length}"


def _wrong_length() -> str:
    conf = idempotency_settings
    longer = f"longer than {conf.key_max_length} characters"
    if conf.key_min_length > 1:
        return f"shorter than {conf.key_min_length} or {longer}"
    return longer


def _bad_key_description(required: bool, from_header: bool = True) -> str:
    conf = idempotency_settings
    if not from_header:
        return (
            "The idempotency key this operation reads from the request is missing, empty, "
            f"{_wrong_length()}, or not visible ASCII."
        )
    malformed = f"the {conf.header} header is empty, {_wrong_length()}, or not visible ASCII"
    if required:
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
        # Documented by the view already: keep its body, add what else it means.
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


def _error_content(schema: AutoSchema, problem_details: bool) -> dict[str, Any]:
    """The body these errors have: problem details, or what ``EXCEPTION_HANDLER`` renders."""
    if problem_details:
        # @idempotent on dispatch answers as a decorator: RFC 9457, as on a plain view.
        problem = _component(
            schema,
            PROBLEM_COMPONENT,
            {
                "type": "object",
                "properties": {
                    "type": {"type": "string"},
                    "title": {"type": "string"},
                    "status": {"type": "integer"},
                    "detail": {"type": "string"},
                },
                "required": ["type", "title", "status", "detail"],
            },
        )
        return {PROBLEM_CONTENT_TYPE: {"schema": problem}}
    if api_settings.EXCEPTION_HANDLER is drf_exception_handler:
        body = _component(
            schema,
            ERROR_COMPONENT,
            {
                "type": "object",
                "properties": {"detail": {"type": "string"}},
                "required": ["detail"],
            },
        )
    else:
        # A project's own handler decides the shape; say so rather than guess.
        body = {"description": "Rendered by the project's REST_FRAMEWORK EXCEPTION_HANDLER."}
    media_types = schema.map_renderers("media_type") or ["application/json"]
    return {media_type: {"schema": body} for media_type in media_types}


def _component(schema: AutoSchema, name: str, body: dict[str, Any]) -> dict[str, Any]:
    """A reference to the schema component ``name``, registered the first time it is used."""
    component = ResolvedComponent(
        name=name, type=ResolvedComponent.SCHEMA, object=name, schema=body
    )
    schema.registry.register_on_missing(component)
    return component.ref
