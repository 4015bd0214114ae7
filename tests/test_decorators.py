"""Every row of the HTTP contract through ``@idempotent`` on plain Django views."""

from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.test import Client, override_settings
from django.utils import timezone

from django_idempotency.models import IdempotencyKey
from tests.clients import post_json
from tests.factories import IdempotencyKeyFactory
from tests.models import Order
from tests.views import fail_next

pytestmark = pytest.mark.django_db


def post(
    client: Client,
    url: str,
    data: dict | None = None,
    key: str | None = "key-1",
    *,
    headers: dict[str, str] | None = None,
):
    """``post_json`` of ``data``, an order of a book unless given, with this module's key."""
    return post_json(client, url, {"item": "book"} if data is None else data, key, headers=headers)


class FirstRequestTests:
    def test_first_request_runs_handler_and_stores_response(self, client, reset_calls):
        response = post(client, "/orders/")

        assert response.status_code == 201
        assert reset_calls.value == 1
        record = IdempotencyKey.objects.get()
        assert record.state == IdempotencyKey.State.COMPLETED
        assert record.status_code == 201
        assert bytes(record.response_body) == response.content
        assert "Idempotent-Replayed" not in response.headers

    def test_first_request_gets_handler_headers_and_cookies(self, client):
        # Only the *stored* copy is filtered; the original answer is untouched.
        response = post(client, "/orders/")

        assert response["X-Request-Secret"] == "not-in-the-allowlist"
        assert response.cookies["handler_cookie"].value == "handler-cookie"


class ReplayTests:
    def test_retry_replays_status_headers_and_body_without_running_handler(
        self, client, reset_calls
    ):
        first = post(client, "/orders/")
        retry = post(client, "/orders/")

        assert reset_calls.value == 1
        assert Order.objects.count() == 1
        assert retry.status_code == first.status_code == 201
        assert retry.content == first.content
        assert retry["Content-Type"] == "application/json"
        assert retry["Location"] == first["Location"]
        assert retry["Idempotent-Replayed"] == "true"

    def test_replay_never_carries_set_cookie_or_headers_outside_allowlist(self, client):
        post(client, "/orders/")
        retry = post(client, "/orders/")

        assert "handler_cookie" not in retry.cookies
        assert "Set-Cookie" not in retry.headers
        assert "X-Request-Secret" not in retry.headers
        stored = IdempotencyKey.objects.get().response_headers
        assert {name.lower() for name, _ in stored} == {"content-type", "location"}

    @override_settings(IDEMPOTENCY={"STORED_HEADERS": ("Content-Type", "Set-Cookie")})
    def test_set_cookie_is_never_stored_even_when_listed(self, client):
        post(client, "/orders/")
        retry = post(client, "/orders/")

        assert "Set-Cookie" not in retry.headers
        assert "handler_cookie" not in retry.cookies

    def test_replay_of_a_4xx_answer_keeps_its_status(self, client, reset_calls):
        first = post(client, "/orders/", {"item": "book", "status": 400})
        retry = post(client, "/orders/", {"item": "book", "status": 400})

        assert first.status_code == retry.status_code == 400
        assert retry["Idempotent-Replayed"] == "true"
        assert reset_calls.value == 1

    def test_binary_body_is_replayed_byte_for_byte(self, client):
        first = post(client, "/binary/")
        retry = post(client, "/binary/")

        assert retry.content == first.content == bytes(range(256)) * 4
        assert retry["Content-Type"] == "application/octet-stream"

    @override_settings(IDEMPOTENCY={"REPLAY_HEADER": "X-Replayed"})
    def test_replay_header_name_follows_the_setting(self, client):
        post(client, "/orders/")
        retry = post(client, "/orders/")

        assert retry["X-Replayed"] == "true"
        assert "Idempotent-Replayed" not in retry.headers

    def test_class_based_view_through_method_decorator(self, client, reset_calls):
        first = post(client, "/orders/class-based/")
        retry = post(client, "/orders/class-based/")

        assert first.status_code == retry.status_code == 201
        assert retry.content == first.content
        assert reset_calls.value == 1

    def test_api_view_response_is_rendered_before_it_is_stored(self, client, reset_calls):
        first = post(client, "/api/orders/")
        retry = post(client, "/api/orders/")

        assert first.status_code == retry.status_code == 201
        assert json.loads(first.content)["item"] == "book"
        assert retry.content == first.content
        assert retry["Idempotent-Replayed"] == "true"
        assert reset_calls.value == 1


