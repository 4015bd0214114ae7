"""``IdempotencyMiddleware`` and ``@idempotency_exempt``, sync (WSGI) and async (ASGI).

How the middleware meets ``ATOMIC_REQUESTS`` is in ``test_transactions.py``.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from asgiref.sync import iscoroutinefunction, sync_to_async
from django.contrib import admin
from django.contrib.auth.decorators import login_required
from django.contrib.auth.models import User
from django.core.checks import WARNING
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction
from django.http import HttpResponse
from django.test import AsyncClient, Client
from django.test.utils import CaptureQueriesContext
from django.urls import include, path
from django.views.decorators.csrf import csrf_exempt
from rest_framework import viewsets
from rest_framework.authentication import BaseAuthentication
from rest_framework.authtoken.models import Token
from rest_framework.decorators import api_view, authentication_classes, permission_classes
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import idempotency_exempt
from django_idempotency.middleware import IdempotencyMiddleware
from django_idempotency.models import IdempotencyKey
from tests import middleware_views
from tests.clients import get, post, post_json
from tests.models import Order
from tests.test_asynchronous import ASYNC_METHOD_DECORATOR
from tests.test_engine import assert_refused_as_not_stored
from tests.views import calls

pytestmark = pytest.mark.django_db(transaction=True)
MIDDLEWARE = "django_idempotency.middleware.IdempotencyMiddleware"
CSRF_MIDDLEWARE = "django.middleware.csrf.CsrfViewMiddleware"
EXCEPTION_MIDDLEWARE = "tests.middleware_views.ExceptionAsBadRequestMiddleware"


@pytest.fixture
def installed(settings: Any) -> None:
    settings.MIDDLEWARE = [*settings.MIDDLEWARE, MIDDLEWARE]


@pytest.fixture
def atomic_requests() -> Any:
    connection.settings_dict["ATOMIC_REQUESTS"] = True
    yield
    connection.settings_dict["ATOMIC_REQUESTS"] = False


def sql(captured: CaptureQueriesContext) -> list[str]:
    return [query["sql"] for query in captured.captured_queries]


@pytest.fixture
def wsgi() -> Client:
    return Client(raise_request_exception=False)


@pytest.fixture
def asgi() -> AsyncClient:
    return AsyncClient(raise_request_exception=False)


@pytest.fixture(params=["wsgi", "asgi"])
def any_client(request: pytest.FixtureRequest) -> Client | AsyncClient:
    return request.getfixturevalue(request.param)


@pytest.fixture(params=["wsgi", "asgi"])
def reraising_client(request: pytest.FixtureRequest) -> Client | AsyncClient:
    """A test client as Django makes it: an error Django handled for the request is raised."""
    return Client() if request.param == "wsgi" else AsyncClient()


@pytest.mark.usefixtures("installed")
class ProtectionTests:
    @pytest.mark.parametrize("url", ["/async/sync/plain/", "/async/orders/plain/"])
    def test_plain_view_is_protected(self, any_client, url: str) -> None:
        first = post(any_client, url)
        retry = post(any_client, url)

        assert first.status_code == 201
        assert retry.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == first.content
        assert calls.value == 1
        assert IdempotencyKey.objects.get().state == IdempotencyKey.State.COMPLETED

    @pytest.mark.parametrize(
        "url", ["/async/sync/exempt/", "/async/sync/exempt-class/", "/async/orders/exempt/"]
    )
    def test_exempt_view_runs_unprotected(self, any_client, url: str) -> None:
        first = post(any_client, url)
        second = post(any_client, url)

        assert first.status_code == second.status_code == 201
        assert "Idempotent-Replayed" not in second
        assert calls.value == 2
        assert IdempotencyKey.objects.count() == 0

    def test_plain_view_failure_leaves_nothing(self, any_client) -> None:
        raised = post(any_client, "/async/orders/plain/", key="boom", **{"raise": True})
        assert raised.status_code == 500
        assert Order.objects.count() == 0
        assert IdempotencyKey.objects.count() == 0
        assert post(any_client, "/async/orders/plain/", key="boom").status_code == 201
        assert post(any_client, "/async/orders/plain/", key="boom")["Idempotent-Replayed"] == "true"
        assert calls.value == 2

    def test_other_methods_missing_keys_and_unknown_paths_pass_through(self, any_client) -> None:
        assert post(any_client, "/async/sync/plain/", key=None).status_code == 201
        assert post(any_client, "/async/sync/plain/", key=None).status_code == 201
        assert post(any_client, "/no/such/path/").status_code == 404
        assert get(any_client, "/async/ping/", **{"Idempotency-Key": "g"}).status_code == 200
        assert calls.value == 2
        assert IdempotencyKey.objects.count() == 0

    def test_required_setting_applies_to_plain_views(self, any_client, settings) -> None:
        settings.IDEMPOTENCY = {"REQUIRED": True}
        response = post(any_client, "/async/sync/plain/", key=None)
        assert response.status_code == 400
        assert response["Content-Type"] == "application/problem+json"
        assert calls.value == 0

    def test_bad_key_is_a_problem_response(self, any_client) -> None:
        response = post(any_client, "/async/orders/plain/", key="bad key")
        assert response.status_code == 400
        assert response["Content-Type"] == "application/problem+json"

    def test_disabled_passes_through(self, any_client, settings) -> None:
        settings.IDEMPOTENCY = {"ENABLED": False}
        post(any_client, "/async/sync/plain/")
        post(any_client, "/async/sync/plain/")
        assert calls.value == 2
        assert IdempotencyKey.objects.count() == 0


class ProtectedOnceTests:
    """A view that protects itself is left alone: same statements, one run per key."""

    @pytest.mark.parametrize(
        ("kind", "url"),
        [
            ("wsgi", "/orders/"),
            ("wsgi", "/orders/class-based/"),
            ("wsgi", "/api/orders/"),
            ("wsgi", "/drf/orders/"),
            ("asgi", "/async/orders/"),
            pytest.param("asgi", "/async/orders/class-based/", marks=ASYNC_METHOD_DECORATOR),
            ("asgi", "/drf/orders/"),
        ],
    )
    def test_decorated_view_makes_the_same_statements(
        self, request: pytest.FixtureRequest, settings: Any, kind: str, url: str
    ) -> None:
        user = User.objects.create_user("alice")
        auth = {"Authorization": f"Token {Token.objects.create(user=user).key}"}

        def measure(label: str) -> tuple[int, int]:
            client = Client() if kind == "wsgi" else AsyncClient()
            post(client, url, key=f"{label}-warm-up", headers=auth)
            with CaptureQueriesContext(connection) as first:
                assert post(client, url, key=label, headers=auth).status_code == 201
            with CaptureQueriesContext(connection) as replay:
                replayed = post(client, url, key=label, headers=auth)
                assert replayed["Idempotent-Replayed"] == "true"
            return len(sql(first)), len(sql(replay))

        without = measure("without")
        runs_without = calls.value
        settings.MIDDLEWARE = [*settings.MIDDLEWARE, MIDDLEWARE]
        with_middleware = measure("with")

        assert without[0] > 0
        assert with_middleware == without
        assert calls.value == 2 * runs_without == 4  # warm-up and first, per phase
        if url.startswith("/drf/"):
            # The mixin, not the middleware, scoped it: after DRF's token authentication.
            assert set(IdempotencyKey.objects.values_list("scope", flat=True)) == {
                f"user:{user.pk}"
            }

    @pytest.mark.usefixtures("installed")
    def test_decorated_view_hidden_from_the_middleware_is_protected_once(self, any_client) -> None:
        first = post(any_client, "/async/sync/hidden-decorated/", key="hidden")
        retry = post(any_client, "/async/sync/hidden-decorated/", key="hidden")

        assert first.status_code == 201, first.content
        assert retry["Idempotent-Replayed"] == "true"
        assert calls.value == 1
        assert IdempotencyKey.objects.count() == 1

    def test_exempt_marks_the_view_it_returns(self) -> None:
        def view(request: Any) -> HttpResponse:
            return HttpResponse()

        assert idempotency_exempt(view) is view
        assert view._idempotency_exempt  # type: ignore[attr-defined]


HIDDEN_WITH_OTHER_OPTIONS = [
    "/async/sync/hidden-scoped/",
    "/async/sync/hidden-lease/",
    "/async/sync/hidden-scoped-outer-lease/",
    "/async/sync/hidden-scoped-by-class/",
    "/async/sync/hidden-scoped-async/",
    "/async/sync/hidden-drf-scoped/",
    "/async/sync/hidden-store/",
]


PARSE_JSON_MIDDLEWARE = "tests.middleware_views.ParseJSONMiddleware"


class ConsumedStreamTests:
    """A middleware read the stream and kept only what it parsed, as ``request.data``."""

    @pytest.mark.parametrize(
        ("url", "chain"),
        [
            ("/async/sync/from-data/", [PARSE_JSON_MIDDLEWARE, MIDDLEWARE]),
            ("/async/sync/from-data-decorated/", [PARSE_JSON_MIDDLEWARE]),
        ],
        ids=["middleware", "decorator"],
    )
    def test_a_reused_key_with_another_body_is_refused(self, settings, any_client, url, chain):
        settings.MIDDLEWARE = [*settings.MIDDLEWARE, *chain]

        first = post_json(any_client, url, {"item": "book", "quantity": 10})
        replay = post_json(any_client, url, {"quantity": 10, "item": "book"})
        other = post_json(any_client, url, {"item": "book", "quantity": 9999})

        assert first.status_code == 201
        assert replay.status_code == 201
        assert replay["Idempotent-Replayed"] == "true"
        assert other.status_code == 422
        assert list(Order.objects.values_list("quantity", flat=True)) == [10]


@pytest.mark.usefixtures("installed")
class HiddenOptionsTests:
    """A view that protects itself with other options, behind a decorator hiding its mark."""

    @pytest.mark.parametrize("url", HIDDEN_WITH_OTHER_OPTIONS)
    def test_refused_before_the_handler_and_nothing_stored(self, any_client, url: str) -> None:
        first = post(any_client, url, key="shared", headers={"X-Api-Key": "A"})
        other = post(any_client, url, key="shared", headers={"X-Api-Key": "B"})

        assert first.status_code == other.status_code == 500
        assert b"client" not in other.content
        assert calls.value == 0
        assert Order.objects.count() == 0
        # Atomic mode rolled the claim back; lease mode released it.
        assert IdempotencyKey.objects.count() == 0

    @pytest.mark.parametrize("url", HIDDEN_WITH_OTHER_OPTIONS)
    def test_the_refusal_says_how_to_fix_it(self, url: str) -> None:
        with pytest.raises(ImproperlyConfigured) as raised:
            post(Client(), url, key="shared", headers={"X-Api-Key": "A"})

        message = str(raised.value)
        assert "functools.wraps" in message
        assert "@idempotency_exempt" in message
        assert "scope" in message or "atomic" in message or "store" in message

    def test_exempt_leaves_the_view_its_own_options(self, any_client) -> None:
        url = "/async/sync/hidden-scoped-exempt/"
        alice = post(any_client, url, key="shared", headers={"X-Api-Key": "A"})
        bob = post(any_client, url, key="shared", headers={"X-Api-Key": "B"})

        assert alice.status_code == bob.status_code == 201
        assert "Idempotent-Replayed" not in bob
        assert calls.value == 2
        scopes = set(IdempotencyKey.objects.values_list("scope", flat=True))
        assert scopes == {"client:A", "client:B"}

    def test_drf_view_with_the_same_options_is_refused_too(self, any_client) -> None:
        # The middleware claimed before DRF authenticated the caller: callers
        # that only DRF tells apart would share its scope, whatever the options.
        first = post(any_client, "/async/sync/hidden-drf-default/", key="hidden")
        retry = post(any_client, "/async/sync/hidden-drf-default/", key="hidden")

        assert first.status_code == retry.status_code == 500
        assert calls.value == 0
        assert IdempotencyKey.objects.count() == 0
        with pytest.raises(ImproperlyConfigured, match="claimed before DRF authenticated"):
            post(Client(), "/async/sync/hidden-drf-default/", key="hidden")

    @pytest.mark.parametrize("answer", ["json", "redirect", "drf"])
    def test_drf_view_without_the_mixin_is_refused_whatever_it_answers(
        self, any_client, answer: str
    ) -> None:
        # Its scope was taken before DRF read the API key: alice's answer would be
        # replayed to bob, and to a caller with no key at all, past DRF's permissions.
        url = f"/async/sync/hidden-drf-plain/?answer={answer}"
        alice = post(any_client, url, key="shared", headers={"X-Api-Key": "alice"})
        nobody = post(any_client, url, key="shared")

        assert alice.status_code == 500
        assert nobody.status_code == 500
        assert b"alice" not in nobody.content
        assert calls.value == 0
        assert Order.objects.count() == 0
        assert IdempotencyKey.objects.count() == 0
        with pytest.raises(ImproperlyConfigured, match="claimed before DRF authenticated"):
            post(Client(), url, key="shared", headers={"X-Api-Key": "bob"})


@pytest.mark.parametrize("answer", ["json", "redirect"])
def test_idempotent_around_a_hidden_drf_view_is_refused_whatever_it_answers(
    any_client, answer: str
) -> None:
    # No middleware: @idempotent itself cannot see the DRF view its decorator hides.
    url = f"/async/sync/decorated-hidden-drf-plain/?answer={answer}"
    alice = post(any_client, url, key="shared", headers={"X-Api-Key": "alice"})
    nobody = post(any_client, url, key="shared")

    assert alice.status_code == nobody.status_code == 500
    assert calls.value == 0
    assert IdempotencyKey.objects.count() == 0


class OrderingTests:
    @pytest.mark.parametrize("kind", ["wsgi", "asgi"])
    def test_request_refused_before_its_view_keeps_its_key(self, settings, kind: str) -> None:
        settings.MIDDLEWARE = [*settings.MIDDLEWARE, CSRF_MIDDLEWARE, MIDDLEWARE]
        strict = (
            Client(enforce_csrf_checks=True)
            if kind == "wsgi"
            else AsyncClient(enforce_csrf_checks=True)
        )
        refused = post(strict, "/async/sync/plain/", key="csrf")
        assert refused.status_code == 403
        assert IdempotencyKey.objects.count() == 0

        lenient = Client() if kind == "wsgi" else AsyncClient()
        accepted = post(lenient, "/async/sync/plain/", key="csrf")
        assert accepted.status_code == 201
        assert "Idempotent-Replayed" not in accepted
        assert calls.value == 1

    @pytest.fixture
    def before_csrf(self, settings: Any) -> None:
        settings.MIDDLEWARE = [*settings.MIDDLEWARE, MIDDLEWARE, CSRF_MIDDLEWARE]

    @pytest.mark.usefixtures("before_csrf")
    @pytest.mark.parametrize("kind", ["wsgi", "asgi"])
    def test_listed_before_csrf_it_refuses_to_load(self, kind: str) -> None:
        # Its process_view would run before CSRF's: the 403 of a request
        # without a token would be stored for the key and replayed to the
        # request that sends one.
        strict = (
            Client(enforce_csrf_checks=True)
            if kind == "wsgi"
            else AsyncClient(enforce_csrf_checks=True)
        )
        with pytest.raises(ImproperlyConfigured, match="must come after") as raised:
            post(strict, "/async/sync/plain/", key="csrf")

        assert repr(CSRF_MIDDLEWARE) in str(raised.value)
        assert calls.value == 0
        assert IdempotencyKey.objects.count() == 0

    @pytest.mark.usefixtures("before_csrf")
    def test_listed_before_csrf_the_check_says_so(self) -> None:
        from django_idempotency.checks import check_middleware_order

        [error] = check_middleware_order()
        assert error.id == "django_idempotency.E006"
        assert error.msg == f"{MIDDLEWARE!r} must come after {CSRF_MIDDLEWARE!r} in MIDDLEWARE."
        assert "replay it to the corrected request" in error.hint

    def test_a_later_middleware_without_view_hooks_is_only_warned_of(self, settings: Any) -> None:
        later = "tests.endings_views.SlowResponseMiddleware"
        settings.MIDDLEWARE = [*settings.MIDDLEWARE, MIDDLEWARE, later]
        from django_idempotency.checks import check_middleware_order

        [warning] = check_middleware_order()
        assert warning.id == "django_idempotency.W006"
        assert warning.level == WARNING
        assert repr(later) in warning.msg
        assert "end of MIDDLEWARE" in warning.hint

    def test_last_it_is_not_warned_of(self, settings: Any) -> None:
        settings.MIDDLEWARE = [*settings.MIDDLEWARE, MIDDLEWARE]
        from django_idempotency.checks import check_middleware_order

        assert check_middleware_order() == []

    @pytest.mark.parametrize("kind", ["wsgi", "asgi"])
    def test_listed_before_a_process_exception_it_refuses_to_load(
        self, settings: Any, kind: str
    ) -> None:
        # That hook would answer a raising view before ours hears of it: its
        # 400 would be stored as the view's own answer, with the view's writes.
        settings.MIDDLEWARE = [*settings.MIDDLEWARE, MIDDLEWARE, EXCEPTION_MIDDLEWARE]
        client = Client() if kind == "wsgi" else AsyncClient()
        with pytest.raises(ImproperlyConfigured, match="must come after") as raised:
            post(client, "/async/sync/plain/", "raises", **{"raise": True})

        assert repr(EXCEPTION_MIDDLEWARE) in str(raised.value)
        assert "exception" in str(raised.value)
        assert calls.value == 0
        from django_idempotency.checks import check_middleware_order

        [error] = check_middleware_order()
        assert error.id == "django_idempotency.E006"

    @pytest.mark.parametrize("kind", ["wsgi", "asgi"])
    def test_after_a_process_exception_a_raising_view_stores_nothing(
        self, settings: Any, kind: str
    ) -> None:
        settings.MIDDLEWARE = [*settings.MIDDLEWARE, EXCEPTION_MIDDLEWARE, MIDDLEWARE]
        client = Client() if kind == "wsgi" else AsyncClient()
        failed = post(client, "/async/sync/plain/", "raises", **{"raise": True})

        assert failed.status_code == 400  # the project's middleware answered
        assert IdempotencyKey.objects.count() == 0
        assert Order.objects.count() == 0  # rolled back with the claim


@pytest.mark.usefixtures("installed")
class OwnTransactionsTests:
    """A view marked non_atomic_requests runs in lease mode, outside any transaction of ours."""

    def test_durable_block_runs_once_per_key(self, any_client) -> None:
        first = post(any_client, "/async/sync/durable/", key="durable")
        retry = post(any_client, "/async/sync/durable/", key="durable")

        assert first.status_code == 201, first.content
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == first.content
        assert calls.value == 1
        assert Order.objects.count() == 1
        assert IdempotencyKey.objects.get().state == IdempotencyKey.State.COMPLETED

    def test_lease_mode_even_with_atomic_requests(self, any_client, atomic_requests) -> None:
        first = post(any_client, "/async/sync/durable/", key="durable")
        assert first.status_code == 201, first.content
        replay = post(any_client, "/async/sync/durable/", key="durable")
        assert replay["Idempotent-Replayed"] == "true"
        assert calls.value == 1


@pytest.mark.usefixtures("installed")
class ViewRaisedTests:
    """An exception Django turns into a response is still the handler's failure."""

    @pytest.mark.parametrize(("refusal", "status"), [("forbidden", 403), ("missing", 404)])
    def test_atomic_mode_rolls_back_and_stores_nothing(
        self, any_client, refusal: str, status: int
    ) -> None:
        url = f"/async/sync/refuse/{refusal}/"
        refused = post(any_client, url, key="refused")

        assert refused.status_code == status
        assert Order.objects.count() == 0
        assert IdempotencyKey.objects.count() == 0
        retry = post(any_client, url, key="refused")
        assert retry.status_code == status
        assert "Idempotent-Replayed" not in retry
        assert calls.value == 2

    def test_lease_mode_releases_the_key(self, any_client, settings) -> None:
        settings.IDEMPOTENCY = {"ATOMIC": False}
        refused = post(any_client, "/async/sync/refuse/forbidden/", key="refused")

        assert refused.status_code == 403
        assert IdempotencyKey.objects.count() == 0
        assert post(any_client, "/async/sync/refuse/forbidden/", key="refused").status_code == 403
        assert calls.value == 2

    def test_a_view_answering_4xx_itself_is_stored(self, any_client) -> None:
        first = post(any_client, "/async/sync/plain/", key="teapot", status=418)
        retry = post(any_client, "/async/sync/plain/", key="teapot", status=418)

        assert first.status_code == retry.status_code == 418
        assert retry["Idempotent-Replayed"] == "true"
        assert calls.value == 1


