"""OpenAPI 3 schemas through drf-spectacular: protected operations, and only those, document it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.test import override_settings
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.renderers import OpenApiJsonRenderer
from openapi_spec_validator import validate
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient
from rest_framework.views import exception_handler

from django_idempotency.models import IdempotencyKey
from tests import drf_views
from tests.models import Order

ROOT = Path(__file__).resolve().parent.parent
HEADER = "Idempotency-Key"
REPLAY = "Idempotent-Replayed"
MIDDLEWARE = "django_idempotency.middleware.IdempotencyMiddleware"
URLCONF = "tests.openapi_urls"

# (path, method): (required, expiry as described)
PROTECTED = {
    ("/orders/", "post"): (False, "24 hours"),
    ("/orders/{id}/", "patch"): (False, "24 hours"),
    ("/orders/{id}/ship/", "post"): (False, "24 hours"),
    ("/required-orders/", "post"): (True, "24 hours"),
    ("/options-orders/", "post"): (False, "1 minute"),
    ("/put-orders/{id}/", "put"): (False, "24 hours"),
    ("/generic/", "post"): (False, "24 hours"),
    ("/documented/", "post"): (True, "10 minutes"),
    ("/lease-function/", "post"): (False, "24 hours"),
}
UNPROTECTED = [
    ("/orders/", "get"),
    ("/orders/{id}/", "put"),
    ("/orders/{id}/", "delete"),
    ("/put-orders/{id}/", "delete"),
    ("/unprotected-orders/", "post"),
    ("/unprotected-orders/{id}/", "patch"),
    ("/unprotected-function/", "post"),
    ("/unprotected-function/", "get"),
]


def generate(urlconf: str | None = URLCONF) -> dict[str, Any]:
    schema = SchemaGenerator(urlconf=urlconf).get_schema(request=None, public=True)
    # Through the renderer, as served, so the validator sees plain JSON.
    document = json.loads(OpenApiJsonRenderer().render(schema, renderer_context={}))
    validate(document)
    return document


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return generate()


@pytest.fixture(scope="module")
def middleware_schema() -> dict[str, Any]:
    with under_middleware():
        return generate(urlconf=None)


def header_parameter(operation: dict[str, Any]) -> dict[str, Any] | None:
    found = [p for p in operation.get("parameters", []) if p["in"] == "header"]
    return next((p for p in found if p["name"] == HEADER), None)


class ProtectedOperationTests:
    @pytest.mark.parametrize(("path", "method"), list(PROTECTED))
    def test_header_parameter_with_length_and_expiry(self, schema, path, method):
        required, expiry = PROTECTED[path, method]
        parameter = header_parameter(schema["paths"][path][method])

        assert parameter is not None
        assert parameter["required"] is required
        assert parameter["schema"]["maxLength"] == 255
        assert parameter["schema"]["minLength"] == 1
        assert f"Keys expire {expiry} after the response is stored" in parameter["description"]

    @pytest.mark.parametrize(("path", "method"), list(PROTECTED))
    def test_error_responses_and_replay_header(self, schema, path, method):
        responses = schema["paths"][path][method]["responses"]

        assert {"400", "409", "422"} <= set(responses)
        assert responses["409"]["headers"]["Retry-After"]["schema"] == {
            "type": "integer",
            "minimum": 1,
        }
        # DRF views answer through the default EXCEPTION_HANDLER: {"detail": ...}.
        assert responses["422"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/IdempotencyError"
        }
        successes = [code for code in responses if code.startswith("2")]
        assert successes
        for code in successes:
            assert REPLAY in responses[code]["headers"]
        for code in ("409", "422"):
            assert REPLAY not in responses[code].get("headers", {})

    def test_error_component_is_drfs_default_shape(self, schema):
        assert schema["components"]["schemas"]["IdempotencyError"] == {
            "type": "object",
            "properties": {"detail": {"type": "string"}},
            "required": ["detail"],
        }

    def test_ttl_in_seconds_for_machines(self, schema):
        parameter = header_parameter(schema["paths"]["/options-orders/"]["post"])
        assert parameter["x-idempotency-key-expires-after-seconds"] == 60

    def test_views_own_response_documentation_is_kept(self, schema):
        operation = schema["paths"]["/documented/"]["post"]
        bad_request = operation["responses"]["400"]["description"]

        assert bad_request.startswith("The item is not for sale.")
        assert "header is missing (this operation requires it)" in bad_request
        assert operation["requestBody"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/Order"
        }

    def test_atomic_409_mentions_the_wait_and_lease_409_does_not(self, schema):
        atomic = schema["paths"]["/orders/"]["post"]["responses"]["409"]["description"]
        lease = schema["paths"]["/lease-function/"]["post"]["responses"]["409"]["description"]

        assert "waited up to 5 seconds" in atomic
        assert "waited" not in lease

    @pytest.mark.parametrize(
        ("path", "method"),
        [
            ("/undocumented-orders/", "post"),
            ("/undocumented-orders/", "get"),
            ("/undocumented-orders/{id}/", "patch"),
            ("/undocumented-create/", "post"),
        ],
    )
    def test_view_without_a_docstring_gets_no_description(self, schema, path, method):
        # The mixin's own docstring is about this package, not about the API.
        assert "description" not in schema["paths"][path][method]

    @pytest.mark.parametrize(
        ("path", "method", "description"),
        [
            ("/orders/", "post", "A ModelViewSet behind token authentication, as most APIs"),
            ("/inherited-doc-orders/", "post", "Orders, as the project documents them."),
            ("/inherited-doc-orders/{id}/", "get", "Orders, as the project documents them."),
            ("/documented-action/", "post", "Create an order, as the handler documents it."),
        ],
    )
    def test_projects_own_docstring_is_the_description(self, schema, path, method, description):
        operation = schema["paths"][path][method]

        assert operation["description"].startswith(description)
        assert "idempotency_" not in operation["description"]

    def test_no_operation_shows_the_mixins_docstring(self, schema):
        for path_item in schema["paths"].values():
            for operation in path_item.values():
                assert "idempotency_<option>" not in operation.get("description", "")

    def test_view_classes_are_left_untouched(self, schema):
        assert not hasattr(drf_views.OrderViewSet.create, "kwargs")
        assert not hasattr(drf_views.OrderViewSet.partial_update, "kwargs")


class UnprotectedOperationTests:
    @pytest.mark.parametrize(("path", "method"), UNPROTECTED)
    def test_no_header_no_idempotency_answers(self, schema, path, method):
        operation = schema["paths"][path][method]

        assert header_parameter(operation) is None
        assert not {"409", "422"} & set(operation["responses"])
        for response in operation["responses"].values():
            assert REPLAY not in response.get("headers", {})


class SettingsInTheSchemaTests:
    @override_settings(IDEMPOTENCY={"ENABLED": False})
    def test_disabled_documents_nothing(self):
        document = generate()
        assert header_parameter(document["paths"]["/orders/"]["post"]) is None

    @override_settings(
        IDEMPOTENCY={"HEADER": "X-Request-Key", "KEY_MAX_LENGTH": 64, "REQUIRED": True}
    )
    def test_header_name_length_and_required_follow_the_settings(self):
        operation = generate()["paths"]["/orders/"]["post"]
        (parameter,) = [p for p in operation["parameters"] if p["name"] == "X-Request-Key"]
        assert parameter["required"] is True
        assert parameter["schema"]["maxLength"] == 64

    @override_settings(IDEMPOTENCY={"KEY_MIN_LENGTH": 16, "KEY_MAX_LENGTH": 64})
    def test_a_minimum_key_length_is_documented_as_the_key_rules_check_it(self):
        operation = generate()["paths"]["/orders/"]["post"]
        parameter = header_parameter(operation)
        assert parameter["schema"]["minLength"] == 16
        assert parameter["schema"]["maxLength"] == 64
        assert "From 16 to 64 visible ASCII characters" in parameter["description"]
        bad_request = operation["responses"]["400"]["description"]
        assert "shorter than 16 or longer than 64 characters" in bad_request

    @override_settings(IDEMPOTENCY={"PROBLEM_TYPE_BASE_URL": "https://api.example.com/p/"})
    def test_problem_base_url_documents_the_link_header(self):
        responses = generate()["paths"]["/orders/"]["post"]["responses"]
        for code in ("400", "409", "422"):
            assert "Link" in responses[code]["headers"]

    def test_projects_own_exception_handler_is_not_guessed(self):
        rest_framework = {
            "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
            "EXCEPTION_HANDLER": "tests.test_spectacular.project_exception_handler",
        }
        with override_settings(REST_FRAMEWORK=rest_framework):
            responses = generate()["paths"]["/orders/"]["post"]["responses"]
        body = responses["422"]["content"]["application/json"]["schema"]
        assert "$ref" not in body
        assert "EXCEPTION_HANDLER" in body["description"]


def under_middleware(**overrides: Any) -> Any:
    """Settings with ``IdempotencyMiddleware`` installed, resolving the OpenAPI URLconf."""
    return override_settings(
        MIDDLEWARE=[*settings.MIDDLEWARE, MIDDLEWARE], ROOT_URLCONF=URLCONF, **overrides
    )


def documented(schema: dict[str, Any], path: str, method: str) -> dict[str, Any] | None:
    """The key header parameter of an operation, or ``None`` when it documents none."""
    return header_parameter(schema["paths"][path][method])


def error_media_types(schema: dict[str, Any], path: str, method: str) -> set[str]:
    return set(schema["paths"][path][method]["responses"]["422"]["content"])


def waits(schema: dict[str, Any], path: str, method: str) -> bool:
    return "waited up to" in schema["paths"][path][method]["responses"]["409"]["description"]


class EveryWayOfProtectingTests:
    """Each way the package protects a DRF operation, documented as the run time protects it."""

    def test_method_decorator_on_a_viewset_action(self, schema):
        assert documented(schema, "/action-orders/", "post")["required"] is False
        assert documented(schema, "/action-orders/{id}/", "patch") is None
        assert documented(schema, "/action-orders/{id}/", "put") is None

    def test_method_decorator_on_a_viewsets_dispatch(self, schema):
        for path, method in [("/dispatch-orders/", "post"), ("/dispatch-orders/{id}/", "patch")]:
            parameter = documented(schema, path, method)
            assert parameter["x-idempotency-key-expires-after-seconds"] == 120
        assert documented(schema, "/dispatch-orders/{id}/", "put") is None
        assert documented(schema, "/dispatch-orders/", "get") is None

    def test_method_decorator_on_an_apiview_method(self, schema):
        assert documented(schema, "/method-decorated/", "post")["required"] is True
        assert documented(schema, "/method-decorated/", "patch") is None

    def test_method_decorator_on_an_apiviews_dispatch_with_its_methods(self, schema):
        assert documented(schema, "/dispatch-decorated/", "post") is not None
        assert documented(schema, "/dispatch-decorated/", "put") is not None
        assert documented(schema, "/dispatch-decorated/", "patch") is None

    def test_dispatch_answers_before_drf_with_problem_details(self, schema):
        # @idempotent on dispatch answers as a decorator does: RFC 9457.
        assert error_media_types(schema, "/dispatch-orders/", "post") == {
            "application/problem+json"
        }
        problem = schema["components"]["schemas"]["IdempotencyProblem"]
        assert problem["required"] == ["type", "title", "status", "detail"]
        assert error_media_types(schema, "/action-orders/", "post") == {"application/json"}

    def test_decorated_update_protects_patch_through_partial_update(self, schema):
        assert documented(schema, "/update-orders/{id}/", "patch") is not None
        assert not waits(schema, "/update-orders/{id}/", "patch")  # wait=0
        # PUT is not in METHODS: the decorator passes it through.
        assert documented(schema, "/update-orders/{id}/", "put") is None

    def test_decorated_create_protects_a_generic_views_post(self, schema):
        assert documented(schema, "/generic-create/", "post") is not None
        assert not waits(schema, "/generic-create/", "post")  # lease mode

    def test_mixin_as_view_arguments(self, schema):
        parameter = documented(schema, "/as-view-options/", "post")
        assert parameter["required"] is True
        assert parameter["x-idempotency-key-expires-after-seconds"] == 30

    def test_mixin_option_given_as_a_property(self, schema):
        assert documented(schema, "/property-orders/", "post")["required"] is True
        assert documented(schema, "/property-orders/{id}/", "patch")["required"] is False

    def test_the_outer_layer_claims_and_any_layer_may_require(self, schema):
        parameter = documented(schema, "/layered-orders/", "post")

        assert parameter["x-idempotency-key-expires-after-seconds"] == 300  # dispatch's
        assert parameter["required"] is True  # the mixin's
        assert error_media_types(schema, "/layered-orders/", "post") == {"application/problem+json"}

    def test_mixin_methods_option(self, schema):
        assert documented(schema, "/put-orders/{id}/", "put") is not None
        assert documented(schema, "/orders/{id}/", "put") is None

    def test_views_that_protect_nothing_document_nothing(self, schema):
        for path, method in [
            ("/creating/", "post"),
            ("/unprotected-orders/", "post"),
            ("/unprotected-function/", "post"),
            ("/non-atomic/", "post"),
        ]:
            assert documented(schema, path, method) is None


class SettingsChangesTests:
    """Options left to the settings follow them, as the run time resolves them."""

    def test_ttl_wait_and_methods_follow_the_settings(self, schema):
        with override_settings(IDEMPOTENCY={"TTL": 3600, "WAIT": 0, "METHODS": ["POST", "PUT"]}):
            changed = generate()

        assert (
            documented(changed, "/action-orders/", "post")[
                "x-idempotency-key-expires-after-seconds"
            ]
            == 3600
        )
        assert not waits(changed, "/action-orders/", "post")
        assert documented(changed, "/dispatch-orders/{id}/", "put") is not None
        assert documented(changed, "/dispatch-orders/{id}/", "patch") is None
        # A view's own option stays its own.
        assert (
            documented(changed, "/dispatch-orders/", "post")[
                "x-idempotency-key-expires-after-seconds"
            ]
            == 120
        )
        assert (
            documented(changed, "/options-orders/", "post")[
                "x-idempotency-key-expires-after-seconds"
            ]
            == 60
        )
        # And the settings' next change is seen too.
        assert (
            documented(generate(), "/action-orders/", "post")[
                "x-idempotency-key-expires-after-seconds"
            ]
            == 86400
        )

    def test_required_and_atomic_follow_the_settings(self):
        with override_settings(IDEMPOTENCY={"REQUIRED": True, "ATOMIC": False}):
            changed = generate()

        assert documented(changed, "/action-orders/", "post")["required"] is True
        assert not waits(changed, "/action-orders/", "post")
        assert documented(changed, "/method-decorated/", "post")["required"] is True


class MiddlewareTests:
    """Under ``IdempotencyMiddleware`` every DRF operation in ``METHODS`` is protected."""

    @pytest.mark.parametrize(
        ("path", "method"),
        [
            ("/unprotected-orders/", "post"),
            ("/unprotected-orders/{id}/", "patch"),
            ("/unprotected-function/", "post"),
            ("/creating/", "post"),
            ("/creating/", "patch"),
            # What a view protects itself is left to it; the rest the middleware protects.
            ("/action-orders/{id}/", "patch"),
            ("/method-decorated/", "patch"),
        ],
    )
    def test_drf_operations_in_methods_are_protected_with_the_settings(
        self, middleware_schema, path, method
    ):
        parameter = documented(middleware_schema, path, method)

        assert parameter is not None
        assert parameter["required"] is False
        assert parameter["x-idempotency-key-expires-after-seconds"] == 86400
        assert waits(middleware_schema, path, method)
        assert error_media_types(middleware_schema, path, method) == {"application/json"}

    @pytest.mark.parametrize(
        ("path", "method"),
        [
            ("/unprotected-orders/", "get"),
            ("/unprotected-orders/{id}/", "put"),
            ("/unprotected-orders/{id}/", "delete"),
            ("/creating/", "put"),
            ("/exempt-view/", "post"),
            ("/exempt-dispatch/", "post"),
            ("/exempt-include/orders/", "post"),
            ("/admin-namespace/orders/", "post"),
            # The mixin protects POST, PUT and PATCH only, as its methods say.
            ("/put-orders/{id}/", "delete"),
        ],
    )
    def test_exempt_admin_and_other_methods_are_not(self, middleware_schema, path, method):
        assert documented(middleware_schema, path, method) is None

    def test_a_view_that_manages_its_transactions_is_in_lease_mode(self, middleware_schema):
        assert documented(middleware_schema, "/non-atomic/", "post") is not None
        assert not waits(middleware_schema, "/non-atomic/", "post")

    def test_a_decorated_dispatch_is_left_to_its_decorator(self, middleware_schema):
        # dispatch protects POST and PUT, its own methods; as for any view that
        # protects itself, the middleware adds nothing for PATCH.
        assert error_media_types(middleware_schema, "/dispatch-decorated/", "post") == {
            "application/problem+json"
        }
        assert documented(middleware_schema, "/dispatch-decorated/", "patch") is None

    def test_views_own_options_are_kept(self, middleware_schema):
        assert documented(middleware_schema, "/as-view-options/", "post")["required"] is True
        assert (
            documented(middleware_schema, "/documented/", "post")[
                "x-idempotency-key-expires-after-seconds"
            ]
            == 600
        )

    def test_methods_setting_widens_what_the_middleware_protects(self):
        with under_middleware(IDEMPOTENCY={"METHODS": ["POST", "PUT", "PATCH", "DELETE"]}):
            schema = generate(urlconf=None)

        assert documented(schema, "/unprotected-orders/{id}/", "put") is not None
        assert documented(schema, "/unprotected-orders/{id}/", "delete") is not None
        assert documented(schema, "/exempt-view/", "put") is None

    def test_disabled_documents_nothing(self):
        with under_middleware(IDEMPOTENCY={"ENABLED": False}):
            schema = generate(urlconf=None)

        assert documented(schema, "/unprotected-orders/", "post") is None
        assert documented(schema, "/orders/", "post") is None


def test_a_key_taken_from_the_request_documents_no_header() -> None:
    operation = generate("tests.openapi_key_urls")["paths"]["/deliveries/"]["post"]

    assert header_parameter(operation) is None
    responses = operation["responses"]
    assert {"400", "409", "422"} <= set(responses)
    assert "reads from the request" in responses["400"]["description"]
    assert HEADER not in responses["400"]["description"]


# The schema against the run time: every operation, sent with a key twice.

BODY = {"item": "book", "quantity": 2}
OTHER_BODY = {"item": "pen", "quantity": 3}


def operations(schema: dict[str, Any]) -> list[tuple[str, str]]:
    return [(path, method) for path, item in schema["paths"].items() for method in item]


def send(client: APIClient, method: str, url: str, key: str | None, body: Any = BODY) -> Any:
    headers = {} if key is None else {HEADER: key}
    if method in ("get", "delete"):
        return getattr(client, method)(url, headers=headers)
    return getattr(client, method)(url, body, format="json", headers=headers)


def check_against_the_run_time(schema: dict[str, Any]) -> None:
    """Every documented operation is protected as documented, and no other is.

    Protected: a retry with the key is a replay; the record expires after the
    documented TTL; without a key the request is refused exactly when the
    header is required; the key with another body gets 422 in the documented
    media type. Not protected: a retry runs again and nothing is recorded.
    """
    user = User.objects.create_user("reader")
    client = APIClient(raise_request_exception=False)
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    disagreements = []
    protected = 0
    for number, (path, method) in enumerate(operations(schema)):
        url = path.replace("{id}", str(Order.objects.create(item="existing").pk))
        key = f"key-{number}"
        parameter = header_parameter(schema["paths"][path][method])
        first = send(client, method, url, key)
        retry = send(client, method, url, key)
        replayed = retry.get(REPLAY) == "true"
        where = f"{method.upper()} {path} ({first.status_code})"
        if parameter is None:
            if replayed or IdempotencyKey.objects.filter(key=key).exists():
                disagreements.append(f"{where}: protected, but the schema says nothing")
            continue
        if not replayed:
            disagreements.append(f"{where}: documented, but a retry ran again")
            continue
        protected += 1
        record = IdempotencyKey.objects.get(key=key)
        ttl = (record.expires_at - record.created_at).total_seconds()
        documented_ttl = parameter["x-idempotency-key-expires-after-seconds"]
        if abs(ttl - documented_ttl) > 5:
            disagreements.append(f"{where}: documented TTL {documented_ttl}s, the record's {ttl}s")
        refused = send(client, method, url, None).status_code == 400
        if refused is not parameter["required"]:
            disagreements.append(f"{where}: required={parameter['required']}, refused={refused}")
        mismatch = send(client, method, url, key, OTHER_BODY)
        media_types = error_media_types(schema, path, method)
        if mismatch.status_code != 422 or mismatch["Content-Type"] not in media_types:
            disagreements.append(
                f"{where}: another body got {mismatch.status_code} "
                f"{mismatch['Content-Type']}, documented 422 {media_types}"
            )
    assert not disagreements, "\n".join(disagreements)
    assert protected >= 20  # so that agreeing on nothing cannot pass


@pytest.mark.urls(URLCONF)
@pytest.mark.django_db(transaction=True)
class SchemaAgainstRunTimeTests:
    @pytest.mark.parametrize(
        "idempotency",
        [{}, {"TTL": 3600, "METHODS": ["POST", "PUT", "PATCH"], "WAIT": 1}],
        ids=["defaults", "settings"],
    )
    def test_without_the_middleware(self, idempotency):
        with override_settings(IDEMPOTENCY=idempotency):
            check_against_the_run_time(generate(urlconf=None))

    @pytest.mark.parametrize(
        "idempotency",
        [{}, {"TTL": 3600, "METHODS": ["POST", "PUT", "PATCH"], "REQUIRED": True}],
        ids=["defaults", "settings"],
    )
    def test_under_the_middleware(self, idempotency):
        with under_middleware(IDEMPOTENCY=idempotency):
            check_against_the_run_time(generate(urlconf=None))


def project_exception_handler(exc, context):  # type: ignore[no-untyped-def]
    return exception_handler(exc, context)


@pytest.mark.skipif(
    os.environ.get("TEST_DATABASE", "sqlite") != "sqlite",
    reason="runs once, in the SQLite run: it needs no database",
)
def test_example_project_schema_is_valid_and_documents_bookings(tmp_path):
    out = tmp_path / "schema.json"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "example_project.settings",
        "EXAMPLE_SQLITE_PATH": str(tmp_path / "example.sqlite3"),
    }
    env.pop("DATABASE_URL", None)
    completed = subprocess.run(
        [
            sys.executable,
            "manage.py",
            "spectacular",
            "--format",
            "openapi-json",
            "--file",
            str(out),
            "--validate",
            "--fail-on-warn",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    document = json.loads(out.read_text())
    validate(document)

    paths = document["paths"]
    for path, method in [("/api/bookings/", "post"), ("/api/bookings/{id}/", "patch")]:
        operation = paths[path][method]
        assert header_parameter(operation)["required"] is False
        assert {"400", "409", "422"} <= set(operation["responses"])
        assert "Keys expire 24 hours" in header_parameter(operation)["description"]
    for path, method in [
        ("/api/bookings/", "get"),
        ("/api/bookings/{id}/", "get"),
        ("/api/bookings/{id}/", "put"),
        ("/api/bookings/{id}/", "delete"),
    ]:
        assert header_parameter(paths[path][method]) is None


def test_another_view_extension_for_a_protected_view_is_combined():
    from drf_spectacular.extensions import OpenApiViewExtension

    class SummaryExtension(OpenApiViewExtension):
        target_class = "tests.drf_views.OrderCreateView"

        def view_replacement(self):  # type: ignore[no-untyped-def]
            class Replacement(self.target):
                """Described by another extension."""

            return Replacement

    try:
        operation = generate()["paths"]["/generic/"]["post"]
    finally:
        OpenApiViewExtension._registry.remove(SummaryExtension)

    assert operation["description"] == "Described by another extension."
    assert header_parameter(operation) is not None
    assert "409" in operation["responses"]


def test_a_view_the_middleware_refuses_is_documented_without_the_key() -> None:
    # Every request with a key to it is refused (check E007): the schema still generates.
    with override_settings(MIDDLEWARE=[*settings.MIDDLEWARE, MIDDLEWARE]):
        document = generate(urlconf="tests.test_middleware")

    assert documented(document, "/drf-login-required/", "post") is None
    assert documented(document, "/drf-csrf-exempt-again/", "post") is not None
