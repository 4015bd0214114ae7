"""The fingerprint reads the body, and the view must still find it as it would without a key."""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterator
from io import BytesIO
from tempfile import SpooledTemporaryFile
from typing import Any

import pytest
from django.core.exceptions import RequestDataTooBig
from django.core.files.uploadedfile import SimpleUploadedFile, TemporaryUploadedFile
from django.core.files.uploadhandler import TemporaryFileUploadHandler
from django.core.handlers.asgi import ASGIRequest
from django.core.handlers.wsgi import WSGIRequest
from django.http import UnreadablePostError
from django.test import RequestFactory
from django.test.client import encode_multipart

from django_idempotency.body import close_spools_with
from django_idempotency.fingerprint import request_fingerprint

factory = RequestFactory()
LIMIT = 1024
BOUNDARY = "BoUnDaRy"
MULTIPART = f"multipart/form-data; boundary={BOUNDARY}"


@pytest.fixture(autouse=True)
def small_limits(settings: Any) -> None:
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = LIMIT
    settings.FILE_UPLOAD_MAX_MEMORY_SIZE = LIMIT // 2


_fingerprinted: list[Any] = []


def fingerprint_of(request: Any) -> str:
    """:func:`request_fingerprint`, the request remembered so its copy of the body is closed."""
    _fingerprinted.append(request)
    return request_fingerprint(request)


@pytest.fixture(autouse=True)
def close_body_copies() -> Iterator[None]:
    """Close the copies of the bodies the test fingerprinted, as a sent response does."""
    yield
    while _fingerprinted:
        close_spools_with(_fingerprinted.pop(), None)