@pytest.mark.usefixtures("installed")
class RenderFailureTests:
    """A view that returned a ``TemplateResponse`` Django's handler then fails to render.

    Django renders it after the view, inside the middleware's call: the view
    has acted by then, so lease mode must not give its key back.
    """

    url = "/async/sync/unrenderable/"

    def test_lease_mode_completes_the_key_with_a_refusal(self, any_client, settings) -> None:
        settings.IDEMPOTENCY = {"ATOMIC": False}
        failed = post(any_client, self.url, key="unrenderable")
        assert failed.status_code == 500
        assert "Idempotent-Replayed" not in failed
        assert IdempotencyKey.objects.get().state == IdempotencyKey.State.COMPLETED

        assert_refused_as_not_stored(post(any_client, self.url, key="unrenderable"))
        assert calls.value == 1
        assert Order.objects.count() == 1

    def test_atomic_mode_rolls_back_for_a_retry(self, any_client) -> None:
        for _ in range(2):
            assert post(any_client, self.url, key="unrenderable").status_code == 500
        assert calls.value == 2
        assert Order.objects.count() == 0
        assert IdempotencyKey.objects.count() == 0


@pytest.mark.usefixtures("installed")
class CredentialScopeTests:
    """A view that authenticates by itself: the Authorization header narrows the scope."""

    def test_other_credentials_never_replay_an_answer(self, any_client) -> None:
        url = "/async/sync/token-auth/"
        alice = post(any_client, url, key="shared", headers={"Authorization": "Bearer alice"})
        bob = post(any_client, url, key="shared", headers={"Authorization": "Bearer bob"})

        assert alice.status_code == bob.status_code == 201
        assert "Idempotent-Replayed" not in bob
        assert json.loads(alice.content)["caller"] == "alice"
        assert json.loads(bob.content)["caller"] == "bob"
        assert calls.value == 2

        again = post(any_client, url, key="shared", headers={"Authorization": "Bearer alice"})
        assert again["Idempotent-Replayed"] == "true"
        assert again.content == alice.content
        assert calls.value == 2
        scopes = set(IdempotencyKey.objects.values_list("scope", flat=True))
        assert len(scopes) == 2
        assert all(scope.startswith("anonymous|credential:") for scope in scopes)
        assert not any("alice" in scope or "bob" in scope for scope in scopes)

    def test_authenticated_user_keeps_the_user_scope(self, any_client) -> None:
        user = User.objects.create_user("carol")
        any_client.force_login(user)
        post(any_client, "/async/sync/plain/", key="u", headers={"Authorization": "Bearer x"})

        assert IdempotencyKey.objects.get().scope == f"user:{user.pk}"

    def test_the_scope_setting_is_used_as_it_is(self, any_client, settings) -> None:
        # The default scope folds the credentials in; a scope of your own decides alone.
        settings.IDEMPOTENCY = {"SCOPE": lambda request: "tenant:acme"}
        post(any_client, "/async/sync/plain/", key="t", headers={"Authorization": "Bearer x"})

        assert IdempotencyKey.objects.get().scope == "tenant:acme"

    def test_middleware_and_decorator_scope_a_caller_alike(self, any_client) -> None:
        headers = {"Authorization": "Bearer alice"}
        post(any_client, "/async/sync/token-auth/", key="middleware", headers=headers)
        post(any_client, "/orders/token-auth/", key="decorator", headers=headers)

        by_key = dict(IdempotencyKey.objects.values_list("key", "scope"))
        assert by_key["middleware"] == by_key["decorator"]
        assert by_key["middleware"].startswith("anonymous|credential:")