class KeyTests:
    def test_method_outside_methods_passes_straight_through(self, client, reset_calls):
        response = client.put("/orders/", b"{}", headers={"Idempotency-Key": "key-1"})

        assert response.status_code == 201
        assert not IdempotencyKey.objects.exists()

    def test_no_key_runs_handler_unprotected(self, client, reset_calls):
        post(client, "/orders/", key=None)
        post(client, "/orders/", key=None)

        assert reset_calls.value == 2
        assert Order.objects.count() == 2
        assert not IdempotencyKey.objects.exists()

    def test_no_key_on_required_view_is_400_problem(self, client, reset_calls):
        response = post(client, "/orders/required/", key=None)

        assert response.status_code == 400
        assert response["Content-Type"] == "application/problem+json"
        problem = response.json()
        assert problem["status"] == 400
        assert set(problem) == {"type", "title", "status", "detail"}
        assert "Idempotency-Key" in problem["detail"]
        assert reset_calls.value == 0

    @override_settings(IDEMPOTENCY={"REQUIRED": True})
    def test_required_setting_applies_to_every_view(self, client):
        assert post(client, "/orders/", key=None).status_code == 400

    @pytest.mark.parametrize(
        "key",
        ["", "a" * 256, "has space", "caf\u00e9", "tab\there", '"unterminated', '""', '"a"b"'],
    )
    def test_malformed_key_is_400_and_changes_nothing(self, client, reset_calls, key):
        IdempotencyKeyFactory(key="existing")
        response = post(client, "/orders/", key=key)

        assert response.status_code == 400
        assert response["Content-Type"] == "application/problem+json"
        assert reset_calls.value == 0
        assert IdempotencyKey.objects.count() == 1
        assert Order.objects.count() == 0

    @override_settings(IDEMPOTENCY={"KEY_MAX_LENGTH": 8})
    def test_key_length_follows_the_setting(self, client):
        assert post(client, "/orders/", key="12345678").status_code == 201
        assert post(client, "/orders/", key="123456789").status_code == 400

    def test_quoted_key_is_the_same_key_as_bare(self, client, reset_calls):
        post(client, "/orders/", key="abc-123")
        retry = post(client, "/orders/", key='"abc-123"')

        assert retry["Idempotent-Replayed"] == "true"
        assert reset_calls.value == 1
        assert IdempotencyKey.objects.get().key == "abc-123"

    def test_key_of_maximum_length_is_accepted_bare_and_quoted(self, client):
        key = "k" * 255
        assert post(client, "/orders/", key=key).status_code == 201
        assert post(client, "/orders/", key=f'"{key}"')["Idempotent-Replayed"] == "true"

    def test_keys_compare_exactly(self, client, reset_calls):
        post(client, "/orders/", key="abc")
        response = post(client, "/orders/", key="ABC")

        assert "Idempotent-Replayed" not in response.headers
        assert reset_calls.value == 2
        assert IdempotencyKey.objects.count() == 2

    @override_settings(IDEMPOTENCY={"HEADER": "X-Request-Key"})
    def test_header_name_follows_the_setting(self, client, reset_calls):
        post(client, "/orders/", key=None, headers={"X-Request-Key": "k"})
        retry = post(client, "/orders/", key=None, headers={"X-Request-Key": "k"})

        assert retry["Idempotent-Replayed"] == "true"


class MismatchTests:
    def test_same_key_different_body_is_422_and_record_unchanged(self, client, reset_calls):
        post(client, "/orders/", {"item": "book"})
        before = IdempotencyKey.objects.values().get()
        response = post(client, "/orders/", {"item": "lamp"})

        assert response.status_code == 422
        assert response["Content-Type"] == "application/problem+json"
        assert response.json()["status"] == 422
        assert reset_calls.value == 1
        assert IdempotencyKey.objects.values().get() == before

    def test_same_key_other_path_is_422(self, client):
        post(client, "/orders/")
        assert post(client, "/orders/class-based/").status_code == 422

    def test_reordered_json_replays(self, client, reset_calls):
        client.post(
            "/orders/",
            '{"item": "book", "quantity": 2}',
            content_type="application/json",
            headers={"Idempotency-Key": "k"},
        )
        retry = client.post(
            "/orders/",
            '{\n  "quantity" : 2.0 ,"item":"book"}',
            content_type="application/json",
            headers={"Idempotency-Key": "k"},
        )

        assert retry.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert reset_calls.value == 1


