"""Browsers (SPEC 9): the key from a form field, a guest's session scope, answers as pages.

Over HTTP through the test client, on the real database, for every adapter
a browser form reaches: ``@idempotent`` (sync and async), the DRF mixin
(form and multipart parsers) and the middleware. The real browser is in
``tests/test_browser_clicks.py``.
"""

from __future__ import annotations

import hashlib
import re
import sys
import uuid
from typing import Any
from urllib.parse import urlencode

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth.models import User
from django.contrib.sessions.backends.db import SessionStore
from django.core.exceptions import ImproperlyConfigured
from django.core.files.uploadedfile import SimpleUploadedFile
from django.template import Context, Template
from django.test import AsyncClient, Client, RequestFactory, override_settings
from django.test.client import encode_multipart
from django.views.debug import ExceptionReporter

from django_idempotency import idempotent
from django_idempotency.body import close_spools_with
from django_idempotency.exceptions import FingerprintMismatch, RequestAbandoned, RequestInFlight
from django_idempotency.fingerprint import request_fingerprint
from django_idempotency.forms import form_key
from django_idempotency.info import IdempotencyInfo
from django_idempotency.models import IdempotencyKey
from django_idempotency.responses import problem
from django_idempotency.scopes import user_scope
from tests.browser_views import GATE_ENV
from tests.models import Order
from tests.polling import in_background, wait_until

pytestmark = [pytest.mark.django_db, pytest.mark.urls("tests.browser_urls")]

BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
MIDDLEWARE = "django_idempotency.middleware.IdempotencyMiddleware"
KEY_FIELD = re.compile(r'<input type="hidden" name="idempotency_key" value="([^"]+)">')


def rendered_key(client: Client, url: str) -> str:
    """GET the form, as a browser does first (it starts the guest's session); its key."""
    page = client.get(url)
    assert page.status_code == 200
    match = KEY_FIELD.search(page.content.decode())
    assert match is not None, page.content
    return match.group(1)


def submit(client: Client, url: str, key: str | None, item: str = "book", **extra: Any) -> Any:
    """POST the form as a browser sends it: form-encoded, a fresh CSRF mask, HTML preferred."""
    data = {"csrfmiddlewaretoken": uuid.uuid4().hex, "item": item}
    if key is not None:
        data["idempotency_key"] = key
    return client.post(url, data, headers={"Accept": BROWSER_ACCEPT}, **extra)


def records() -> list[tuple[str, str]]:
    return list(IdempotencyKey.objects.order_by("pk").values_list("scope", "key"))


class TemplateTagTests:
    def test_field_renders_a_fresh_key_at_every_render(self):
        template = Template("{% load idempotency %}{% idempotency_key_field %}")

        first, second = (template.render(Context()) for _ in range(2))

        assert KEY_FIELD.fullmatch(first) and KEY_FIELD.fullmatch(second)
        assert first != second

    def test_field_is_named_by_the_form_field_setting(self):
        with override_settings(IDEMPOTENCY={"FORM_FIELD": "order_key"}):
            html = Template("{% load idempotency %}{% idempotency_key_field %}").render(Context())

        assert re.fullmatch(r'<input type="hidden" name="order_key" value="[0-9a-f-]{36}">', html)

    def test_key_alone_is_a_uuid(self):
        template = Template("{% load idempotency %}{% idempotency_key %}")

        keys = {template.render(Context()) for _ in range(2)}

        assert len(keys) == 2
        assert all(uuid.UUID(key).version == 4 for key in keys)

    def test_field_without_a_form_field_setting_names_the_fix(self):
        template = Template("{% load idempotency %}{% idempotency_key_field %}")
        with (
            override_settings(IDEMPOTENCY={"FORM_FIELD": None}),
            pytest.raises(ImproperlyConfigured, match="FORM_FIELD"),
        ):
            template.render(Context())


ADAPTERS = ["/browser/checkout/", "/browser/async/"]