class CapabilityTests:
    def test_sync_and_async_capable(self) -> None:
        assert IdempotencyMiddleware.sync_capable
        assert IdempotencyMiddleware.async_capable

    def test_async_mode_follows_get_response(self) -> None:
        async def get_response(request: Any) -> HttpResponse:
            return HttpResponse()

        assert iscoroutinefunction(IdempotencyMiddleware(get_response))
        assert iscoroutinefunction(IdempotencyMiddleware(get_response).process_view)
        assert not iscoroutinefunction(IdempotencyMiddleware(lambda request: HttpResponse()))


UNPROTECTED_DRF_VIEWS = [
    "/drf/unprotected-apiview/",
    "/drf/unprotected-orders/",
    "/drf/unprotected-api-view/",
]


def token_headers(username: str) -> dict[str, str]:
    user = User.objects.create_user(username)
    return {"Authorization": f"Token {Token.objects.create(user=user).key}"}


@pytest.mark.usefixtures("installed")
class DrfViewTests:
    """DRF views with no protection of their own, under the middleware: scoped after DRF's auth."""

    @pytest.mark.parametrize("url", UNPROTECTED_DRF_VIEWS)
    def test_each_token_user_gets_their_own_answer(self, any_client, url: str) -> None:
        alice, bob = token_headers("alice"), token_headers("bob")

        first = post(any_client, url, key="shared", headers=alice)
        other = post(any_client, url, key="shared", headers=bob)
        retry = post(any_client, url, key="shared", headers=alice)

        assert first.status_code == other.status_code == 201, (first.content, other.content)
        assert json.loads(first.content)["user"] == "alice"
        assert json.loads(other.content)["user"] == "bob"
        assert "Idempotent-Replayed" not in other
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == first.content
        assert calls.value == 2
        scopes = set(IdempotencyKey.objects.values_list("scope", flat=True))
        assert scopes == {f"user:{User.objects.get(username=name).pk}" for name in ("alice", "bob")}

    @pytest.mark.parametrize("url", UNPROTECTED_DRF_VIEWS)
    def test_unauthenticated_caller_is_refused_before_any_claim(self, any_client, url) -> None:
        refused = post(any_client, url, key="anonymous")

        assert refused.status_code == 401
        assert calls.value == 0
        assert IdempotencyKey.objects.count() == 0

    def test_without_a_key_the_view_runs_unprotected(self, any_client) -> None:
        alice = token_headers("alice")
        post(any_client, "/drf/unprotected-apiview/", key=None, headers=alice)
        post(any_client, "/drf/unprotected-apiview/", key=None, headers=alice)

        assert calls.value == 2
        assert IdempotencyKey.objects.count() == 0

    def test_an_exempt_viewset_action_runs_unprotected(self, any_client) -> None:
        alice = token_headers("alice")
        post(any_client, "/drf/exempt-create/", key="exempt", headers=alice)
        second = post(any_client, "/drf/exempt-create/", key="exempt", headers=alice)

        assert "Idempotent-Replayed" not in second
        assert calls.value == 2
        assert IdempotencyKey.objects.count() == 0

    def test_a_decorated_create_keeps_its_options_behind_post(self, any_client) -> None:
        alice = token_headers("alice")
        first = post(any_client, "/drf/decorated-create/", key="decorated", headers=alice)
        retry = post(any_client, "/drf/decorated-create/", key="decorated", headers=alice)

        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == first.content
        assert calls.value == 1
        assert list(IdempotencyKey.objects.values_list("scope", flat=True)) == ["decorated-create"]

    def test_the_view_stays_as_it_is_elsewhere(self) -> None:
        from django_idempotency.contrib.drf import IdempotentMixin
        from tests.drf_views import UnprotectedOrderAPIView

        assert not issubclass(UnprotectedOrderAPIView, IdempotentMixin)


