"""Request bodies through protected views: every method, large uploads, value order, formats.

A key must never change whether a valid request is accepted, and a retry
whose body (or asked-for format) differs must get 422, not another
request's stored response. Through the test client here; over real HTTP
against gunicorn in ``OverHttpTests``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from django.contrib.auth.models import User
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import connections
from django.test import Client
from django.test.client import encode_multipart
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from django_idempotency.models import IdempotencyKey
from tests.body_views import open_temporary_files
from tests.models import Order
from tests.polling import wait_until
from tests.server import DATABASE_NAME_ENV, UPLOAD_TEMP_DIR_ENV, GunicornServer
from tests.views import calls

pytestmark = pytest.mark.urls("tests.body_urls")

LIMIT = 4096
OCTETS = "application/octet-stream"


def key(value: str = "k-1") -> dict[str, str]:
    return {"Idempotency-Key": value}


def body(size: int, seed: bytes = b"") -> bytes:
    return (seed + bytes(range(256)) * (size // 256 + 1))[:size]


def json_items(count: int, item: str = "x" * 100) -> bytes:
    return json.dumps({"items": [item] * count}).encode()


def multipart(fields: dict[str, Any], boundary: str = "BoUnDaRy") -> tuple[bytes, str]:
    data = {
        name: [
            SimpleUploadedFile(v[0], v[1], content_type="text/plain") if isinstance(v, tuple) else v
            for v in values
        ]
        for name, values in fields.items()
    }
    return encode_multipart(boundary, data), f"multipart/form-data; boundary={boundary}"


def send(client: Client, method: str, url: str, fields: dict[str, Any], **extra: Any) -> Any:
    boundary = extra.pop("boundary", "BoUnDaRy")
    content, content_type = multipart(fields, boundary)
    return client.generic(method, url, content, content_type=content_type, **extra)


@pytest.fixture
def small_limits(settings: Any) -> None:
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = LIMIT
    settings.FILE_UPLOAD_MAX_MEMORY_SIZE = LIMIT // 2


@pytest.mark.django_db
@pytest.mark.usefixtures("small_limits")
class LargeBodyTests:
    @pytest.mark.parametrize("method", ["POST", "PUT"])
    def test_streamed_body_past_the_limit_is_accepted_with_a_key_as_without(
        self, client: Client, method: str
    ) -> None:
        data = body(4 * LIMIT)
        expected = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        unkeyed = client.generic(method, "/bodies/stream/unprotected/", data, OCTETS)
        first = client.generic(method, "/bodies/stream/", data, OCTETS, headers=key())
        retry = client.generic(method, "/bodies/stream/", data, OCTETS, headers=key())
        changed = client.generic(
            method, "/bodies/stream/", body(4 * LIMIT, b"x"), OCTETS, headers=key()
        )

        assert unkeyed.status_code == first.status_code == 201
        assert {k: first.json()[k] for k in expected} == expected
        assert retry.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == first.content
        assert changed.status_code == 422
        assert calls.value == 2  # the unprotected run and the first one
        assert Order.objects.count() == 2

    @pytest.mark.parametrize("content_type", ["application/json", "application/problem+json"])
    def test_json_read_from_the_stream_past_the_limit_is_accepted_with_a_key_as_without(
        self, client: Client, content_type: str
    ) -> None:
        # json.load(request) reads the stream, which Django does not limit:
        # only request.body and request.POST refuse a body past the limit.
        count = 4 * LIMIT // 100
        data, other = json_items(count), json_items(count, "y" * 100)
        unkeyed = client.post("/bodies/json-load/unprotected/", data, content_type)
        first = client.post("/bodies/json-load/", data, content_type, headers=key())
        retry = client.post("/bodies/json-load/", data, content_type, headers=key())
        changed = client.post("/bodies/json-load/", other, content_type, headers=key())

        assert unkeyed.status_code == first.status_code == 201
        assert unkeyed.json()["items"] == first.json()["items"] == count
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == first.content
        assert changed.status_code == 422
        assert calls.value == 2

    def test_form_read_from_the_stream_past_the_limit_is_accepted_with_a_key_as_without(
        self, client: Client
    ) -> None:
        form = "application/x-www-form-urlencoded"
        data = b"q=" + b"x" * (4 * LIMIT)
        unkeyed = client.post("/bodies/stream/unprotected/", data, form)
        first = client.post("/bodies/stream/", data, form, headers=key())
        retry = client.post("/bodies/stream/", data, form, headers=key())

        assert unkeyed.status_code == first.status_code == 201
        assert first.json()["size"] == len(data)
        assert first.json()["sha256"] == hashlib.sha256(data).hexdigest()
        assert retry["Idempotent-Replayed"] == "true"
        assert calls.value == 2

    def test_loaded_body_past_the_limit_is_refused_with_a_key_as_without(
        self, client: Client
    ) -> None:
        data = body(4 * LIMIT)
        unkeyed = client.post("/bodies/load/unprotected/", data, OCTETS)
        keyed = client.post("/bodies/load/", data, OCTETS, headers=key())
        assert unkeyed.status_code == keyed.status_code == 400
        assert not IdempotencyKey.objects.exists()
        assert not Order.objects.exists()

    def test_drf_json_past_the_limit_is_answered_with_a_key_as_without(self) -> None:
        # DRF before 3.17.2 read JSON from the raw stream, with no size limit
        # of its own; later releases go through request.body and refuse it.
        # Whichever DRF is installed, the key must not change the answer.
        client = APIClient()
        data = {"items": ["x" * 100] * (4 * LIMIT // 100)}
        unkeyed = client.post("/bodies/drf-json/", data, format="json")
        first = client.post("/bodies/drf-json/", data, format="json", headers=key())
        retry = client.post("/bodies/drf-json/", data, format="json", headers=key())
        assert first.status_code == unkeyed.status_code
        if unkeyed.status_code == 201:
            assert first.json()["items"] == len(data["items"])
            assert retry["Idempotent-Replayed"] == "true"
            assert retry.content == first.content
            assert calls.value == 2
        else:
            assert unkeyed.status_code == retry.status_code == 400
            assert not IdempotencyKey.objects.exists()

    def test_drf_upload_past_the_limit_is_accepted_and_replayed(self) -> None:
        client = APIClient()
        content = body(4 * LIMIT)
        unkeyed = send(client, "PUT", "/bodies/drf-form/", {"scan": [("a.bin", content)]})
        first = send(
            client, "PUT", "/bodies/drf-form/", {"scan": [("a.bin", content)]}, headers=key()
        )
        retry = send(
            client,
            "PUT",
            "/bodies/drf-form/",
            {"scan": [("a.bin", content)]},
            headers=key(),
            boundary="AnotherBoundary",
        )
        assert unkeyed.status_code == first.status_code == 201
        assert first.json()["scan"] == [hashlib.sha256(content).hexdigest()]
        assert retry["Idempotent-Replayed"] == "true"
        assert calls.value == 2


@pytest.mark.django_db
@pytest.mark.usefixtures("small_limits")
class LimitsTests:
    """Bodies Django refuses are refused with a key exactly as without one."""

    @pytest.mark.parametrize(
        "content_type", ["application/json", "application/x-www-form-urlencoded"]
    )
    def test_loaded_body_past_the_limit_gets_the_answer_it_gets_without_a_key(
        self, client: Client, content_type: str
    ) -> None:
        data = b"q=" + b"x" * (40 * LIMIT)
        unkeyed = client.post("/bodies/load/unprotected/", data, content_type)
        keyed = client.post("/bodies/load/", data, content_type, headers=key())
        assert unkeyed.status_code == keyed.status_code == 400
        assert keyed.content == unkeyed.content
        assert not IdempotencyKey.objects.exists()
        assert not Order.objects.exists()

    def test_form_past_the_limit_is_refused_by_request_post_with_a_key_as_without(
        self, client: Client
    ) -> None:
        form = "application/x-www-form-urlencoded"
        data = b"q=" + b"x" * (40 * LIMIT)
        unkeyed = client.post("/bodies/form-fields/unprotected/", data, form)
        keyed = client.post("/bodies/form-fields/", data, form, headers=key())
        assert unkeyed.status_code == keyed.status_code == 400
        assert keyed.content == unkeyed.content
        assert not IdempotencyKey.objects.exists()
        assert not Order.objects.exists()

    def test_form_with_too_many_fields_gets_the_answer_it_gets_without_a_key(
        self, client: Client, settings: Any
    ) -> None:
        settings.DATA_UPLOAD_MAX_NUMBER_FIELDS = 10
        form = "application/x-www-form-urlencoded"
        data = "&".join(f"f{i}=x" for i in range(11))
        unkeyed = client.post("/bodies/form-fields/unprotected/", data, form)
        keyed = client.post("/bodies/form-fields/", data, form, headers=key())
        assert unkeyed.status_code == keyed.status_code == 400
        assert keyed.content == unkeyed.content
        assert not IdempotencyKey.objects.exists()
        within = client.post("/bodies/form-fields/", data.rsplit("&", 1)[0], form, headers=key())
        assert within.status_code == 201
        assert within.json()["fields"] == 10


@pytest.mark.django_db
class ParsedBeforeTheKeyTests:
    """A permission read ``request.data``, so the fingerprint has only the parsed data."""

    def test_different_files_of_one_name_under_one_key_are_422(self) -> None:
        client = APIClient()
        url = "/bodies/upload/invoice.pdf/"
        content = b"%PDF-1 pay 10 EUR"
        first = client.post(url, content, content_type=OCTETS, headers=key())
        same = client.post(url, content, content_type=OCTETS, headers=key())
        other = client.post(url, b"%PDF-1 pay 9999 EUR", content_type=OCTETS, headers=key())

        assert first.status_code == 201
        # The view still reads the whole file after the fingerprint digested it.
        assert first.json()["file"] == hashlib.sha256(content).hexdigest()
        assert same["Idempotent-Replayed"] == "true"
        assert other.status_code == 422
        assert calls.value == 1

    def test_numbers_compare_by_value_when_a_parser_consumed_the_stream(self) -> None:
        client = APIClient()
        url = "/bodies/stream-json/"
        answers = [
            client.post(url, body, content_type="application/json", headers=key())
            for body in (
                '{"q": 10, "r": [1, 2]}',
                '{"r": [1, 2.0], "q": 10.0}',
                '{"q": 1e1, "r": [1, 2]}',
            )
        ]
        changed = client.post(
            url, '{"q": 10, "r": [2, 1]}', content_type="application/json", headers=key()
        )

        assert [answer.status_code for answer in answers] == [201, 201, 201]
        assert [answer.get("Idempotent-Replayed") for answer in answers[1:]] == ["true", "true"]
        assert changed.status_code == 422
        assert calls.value == 1


@pytest.mark.django_db
class MultipartEveryMethodTests:
    @pytest.mark.parametrize("method", ["PUT", "PATCH", "DELETE"])
    def test_changed_multipart_body_is_422_and_the_same_replays(
        self, client: Client, method: str
    ) -> None:
        fields = {"item": ["book"], "scan": [("a.txt", b"hello")]}
        first = send(client, method, "/bodies/form/", fields, headers=key())
        same = send(client, method, "/bodies/form/", fields, headers=key(), boundary="Other2")
        field = send(client, method, "/bodies/form/", {**fields, "item": ["pen"]}, headers=key())
        file = send(
            client,
            method,
            "/bodies/form/",
            {**fields, "scan": [("a.txt", b"hellO")]},
            headers=key(),
        )

        assert first.status_code == 201
        assert first.json()["fields"] == {"item": ["book"]}
        assert same.status_code == 201
        assert same["Idempotent-Replayed"] == "true"
        assert field.status_code == file.status_code == 422
        assert calls.value == 1

    @pytest.mark.parametrize("method", ["PUT", "PATCH"])
    def test_changed_multipart_body_through_drf_is_422(self, method: str) -> None:
        client = APIClient()
        first = send(client, method, "/bodies/drf-form/", {"item": ["book"]}, headers=key())
        changed = send(client, method, "/bodies/drf-form/", {"item": ["pen"]}, headers=key())
        assert first.status_code == 201
        assert first.json()["item"] == ["book"]
        assert changed.status_code == 422
        assert calls.value == 1

    def test_changed_multipart_update_of_a_model_viewset_is_422(self) -> None:
        user = User.objects.create_user("alice")
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
        order = Order.objects.create(item="old")
        url = f"/drf/put-orders/{order.pk}/"
        first = send(client, "PUT", url, {"item": ["book"], "quantity": ["1"]}, headers=key())
        changed = send(client, "PUT", url, {"item": ["pen"], "quantity": ["1"]}, headers=key())
        assert first.status_code == 200
        assert changed.status_code == 422
        order.refresh_from_db()
        assert order.item == "book"


@pytest.mark.django_db
class ValueOrderTests:
    def test_multipart_values_in_another_order_are_422(self, client: Client) -> None:
        first = send(client, "POST", "/bodies/form/", {"name": ["a", "b"]}, headers=key())
        swapped = send(client, "POST", "/bodies/form/", {"name": ["b", "a"]}, headers=key())
        assert first.json()["fields"] == {"name": ["a", "b"]}
        assert swapped.status_code == 422

    def test_form_values_in_another_order_are_422(self) -> None:
        client = APIClient()
        form = "application/x-www-form-urlencoded"
        url = "/bodies/drf-form/"
        first = client.post(url, "name=a&name=b", content_type=form, headers=key())
        swapped = client.post(url, "name=b&name=a", content_type=form, headers=key())
        other_names = client.post(url, "x=1&name=a&name=b", content_type=form, headers=key("k-2"))
        reordered = client.post(url, "name=a&x=1&name=b", content_type=form, headers=key("k-2"))
        assert first.json()["name"] == ["a", "b"]
        assert swapped.status_code == 422
        assert reordered["Idempotent-Replayed"] == "true"
        assert reordered.content == other_names.content

    def test_query_values_in_another_order_are_422(self, client: Client) -> None:
        fields = {"item": ["book"]}
        first = send(client, "POST", "/bodies/form/?tag=a&tag=b", fields, headers=key())
        swapped = send(client, "POST", "/bodies/form/?tag=b&tag=a", fields, headers=key())
        assert first.status_code == 201
        assert swapped.status_code == 422


@pytest.mark.django_db
class NegotiatedFormatTests:
    @pytest.mark.parametrize(
        ("first_accept", "retry_accept"),
        [("text/html", "application/json"), ("application/json", "text/html")],
    )
    def test_retry_asking_for_another_format_is_422(
        self, first_accept: str, retry_accept: str
    ) -> None:
        client = APIClient()
        first = client.post(
            "/api/orders/", {"item": "book"}, format="json", headers=key(), HTTP_ACCEPT=first_accept
        )
        retry = client.post(
            "/api/orders/", {"item": "book"}, format="json", headers=key(), HTTP_ACCEPT=retry_accept
        )
        assert first.status_code == 201
        assert first["Content-Type"].startswith(first_accept)
        assert retry.status_code == 422
        assert not retry.content.startswith(first.content[:50])
        assert calls.value == 1

    def test_retry_asking_for_the_same_format_replays_it(self) -> None:
        client = APIClient()
        sends = [
            client.post(
                "/bodies/drf-form/", {"item": "book"}, headers=key(), HTTP_ACCEPT="text/html"
            )
            for _ in range(2)
        ]
        assert sends[0]["Content-Type"].startswith("text/html")
        assert sends[1]["Idempotent-Replayed"] == "true"
        assert sends[1].content == sends[0].content
        assert calls.value == 1

    def test_browsable_api_form_on_a_required_view_gets_400_on_its_page(self) -> None:
        user = User.objects.create_user("alice")
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
        # What the browsable API's HTML form sends: a form body, no key header.
        response = client.post(
            "/drf/required-orders/",
            "item=book&quantity=1",
            content_type="application/x-www-form-urlencoded",
            HTTP_ACCEPT="text/html,application/xhtml+xml",
        )
        assert response.status_code == 400
        assert response["Content-Type"].startswith("text/html")
        assert b"Idempotency-Key" in response.content
        assert not Order.objects.exists()


def over_http(
    method: str, url: str, data: bytes, content_type: str, idempotency_key: str | None = "k-1"
) -> requests.Response:
    """Send ``data`` with ``requests``, under ``idempotency_key`` unless it is None."""
    headers = {"Content-Type": content_type}
    if idempotency_key is not None:
        headers.update(key(idempotency_key))
    return requests.request(method, url, data=data, headers=headers, timeout=30)


def unkeyed_and_keyed(
    method: str, url: str, data: bytes, content_type: str
) -> tuple[requests.Response, requests.Response]:
    """The same request to the view's unprotected twin, then under a key to the view."""
    unkeyed = over_http(method, url + "unprotected/", data, content_type, idempotency_key=None)
    return unkeyed, over_http(method, url, data, content_type)