class FormKeyTests:
    @pytest.mark.parametrize("url", ADAPTERS)
    def test_double_submit_replays_the_redirect(self, client, url):
        key = rendered_key(client, url)

        first = submit(client, url, key)
        second = submit(client, url, key)  # another CSRF mask: still the same submission

        assert first.status_code == 302
        assert second.status_code == 302
        assert second["Location"] == first["Location"]
        assert second["Idempotent-Replayed"] == "true"
        assert "Idempotent-Replayed" not in first
        assert Order.objects.count() == 1
        assert [k for _, k in records()] == [key]

    def test_header_wins_over_the_field(self, client):
        rendered_key(client, "/browser/checkout/")

        response = submit(
            client, "/browser/checkout/", "field-key", HTTP_IDEMPOTENCY_KEY="header-key"
        )
        again = submit(
            client, "/browser/checkout/", "other-field-key", HTTP_IDEMPOTENCY_KEY="header-key"
        )

        assert response.status_code == 302
        assert again["Idempotent-Replayed"] == "true"
        assert [k for _, k in records()] == ["header-key"]

    def test_field_satisfies_required(self, client):
        key = rendered_key(client, "/browser/required/")

        response = submit(client, "/browser/required/", key)

        assert response.status_code == 302
        assert Order.objects.count() == 1

    def test_form_without_the_field_under_required_is_a_page_naming_the_tag(self, client):
        rendered_key(client, "/browser/required/")

        response = submit(client, "/browser/required/", None)

        assert response.status_code == 400
        assert response["Content-Type"] == "text/html; charset=utf-8"
        assert Order.objects.count() == 0
        api = client.post("/browser/required/", {"item": "book"})
        assert api.status_code == 400
        assert api["Content-Type"] == "application/problem+json"
        assert "{% idempotency_key_field %}" in api.json()["detail"]

    def test_field_follows_the_key_rules(self, client):
        rendered_key(client, "/browser/checkout/")

        response = client.post("/browser/checkout/", {"item": "book", "idempotency_key": "a b"})
        twice = client.post(
            "/browser/checkout/",
            "item=book&idempotency_key=k1&idempotency_key=k2",
            content_type="application/x-www-form-urlencoded",
        )

        assert response.status_code == 400
        assert "visible ASCII" in response.json()["detail"]
        assert twice.status_code == 400
        assert "2 times" in twice.json()["detail"]
        assert Order.objects.count() == 0

    def test_a_form_without_a_key_is_not_protected(self, client):
        rendered_key(client, "/browser/checkout/")

        submit(client, "/browser/checkout/", None)
        submit(client, "/browser/checkout/", None)

        assert Order.objects.count() == 2
        assert records() == []

    def test_a_form_field_setting_of_none_reads_the_header_only(self, client):
        rendered_key(client, "/browser/checkout/")
        with override_settings(IDEMPOTENCY={"FORM_FIELD": None}):
            submit(client, "/browser/checkout/", "k-1")
            submit(client, "/browser/checkout/", "k-1")

        assert Order.objects.count() == 2
        assert records() == []

    def test_a_re_rendered_form_carries_a_new_key(self, client):
        key = rendered_key(client, "/browser/checkout/")

        invalid = submit(client, "/browser/checkout/", key, item="")
        new_key = KEY_FIELD.search(invalid.content.decode()).group(1)
        corrected = submit(client, "/browser/checkout/", new_key)

        assert invalid.status_code == 200 and b"Choose an item." in invalid.content
        assert new_key != key
        assert corrected.status_code == 302
        assert Order.objects.count() == 1

    def test_the_old_key_with_new_contents_is_a_422_page_for_a_browser(self, client):
        key = rendered_key(client, "/browser/checkout/")
        submit(client, "/browser/checkout/", key, item="")

        page = submit(client, "/browser/checkout/", key, item="book")
        api = client.post(
            "/browser/checkout/",
            {"item": "book", "idempotency_key": key},
            headers={"Accept": "application/json"},
        )

        assert page.status_code == 422
        assert page["Content-Type"] == "text/html; charset=utf-8"
        assert b"This form was already submitted" in page.content
        assert b"Reload the form" in page.content or b"Go back" in page.content
        assert api.status_code == 422
        assert api["Content-Type"] == "application/problem+json"
        assert api.json()["status"] == 422
        assert Order.objects.count() == 0

    def test_multipart_with_a_file_upload(self, client):
        key = rendered_key(client, "/browser/checkout/?upload=1")
        content = b"receipt " * 10_000
        for _ in range(2):
            upload = SimpleUploadedFile("receipt.txt", content, "text/plain")
            data = {"item": "book", "idempotency_key": key, "receipt": upload}
            data["csrfmiddlewaretoken"] = uuid.uuid4().hex
            response = client.post("/browser/checkout/", data)
            assert response.status_code == 302

        assert response["Idempotent-Replayed"] == "true"
        # The view read the whole file, after the key and the fingerprint did.
        assert list(Order.objects.values_list("item", flat=True)) == [
            f"book|receipt.txt|{len(content)}"
        ]
        assert [k for _, k in records()] == [key]

    def test_another_file_under_the_same_key_is_422(self, client):
        key = rendered_key(client, "/browser/checkout/?upload=1")
        for content, status in ((b"one", 302), (b"two", 422)):
            upload = SimpleUploadedFile("receipt.txt", content, "text/plain")
            response = client.post(
                "/browser/checkout/", {"item": "book", "idempotency_key": key, "receipt": upload}
            )
            assert response.status_code == status

    def test_a_json_request_with_a_header_never_reads_the_body_for_a_key(self):
        from django_idempotency.core import sent_key

        request = RequestFactory().post(
            "/", "{}", content_type="application/json", headers={"Idempotency-Key": "k"}
        )
        json_without_header = RequestFactory().post("/", "{}", content_type="application/json")

        assert sent_key(request) == "k"
        assert sent_key(json_without_header) is None
        assert not request._read_started and not json_without_header._read_started