# URLs of the admin and an exempt include, for the tests below (pytest.mark.urls).
FORM_VIEWS = [path("plain/", middleware_views.create_order)]
urlpatterns = [
    path("admin/", admin.site.urls),
    path("exempt/", idempotency_exempt(include(FORM_VIEWS))),
    path("protected/", include(FORM_VIEWS)),
]


@pytest.mark.urls("tests.test_middleware")
@pytest.mark.usefixtures("installed")
class RequiredKeysTests:
    """``REQUIRED: True`` under the middleware: browser forms cannot send a key."""

    @pytest.fixture(autouse=True)
    def required(self, settings: Any) -> None:
        settings.IDEMPOTENCY = {"REQUIRED": True}

    def test_the_admin_login_keeps_working(self, wsgi) -> None:
        User.objects.create_superuser("admin", password="secret")

        response = wsgi.post("/admin/login/", {"username": "admin", "password": "secret"})

        assert response.status_code == 302, response.content[:300]
        assert IdempotencyKey.objects.count() == 0

    def test_every_view_of_an_exempt_include_runs_without_a_key(self, any_client) -> None:
        assert post(any_client, "/exempt/plain/", key=None).status_code == 201
        assert post(any_client, "/exempt/plain/", key=None).status_code == 201
        assert calls.value == 2

    def test_the_same_view_outside_the_include_still_needs_a_key(self, any_client) -> None:
        refused = post(any_client, "/protected/plain/", key=None)

        assert refused.status_code == 400
        assert json.loads(refused.content)["type"].endswith("idempotency-key-required")
        assert calls.value == 0

    def test_exempting_an_include_leaves_its_views_unmarked(self) -> None:
        view = middleware_views.create_order
        exempt_patterns, app_name, namespace = idempotency_exempt(include(FORM_VIEWS))

        assert not getattr(view, "_idempotency_exempt", False)
        assert exempt_patterns[0].callback is not view
        assert exempt_patterns[0].callback.__wrapped__ is view
        assert (app_name, namespace) == (None, None)


