"""Views that read request bodies the ways real views do: streamed, loaded, parsed as forms.

Each writes one Order as its effect and answers with what it read, so a
test can tell a replay from a run and see that the view got the whole body.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from rest_framework import status
from rest_framework.parsers import BaseParser, FileUploadParser
from rest_framework.permissions import AllowAny, BasePermission
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import idempotent
from django_idempotency.contrib.drf import IdempotentMixin
from tests.models import Order
from tests.views import calls

EVERY_METHOD = ("POST", "PUT", "PATCH", "DELETE")


def _created(summary: dict[str, Any]) -> JsonResponse:
    calls.increment()
    order = Order.objects.create(item=str(summary)[:100])
    return JsonResponse({"id": order.pk, **summary}, status=201)


def _streamed(request: HttpRequest) -> HttpResponse:
    digest, size = hashlib.sha256(), 0
    while chunk := request.read(64 * 1024):
        digest.update(chunk)
        size += len(chunk)
    return _created({"size": size, "sha256": digest.hexdigest()})


@idempotent(methods=EVERY_METHOD)
def stream_body(request: HttpRequest) -> HttpResponse:
    """Streams the body with ``request.read()``, as an upload endpoint does."""
    return _streamed(request)


def stream_body_unprotected(request: HttpRequest) -> HttpResponse:
    return _streamed(request)


def open_temporary_files(pid: int | str = "self", directory: str | None = None) -> int:
    """How many files process ``pid`` holds open in ``directory`` (``FILE_UPLOAD_TEMP_DIR``).

    A body past ``FILE_UPLOAD_MAX_MEMORY_SIZE`` is copied to a file there,
    unlinked at once, so only an open descriptor shows it.
    """
    directory = directory or settings.FILE_UPLOAD_TEMP_DIR
    if directory is None:
        return 0
    targets = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            targets.append(os.readlink(fd))
        except OSError:
            continue  # closed while we looked (the listing's own descriptor)
    return sum(target.startswith(str(directory) + os.sep) for target in targets)


def _json_streamed(request: HttpRequest) -> HttpResponse:
    data = json.load(request)
    return _created({"items": len(data["items"]), "open_temporary_files": open_temporary_files()})


@idempotent(methods=EVERY_METHOD)
def stream_json(request: HttpRequest) -> HttpResponse:
    """Reads JSON from the stream with ``json.load(request)``, past any size limit."""
    return _json_streamed(request)


def stream_json_unprotected(request: HttpRequest) -> HttpResponse:
    return _json_streamed(request)


@idempotent(methods=EVERY_METHOD)
def load_body(request: HttpRequest) -> HttpResponse:
    """Loads ``request.body``, which Django caps at ``DATA_UPLOAD_MAX_MEMORY_SIZE``."""
    return _created({"size": len(request.body)})


def load_body_unprotected(request: HttpRequest) -> HttpResponse:
    return _created({"size": len(request.body)})


@idempotent(methods=EVERY_METHOD)
def form(request: HttpRequest) -> HttpResponse:
    """Parses a multipart form for any method, as Django documents for PUT."""
    if request.method == "POST":
        fields, files = request.POST, request.FILES
    else:
        fields, files = request.parse_file_upload(request.META, request)
    return _created(
        {
            "fields": {name: fields.getlist(name) for name in fields},
            "files": {
                name: [hashlib.sha256(upload.read()).hexdigest() for upload in files.getlist(name)]
                for name in files
            },
        }
    )


class FormAPIView(IdempotentMixin, APIView):
    """DRF's parsers for every method: ``request.data`` holds the form and files."""

    authentication_classes: list[type] = []
    permission_classes = [AllowAny]
    idempotency_methods = EVERY_METHOD

    def post(self, request: Request) -> Response:
        calls.increment()
        data = request.data
        summary = {
            name: [
                hashlib.sha256(value.read()).hexdigest() if hasattr(value, "read") else value
                for value in data.getlist(name)
            ]
            for name in data
        }
        order = Order.objects.create(item=str(summary)[:100])
        return Response({"id": order.pk, **summary}, status=status.HTTP_201_CREATED)

    put = patch = delete = post


class ReadsData(BasePermission):
    """A permission that looks at ``request.data``: the stream is parsed before the key is."""

    def has_permission(self, request: Request, view: Any) -> bool:
        return request.data is not None


class StreamJSONParser(BaseParser):
    """A JSON parser that reads the stream and keeps nothing, as older DRF releases did."""

    media_type = "application/json"

    def parse(self, stream: Any, media_type: Any = None, parser_context: Any = None) -> Any:
        return json.load(stream)


class ParsedFirstAPIView(IdempotentMixin, APIView):
    """The body is parsed by a permission before the fingerprint is computed."""

    authentication_classes: list[type] = []
    permission_classes = [ReadsData]

    def post(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        calls.increment()
        summary = {
            name: hashlib.sha256(value.read()).hexdigest() if hasattr(value, "read") else value
            for name, value in request.data.items()
        }
        order = Order.objects.create(item=str(summary)[:100])
        return Response({"id": order.pk, **summary}, status=status.HTTP_201_CREATED)

    put = post


class UploadAPIView(ParsedFirstAPIView):
    parser_classes = [FileUploadParser]


class StreamJSONAPIView(ParsedFirstAPIView):
    parser_classes = [StreamJSONParser]


@idempotent
def form_fields(request: HttpRequest) -> HttpResponse:
    """Reads ``request.POST``, which Django caps at ``DATA_UPLOAD_MAX_NUMBER_FIELDS``."""
    return _created({"fields": len(request.POST)})


def form_fields_unprotected(request: HttpRequest) -> HttpResponse:
    return _created({"fields": len(request.POST)})


class JSONAPIView(IdempotentMixin, APIView):
    """DRF's JSONParser reads the raw stream and sets no size limit of its own."""

    authentication_classes: list[type] = []
    permission_classes = [AllowAny]

    def post(self, request: Request) -> Response:
        calls.increment()
        items = request.data["items"]
        order = Order.objects.create(item=f"json:{len(items)}")
        return Response({"id": order.pk, "items": len(items)}, status=status.HTTP_201_CREATED)