class FailureTests:
    def test_handler_exception_rolls_back_effect_and_record(self, client, reset_calls):
        client.raise_request_exception = False
        failed = post(client, "/orders/", {"item": "book", "raise": True})

        assert failed.status_code == 500
        assert not Order.objects.exists()
        assert not IdempotencyKey.objects.exists()

        retry = post(client, "/orders/", {"item": "book", "raise": True})
        assert retry.status_code == 500
        assert reset_calls.value == 2  # the retry ran again, once

    def test_retry_after_exception_runs_once_and_is_then_replayed(self, client, reset_calls):
        client.raise_request_exception = False
        fail_next.set()
        assert post(client, "/orders/").status_code == 500
        assert post(client, "/orders/").status_code == 201
        assert post(client, "/orders/")["Idempotent-Replayed"] == "true"
        assert reset_calls.value == 2
        assert Order.objects.count() == 1

    @pytest.mark.parametrize("status", [500, 502, 503, 408, 409, 425, 429])
    def test_transient_or_5xx_answer_is_not_stored_and_rolls_back(
        self, client, reset_calls, status
    ):
        first = post(client, "/orders/", {"item": "book", "status": status})
        retry = post(client, "/orders/", {"item": "book", "status": status})

        assert first.status_code == retry.status_code == status
        assert "Idempotent-Replayed" not in retry.headers
        assert reset_calls.value == 2
        assert not IdempotencyKey.objects.exists()
        assert not Order.objects.exists()  # atomic mode rolled the effect back


class ExpiryTests:
    def test_expired_record_is_treated_as_absent(self, client, reset_calls):
        IdempotencyKeyFactory(key="key-1", expired=True, response_body=b"old")
        response = post(client, "/orders/")

        assert response.status_code == 201
        assert "Idempotent-Replayed" not in response.headers
        assert reset_calls.value == 1
        record = IdempotencyKey.objects.get()
        assert bytes(record.response_body) == response.content
        assert record.expires_at > timezone.now() + timedelta(hours=23)

    def test_expired_record_with_other_fingerprint_is_reusable(self, client):
        post(client, "/orders/", {"item": "book"})
        IdempotencyKey.objects.update(expires_at=timezone.now() - timedelta(seconds=1))

        assert post(client, "/orders/", {"item": "lamp"}).status_code == 201

    def test_ttl_option_sets_expiry(self, client, settings):
        settings.IDEMPOTENCY = {"TTL": 60}
        before = timezone.now()
        post(client, "/orders/")

        expires_at = IdempotencyKey.objects.get().expires_at
        assert before + timedelta(seconds=59) < expires_at <= timezone.now() + timedelta(seconds=60)