class MiddlewareOrderTests:
    """Listed before AuthenticationMiddleware, the middleware refuses to load: no server serves."""

    @pytest.fixture
    def misordered(self, settings: Any) -> None:
        auth = "django.contrib.auth.middleware.AuthenticationMiddleware"
        settings.MIDDLEWARE = [
            entry if entry != auth else MIDDLEWARE for entry in settings.MIDDLEWARE
        ] + [auth]

    @pytest.mark.usefixtures("misordered")
    def test_the_handler_refuses_to_load_with_the_fix(self, any_client) -> None:
        from django.core.exceptions import ImproperlyConfigured

        with pytest.raises(ImproperlyConfigured, match="must come after") as raised:
            post(any_client, "/async/sync/plain/", key="k")

        assert "AuthenticationMiddleware" in str(raised.value)
        assert calls.value == 0
        assert IdempotencyKey.objects.count() == 0

    @pytest.mark.usefixtures("misordered")
    def test_silencing_the_check_lets_it_load(self, settings: Any, wsgi) -> None:
        settings.SILENCED_SYSTEM_CHECKS = ["django_idempotency.E006"]

        assert post(wsgi, "/async/sync/plain/", key="k").status_code == 201


#: What the view below saw: the row it deadlocks on, and each attempt.
_deadlocking: dict[str, Any] = {}


def deadlocks_once(request: Any) -> HttpResponse:
    """Deadlocks in its own statements on its first attempt (InnoDB's victim), then creates.

    With ``always`` set it deadlocks on every attempt.
    """
    from tests.test_engine import deadlock_with_a_heavier_transaction

    attempts = _deadlocking.setdefault("attempts", [])
    attempts.append(len(attempts) + 1)
    if len(attempts) == 1 or _deadlocking.get("always"):
        deadlock_with_a_heavier_transaction(_deadlocking["row"])
    order = Order.objects.create(item="deadlocked")
    return HttpResponse(f"order {order.pk}", status=201)