class CsrfReadTheBodyFirstTests:
    """Django's CSRF check reads ``request.POST`` before the view: the key is still found."""

    @pytest.fixture(autouse=True)
    def csrf(self, settings):
        settings.MIDDLEWARE = [*settings.MIDDLEWARE, "django.middleware.csrf.CsrfViewMiddleware"]

    @pytest.mark.parametrize("upload", [False, True], ids=["form", "multipart"])
    def test_the_key_and_the_file_after_the_csrf_check(self, upload):
        client = Client(enforce_csrf_checks=True)
        page = client.get("/browser/checkout/?upload=1").content.decode()
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
        key = KEY_FIELD.search(page).group(1)
        answers = []
        for _ in range(2):
            data: dict[str, Any] = {"item": "book", "idempotency_key": key}
            data["csrfmiddlewaretoken"] = token
            if upload:
                data["receipt"] = SimpleUploadedFile("r.txt", b"paid", "text/plain")
                answers.append(client.post("/browser/checkout/", data))
            else:
                answers.append(
                    client.post(
                        "/browser/checkout/",
                        urlencode(data),
                        content_type="application/x-www-form-urlencoded",
                    )
                )

        assert [a.status_code for a in answers] == [302, 302]
        assert answers[1]["Idempotent-Replayed"] == "true"
        expected = "book|r.txt|4" if upload else "book"
        assert list(Order.objects.values_list("item", flat=True)) == [expected]
        assert [k for _, k in records()] == [key]


class DrfFormTests:
    @pytest.mark.parametrize("multipart", [False, True], ids=["form", "multipart"])
    def test_mixin_reads_the_field_and_replays(self, client, multipart):
        key = rendered_key(client, "/browser/checkout/")
        data: dict[str, Any] = {"item": "book", "idempotency_key": key}
        answers = []
        for _ in range(2):
            data["csrfmiddlewaretoken"] = uuid.uuid4().hex
            if multipart:
                data["receipt"] = SimpleUploadedFile("r.txt", b"paid", "text/plain")
                answers.append(client.post("/browser/api/", data))
            else:
                answers.append(
                    client.post(
                        "/browser/api/",
                        "&".join(f"{k}={v}" for k, v in data.items()),
                        content_type="application/x-www-form-urlencoded",
                    )
                )

        assert [a.status_code for a in answers] == [201, 201]
        assert answers[1]["Idempotent-Replayed"] == "true"
        assert answers[1].content == answers[0].content
        expected = "book|r.txt|4" if multipart else "book"
        assert list(Order.objects.values_list("item", flat=True)) == [expected]
        assert [k for _, k in records()] == [key]

    def test_a_dispatch_that_answers_first_keeps_its_answer_for_a_bad_form(self, client, caplog):
        response = client.post(
            "/browser/closed-api/",
            "item=book&idempotency_key=k1&idempotency_key=k2",
            content_type="application/x-www-form-urlencoded",
        )

        assert response.status_code == 503 and response.content == b"closed"
        assert "protected nothing" in caplog.text

    def test_mixin_answers_a_browser_through_drf(self, client):
        """DRF views keep DRF's exception handling, for a browser too (docs/browsers.rst)."""
        key = rendered_key(client, "/browser/checkout/")
        client.post("/browser/api/", {"item": "book", "idempotency_key": key})

        other = client.post(
            "/browser/api/",
            {"item": "pen", "idempotency_key": key},
            headers={"Accept": "application/json"},
        )

        assert other.status_code == 422
        assert other["Content-Type"] == "application/json"
        browser = client.post(
            "/browser/api/",
            {"item": "pen", "idempotency_key": key},
            headers={"Accept": BROWSER_ACCEPT},
        )
        assert browser.status_code == 422
        # DRF's browsable API renders it, as it renders any error of the view.
        assert browser["Content-Type"] == "text/html; charset=utf-8"
        assert b"Django REST framework" in browser.content


