"""Views whose bodies ``IdempotencyMiddleware`` must leave alone, and forms it protects.

The views it leaves alone (exempt, or protecting themselves with a key of
their own) read the body their own way: with upload handlers of their own,
or not at all. Each says what it saw of the body when it first got to it,
so a test can tell the client's stream from a copy the middleware made.
"""

from __future__ import annotations

import hashlib
from typing import Any

from django.core.files.uploadhandler import FileUploadHandler
from django.http import HttpRequest, HttpResponse, JsonResponse

from django_idempotency import idempotency_exempt, idempotent
from tests.body_views import open_temporary_files
from tests.models import Order
from tests.views import calls


class ArrivalHandler(FileUploadHandler):
    """An upload handler of a view's own: digests each file, noting what it saw first.

    At the first chunk: how much of the client's stream was still unread
    (known under the test client, whose stream has a length), and how many
    copies of the body were open in ``FILE_UPLOAD_TEMP_DIR``.
    """

    def __init__(self, request: HttpRequest) -> None:
        super().__init__(request)
        self.first_chunk: dict[str, Any] | None = None
        self.digest = hashlib.sha256()
        self.size = 0

    def receive_data_chunk(self, raw_data: bytes, start: int) -> None:
        if self.first_chunk is None:
            stream = self.request.META.get("wsgi.input")
            self.first_chunk = {
                "unread": len(stream) if hasattr(stream, "__len__") else None,
                "open_temporary_files": open_temporary_files(),
            }
        self.digest.update(raw_data)
        self.size += len(raw_data)

    def file_complete(self, file_size: int) -> None:
        return None  # digested, kept nowhere


def upload_to_own_handler(request: HttpRequest) -> HttpResponse:
    """Sets its own upload handlers, which Django allows only before the body is read."""
    handler = ArrivalHandler(request)
    request.upload_handlers = [handler]
    fields = request.POST
    return JsonResponse(
        {
            "first_chunk": handler.first_chunk,
            "size": handler.size,
            "sha256": handler.digest.hexdigest(),
            "fields": {name: fields.getlist(name) for name in fields},
        }
    )


def upload_id(request: HttpRequest) -> str | None:
    return request.headers.get("X-Upload-Id")


upload_with_own_key = idempotent(key=upload_id)(upload_to_own_handler)


@idempotency_exempt
def exempt_upload(request: HttpRequest) -> HttpResponse:
    return upload_to_own_handler(request)


def refuse_upload(request: HttpRequest) -> HttpResponse:
    """Refuses an upload before reading it, as a quota or permission check does."""
    return HttpResponse("uploads are closed", status=403)


@idempotency_exempt
def exempt_refuse_upload(request: HttpRequest) -> HttpResponse:
    return refuse_upload(request)


async def async_form_order(request: HttpRequest) -> HttpResponse:
    calls.increment()
    order = await Order.objects.acreate(item=request.POST.get("item", "widget"))
    return JsonResponse({"id": order.pk, "item": order.item}, status=201)


async_form_order_decorated = idempotent(async_form_order)