def deadlocks_rendering_once(request: Any) -> Any:
    """Creates, then returns a template response whose rendering deadlocks the first time."""
    from django.template import engines
    from django.template.response import TemplateResponse

    from tests.test_engine import deadlock_with_a_heavier_transaction

    attempts = _deadlocking.setdefault("attempts", [])
    attempts.append(len(attempts) + 1)
    order = Order.objects.create(item="deadlocked")

    def rendered() -> int:
        if len(attempts) == 1:
            deadlock_with_a_heavier_transaction(_deadlocking["row"])
        return order.pk

    template = engines["django"].from_string("order {{ rendered }}")
    return TemplateResponse(request, template, {"rendered": rendered}, status=201)


async def deadlocks_once_async(request: Any) -> HttpResponse:
    """:func:`deadlocks_once` as an ``async def`` view: its queries in the request's thread."""
    return await sync_to_async(deadlocks_once)(request)


urlpatterns.append(path("deadlocks-once/", deadlocks_once))
urlpatterns.append(path("deadlocks-once-async/", deadlocks_once_async))


@transaction.non_atomic_requests(using="other")
def deadlocks_once_outside_other(request: Any) -> HttpResponse:
    """:func:`deadlocks_once`, left out of the ``other`` database's request transaction."""
    return deadlocks_once(request)


urlpatterns.append(path("deadlocks-once-outside-other/", deadlocks_once_outside_other))
urlpatterns.append(path("deadlocks-rendering-once/", deadlocks_rendering_once))


class InRequestTransactions(APIView):
    """A DRF view, unprotected itself: which request transactions wrap it.

    ``fail``: writes an order, then raises.
    """

    authentication_classes: list[Any] = []
    permission_classes: list[Any] = []

    def post(self, request: Any) -> Response:
        from django.db import connections

        calls.increment()
        if request.data.get("fail"):
            Order.objects.create(item="written before the error")
            raise RuntimeError("the view failed after a write")
        return Response(
            {alias: connections[alias].in_atomic_block for alias in ["default", "other"]},
            status=201,
        )


class InRequestTransactionsViewSet(viewsets.ViewSet):
    """:class:`InRequestTransactions` as a viewset's ``create``."""

    authentication_classes: list[Any] = []
    permission_classes: list[Any] = []

    def create(self, request: Any) -> Response:
        return InRequestTransactions().post(request)


@api_view(["POST"])
@authentication_classes([])
@permission_classes([])
def in_request_transactions(request: Any) -> Response:
    """:class:`InRequestTransactions` as an ``@api_view`` function."""
    return InRequestTransactions().post(request)


_outside_other = transaction.non_atomic_requests(using="other")
urlpatterns += [
    path("drf-outside-other/", _outside_other(InRequestTransactions.as_view())),
    path(
        "drf-outside-other-viewset/",
        _outside_other(InRequestTransactionsViewSet.as_view({"post": "create"})),
    ),
    path("drf-outside-other-api-view/", _outside_other(in_request_transactions)),
]


