"""Whose request bodies ``IdempotencyMiddleware`` reads: only those of the views it protects.

A form's key may be in the body, so the middleware reads the body of a
form sent without the header. It does so only once it knows the view is
one it protects: an exempt view, the admin, or a view that protects itself
gets the body as the client sends it, for upload handlers of its own, for
streaming, or for refusing an upload before it has arrived. For an async
view the body is read outside the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.db import connections
from django.test import AsyncClient, Client
from django.test.client import encode_multipart

from django_idempotency import core
from django_idempotency.models import IdempotencyKey
from tests.models import Order
from tests.server import DATABASE_NAME_ENV, UPLOAD_TEMP_DIR_ENV, GunicornServer
from tests.views import calls

pytestmark = [pytest.mark.urls("tests.middleware_body_urls"), pytest.mark.django_db]

MIDDLEWARE = "django_idempotency.middleware.IdempotencyMiddleware"
BOUNDARY = "BoUnDaRy"
MULTIPART = f"multipart/form-data; boundary={BOUNDARY}"
#: Django's multipart parser reads the stream 64 KiB at a time.
SIZE = 16 * 64 * 1024


@pytest.fixture(autouse=True)
def installed(settings: Any) -> None:
    settings.MIDDLEWARE = [*settings.MIDDLEWARE, MIDDLEWARE]


def content(size: int = SIZE, seed: bytes = b"") -> bytes:
    return (seed + bytes(range(256)) * (size // 256 + 1))[:size]


def upload(data: bytes, **fields: str) -> bytes:
    """A multipart body with ``fields`` and ``data`` as the file ``scan``."""
    from django.core.files.uploadedfile import SimpleUploadedFile

    return encode_multipart(BOUNDARY, {**fields, "scan": SimpleUploadedFile("scan.bin", data)})


def send(client: Client, url: str, body: bytes, **extra: Any) -> Any:
    return client.generic("POST", url, body, content_type=MULTIPART, **extra)


class LeftAloneTests:
    """A view the middleware leaves alone gets the client's stream, untouched."""

    @pytest.mark.parametrize(
        "url", ["/exempt/upload/", "/exempt-include/upload/", "/own-key/upload/"]
    )
    def test_its_upload_handlers_get_the_file_as_it_arrives(self, client: Client, url) -> None:
        data = content()

        response = send(client, url, upload(data, item="scan"))

        assert response.status_code == 200, response.content
        answer = response.json()
        assert answer["size"] == SIZE
        assert answer["sha256"] == hashlib.sha256(data).hexdigest()
        assert answer["fields"] == {"item": ["scan"]}
        # Most of the body was still with the client when the file began.
        assert answer["first_chunk"]["unread"] > SIZE // 2
        assert not IdempotencyKey.objects.exists()

    @pytest.mark.parametrize("url", ["/exempt/upload/", "/exempt-include/upload/"])
    def test_a_form_field_named_like_the_key_is_the_view_s(self, client: Client, url) -> None:
        data = content()

        first = send(client, url, upload(data, idempotency_key="k"))
        second = send(client, url, upload(data, idempotency_key="k"))

        assert first.status_code == second.status_code == 200
        assert "Idempotent-Replayed" not in second
        assert first.json()["first_chunk"]["unread"] > SIZE // 2
        assert first.json()["fields"] == {"idempotency_key": ["k"]}
        assert not IdempotencyKey.objects.exists()

    def test_a_large_upload_is_never_copied(self, client: Client, settings, tmp_path) -> None:
        # Past FILE_UPLOAD_MAX_MEMORY_SIZE, a copy of the body would be a
        # file in FILE_UPLOAD_TEMP_DIR, open while the view reads.
        settings.FILE_UPLOAD_MAX_MEMORY_SIZE = settings.DATA_UPLOAD_MAX_MEMORY_SIZE = SIZE // 4
        settings.FILE_UPLOAD_TEMP_DIR = str(tmp_path)
        data = content()

        response = send(client, "/exempt/upload/", upload(data, item="scan"))

        assert response.status_code == 200, response.content
        assert response.json()["first_chunk"]["open_temporary_files"] == 0
        assert response.json()["sha256"] == hashlib.sha256(data).hexdigest()

    def test_with_a_key_header_too(self, client: Client) -> None:
        response = send(
            client, "/exempt/upload/", upload(content()), headers={"Idempotency-Key": "k"}
        )

        assert response.json()["first_chunk"]["unread"] > SIZE // 2
        assert not IdempotencyKey.objects.exists()