class ScopeTests:
    def test_two_users_same_key_get_two_independent_records(self, client, reset_calls):
        alice = User.objects.create_user("alice")
        bob = User.objects.create_user("bob")
        client.force_login(alice)
        alice_response = post(client, "/orders/", {"item": "book"})
        client.force_login(bob)
        bob_response = post(client, "/orders/", {"item": "book"})

        assert "Idempotent-Replayed" not in bob_response.headers
        assert bob_response.content != alice_response.content
        assert reset_calls.value == 2
        assert set(IdempotencyKey.objects.values_list("scope", flat=True)) == {
            f"user:{alice.pk}",
            f"user:{bob.pk}",
        }
        client.force_login(alice)
        assert post(client, "/orders/", {"item": "book"}).content == alice_response.content

    @pytest.mark.parametrize("option", ["SCOPE", "FINGERPRINT"])
    def test_a_function_returning_no_string_is_a_clear_error(self, settings, reset_calls, option):
        settings.IDEMPOTENCY = {option: "tests.test_decorators.numeric_value"}
        client = Client(raise_request_exception=True)
        with pytest.raises(TypeError, match="returned int, not a string"):
            post(client, "/orders/", {"item": "book"})
        assert reset_calls.value == 0
        assert not IdempotencyKey.objects.exists()

    def test_scopes_compare_exactly(self, client, settings, reset_calls):
        settings.IDEMPOTENCY = {"SCOPE": "tests.test_decorators.tenant_scope"}
        post(client, "/orders/", headers={"X-Tenant": "Acme"})
        other = post(client, "/orders/", headers={"X-Tenant": "acme"})
        padded = post(client, "/orders/", headers={"X-Tenant": "Acme "})

        assert "Idempotent-Replayed" not in other.headers
        assert "Idempotent-Replayed" not in padded.headers
        assert reset_calls.value == 3

    def test_long_scope_is_stored_as_its_digest(self, client, settings):
        settings.IDEMPOTENCY = {"SCOPE": "tests.test_decorators.tenant_scope"}
        post(client, "/orders/", headers={"X-Tenant": "t" * 300})
        retry = post(client, "/orders/", headers={"X-Tenant": "t" * 300})

        assert retry["Idempotent-Replayed"] == "true"
        assert IdempotencyKey.objects.get().scope.startswith("sha256:")

    def test_a_scope_spelling_another_scopes_digest_is_not_that_scope(
        self, client, settings, reset_calls
    ):
        # The scope is the caller's own choice here (an organisation's name):
        # one that spells a long scope's stored digest must not be replayed its answer.
        settings.IDEMPOTENCY = {"SCOPE": "tests.test_decorators.chosen_scope"}
        post(client, "/orders/", headers={"X-Tenant": "t" * 300})
        digest = IdempotencyKey.objects.get().scope
        other = post(client, "/orders/", headers={"X-Tenant": digest})

        assert "Idempotent-Replayed" not in other.headers
        assert reset_calls.value == 2
        assert IdempotencyKey.objects.count() == 2


def numeric_value(request: object) -> int:
    """A scope or fingerprint function that forgot to return a string."""
    return 42


def tenant_scope(request) -> str:
    return "tenant:" + request.headers.get("X-Tenant", "")


def chosen_scope(request) -> str:
    return request.headers.get("X-Tenant", "")


class LargeAndStreamingTests:
    def test_body_over_max_stored_body_is_not_stored_and_never_reruns(self, client, reset_calls):
        first = post(client, "/large/")
        retry = post(client, "/large/")

        assert len(first.content) == 2_000_000
        assert reset_calls.value == 1
        assert Order.objects.count() == 1
        assert retry.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert retry["Location"] == "/exports/1/"
        assert retry.content == b""
        assert "Content-Type" not in retry.headers
        assert IdempotencyKey.objects.get().response_body is None

    def test_replay_without_the_body_drops_the_headers_describing_it(self, client):
        first = post(client, "/large/")
        retry = post(client, "/large/")

        assert first["Content-Encoding"] == "gzip"
        assert retry.content == b""
        for name in (
            "Content-Encoding",
            "Content-Disposition",
            "Content-Language",
            "ETag",
            "Last-Modified",
        ):
            assert name not in retry.headers, name
        assert retry["Location"] == "/exports/1/"

    @override_settings(IDEMPOTENCY={"MAX_STORED_BODY": 100})
    def test_replay_with_the_body_keeps_the_headers_describing_it(self, client):
        post(client, "/large/?size=100")
        retry = post(client, "/large/?size=100")

        assert retry.content == b"x" * 100
        assert retry["Content-Encoding"] == "gzip"
        assert retry["ETag"] == '"export-1"'

    @override_settings(IDEMPOTENCY={"MAX_STORED_BODY": 100})
    def test_max_stored_body_follows_the_setting(self, client):
        post(client, "/large/?size=100")
        assert post(client, "/large/?size=100").content == b"x" * 100
        post(client, "/large/?size=101", key="key-2")
        assert post(client, "/large/?size=101", key="key-2").content == b""

    def test_streaming_response_is_sent_whole_and_never_reruns(self, client, reset_calls):
        first = post(client, "/stream/")
        retry = post(client, "/stream/")

        assert b"".join(first.streaming_content) == b"chunk-1,chunk-2"
        assert reset_calls.value == 1
        assert Order.objects.count() == 1
        assert retry.status_code == 200
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == b""