class MiddlewareFormTests:
    @pytest.fixture(autouse=True)
    def middleware(self, settings):
        settings.MIDDLEWARE = [*settings.MIDDLEWARE, MIDDLEWARE]

    def test_middleware_reads_the_field_and_replays_the_redirect(self, client):
        key = rendered_key(client, "/browser/plain/")

        first = submit(client, "/browser/plain/", key)
        second = submit(client, "/browser/plain/", key)

        assert first.status_code == second.status_code == 302
        assert second["Location"] == first["Location"]
        assert second["Idempotent-Replayed"] == "true"
        assert Order.objects.count() == 1

    def test_required_middleware_leaves_forms_without_the_tag_to_a_readable_400(
        self, client, settings
    ):
        settings.IDEMPOTENCY = {"REQUIRED": True}
        rendered_key(client, "/browser/plain/")

        response = submit(client, "/browser/plain/", None)

        assert response.status_code == 400
        assert response["Content-Type"] == "text/html; charset=utf-8"
        assert Order.objects.count() == 0

    def test_a_field_sent_twice_is_a_400_page_not_an_error(self, client):
        rendered_key(client, "/browser/plain/")

        response = client.post(
            "/browser/plain/",
            "item=book&idempotency_key=k1&idempotency_key=k2",
            content_type="application/x-www-form-urlencoded",
            headers={"Accept": BROWSER_ACCEPT},
        )

        assert response.status_code == 400
        assert response["Content-Type"] == "text/html; charset=utf-8"
        assert Order.objects.count() == 0

    def test_middleware_422_is_a_page_for_a_browser(self, client):
        key = rendered_key(client, "/browser/plain/")
        submit(client, "/browser/plain/", key)

        page = submit(client, "/browser/plain/", key, item="pen")

        assert page.status_code == 422
        assert b"already submitted" in page.content


class SessionScopeTests:
    def test_two_sessions_sending_one_key_are_two_records(self):
        alice, bob = Client(), Client()
        key = rendered_key(alice, "/browser/checkout/")
        rendered_key(bob, "/browser/checkout/")

        first = submit(alice, "/browser/checkout/", key)
        other = submit(bob, "/browser/checkout/", key)

        assert "Idempotent-Replayed" not in other
        assert first["Location"] != other["Location"]
        assert Order.objects.count() == 2
        scopes = [scope for scope, _ in records()]
        assert len(set(scopes)) == 2 and all(s.startswith("session:") for s in scopes)
        for browser in (alice, bob):
            session_key = browser.cookies["sessionid"].value
            assert not any(session_key in scope for scope in scopes)

    def test_a_guest_who_logs_in_before_submitting_is_scoped_by_the_user(self, client):
        """Render as a guest, log in (the session key rotates), submit: the user's scope."""
        key = rendered_key(client, "/browser/checkout/")
        guest_session = client.cookies["sessionid"].value
        user = User.objects.create_user("shopper")
        client.force_login(user)
        assert client.cookies["sessionid"].value != guest_session

        first = submit(client, "/browser/checkout/", key)
        second = submit(client, "/browser/checkout/", key)

        assert first.status_code == 302 and "Idempotent-Replayed" not in first
        assert second["Idempotent-Replayed"] == "true"
        assert records() == [(f"user:{user.pk}", key)]

    def test_a_guest_who_logs_in_between_two_submits_is_a_new_scope(self, client):
        """The retry comes from another caller now: never given the guest's response."""
        key = rendered_key(client, "/browser/checkout/")
        submit(client, "/browser/checkout/", key)
        client.force_login(User.objects.create_user("shopper"))

        again = submit(client, "/browser/checkout/", key)

        assert "Idempotent-Replayed" not in again
        assert Order.objects.count() == 2
        assert [scope.split(":")[0] for scope, _ in records()] == ["session", "user"]

    @pytest.mark.parametrize("url", ["/browser/signing-up/", "/browser/signing-up-lease/"])
    def test_a_retry_with_the_cookie_a_login_rotated_is_replayed(self, client, url):
        """The view logs the guest in: the browser that never got its answer resends."""
        key = rendered_key(client, url)
        sent_cookie = client.cookies["sessionid"].value

        first = submit(client, url, key)
        assert not SessionStore().exists(sent_cookie)  # login() rotated it away
        retry = Client()
        retry.cookies["sessionid"] = sent_cookie
        again = submit(retry, url, key)

        assert first.status_code == again.status_code == 302
        assert again["Idempotent-Replayed"] == "true"
        assert again["Location"] == first["Location"]
        assert Order.objects.count() == 1
        assert User.objects.count() == 1

    def test_a_session_cookie_the_store_does_not_know_is_a_scope_of_its_own(self):
        # As sent: a login, an expiry or an eviction between a double click's two POSTs
        # must not split them into two scopes.
        request = RequestFactory().post("/")
        request.COOKIES["sessionid"] = "made-up-session-key-000000000000"
        request.session = SessionStore("made-up-session-key-000000000000")
        request.user = type("Anonymous", (), {"is_authenticated": False})()

        scope = user_scope(request)

        assert scope == "session:" + hashlib.sha256(b"made-up-session-key-000000000000").hexdigest()