class ProtectedTests:
    """A view the middleware protects has its form read for the key, as before."""

    def test_the_form_s_key_protects_the_upload(self, client: Client) -> None:
        data = content()

        first = send(client, "/protected/upload/", upload(data, idempotency_key="k"))
        retry = send(client, "/protected/upload/", upload(data, idempotency_key="k"))
        changed = send(
            client, "/protected/upload/", upload(content(seed=b"x"), idempotency_key="k")
        )

        assert first.status_code == 200, first.content
        # The view's own handlers still get the file, from the copy.
        assert first.json()["sha256"] == hashlib.sha256(data).hexdigest()
        assert first.json()["first_chunk"]["unread"] == 0
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == first.content
        assert changed.status_code == 422
        assert IdempotencyKey.objects.count() == 1

    def test_without_the_field_it_runs_unprotected(self, client: Client) -> None:
        send(client, "/protected/upload/", upload(content()))
        second = send(client, "/protected/upload/", upload(content()))

        assert second.status_code == 200
        assert "Idempotent-Replayed" not in second
        assert not IdempotencyKey.objects.exists()

    def test_the_field_sent_twice_is_refused(self, client: Client) -> None:
        body = encode_multipart(BOUNDARY, {"idempotency_key": ["k1", "k2"]})

        refused = send(client, "/protected/upload/", body)

        assert refused.status_code == 400
        assert refused["Content-Type"] == "application/problem+json"

    def test_required_refuses_a_form_without_the_field(self, client: Client, settings) -> None:
        settings.IDEMPOTENCY = {"REQUIRED": True}

        refused = send(client, "/protected/upload/", upload(content()))
        exempt = send(client, "/exempt/upload/", upload(content()))

        assert refused.status_code == 400
        assert exempt.status_code == 200
        assert exempt.json()["first_chunk"]["unread"] > SIZE // 2


def in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.fixture
def form_key_reads(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """For each read of a form's key: whether it ran in an event loop's thread."""
    reads: list[bool] = []
    read = core.form_key

    def recorded(request: Any, field: str) -> str | None:
        reads.append(in_event_loop())
        return read(request, field)

    monkeypatch.setattr(core, "form_key", recorded)
    return reads


def asgi_post(url: str, data: Any, **extra: Any) -> Any:
    """POST through Django's ASGI handler, from this sync test."""
    return async_to_sync(AsyncClient().post)(url, data, **extra)


@pytest.mark.django_db(transaction=True)
class AsyncViewTests:
    """Under ASGI the body is a temporary file: its key is read outside the event loop."""

    @pytest.mark.parametrize("url", ["/async/form/", "/async/form/decorated/"])
    def test_the_key_is_read_in_a_thread(self, url: str, form_key_reads) -> None:
        form = {"item": "pen", "idempotency_key": "async-form"}

        first = asgi_post(url, form)
        retry = asgi_post(url, form)

        assert first.status_code == 201, first.content
        assert retry["Idempotent-Replayed"] == "true"
        assert form_key_reads == [False, False]
        assert calls.value == 1
        assert Order.objects.count() == 1

    def test_the_field_sent_twice_is_refused(self, form_key_reads) -> None:
        refused = asgi_post(
            "/async/form/",
            "item=pen&idempotency_key=k1&idempotency_key=k2",
            content_type="application/x-www-form-urlencoded",
        )

        assert refused.status_code == 400
        assert form_key_reads == [False]
        assert calls.value == 0

    def test_an_exempt_view_s_body_is_not_read(self, form_key_reads) -> None:
        response = asgi_post(
            "/exempt/upload/", upload(content(), idempotency_key="k"), content_type=MULTIPART
        )

        assert response.status_code == 200
        assert form_key_reads == []


@pytest.fixture(scope="module")
def upload_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("uploads")


@pytest.fixture(scope="module")
def server(
    django_db_setup: None, tmp_path_factory: pytest.TempPathFactory, upload_dir: Path
) -> Iterator[GunicornServer]:
    env = {
        "DJANGO_SETTINGS_MODULE": "tests.middleware_body_server_settings",
        DATABASE_NAME_ENV: connections["default"].settings_dict["NAME"],
        UPLOAD_TEMP_DIR_ENV: str(upload_dir),
    }
    with GunicornServer(env, tmp_path_factory.mktemp("gunicorn"), workers=1) as gunicorn:
        yield gunicorn


def head(path: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {MULTIPART}\r\n"
        f"Content-Length: {length}\r\nConnection: close\r\n\r\n"
    ).encode()


@pytest.mark.server
@pytest.mark.django_db(transaction=True)
class OverHttpTests:
    """Gunicorn, Django's default limits, a client that sends its body as it goes."""

    #: Past DATA_UPLOAD_MAX_MEMORY_SIZE and FILE_UPLOAD_MAX_MEMORY_SIZE (2.5 MB).
    LARGE = 3 * 1024 * 1024

    @pytest.mark.parametrize("path", ["/exempt/refuse/", "/exempt-include/refuse/"])
    def test_an_exempt_view_answers_before_the_body_has_arrived(
        self, server: GunicornServer, path: str
    ) -> None:
        body = upload(content(self.LARGE), idempotency_key="k")
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            # The body's first 16 KiB, then wait for the answer: reading the
            # whole body before the view would wait for the rest forever. (A
            # few KiB, not more: the socket's buffers must take them unread.)
            sock.sendall(head(path, len(body)) + body[:16384])
            answer = sock.recv(4096)

        assert answer.startswith(b"HTTP/1.1 403"), (answer, server.log())

    def test_a_large_upload_to_an_exempt_view_is_never_copied(self, server: GunicornServer) -> None:
        import requests

        data = content(self.LARGE)
        response = requests.post(
            f"{server.url}/exempt/upload/",
            data=upload(data, idempotency_key="k"),
            headers={"Content-Type": MULTIPART},
            timeout=30,
        )

        assert response.status_code == 200, server.log()
        assert response.json()["sha256"] == hashlib.sha256(data).hexdigest()
        assert response.json()["first_chunk"]["open_temporary_files"] == 0
        assert not IdempotencyKey.objects.exists()
