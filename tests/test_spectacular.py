"""OpenAPI 3 schemas through drf-spectacular: protected operations, and only those, document it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.renderers import OpenApiJsonRenderer
from openapi_spec_validator import validate
from rest_framework.views import exception_handler

from tests import drf_views

ROOT = Path(__file__).resolve().parent.parent
HEADER = "Idempotency-Key"
REPLAY = "Idempotent-Replayed"

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


def generate(urlconf: str = "tests.openapi_urls") -> dict[str, Any]:
    schema = SchemaGenerator(urlconf=urlconf).get_schema(request=None, public=True)
    # Through the renderer, as served, so the validator sees plain JSON.
    document = json.loads(OpenApiJsonRenderer().render(schema, renderer_context={}))
    validate(document)
    return document


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return generate()


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