class FingerprintTests:
    def fingerprint(self, body: str, content_type: str = "application/x-www-form-urlencoded"):
        request = RequestFactory().post("/", body, content_type=content_type)
        try:
            return request_fingerprint(request)
        finally:
            close_spools_with(request, None)

    def test_csrf_token_and_key_field_are_left_out(self):
        assert self.fingerprint("item=book&csrfmiddlewaretoken=a&idempotency_key=k1") == (
            self.fingerprint("idempotency_key=k2&item=book&csrfmiddlewaretoken=b")
        )
        assert self.fingerprint("item=book") != self.fingerprint("item=pen&csrfmiddlewaretoken=a")

    def test_left_out_in_multipart_too(self):
        def multipart(token: str) -> str:
            fields = {"item": "book", "csrfmiddlewaretoken": token, "idempotency_key": token}
            return self.fingerprint(
                encode_multipart("BoUnDaRy", fields).decode(),
                "multipart/form-data; boundary=BoUnDaRy",
            )

        assert multipart("a") == multipart("b")

    def test_the_key_field_of_a_json_body_counts(self):
        json = "application/json"
        assert self.fingerprint('{"idempotency_key": "a"}', json) != self.fingerprint(
            '{"idempotency_key": "b"}', json
        )


class ProblemPageTests:
    def browser_request(self, referer: str = "http://testserver/checkout/"):
        return RequestFactory().post(
            "/checkout/",
            "item=book&idempotency_key=k",
            content_type="application/x-www-form-urlencoded",
            headers={"Accept": BROWSER_ACCEPT, "Referer": referer},
        )

    @pytest.mark.parametrize(
        ("accept", "html"),
        [
            (BROWSER_ACCEPT, True),
            ("text/html", True),
            ("application/json", False),
            ("*/*", False),
            ("", False),
            ("application/json, text/html;q=0.9", False),
            ("text/html;q=0.5, application/json", False),
            # text/* names text/html too, without the word.
            ("text/*, application/json;q=0.5", True),
            ("application/json, text/*;q=0.5", False),
            # The most specific range decides each type's quality.
            ("text/html;q=0.2, text/*, application/json;q=0.5", False),
            ("*/*;q=0.1, text/html;q=0.5", True),
            ("TEXT/HTML, application/json;q=0.9", True),
            # A tie keeps JSON, whatever the order.
            ("text/html, application/json", False),
            ("text/html;q=0.5, */*;q=0.5", False),
        ],
    )
    def test_accept_decides_page_or_problem_details(self, accept, html):
        request = RequestFactory().post("/", HTTP_ACCEPT=accept)

        response = problem(FingerprintMismatch(), request)

        assert response.status_code == 422
        expected = "text/html; charset=utf-8" if html else "application/problem+json"
        assert response["Content-Type"] == expected

    @pytest.mark.parametrize(
        "accept",
        [
            # text/html and JSON at the same quality, whatever the order or the ranges.
            "text/*, application/*",
            "application/*, text/*",
            "text/*, */*",
            # text/html refused outright; text/* does not take it back.
            "text/html;q=0, text/*",
            # A quality above 1 is not a qvalue (RFC 9110, 12.4.2): it counts as 1.
            "application/json, text/html;q=1.0001",
            "application/json, text/html;q=2",
            "application/json, text/html;q=inf",
            # A comma inside a quoted parameter value does not end the range.
            'text/html;foo="a,b";q=0.1, application/json;q=0.5',
        ],
    )
    def test_html_not_ranked_above_json_keeps_problem_details(self, accept):
        request = RequestFactory().post("/", HTTP_ACCEPT=accept)

        response = problem(FingerprintMismatch(), request)

        assert response["Content-Type"] == "application/problem+json"

    def test_409_page_keeps_retry_after_and_resends_the_same_submission(self):
        response = problem(RequestInFlight(retry_after=2), self.browser_request())

        assert response.status_code == 409
        assert response["Retry-After"] == "2"
        html = response.content.decode()
        assert '<form method="post" action="/checkout/"' in html
        assert '<input type="hidden" name="idempotency_key" value="k">' in html
        assert "2 * 1000" in html

    def test_409_page_resends_sooner_than_a_lease_runs_out(self):
        response = problem(RequestInFlight(retry_after=290), self.browser_request())

        assert response["Retry-After"] == "290"
        assert "2 * 1000" in response.content.decode()

    def test_a_held_key_page_sends_nothing_again(self):
        # recovery.hold's 409: nothing changes until an operator acts, and each resend would
        # ask the policy again.
        response = problem(RequestAbandoned(retry_after=60), self.browser_request())

        assert response.status_code == 409
        assert response["Retry-After"] == "60"
        html = response.content.decode()
        assert "waiting for our staff" in html
        assert "setTimeout" not in html
        # The same submission, by hand: a form reloaded would carry a new key.
        assert '<input type="hidden" name="idempotency_key" value="k">' in html
        assert "Check again now" in html
        assert 'href="http://testserver/checkout/"' not in html
        assert "history.back()" not in html

    def test_422_page_offers_the_form_again(self):
        html = problem(FingerprintMismatch(), self.browser_request()).content.decode()

        assert 'href="http://testserver/checkout/"' in html
        assert "idempotency-resend" not in html

    def test_a_referer_of_another_site_is_not_offered(self):
        request = self.browser_request(referer="https://evil.example/")

        html = problem(FingerprintMismatch(), request).content.decode()

        assert "evil.example" not in html

    def test_the_project_overrides_the_template(self, settings, tmp_path):
        (tmp_path / "django_idempotency").mkdir()
        (tmp_path / "django_idempotency" / "problem.html").write_text(
            "custom {{ problem.status }} {{ problem.title }} {{ problem.type }}"
        )
        settings.TEMPLATES = [{**settings.TEMPLATES[0], "DIRS": [str(tmp_path)]}]

        response = problem(FingerprintMismatch(), self.browser_request())

        assert response.content.decode().startswith("custom 422 ")

    def test_without_a_template_engine_the_shipped_page_is_used(self, settings):
        settings.TEMPLATES = []

        response = problem(FingerprintMismatch(), self.browser_request())

        assert b"This form was already submitted" in response.content