class KillSwitchTests:
    @override_settings(IDEMPOTENCY={"ENABLED": False, "REQUIRED": True})
    def test_disabled_passes_everything_through(self, client, reset_calls):
        post(client, "/orders/")
        post(client, "/orders/")
        post(client, "/orders/required/", key=None)

        assert reset_calls.value == 3
        assert not IdempotencyKey.objects.exists()


class RequestInfoTests:
    def test_request_idempotency_exposes_key_scope_fingerprint_and_derive(self, client):
        info = post(client, "/info/", key='"pay-1"').json()

        assert info["key"] == "pay-1"
        assert info["scope"] == "anonymous"
        assert len(info["fingerprint"]) == 64
        assert len(info["payment"]) == 64
        assert "pay-1" not in info["payment"]

    def test_derive_is_stable_across_retries_and_distinct_per_name_key_scope(self):
        from django_idempotency.info import IdempotencyInfo

        info = IdempotencyInfo(key="k", scope="s", fingerprint="f")
        assert info.derive("charge") == IdempotencyInfo("k", "s", "other").derive("charge")
        assert info.derive("charge") != info.derive("refund")
        assert info.derive("charge") != IdempotencyInfo("k2", "s", "f").derive("charge")
        assert info.derive("charge") != IdempotencyInfo("k", "s2", "f").derive("charge")


class OptionTests:
    def test_unknown_option_is_a_type_error_at_decoration(self):
        from django_idempotency import idempotent

        with pytest.raises(TypeError, match="tll"):
            idempotent(tll=5)

    def test_async_view_gets_an_async_wrapper(self):
        from asgiref.sync import iscoroutinefunction

        from django_idempotency import idempotent

        async def view(request):  # pragma: no cover - never called
            return None

        # Async views are protected (tests/test_asynchronous.py), not refused.
        assert iscoroutinefunction(idempotent(view))
        assert iscoroutinefunction(idempotent(wait=1)(view))

    @pytest.mark.parametrize(
        ("option", "value", "fix"),
        [
            ("methods", "POST", r"\('POST',\)"),
            ("methods", ("POST", "FETCH"), "HTTP methods"),
            ("ttl", "1h", "timedelta"),
            ("ttl", 0, "timedelta"),
            ("lease", -1, "timedelta"),
            ("wait", "5", "seconds"),
            ("wait", 7200, "seconds"),
            ("required", "yes", "True or False"),
            ("atomic", 0, "lease mode"),
            ("scope", 42, "callable"),
            ("scope", "not a dotted path", "dotted path"),
            ("fingerprint", ["a.b"], "callable"),
        ],
    )
    def test_wrong_value_is_refused_at_decoration_naming_option_and_fix(self, option, value, fix):
        from django.core.exceptions import ImproperlyConfigured

        from django_idempotency import idempotent

        with pytest.raises(
            ImproperlyConfigured, match=rf"@idempotent\({option}=\.\.\.\)"
        ) as raised:
            idempotent(**{option: value})
        assert re.search(fix, str(raised.value))

    def test_misspelt_option_suggests_the_name(self):
        from django_idempotency import idempotent

        with pytest.raises(TypeError, match="Did you mean 'required'"):
            idempotent(requird=True)

    def test_valid_values_of_every_type_are_accepted(self):
        from django_idempotency import idempotent

        idempotent(
            required=True,
            ttl=timedelta(hours=1),
            methods=["post", "PUT"],
            scope="tests.views.anything",  # imported at first use, not now
            fingerprint=lambda request: "f",
            atomic=False,
            wait=0,
            lease=30.5,
        )

    def test_dotted_path_that_fails_to_import_is_a_clear_error_at_first_use(self, rf):
        from django.core.exceptions import ImproperlyConfigured

        from django_idempotency import idempotent

        @idempotent(scope="tests.no_such_module.scope")
        def view(request):  # pragma: no cover - never reached
            raise AssertionError

        request = rf.post("/", headers={"Idempotency-Key": "k"})
        with pytest.raises(
            ImproperlyConfigured,
            match=r"@idempotent\(scope=\.\.\.\) on tests\.test_decorators\..*view names "
            r"'tests.no_such_module.scope', which could not be imported: "
            r"No module named 'tests.no_such_module'",
        ):
            view(request)
        assert not IdempotencyKey.objects.exists()
