"""Django REST framework integration: ``IdempotentMixin`` and API exceptions.

The only module that imports ``rest_framework``. The mixin wraps the
handler after DRF's ``initial()``, so authentication, permissions and
throttling have answered before any key is claimed, and the scope sees the
DRF-authenticated user (token, JWT, session). Async handlers of ``adrf``
views go through the same core (``docs/async.rst``).
"""

from __future__ import annotations

from inspect import ismethod
from typing import Any

from asgiref.sync import iscoroutinefunction
from django.conf import settings
from django.http import HttpResponseBase
from django.template.response import SimpleTemplateResponse
from rest_framework import exceptions, status
from rest_framework.request import Request
from rest_framework.response import Response

from django_idempotency import exceptions as core_exceptions
from django_idempotency.conf import idempotency_settings
from django_idempotency.core import OPTION_NAMES, protect


class IdempotencyKeyRequired(exceptions.APIException):
    status_code = status.HTTP_400_BAD_REQUEST
    default_detail = core_exceptions.IdempotencyKeyRequired.default_detail
    default_code = core_exceptions.IdempotencyKeyRequired.code


class InvalidIdempotencyKey(exceptions.APIException):
    status_code = status.HTTP_400_BAD_REQUEST
    default_detail = core_exceptions.InvalidIdempotencyKey.default_detail
    default_code = core_exceptions.InvalidIdempotencyKey.code


class RequestInFlight(exceptions.APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = core_exceptions.RequestInFlight.default_detail
    default_code = core_exceptions.RequestInFlight.code

    def __init__(self, detail: Any = None, code: Any = None, wait: int = 1) -> None:
        super().__init__(detail, code)
        # DRF's exception handler turns ``wait`` into Retry-After, as for Throttled.
        self.wait = wait


class FingerprintMismatch(exceptions.APIException):
    status_code = status.HTTP_422_UNPROCESSABLE_ENTITY
    default_detail = core_exceptions.FingerprintMismatch.default_detail
    default_code = core_exceptions.FingerprintMismatch.code


_EQUIVALENTS: dict[type[core_exceptions.IdempotencyError], type[exceptions.APIException]] = {
    core_exceptions.IdempotencyKeyRequired: IdempotencyKeyRequired,
    core_exceptions.InvalidIdempotencyKey: InvalidIdempotencyKey,
    core_exceptions.RequestInFlight: RequestInFlight,
    core_exceptions.FingerprintMismatch: FingerprintMismatch,
}


def to_api_exception(error: core_exceptions.IdempotencyError) -> exceptions.APIException:
    """The DRF exception for a core error, so the project's EXCEPTION_HANDLER renders it."""
    # Walk the MRO so that a subclass of a core error keeps its HTTP meaning.
    api_class = next(_EQUIVALENTS[cls] for cls in type(error).__mro__ if cls in _EQUIVALENTS)
    if isinstance(error, core_exceptions.RequestInFlight):
        return RequestInFlight(error.detail, wait=error.retry_after)
    return api_class(error.detail)


def finalize_api_view_response(request: Request, response: HttpResponseBase) -> HttpResponseBase:
    """Give an ``@api_view`` response its renderer now, so it can be rendered and stored."""
    view = request.parser_context["view"]
    return view.finalize_response(request, response)


class IdempotentMixin:
    """Protect a DRF view's handlers; options as ``idempotency_<option>`` attributes.

    Put it before the DRF base class: ``class OrderViewSet(IdempotentMixin,
    ModelViewSet)``. Attributes left ``None`` fall back to the setting of
    the same name.
    """

    idempotency_required: bool | None = None
    idempotency_ttl: Any = None
    idempotency_methods: Any = None
    idempotency_scope: Any = None
    idempotency_fingerprint: Any = None
    idempotency_atomic: bool | None = None
    idempotency_wait: float | None = None
    idempotency_lease: Any = None

    @classmethod
    def as_view(cls, *args: Any, **initkwargs: Any) -> Any:
        """Keep lease-mode views out of ``ATOMIC_REQUESTS``.

        Lease mode must commit its claim before the handler runs, which a
        request-wide transaction would prevent. Django decides this from the
        view function before DRF's ``dispatch`` ever runs, so it is settled
        here, from the attribute, the ``as_view`` argument or the setting.
        """
        view = super().as_view(*args, **initkwargs)  # type: ignore[misc]
        atomic = initkwargs.get("idempotency_atomic", cls.idempotency_atomic)
        if atomic is None:
            atomic = idempotency_settings.atomic
        if not atomic:
            view._non_atomic_requests = set(settings.DATABASES)
        return view

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)  # type: ignore[misc]
        # DRF looks the handler up after initial(); shadow it on the instance
        # (as ViewSets themselves do) with a protected version.
        method = (request.method or "").lower()
        handler = getattr(self, method, None)
        if handler is not None:
            setattr(self, method, self._protected(handler))

    def _protected(self, handler: Any) -> Any:
        options = {name: self._option(name) for name in OPTION_NAMES}
        if iscoroutinefunction(handler):
            # An async handler of an adrf view (docs/async.rst).
            return self._protected_async(handler, options)

        def protected_handler(request: Request, *args: Any, **kwargs: Any) -> HttpResponseBase:
            try:
                return protect(
                    request,
                    lambda: handler(request, *args, **kwargs),
                    options,
                    sender=type(self),
                    finalize=lambda response: self._render_now(request, response),
                )
            except core_exceptions.IdempotencyError as error:
                raise to_api_exception(error) from error

        return protected_handler

    def _protected_async(self, handler: Any, options: dict[str, Any]) -> Any:
        from django_idempotency.asynchronous import protect_async

        async def protected_handler(
            request: Request, *args: Any, **kwargs: Any
        ) -> HttpResponseBase:
            try:
                return await protect_async(
                    request,
                    lambda: handler(request, *args, **kwargs),
                    options,
                    sender=type(self),
                    finalize=lambda response: self._render_now(request, response),
                )
            except core_exceptions.IdempotencyError as error:
                raise to_api_exception(error) from error

        return protected_handler

    def _option(self, name: str) -> Any:
        value = getattr(self, f"idempotency_{name}")
        # A function assigned as a class attribute comes back bound to the
        # view; the scope and fingerprint callables take only the request.
        if ismethod(value) and value.__self__ is self:
            return value.__func__
        return value

    def _render_now(self, request: Request, response: HttpResponseBase) -> HttpResponseBase:
        # Render before storing, so that what is stored is the bytes DRF
        # sends; a plain TemplateResponse (which DRF passes through) too.
        if isinstance(response, Response) and not response.is_rendered:
            response = self.finalize_response(request, response)  # type: ignore[attr-defined]
        if isinstance(response, SimpleTemplateResponse) and not response.is_rendered:
            response.render()
        return response
