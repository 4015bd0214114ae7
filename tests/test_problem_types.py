"""Problem ``type`` URIs and ``Link: rel="describedby"`` (PROBLEM_TYPE_BASE_URL)."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest
from django.test import override_settings

from django_idempotency import exceptions
from django_idempotency.checks import check_settings
from django_idempotency.models import IdempotencyKey
from tests.clients import drf_post, post, token_client
from tests.factories import IdempotencyKeyFactory

BASE = "https://api.example.com/problems/"
WITH_BASE = {"PROBLEM_TYPE_BASE_URL": BASE}
DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.mark.django_db
class PlainViewProblemTypeTests:
    def test_default_type_is_a_urn_without_link(self, client):
        post(client, "/orders/", item="a")
        response = post(client, "/orders/", item="b")

        assert response.status_code == 422
        assert response.json()["type"] == "urn:django-idempotency:problem:idempotency-key-reused"
        assert "Link" not in response

    @override_settings(IDEMPOTENCY=WITH_BASE)
    def test_base_url_makes_type_a_url_with_describedby_link(self, client):
        post(client, "/orders/", item="a")
        response = post(client, "/orders/", item="b")

        url = BASE + "idempotency-key-reused"
        assert response.json()["type"] == url
        assert response["Link"] == f'<{url}>; rel="describedby"'

    @pytest.mark.parametrize(
        "base, expected",
        [
            ("https://api.example.com/problems", "https://api.example.com/problems/"),
            ("https://api.example.com", "https://api.example.com/"),
            ("https://api.example.com/errors#", "https://api.example.com/errors#"),
            ("https://api.example.com/errors?problem=", "https://api.example.com/errors?problem="),
            ("https://api.example.com/errors#idem-", "https://api.example.com/errors#idem-"),
        ],
    )
    def test_each_type_is_under_the_base_url_however_it_ends(self, client, base, expected):
        post(client, "/orders/", item="a")
        with override_settings(IDEMPOTENCY={"PROBLEM_TYPE_BASE_URL": base}):
            response = post(client, "/orders/", item="b")

        assert response.json()["type"] == expected + "idempotency-key-reused"

    @override_settings(IDEMPOTENCY=WITH_BASE)
    def test_invalid_key_has_link_too(self, client):
        response = post(client, "/orders/", "", item="a")

        assert response.status_code == 400
        assert response.json()["type"] == BASE + "invalid-idempotency-key"
        assert response["Link"] == f'<{BASE}invalid-idempotency-key>; rel="describedby"'

    @override_settings(IDEMPOTENCY=WITH_BASE)
    def test_conflict_keeps_retry_after_beside_link(self, client):
        post(client, "/orders/", item="a")
        record = IdempotencyKey.objects.get()
        record.delete()
        IdempotencyKeyFactory(key="k", in_flight=True, fingerprint=record.fingerprint)

        response = post(client, "/orders/", item="a")

        assert response.status_code == 409
        assert int(response["Retry-After"]) >= 1
        assert response["Link"] == f'<{BASE}request-in-flight>; rel="describedby"'


@pytest.mark.django_db
class DrfProblemLinkTests:
    @pytest.fixture
    def api(self):
        return token_client("alice")[0]

    @pytest.mark.parametrize("url", ["/drf/orders/", "/api/orders/"])
    @override_settings(IDEMPOTENCY=WITH_BASE)
    def test_drf_error_keeps_its_body_and_gains_link(self, api, url):
        drf_post(api, url, {"item": "a"}, "k")
        response = drf_post(api, url, {"item": "b"}, "k")

        assert response.status_code == 422
        assert set(response.json()) == {"detail"}
        assert response["Link"] == f'<{BASE}idempotency-key-reused>; rel="describedby"'

    def test_drf_error_without_base_url_has_no_link(self, api):
        drf_post(api, "/drf/orders/", {"item": "a"}, "k")
        response = drf_post(api, "/drf/orders/", {"item": "b"}, "k")

        assert response.status_code == 422
        assert "Link" not in response


class ProblemTypeBaseUrlCheckTests:
    @pytest.mark.parametrize("value", [None, BASE, "http://localhost:8000/errors#"])
    def test_valid_values_pass(self, value):
        with override_settings(IDEMPOTENCY={"PROBLEM_TYPE_BASE_URL": value}):
            assert check_settings() == []

    @pytest.mark.parametrize("value", ["problems/", "ftp://example.com/", "https://", 5, b"x"])
    def test_invalid_values_are_e119_naming_the_key(self, value):
        with override_settings(IDEMPOTENCY={"PROBLEM_TYPE_BASE_URL": value}):
            errors = check_settings()
        assert [error.id for error in errors] == ["django_idempotency.E119"]
        assert "'PROBLEM_TYPE_BASE_URL'" in errors[0].msg


def http_problem_classes() -> list[type[exceptions.IdempotencyError]]:
    """Every concrete error of the module that is not raised to a function's or task's caller."""
    return [
        cls
        for cls in vars(exceptions).values()
        if isinstance(cls, type)
        and issubclass(cls, exceptions.IdempotencyError)
        and cls not in (exceptions.IdempotencyError, exceptions.InFlight)
        and not issubclass(cls, exceptions.CALL_ERRORS)
    ]


def test_every_error_a_view_answers_with_is_a_problem_type():
    assert set(http_problem_classes()) == set(exceptions.PROBLEM_TYPES)


class DocumentedProblemTypesTests:
    """The docs list every problem type a view answers with, from the code itself."""

    generated = DOCS / "_generated" / "problem_types.rst"

    def documented_names(self) -> list[str]:
        return re.findall(r"^   \* - ``([a-z-]+)``$", self.generated.read_text(), re.MULTILINE)

    def test_docs_list_the_code_of_every_exception_class_a_view_answers_with(self):
        codes = [cls.code.replace("_", "-") for cls in exceptions.PROBLEM_TYPES]

        assert self.documented_names() == codes
        assert "database-busy" in codes

    @override_settings(IDEMPOTENCY=WITH_BASE)
    def test_each_documented_name_is_a_url_under_the_base(self):
        urls = {cls().type_uri for cls in http_problem_classes()}

        assert urls == {BASE + name for name in self.documented_names()}

    def test_generated_list_is_what_the_docs_build_writes(self):
        build = runpy.run_path(str(DOCS / "conf.py"))

        assert self.generated.read_text() == build["problem_types_rst"](), (
            "docs/_generated/problem_types.rst is stale: run python3 dev.py docs"
        )

    @pytest.mark.parametrize("page", ["http.rst", "settings.rst"])
    def test_pages_under_problem_type_base_url_include_the_list_and_count_nothing(self, page):
        text = (DOCS / page).read_text()

        assert ".. include:: _generated/problem_types.rst" in text
        numbers = "one|two|three|four|five|six|seven|eight|nine|ten"
        assert not re.search(rf"\b({numbers}|\d+) (URLs|problem types)\b", text)