class FormKeyEdgeTests:
    """Bodies the key cannot be read from: no key, and the view answers as without us."""

    def form_request(self, body: bytes, content_type: str = "application/x-www-form-urlencoded"):
        return RequestFactory().post("/", body, content_type=content_type)

    def test_a_form_past_the_upload_limit_has_no_key(self, settings):
        settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10
        request = self.form_request(b"idempotency_key=k1&item=" + b"x" * 20)
        try:
            assert form_key(request, "idempotency_key") is None
        finally:
            close_spools_with(request, None)

    def test_a_form_that_is_not_utf8_has_no_key(self):
        request = self.form_request(b"idempotency_key=\xff")
        try:
            assert form_key(request, "idempotency_key") is None
        finally:
            close_spools_with(request, None)

    def test_a_malformed_multipart_body_has_no_key(self):
        request = self.form_request(b"--x\r\nnot a part", "multipart/form-data; boundary=y")
        try:
            assert form_key(request, "idempotency_key") is None
        finally:
            close_spools_with(request, None)

    def test_a_body_read_and_not_kept_has_no_key(self):
        request = self.form_request(b"idempotency_key=k1")
        request.read()  # read raw by the project's own code, before any parser

        assert form_key(request, "idempotency_key") is None

    def test_a_body_drf_parsed_first_gives_its_key(self):
        from rest_framework.parsers import FormParser
        from rest_framework.request import Request

        request = Request(self.form_request(b"idempotency_key=k1&item=book"), [FormParser()])
        assert request.data["item"] == "book"  # a permission read it before the mixin

        assert form_key(request, "idempotency_key") == "k1"

    def test_a_custom_parser_s_dict_gives_its_key(self):
        from rest_framework.request import Request

        request = Request(self.form_request(b"ignored"))
        request._request._read_started = True
        request._full_data = {"idempotency_key": "k1"}

        assert form_key(request, "idempotency_key") == "k1"


class ResendTests:
    def test_only_a_form_post_without_files_is_resent(self):
        factory = RequestFactory(headers={"Accept": BROWSER_ACCEPT})
        json_body = factory.post("/", "{}", content_type="application/json")
        upload = factory.post(
            "/", {"item": "book", "receipt": SimpleUploadedFile("r.txt", b"x", "text/plain")}
        )
        too_big = factory.post("/", {"item": "book"})

        in_flight = RequestInFlight(retry_after=1)
        pages = [problem(in_flight, json_body), problem(in_flight, upload)]
        with override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1):
            pages.append(problem(in_flight, too_big))

        for page in pages:
            assert page.status_code == 409
            assert "idempotency-resend" not in page.content.decode()