@pytest.mark.urls("tests.test_middleware")
@pytest.mark.usefixtures("installed")
@pytest.mark.django_db(transaction=True, databases=["default", "other"])
@pytest.mark.parametrize(
    "url", ["/drf-outside-other/", "/drf-outside-other-viewset/", "/drf-outside-other-api-view/"]
)
def test_a_drf_view_left_out_of_a_request_transaction_stays_out_of_it(
    any_client, monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    # The middleware calls its own build of a DRF view (the mixin in front); Django
    # decided the request transactions from the view it resolved, and so does the build.
    from django.db import connections

    monkeypatch.setitem(connections.settings["other"], "ATOMIC_REQUESTS", True)

    first = post(any_client, url, "outside")
    retry = post(any_client, url, "outside")

    assert first.status_code == 201, first.content[:300]
    assert json.loads(first.content)["other"] is False
    assert (retry["Idempotent-Replayed"], retry.content) == ("true", first.content)
    assert calls.value == 1


urlpatterns += [
    path("drf-in-request-transactions/", InRequestTransactions.as_view()),
    # Marked out of the key's database only: lease mode, still in ``other``'s transaction.
    path(
        "drf-outside-default/",
        transaction.non_atomic_requests(InRequestTransactions.as_view()),
    ),
    path("drf-login-required/", login_required(InRequestTransactions.as_view())),
    # DRF's as_view() is csrf_exempt already: one more changes nothing.
    path("drf-csrf-exempt-again/", csrf_exempt(InRequestTransactions.as_view())),
]


@pytest.mark.urls("tests.test_middleware")
@pytest.mark.usefixtures("installed")
@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_a_drf_view_in_lease_mode_keeps_the_request_transactions_it_was_not_marked_out_of(
    any_client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A plain view marked this way keeps ``other``'s transaction (Django wraps it); the
    # middleware's build of a DRF view should too.
    from django.db import connections

    monkeypatch.setitem(connections.settings["other"], "ATOMIC_REQUESTS", True)

    first = post(any_client, "/drf-outside-default/", "lease-by-mark")

    assert first.status_code == 201, first.content[:300]
    assert json.loads(first.content)["other"] is True


@pytest.mark.urls("tests.test_middleware")
@pytest.mark.usefixtures("installed", "atomic_requests")
def test_a_drf_view_in_lease_mode_rolls_back_with_its_request_transaction_but_on_sqlite(
    any_client, settings: Any
) -> None:
    # docs/middleware.rst, ATOMIC_REQUESTS: in lease mode the claim commits before the
    # request's transaction opens. A plain view's writes roll back with it; so should a DRF
    # view's, as they do without the middleware.
    settings.IDEMPOTENCY = {"ATOMIC": False}

    failed = post_json(any_client, "/drf-in-request-transactions/", {"fail": True}, "lease")

    assert failed.status_code == 500
    # SQLite: the lease would ride in the request's transaction (one writer), and roll back
    # with a worker killed mid-view; the build stays out of it there, as the mixin does.
    assert Order.objects.exists() is (connection.vendor == "sqlite")


@pytest.mark.urls("tests.test_middleware")
@pytest.mark.usefixtures("installed")
def test_without_a_key_a_drf_view_inside_a_decorator_runs_its_decorator(any_client) -> None:
    # functools.wraps copies the view's ``cls``: the middleware must not call its own build
    # of the class in place of the decorated view, skipping the decorator.
    response = post(any_client, "/drf-login-required/", None)

    assert response.status_code == 302, response.content[:300]
    assert response["Location"].startswith("/accounts/login/")
    assert calls.value == 0


@pytest.mark.urls("tests.test_middleware")
@pytest.mark.usefixtures("installed")
def test_csrf_exempt_around_a_drf_view_is_not_refused(any_client) -> None:
    first = post(any_client, "/drf-csrf-exempt-again/", "again")
    retry = post(any_client, "/drf-csrf-exempt-again/", "again")

    assert first.status_code == 201, first.content[:300]
    assert (retry["Idempotent-Replayed"], retry.content) == ("true", first.content)
    assert calls.value == 1


@pytest.mark.urls("tests.test_middleware")
@pytest.mark.usefixtures("installed")
def test_under_required_every_request_to_a_drf_view_inside_a_decorator_is_refused(
    settings: Any,
) -> None:
    # Without a key the build would answer 400; it cannot be called either (check E007).
    settings.IDEMPOTENCY = {"REQUIRED": True}

    with pytest.raises(ImproperlyConfigured, match="InRequestTransactions is a DRF view"):
        post(Client(), "/drf-login-required/", None)

    assert calls.value == 0


@pytest.mark.urls("tests.test_middleware")
@pytest.mark.parametrize(
    ("idempotency", "refused"),
    [
        ({"METHODS": 5}, []),  # E103 reports it
        ({"ENABLED": False}, []),  # the middleware protects, and refuses, nothing
        ({"DATABASE": "nowhere"}, ["drf-login-required/"]),  # E004; the rest is read alike
    ],
)
def test_the_check_leaves_bad_settings_and_a_disabled_package_alone(
    settings: Any, idempotency: dict[str, Any], refused: list[str]
) -> None:
    from django_idempotency.checks import check_middleware_views

    settings.MIDDLEWARE = [*settings.MIDDLEWARE, MIDDLEWARE]
    settings.IDEMPOTENCY = idempotency

    errors = check_middleware_views()

    assert [error.msg.split("'")[1] for error in errors] == refused


@pytest.mark.urls("tests.test_middleware")
def test_the_check_names_each_drf_view_inside_a_decorator(settings: Any) -> None:
    from django_idempotency.checks import check_middleware_views

    assert check_middleware_views() == []  # the middleware is not installed

    settings.MIDDLEWARE = [*settings.MIDDLEWARE, MIDDLEWARE]
    [error] = check_middleware_views()

    assert error.id == "django_idempotency.E007"
    assert error.msg.startswith("The URL 'drf-login-required/': ")
    assert "InRequestTransactions is a DRF view" in error.msg
    assert "method_decorator" in error.msg


@pytest.mark.urls("tests.test_middleware")
@pytest.mark.usefixtures("installed")
@pytest.mark.parametrize("kind", ["wsgi", "asgi"])
def test_a_key_for_a_drf_view_inside_a_decorator_is_refused_before_anything_runs(
    kind: str,
) -> None:
    # Neither the build (it would skip the decorator) nor a claim around the decorated
    # view (taken before DRF authenticates the caller) is safe: refused, naming the fixes.
    client = Client() if kind == "wsgi" else AsyncClient()

    with pytest.raises(ImproperlyConfigured, match="InRequestTransactions is a DRF view") as raised:
        post(client, "/drf-login-required/", "anonymous")

    assert "method_decorator" in str(raised.value)
    assert "IdempotentMixin" in str(raised.value)
    assert calls.value == 0
    assert IdempotencyKey.objects.count() == 0


# Lease mode inside the request's transaction (ATOMIC_REQUESTS), through the middleware's build.

_failing: dict[str, Any] = {}


class ReadsTheDatabase(BaseAuthentication):
    """Reads before the key is claimed, as a token lookup does (a snapshot on MariaDB)."""

    def authenticate(self, request: Any) -> None:
        from django.contrib.auth.models import User

        list(User.objects.all()[:1])


class LeaseInRequestTransaction(APIView):
    """Writes an order; ``_failing`` steers how the request ends."""

    authentication_classes: list[Any] = [ReadsTheDatabase]
    permission_classes: list[Any] = []

    def post(self, request: Any) -> Response:
        Order.objects.create(item="in the request transaction")
        started = _failing.pop("started", None)
        if started is not None:
            started.set()
            assert _failing["release"].wait(timeout=30)
        if _failing.pop("at_commit", False):
            with connection.cursor() as cursor:
                # Checked at COMMIT on PostgreSQL, after the view returned.
                cursor.execute(
                    "INSERT INTO auth_user_groups (user_id, group_id) VALUES (%s, %s)",
                    [999999, 999999],
                )
        if _failing.pop("unavailable", False):
            return Response({"detail": "down"}, status=503)
        return Response({"orders": Order.objects.count()}, status=201)


urlpatterns.append(path("drf-lease-in-request/", LeaseInRequestTransaction.as_view()))


@pytest.fixture
def lease_in_atomic_requests(settings: Any) -> Any:
    settings.IDEMPOTENCY = {"ATOMIC": False}
    connection.settings_dict["ATOMIC_REQUESTS"] = True
    _failing.clear()
    yield
    connection.settings_dict["ATOMIC_REQUESTS"] = False
    _failing.clear()


@pytest.mark.urls("tests.test_middleware")
@pytest.mark.usefixtures("installed", "lease_in_atomic_requests")
def test_lease_mode_in_the_request_transaction_completes_and_replays(any_client: Any) -> None:
    from django_idempotency.models import IdempotencyKey

    first = post(any_client, "/drf-lease-in-request/", "ok")
    again = post(any_client, "/drf-lease-in-request/", "ok")

    assert first.status_code == 201, first.content[:300]
    assert again.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert Order.objects.count() == 1
    assert IdempotencyKey.objects.count() == 1


@pytest.mark.urls("tests.test_middleware")
@pytest.mark.usefixtures("installed", "lease_in_atomic_requests")
def test_lease_mode_a_5xx_is_released_and_the_retry_runs(any_client: Any) -> None:
    _failing["unavailable"] = True
    first = post(any_client, "/drf-lease-in-request/", "down")
    again = post(any_client, "/drf-lease-in-request/", "down")

    assert first.status_code == 503, first.content[:300]
    assert again.status_code == 201, again.content[:300]
    assert "Idempotent-Replayed" not in again


@pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="foreign keys checked at COMMIT",
)
@pytest.mark.urls("tests.test_middleware")
@pytest.mark.usefixtures("installed", "lease_in_atomic_requests")
def test_lease_mode_a_request_transaction_failing_at_commit_releases_the_key(
    any_client: Any,
) -> None:
    _failing["at_commit"] = True
    first = post(any_client, "/drf-lease-in-request/", "commit")
    again = post(any_client, "/drf-lease-in-request/", "commit")

    assert first.status_code == 500
    assert again.status_code == 201, again.content[:300]
    assert "Idempotent-Replayed" not in again
    assert Order.objects.count() == 1


@pytest.mark.urls("tests.test_middleware")
@pytest.mark.usefixtures("installed", "lease_in_atomic_requests")
def test_lease_mode_a_duplicate_while_the_first_runs_gets_409() -> None:
    started, release = threading.Event(), threading.Event()
    _failing.update(started=started, release=release)
    answers: list[Any] = []

    def first() -> None:
        try:
            answers.append(
                post(Client(raise_request_exception=False), "/drf-lease-in-request/", "busy")
            )
        finally:
            connection.close()

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert started.wait(timeout=30)
        duplicate = post(Client(raise_request_exception=False), "/drf-lease-in-request/", "busy")
    finally:
        release.set()
        thread.join(timeout=60)

    assert duplicate.status_code == 409, duplicate.content[:300]
    assert "Retry-After" in duplicate
    assert answers[0].status_code == 201


@pytest.mark.urls("tests.test_middleware")
@pytest.mark.usefixtures("installed", "lease_in_atomic_requests")
def test_lease_mode_in_the_request_transaction_another_body_gets_422(any_client: Any) -> None:
    first = post(any_client, "/drf-lease-in-request/", "same")
    other = post(any_client, "/drf-lease-in-request/", "same", item="other")

    assert first.status_code == 201, first.content[:300]
    assert other.status_code == 422, other.content[:300]
    assert Order.objects.count() == 1


@pytest.mark.skipif(connection.vendor != "mysql", reason="InnoDB's deadlock error 1213")
@pytest.mark.urls("tests.test_middleware")
@pytest.mark.usefixtures("installed")
@pytest.mark.django_db(transaction=True, databases=["default", "other"])
@pytest.mark.parametrize(
    ("url", "atomic_requests_elsewhere"),
    [
        ("/deadlocks-once/", False),
        ("/deadlocks-once-async/", False),
        # Django leaves this view out of the other database's request transaction.
        ("/deadlocks-once-outside-other/", True),
    ],
)
def test_a_deadlock_in_the_views_own_statements_starts_the_claim_over(
    reraising_client,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    url: str,
    atomic_requests_elsewhere: bool,
) -> None:
    # As under the decorator: the 1213 rolled the whole attempt back (a lost Galera
    # certification reports the same error), so the view runs again instead of a 500, and
    # Django does not handle the lost attempt's error as the request's (no log, no re-raise).
    from django.db import connections

    monkeypatch.setitem(connections.settings["other"], "ATOMIC_REQUESTS", atomic_requests_elsewhere)
    _deadlocking.clear()
    _deadlocking["row"] = Order.objects.create(item="shared").pk

    first = post(reraising_client, url, "deadlocked")

    assert first.status_code == 201, first.content[:300]
    assert _deadlocking["attempts"] == [1, 2]
    [order] = Order.objects.filter(item="deadlocked").values_list("pk", flat=True)
    assert first.content == f"order {order}".encode()
    retry = post(reraising_client, url, "deadlocked")
    assert (retry.status_code, retry["Idempotent-Replayed"]) == (201, "true")
    assert retry.content == first.content
    assert _deadlocking["attempts"] == [1, 2]
    assert "Internal Server Error" not in caplog.text


@pytest.mark.skipif(connection.vendor != "mysql", reason="InnoDB's deadlock error 1213")
@pytest.mark.urls("tests.test_middleware")
@pytest.mark.usefixtures("installed")
def test_a_view_that_always_deadlocks_is_answered_409_not_500(
    reraising_client, caplog: pytest.LogCaptureFixture
) -> None:
    from django_idempotency import store

    _deadlocking.clear()
    _deadlocking.update(row=Order.objects.create(item="shared").pk, always=True)

    response = post(reraising_client, "/deadlocks-once/", "always")

    assert response.status_code == 409, response.content[:300]
    assert response["Retry-After"] == "1"
    assert len(_deadlocking["attempts"]) == store.CLAIM_ATTEMPTS
    assert not Order.objects.filter(item="deadlocked").exists()
    assert not IdempotencyKey.objects.filter(key="always").exists()
    assert "Internal Server Error" not in caplog.text


@pytest.mark.skipif(connection.vendor != "mysql", reason="InnoDB's deadlock error 1213")
@pytest.mark.urls("tests.test_middleware")
@pytest.mark.usefixtures("installed")
@pytest.mark.django_db(transaction=True, databases=["default", "other"])
@pytest.mark.parametrize(
    ("url", "atomic_requests_elsewhere"),
    [("/deadlocks-rendering-once/", False), ("/deadlocks-once/", True)],
    ids=["while_the_template_renders", "with_atomic_requests_on_another_database"],
)
def test_a_deadlock_that_may_follow_a_commit_elsewhere_is_not_started_over(
    any_client, monkeypatch: pytest.MonkeyPatch, url: str, atomic_requests_elsewhere: bool
) -> None:
    # Django renders after it committed the request's transactions on other databases, and
    # ends them one database after the other: a new attempt could write there again.
    # Django's 500, nothing stored, and the retry runs anew.
    from django.db import connections

    monkeypatch.setitem(connections.settings["other"], "ATOMIC_REQUESTS", atomic_requests_elsewhere)
    _deadlocking.clear()
    _deadlocking["row"] = Order.objects.create(item="shared").pk

    first = post(any_client, url, "elsewhere")

    assert first.status_code == 500
    assert _deadlocking["attempts"] == [1]
    assert not Order.objects.filter(item="deadlocked").exists()
    assert not IdempotencyKey.objects.filter(key="elsewhere").exists()
    retry = post(any_client, url, "elsewhere")
    assert (retry.status_code, _deadlocking["attempts"]) == (201, [1, 2])
    assert "Idempotent-Replayed" not in retry
    [order] = Order.objects.filter(item="deadlocked").values_list("pk", flat=True)
    assert retry.content == f"order {order}".encode()