def big_body(size: int = 4 * LIMIT, seed: bytes = b"") -> bytes:
    return (seed + bytes(range(256)) * (size // 256 + 1))[:size]


def upload_body(content: bytes, item: str = "book") -> bytes:
    upload = SimpleUploadedFile("scan.bin", content, content_type="application/octet-stream")
    return encode_multipart(BOUNDARY, {"item": item, "scan": upload})


class LargeRawBodyTests:
    def test_body_past_the_limit_is_fingerprinted_and_still_streams_to_the_view(self):
        data = big_body()
        request = factory.put("/upload/", data, content_type="application/octet-stream")
        assert len(fingerprint_of(request)) == 64
        streamed = b"".join(iter(lambda: request.read(100), b""))
        assert streamed == data

    def test_body_past_the_limit_fails_in_the_view_as_it_does_without_a_key(self):
        data = big_body()
        with_key = factory.post("/upload/", data, content_type="application/json")
        fingerprint_of(with_key)
        without_key = factory.post("/upload/", data, content_type="application/json")
        for request in (with_key, without_key):
            with pytest.raises(RequestDataTooBig):
                request.body  # noqa: B018

    @pytest.mark.parametrize("kind", ["form", "multipart"])
    def test_form_past_the_limit_fails_in_request_post_as_it_does_without_a_key(self, kind):
        if kind == "form":
            data = ("item=" + "x" * 4 * LIMIT).encode()
            content_type = "application/x-www-form-urlencoded"
        else:
            data = encode_multipart(BOUNDARY, {"item": "x" * 4 * LIMIT})
            content_type = MULTIPART
        with_key = factory.post("/upload/", data, content_type=content_type)
        fingerprint_of(with_key)
        without_key = factory.post("/upload/", data, content_type=content_type)
        for request in (with_key, without_key):
            with pytest.raises(RequestDataTooBig):
                request.POST  # noqa: B018

    @pytest.mark.parametrize(
        "content_type", ["application/json", "application/x-www-form-urlencoded"]
    )
    def test_loaded_body_past_the_limit_is_kept_whole_and_refused_by_request_body(
        self, content_type
    ):
        data = big_body(40 * LIMIT)
        request = factory.post("/upload/", data, content_type=content_type)
        fingerprint = fingerprint_of(request)

        kept = request._stream
        assert kept.seek(0, os.SEEK_END) == len(data)
        kept.seek(0)
        changed = factory.post("/upload/", data[:-1] + b"!", content_type=content_type)
        assert fingerprint_of(changed) != fingerprint  # every byte counts
        with pytest.raises(RequestDataTooBig):
            request.body  # noqa: B018
        assert request.read() == data  # a view reading the stream gets all of it

    def test_loaded_body_past_the_limit_refuses_request_body_by_its_size(self):
        # Without Content-Length (a chunked body under ASGI, say) Django
        # checks the size of a seekable stream: the copy is one.
        data = big_body()
        request = factory.post("/upload/", data, content_type="application/json")
        fingerprint_of(request)
        del request.META["CONTENT_LENGTH"]
        with pytest.raises(RequestDataTooBig):
            request.body  # noqa: B018

    def test_json_past_the_limit_streams_whole_to_a_view_reading_it(self):
        value = {"items": ["x" * 100] * (4 * LIMIT // 100)}
        data = json.dumps(value, indent=1).encode()
        request = factory.post("/upload/", data, content_type="application/json")
        fingerprint_of(request)
        assert json.load(request) == value

    def test_body_past_the_limit_reads_by_line_to_its_end(self):
        data = b"\n".join([b"x" * 100] * (4 * LIMIT // 100))
        request = factory.post("/upload/", data, content_type="application/json")
        fingerprint_of(request)
        assert request.readline() == b"x" * 100 + b"\n"
        assert request.readline(10) == b"x" * 10
        assert b"".join(request) == data[111:]

    def test_body_within_the_limit_reads_as_before(self):
        request = factory.put("/upload/", b'{"a": 1}', content_type="application/json")
        fingerprint_of(request)
        assert request.body == b'{"a": 1}'
        assert request.read() == b'{"a": 1}'

    def test_bodies_past_the_limit_differ_by_content(self):
        def put(data: bytes) -> str:
            return fingerprint_of(factory.put("/upload/", data, content_type="application/json"))

        assert put(big_body()) == put(big_body())
        assert put(big_body()) != put(big_body(seed=b"x"))

    def test_body_past_the_memory_threshold_is_spooled_to_disk(self):
        request = factory.put("/upload/", big_body(), content_type="application/octet-stream")
        fingerprint_of(request)
        stream = request._stream
        assert isinstance(stream, SpooledTemporaryFile)
        assert stream._rolled  # past FILE_UPLOAD_MAX_MEMORY_SIZE: on disk, not in memory

    @pytest.mark.parametrize("size", [0, 1, LIMIT // 2])
    def test_body_within_the_memory_threshold_is_copied_in_memory(self, size):
        data = big_body(size)
        request = factory.put("/upload/", data, content_type="application/octet-stream")
        fingerprint_of(request)
        stream = request._stream
        with pytest.raises(io.UnsupportedOperation):
            stream.fileno()  # no file behind it, now or later
        assert stream.read() == data
        stream.seek(0)
        assert request.body == data

    @pytest.mark.parametrize("threshold", [None, 0])
    def test_body_with_no_memory_threshold_is_copied_in_memory(self, settings, threshold):
        # A spooled file with no threshold never rolls over to disk either.
        settings.FILE_UPLOAD_MAX_MEMORY_SIZE = threshold
        data = b'{"a": 1}'
        request = factory.post("/orders/", data, content_type="application/json")
        fingerprint_of(request)
        assert isinstance(request._stream, io.BytesIO)
        assert request.body == data

    def test_body_one_byte_past_the_memory_threshold_is_spooled_to_disk(self):
        data = big_body(LIMIT // 2 + 1)
        request = factory.put("/upload/", data, content_type="application/octet-stream")
        fingerprint_of(request)
        stream = request._stream
        assert isinstance(stream, SpooledTemporaryFile)
        assert stream._rolled
        assert request.read() == data

    def test_body_read_before_us_gives_the_same_fingerprint(self, settings):
        settings.DATA_UPLOAD_MAX_MEMORY_SIZE = None
        data = big_body()
        read_first = factory.put("/upload/", data, content_type="application/octet-stream")
        assert read_first.body == data
        unread = factory.put("/upload/", data, content_type="application/octet-stream")
        assert fingerprint_of(read_first) == fingerprint_of(unread)

    def test_asgi_body_is_read_in_place_and_left_at_its_start(self):
        data = big_body()
        scope = {
            "type": "http",
            "method": "PUT",
            "path": "/upload/",
            "query_string": b"",
            "headers": [
                (b"content-type", b"application/octet-stream"),
                (b"content-length", str(len(data)).encode()),
            ],
        }
        wsgi = factory.put("/upload/", data, content_type="application/octet-stream")
        with SpooledTemporaryFile() as spool:
            spool.write(data)
            spool.seek(0)
            request = ASGIRequest(scope, spool)
            assert fingerprint_of(request) == fingerprint_of(wsgi)
            assert request._stream is spool
            assert request.read() == data

    def test_client_gone_mid_body_is_an_unreadable_post_error(self):
        class Disconnected(BytesIO):
            def read(self, *args: object) -> bytes:
                raise OSError("connection reset by peer")

        environ = factory.put("/upload/", b"", content_type="text/plain").environ
        environ.update({"CONTENT_LENGTH": "100", "wsgi.input": Disconnected()})
        with pytest.raises(UnreadablePostError):
            fingerprint_of(WSGIRequest(environ))


class MultipartBodyTests:
    def test_post_form_and_files_still_parse_for_the_view(self):
        content = big_body()
        request = factory.post("/upload/", upload_body(content), content_type=MULTIPART)
        fingerprint_of(request)
        assert request.POST["item"] == "book"
        with request.FILES["scan"] as upload:
            assert upload.read() == content

    def test_view_may_still_choose_its_upload_handlers(self):
        content = big_body(LIMIT // 4)
        request = factory.post("/upload/", upload_body(content), content_type=MULTIPART)
        fingerprint_of(request)
        # Django refuses this once request.POST or FILES has been read.
        request.upload_handlers = [TemporaryFileUploadHandler(request)]
        with request.FILES["scan"] as upload:
            assert isinstance(upload, TemporaryUploadedFile)
            assert upload.read() == content

    def test_put_form_parses_for_the_view_as_without_a_key(self):
        content = big_body()
        request = factory.put("/upload/", upload_body(content), content_type=MULTIPART)
        fingerprint_of(request)
        fields, files = request.parse_file_upload(request.META, request)
        assert fields["item"] == "book"
        with files["scan"] as upload:
            assert upload.read() == content

    def test_drf_data_still_parses_after_the_fingerprint(self):
        from rest_framework.parsers import MultiPartParser
        from rest_framework.request import Request

        content = big_body()
        http_request = factory.put("/upload/", upload_body(content), content_type=MULTIPART)
        request = Request(http_request, parsers=[MultiPartParser()])
        fingerprint_of(request)
        assert request.data["item"] == "book"
        with request.data["scan"] as scan:
            assert hashlib.sha256(scan.read()).digest() == hashlib.sha256(content).digest()

    def test_drf_data_parsed_before_us_is_fingerprinted_for_every_method(self):
        from rest_framework.parsers import MultiPartParser
        from rest_framework.request import Request

        def parsed_first(item: str, content: bytes) -> str:
            http_request = factory.put("/upload/", upload_body(content, item), MULTIPART)
            request = Request(http_request, parsers=[MultiPartParser()])
            assert request.data["item"] == item  # a permission read the data
            return fingerprint_of(request)

        book = parsed_first("book", b"1")
        assert book == parsed_first("book", b"1")
        assert book != parsed_first("pen", b"1")
        assert book != parsed_first("book", b"2")
        unread = factory.put("/upload/", upload_body(b"1", "book"), content_type=MULTIPART)
        assert book == fingerprint_of(unread)