class ProblemPageSafetyTests:
    """The page is escaped whatever the project's settings, and rendered off the event loop."""

    def test_a_multipart_form_without_files_is_not_resent(self):
        request = RequestFactory(headers={"Accept": BROWSER_ACCEPT}).post(
            "/", {"item": "book", "idempotency_key": "k"}
        )

        page = problem(RequestInFlight(retry_after=1), request)

        assert request.content_type == "multipart/form-data"
        assert "idempotency-resend" not in page.content.decode()

    def test_the_shipped_page_escapes_with_autoescape_off(self, settings):
        engine = settings.TEMPLATES[0]
        settings.TEMPLATES = [
            {**engine, "OPTIONS": {**engine.get("OPTIONS", {}), "autoescape": False}}
        ]
        request = RequestFactory(headers={"Accept": BROWSER_ACCEPT}).post(
            "/",
            "item=<script>x</script>&idempotency_key=k",
            content_type="application/x-www-form-urlencoded",
        )

        html = problem(RequestInFlight(retry_after=1), request).content.decode()

        assert "<script>x</script>" not in html
        assert "&lt;script&gt;x&lt;/script&gt;" in html

    @pytest.mark.django_db(transaction=True)
    def test_an_async_views_page_may_query_the_database(self, settings, tmp_path):
        # A project's page shows the user, as base templates do: the session
        # and the user load from the database while the page renders.
        (tmp_path / "django_idempotency").mkdir()
        (tmp_path / "django_idempotency" / "problem.html").write_text(
            "{% if user.is_authenticated %}in{% else %}out{% endif %} {{ problem.status }}"
        )
        engine = settings.TEMPLATES[0]
        processors = [
            *engine.get("OPTIONS", {}).get("context_processors", []),
            "django.contrib.auth.context_processors.auth",
        ]
        settings.TEMPLATES = [
            {
                **engine,
                "DIRS": [str(tmp_path)],
                "OPTIONS": {**engine.get("OPTIONS", {}), "context_processors": processors},
            }
        ]
        client = AsyncClient(raise_request_exception=False)
        session = SessionStore()
        session["shop"] = "guest"
        session.save()
        client.cookies[settings.SESSION_COOKIE_NAME] = session.session_key

        response = async_to_sync(client.post)(
            "/browser/async/",
            "item=book&idempotency_key=bad%20key",
            content_type="application/x-www-form-urlencoded",
            headers={"Accept": BROWSER_ACCEPT},
        )

        assert response.status_code == 400
        assert response.content.decode() == "out 400"


FORM = "application/x-www-form-urlencoded"
HIDDEN = re.compile(r'<input type="hidden" name="([^"]*)" value="([^"]*)">')


def resent_fields(page: Any) -> list[tuple[str, str]]:
    """The fields a 409 page's form sends again; none when it has no such form."""
    html = page.content.decode()
    if 'id="idempotency-resend"' not in html:
        return []
    return HIDDEN.findall(html[html.index('id="idempotency-resend"') :])