@pytest.fixture(scope="module")
def upload_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's ``FILE_UPLOAD_TEMP_DIR``: where bodies past its memory size are copied."""
    return tmp_path_factory.mktemp("uploads")


@pytest.fixture(scope="module")
def server(
    django_db_setup: None, tmp_path_factory: pytest.TempPathFactory, upload_dir: Path
) -> Iterator[GunicornServer]:
    name = connections["default"].settings_dict["NAME"]
    env = {
        "DJANGO_SETTINGS_MODULE": "tests.body_server_settings",
        DATABASE_NAME_ENV: name,
        UPLOAD_TEMP_DIR_ENV: str(upload_dir),
        # An unclosed copy of a body would be reported in the server's log.
        "PYTHONWARNINGS": "always::ResourceWarning",
    }
    with GunicornServer(env, tmp_path_factory.mktemp("gunicorn")) as gunicorn:
        yield gunicorn


def assert_no_body_copy_left_open(server: GunicornServer, upload_dir: Path) -> None:
    """Every copy of a body is closed once its response is sent (the server closes it then)."""

    def open_copies() -> int:
        return sum(open_temporary_files(pid, str(upload_dir)) for pid in server.worker_pids())

    wait_until(lambda: open_copies() == 0, "the workers to close the copies of the bodies", 10)
    assert "ResourceWarning" not in server.log()