class ResendUnderItsKeyTests:
    """A 409 page sends the submission again under the key it was sent with, wherever it was."""

    @pytest.mark.django_db(transaction=True)
    def test_a_key_sent_in_the_header_is_resent_in_the_field(self, monkeypatch, tmp_path, settings):
        # htmx with hx-headers (the key, and its CSRF token), asking for the page, as
        # docs/browsers.rst shows: a form sends no header, so the resend carries the key in
        # the field and a CSRF token of its own. Without the key it would run again.
        settings.MIDDLEWARE = [*settings.MIDDLEWARE, "django.middleware.csrf.CsrfViewMiddleware"]
        gate = tmp_path / "gate"
        monkeypatch.setenv(GATE_ENV, str(gate))
        browser = Client(enforce_csrf_checks=True)
        assert browser.get("/browser/slow-lease/").status_code == 200  # session, CSRF cookie
        headers = {
            "Idempotency-Key": "htmx-key-1",
            "Accept": BROWSER_ACCEPT,
            "X-CSRFToken": browser.cookies["csrftoken"].value,
        }

        def send() -> Any:
            tab = Client(enforce_csrf_checks=True)  # the same browser, from another thread
            for name, morsel in browser.cookies.items():
                tab.cookies[name] = morsel.value
            return tab.post(
                "/browser/slow-lease/", urlencode({"item": "book"}), FORM, headers=headers
            )

        join = in_background(send)
        try:
            wait_until(
                lambda: IdempotencyKey.objects.filter(key="htmx-key-1").exists(),
                "the first request's claim",
            )
            page = send()
        finally:
            gate.touch()
        first = join()
        fields = resent_fields(page)

        assert page.status_code == 409
        assert ("idempotency_key", "htmx-key-1") in fields
        assert [name for name, _ in fields].count("csrfmiddlewaretoken") == 1
        resent = browser.post(
            "/browser/slow-lease/", urlencode(fields), FORM, headers={"Accept": BROWSER_ACCEPT}
        )
        assert resent.status_code == 302
        assert resent["Idempotent-Replayed"] == "true"
        assert resent["Location"] == first["Location"]
        assert Order.objects.count() == 1

    def test_the_header_s_key_replaces_the_field_s(self):
        request = RequestFactory().post(
            "/checkout/",
            "item=book&idempotency_key=field-key",
            content_type=FORM,
            headers={"Accept": BROWSER_ACCEPT, "Idempotency-Key": '"header-key"'},
        )

        fields = resent_fields(problem(RequestInFlight(retry_after=1), request))

        # And a CSRF token of the page's own, in place of any the form had.
        assert [name for name, _ in fields] == ["csrfmiddlewaretoken", "item", "idempotency_key"]
        assert fields[1:] == [("item", "book"), ("idempotency_key", "header-key")]

    def test_a_key_read_by_the_view_s_own_function_is_not_resent(self):
        # A webhook's id, say: a form cannot send it again, so the page does not pretend.
        request = RequestFactory().post(
            "/checkout/", "item=book", content_type=FORM, headers={"Accept": BROWSER_ACCEPT}
        )
        request.idempotency = IdempotencyInfo(key="evt-1", scope="s", fingerprint="f")

        page = problem(RequestInFlight(retry_after=1), request)

        assert resent_fields(page) == []
        html = page.content.decode()
        assert "checks again" not in html
        assert "reload this page" in html

    def test_no_form_field_setting_leaves_nothing_to_resend(self, settings):
        settings.IDEMPOTENCY = {"FORM_FIELD": None}
        request = RequestFactory().post(
            "/checkout/",
            "item=book",
            content_type=FORM,
            headers={"Accept": BROWSER_ACCEPT, "Idempotency-Key": "k"},
        )

        assert resent_fields(problem(RequestInFlight(retry_after=1), request)) == []

    def test_a_409_page_that_cannot_resend_sends_the_person_nowhere_near_the_form(self):
        # A multipart form: reloading it would render a new key, and a new key pays twice.
        request = RequestFactory(headers={"Accept": BROWSER_ACCEPT}).post(
            "/",
            {"item": "book", "idempotency_key": "k"},
            headers={"Referer": "http://testserver/checkout/"},
        )

        html = problem(RequestInFlight(retry_after=1), request).content.decode()

        assert "checks again" not in html
        assert "reload this page" in html
        assert 'href="http://testserver/checkout/"' not in html
        assert "history.back()" not in html


class ProblemHeadersTests:
    @pytest.mark.parametrize("accept", [BROWSER_ACCEPT, "application/json"])
    def test_page_or_problem_details_vary_by_accept(self, accept):
        request = RequestFactory().post("/", HTTP_ACCEPT=accept)

        response = problem(RequestInFlight(retry_after=1), request)

        assert response["Vary"] == "Accept"

    def test_a_page_is_not_kept_by_any_cache(self):
        # A 409 page holds the submission's fields, its CSRF token among them.
        request = RequestFactory().post("/", HTTP_ACCEPT=BROWSER_ACCEPT)

        assert problem(FingerprintMismatch(), request)["Cache-Control"] == "no-store"


@idempotent
def _failing_checkout(request: Any) -> Any:
    raise RuntimeError("the payment provider is down")


def error_reports(request: Any) -> list[str]:
    """The HTML and text reports Django mails for the error ``request`` met in its view.

    The HTML one shows the locals of every frame from here on, the engine's among them.
    """
    try:
        _failing_checkout(request)
    except RuntimeError:
        reporter = ExceptionReporter(request, *sys.exc_info())
        return [reporter.get_traceback_html(), reporter.get_traceback_text()]
    finally:
        request.close()
    raise AssertionError("the view did not raise")


class ErrorReportTests:
    """A key replays the stored response to whoever has it: never in an error report."""

    @pytest.mark.parametrize("key_from", ["form", "header"])
    def test_the_key_is_in_no_error_report(self, settings, key_from):
        settings.DEBUG = False  # as in production, where reports are mailed
        key = f"KEY-{uuid.uuid4().hex}"
        body, headers = "item=book", {"Accept": BROWSER_ACCEPT}
        if key_from == "form":
            body += f"&idempotency_key={key}"
        else:
            headers["Idempotency-Key"] = key

        reports = error_reports(RequestFactory().post("/checkout/", body, FORM, headers=headers))

        assert "the payment provider is down" in reports[0]
        assert "idempotency_key" in reports[1] or key_from == "header"
        for report in reports:
            assert key not in report