@pytest.mark.server
@pytest.mark.django_db(transaction=True)
class OverHttpTests:
    """Django's default limits, a real socket and real worker processes."""

    SIZE = 3 * 1024 * 1024  # past the default DATA_UPLOAD_MAX_MEMORY_SIZE (2.5 MB)

    def test_large_streamed_body_is_accepted_with_a_key_as_without(
        self, server: GunicornServer
    ) -> None:
        data = body(self.SIZE)
        url = f"{server.url}/bodies/stream/"
        unkeyed, first = unkeyed_and_keyed("PUT", url, data, OCTETS)
        retry = over_http("PUT", url, data, OCTETS)
        changed = over_http("PUT", url, body(self.SIZE, b"x"), OCTETS)

        assert unkeyed.status_code == first.status_code == 201, server.log()
        assert first.json()["size"] == self.SIZE
        assert first.json()["sha256"] == hashlib.sha256(data).hexdigest()
        assert retry.headers["Idempotent-Replayed"] == "true"
        assert retry.content == first.content
        assert changed.status_code == 422
        assert Order.objects.count() == 2

    @pytest.mark.parametrize("content_type", ["application/json", "application/merge-patch+json"])
    def test_json_read_from_the_stream_past_the_limit_is_accepted_with_a_key_as_without(
        self, server: GunicornServer, upload_dir: Path, content_type: str
    ) -> None:
        count = self.SIZE // 100  # 3.1 MB of JSON
        data = json_items(count)
        url = f"{server.url}/bodies/json-load/"
        unkeyed, first = unkeyed_and_keyed("POST", url, data, content_type)
        retry = over_http("POST", url, data, content_type)
        changed = over_http("POST", url, json_items(count, "y" * 100), content_type)

        assert unkeyed.status_code == first.status_code == 201, server.log()
        assert unkeyed.json()["items"] == first.json()["items"] == count
        # Past FILE_UPLOAD_MAX_MEMORY_SIZE the copy the view read is a file,
        # which the check below would see if it were left open.
        assert first.json()["open_temporary_files"] == 1
        assert retry.headers["Idempotent-Replayed"] == "true"
        assert retry.content == first.content
        assert changed.status_code == 422
        assert Order.objects.count() == 2
        assert_no_body_copy_left_open(server, upload_dir)

    def test_form_read_from_the_stream_past_the_limit_is_accepted_with_a_key_as_without(
        self, server: GunicornServer, upload_dir: Path
    ) -> None:
        data = b"q=" + body(self.SIZE).hex().encode()[: self.SIZE]
        form = "application/x-www-form-urlencoded"
        url = f"{server.url}/bodies/stream/"
        unkeyed, first = unkeyed_and_keyed("POST", url, data, form)
        retry = over_http("POST", url, data, form)

        assert unkeyed.status_code == first.status_code == 201, server.log()
        assert first.json()["size"] == len(data)
        assert first.json()["sha256"] == hashlib.sha256(data).hexdigest()
        assert retry.headers["Idempotent-Replayed"] == "true"
        assert_no_body_copy_left_open(server, upload_dir)

    @pytest.mark.parametrize(
        ("path", "content_type"),
        [
            ("/bodies/load/", "application/json"),
            ("/bodies/load/", "application/x-www-form-urlencoded"),
            ("/bodies/form-fields/", "application/x-www-form-urlencoded"),
        ],
    )
    def test_loaded_body_past_the_limit_is_refused_and_its_copy_closed(
        self, server: GunicornServer, upload_dir: Path, path: str, content_type: str
    ) -> None:
        # request.body and request.POST refuse the body as without a key.
        data = b"q=" + b"x" * self.SIZE
        unkeyed, keyed = unkeyed_and_keyed("POST", server.url + path, data, content_type)

        assert unkeyed.status_code == keyed.status_code == 400, server.log()
        assert keyed.content == unkeyed.content
        assert not Order.objects.exists()
        assert not IdempotencyKey.objects.exists()
        assert_no_body_copy_left_open(server, upload_dir)

    def test_loaded_body_past_the_limit_is_refused_with_a_key_as_without(
        self, server: GunicornServer
    ) -> None:
        url = f"{server.url}/bodies/load/"
        unkeyed, keyed = unkeyed_and_keyed("POST", url, body(self.SIZE), OCTETS)
        assert unkeyed.status_code == keyed.status_code == 400
        assert not Order.objects.exists()
        assert not IdempotencyKey.objects.exists()

    def test_loaded_json_past_the_limit_is_refused_with_a_key_as_without(
        self, server: GunicornServer
    ) -> None:
        data = b'{"item": "' + b"x" * self.SIZE + b'"}'
        url = f"{server.url}/bodies/load/"
        unkeyed, keyed = unkeyed_and_keyed("POST", url, data, "application/json")
        small = over_http("POST", url, b'{"item": 1}', "application/json")
        assert unkeyed.status_code == keyed.status_code == 400, server.log()
        assert keyed.content == unkeyed.content
        assert small.status_code == 201, server.log()
        assert small.json()["size"] == len(b'{"item": 1}')

    def test_large_multipart_put_is_fingerprinted_by_content(self, server: GunicornServer) -> None:
        url = f"{server.url}/bodies/drf-form/"
        content = body(self.SIZE)

        def put(scan: bytes) -> requests.Response:
            # requests picks a new random boundary for every send.
            files = {"scan": ("scan.bin", scan, OCTETS)}
            return requests.put(url, data={"item": "book"}, files=files, headers=key(), timeout=30)

        first, retry, changed = put(content), put(content), put(body(self.SIZE, b"x"))
        assert first.status_code == 201, server.log()
        assert first.json()["scan"] == [hashlib.sha256(content).hexdigest()]
        assert retry.headers["Idempotent-Replayed"] == "true"
        assert changed.status_code == 422
        assert Order.objects.count() == 1
