"""The settings table and what derives from it; the version; header and scope defaults."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings as django_settings
from django.contrib.auth.models import User
from django.contrib.sessions.backends.db import SessionStore
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse
from django.test import AsyncClient, Client, RequestFactory, override_settings
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

import django_idempotency
from django_idempotency import idempotent
from django_idempotency.checks import check_settings
from django_idempotency.conf import BY_NAME, DEFAULTS, SETTINGS, idempotency_settings
from django_idempotency.contrib.drf import IdempotentMixin
from django_idempotency.models import IdempotencyKey
from django_idempotency.options import OPTION_NAMES
from django_idempotency.scopes import session_scope, user_scope
from tests.clients import post
from tests.views import calls

ROOT = Path(__file__).resolve().parent.parent
GZIPPED = gzip.compress(b'{"id": 1, "item": "book"}')


@csrf_exempt
@idempotent
def gzipped_view(request: HttpRequest) -> HttpResponse:
    """Returns bytes it compressed itself, as a view serving stored archives does."""
    calls.increment()
    response = HttpResponse(GZIPPED, status=201, content_type="application/json")
    response["Content-Encoding"] = "gzip"
    response["Content-Disposition"] = 'attachment; filename="order.json"'
    return response


@csrf_exempt
@idempotent(scope=session_scope)
def session_view(request: HttpRequest) -> HttpResponse:
    calls.increment()
    if request.GET.get("login"):
        request.session["cart"] = "new"  # the first request creates the session
    return HttpResponse(f"call {calls.value}", status=201)


urlpatterns = [
    path("gzipped/", gzipped_view),
    path("session/", session_view),
]


class SettingsTableTests:
    def test_defaults_match_the_documented_dict(self):
        assert DEFAULTS["STORED_HEADERS"] == (
            "Content-Type",
            "Location",
            "ETag",
            "Last-Modified",
            "Content-Language",
            "Content-Encoding",
            "Content-Disposition",
        )
        assert DEFAULTS["KEY_MIN_LENGTH"] == 1

    @pytest.mark.parametrize(
        ("name", "value"),
        [
            ("HEADER", "Idempotency-Key\n"),
            ("SCOPE", "myproject.scopes.tenant\n"),
            ("PROBLEM_TYPE_BASE_URL", "https://api.example.com/problems/\n"),
        ],
    )
    def test_a_trailing_newline_is_an_invalid_value(self, name, value):
        assert BY_NAME[name].problem(value, resolve=False) is not None

    def test_every_setting_has_a_typed_accessor(self):
        for setting in SETTINGS:
            value = getattr(idempotency_settings, setting.name.lower())
            assert value == setting.normalise(setting.default)

    def test_options_and_mixin_attributes_come_from_the_table(self):
        assert OPTION_NAMES == (
            "required",
            "methods",
            "ttl",
            "scope",
            "fingerprint",
            "atomic",
            "wait",
            "lease",
            "recover",
            "key",
            "store",
        )
        for name in OPTION_NAMES:
            assert getattr(IdempotentMixin, f"idempotency_{name}") is None

    def test_override_settings_is_followed_although_values_are_cached(self):
        assert idempotency_settings.ttl == timedelta(hours=24)
        with override_settings(IDEMPOTENCY={"TTL": 60}):
            assert idempotency_settings.ttl == timedelta(seconds=60)
        assert idempotency_settings.ttl == timedelta(hours=24)

    def test_values_are_cached_between_reads(self, monkeypatch):
        idempotency_settings.reload()
        reads = []
        original = idempotency_settings.raw

        def counting_raw(name):
            reads.append(name)
            return original(name)

        monkeypatch.setattr(idempotency_settings, "raw", counting_raw)
        for _ in range(3):
            assert idempotency_settings.methods == frozenset({"POST", "PATCH"})
        assert reads == ["METHODS"]

    def test_a_value_read_across_a_reload_is_not_kept(self, monkeypatch):
        # setting_changed arriving while a first read is under way: the value
        # read from the old settings must not outlive them as an attribute.
        original = idempotency_settings.raw

        def raw_then_reload(name):
            found = original(name)
            idempotency_settings.reload()
            return found

        idempotency_settings.reload()
        monkeypatch.setattr(idempotency_settings, "raw", raw_then_reload)
        assert idempotency_settings.ttl == DEFAULTS["TTL"]
        monkeypatch.setattr(idempotency_settings, "raw", original)

        assert "ttl" not in vars(idempotency_settings)
        with override_settings(IDEMPOTENCY={"TTL": 7}):
            assert idempotency_settings.ttl == timedelta(seconds=7)

    def test_a_reload_drops_every_settings_attribute(self):
        for row in SETTINGS:
            getattr(idempotency_settings, row.option_name)
        # Even one the cache no longer lists.
        idempotency_settings._cache.clear()

        idempotency_settings.reload()

        assert not {row.option_name for row in SETTINGS} & set(vars(idempotency_settings))

    def test_bad_value_at_run_time_names_the_key_and_the_fix(self):
        # The system check reports this at start-up; silenced, the first read still refuses it.
        with (
            override_settings(IDEMPOTENCY={"METHODS": "POST"}),
            pytest.raises(ImproperlyConfigured, match=r"IDEMPOTENCY\['METHODS'\].*\('POST',\)"),
        ):
            idempotency_settings.methods  # noqa: B018

    def test_bad_dotted_path_at_run_time_says_the_import_failed(self):
        with (
            override_settings(IDEMPOTENCY={"SCOPE": "no_such_module_here.scope"}),
            pytest.raises(ImproperlyConfigured, match="could not be imported: No module named"),
        ):
            idempotency_settings.scope  # noqa: B018

    def test_settings_not_a_dict_at_run_time(self):
        with (
            override_settings(IDEMPOTENCY=["TTL"]),
            pytest.raises(ImproperlyConfigured, match="must be a dict"),
        ):
            idempotency_settings.ttl  # noqa: B018


class UnknownKeyOverrideTests:
    """``override_settings`` with a misspelt key fails at once, in the system check's words."""

    def test_override_with_an_unknown_key_raises_naming_it_and_the_fix(self):
        with (
            pytest.raises(ImproperlyConfigured) as refused,
            override_settings(IDEMPOTENCY={"TTLL": 5}),
        ):
            pytest.fail("the override must not apply")  # pragma: no cover
        assert (
            str(refused.value) == "IDEMPOTENCY['TTLL'] is not a known setting. Did you mean 'TTL'?"
        )

    def test_the_words_are_the_system_checks(self, monkeypatch):
        monkeypatch.setattr(django_settings, "IDEMPOTENCY", {"MEHTODS": ["POST"]}, raising=False)
        [error] = check_settings()
        monkeypatch.undo()
        with pytest.raises(ImproperlyConfigured) as refused:
            override_settings(IDEMPOTENCY={"MEHTODS": ["POST"]}).enable()
        assert str(refused.value) == f"{error.msg} {error.hint}"

    def test_a_refused_override_leaves_the_settings_as_they_were(self):
        with override_settings(IDEMPOTENCY={"TTL": 60}):
            with (
                pytest.raises(ImproperlyConfigured),
                override_settings(IDEMPOTENCY={"TTL": 5, "X": 1}),
            ):
                pass  # pragma: no cover
            assert idempotency_settings.ttl == timedelta(seconds=60)
        assert idempotency_settings.ttl == timedelta(hours=24)

    def test_pytest_django_settings_fixture_refuses_it_too(self, settings):
        with pytest.raises(ImproperlyConfigured, match=r"IDEMPOTENCY\['REQUIERD'\].*'REQUIRED'"):
            settings.IDEMPOTENCY = {"REQUIERD": True}

    @override_settings(SILENCED_SYSTEM_CHECKS=["django_idempotency.E002"])
    def test_silencing_the_check_silences_the_refusal(self):
        with override_settings(IDEMPOTENCY={"PROJECT_OWN_KEY": 1, "TTL": 60}):
            assert idempotency_settings.ttl == timedelta(seconds=60)

    def test_a_bad_value_is_refused_at_its_first_read_not_by_the_override(self):
        with override_settings(IDEMPOTENCY={"TTL": "1h"}):
            assert idempotency_settings.methods == frozenset({"POST", "PATCH"})
            with pytest.raises(ImproperlyConfigured, match=r"IDEMPOTENCY\['TTL'\]"):
                idempotency_settings.ttl  # noqa: B018


def test_version_is_the_one_in_pyproject():
    pyproject = (ROOT / "pyproject.toml").read_text()
    declared = re.search(r'^version = "([^"]+)"', pyproject, re.MULTILINE).group(1)
    assert django_idempotency.__version__ == declared
    assert re.match(r"^\d+\.\d+", django_idempotency.__version__)


@pytest.mark.django_db
@pytest.mark.urls("tests.test_conf")
class StoredHeadersTests:
    def test_precompressed_body_replays_decodable(self, client: Client):
        first = client.post("/gzipped/", headers={"Idempotency-Key": "gzip-1"})
        retry = client.post("/gzipped/", headers={"Idempotency-Key": "gzip-1"})

        assert calls.value == 1
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.status_code == first.status_code == 201
        assert retry["Content-Encoding"] == "gzip"
        assert retry["Content-Disposition"] == 'attachment; filename="order.json"'
        assert gzip.decompress(retry.content) == b'{"id": 1, "item": "book"}'


@pytest.mark.django_db
@pytest.mark.urls("tests.test_conf")
class KeyMinLengthTests:
    @override_settings(IDEMPOTENCY={"KEY_MIN_LENGTH": 16})
    def test_shorter_key_is_400_and_runs_nothing(self, client: Client):
        response = client.post("/gzipped/", headers={"Idempotency-Key": "x" * 15})

        assert response.status_code == 400
        assert response["Content-Type"] == "application/problem+json"
        assert "at least 16" in response.json()["detail"]
        assert calls.value == 0
        assert not IdempotencyKey.objects.exists()
        assert client.post("/gzipped/", headers={"Idempotency-Key": "x" * 16}).status_code == 201

    @override_settings(IDEMPOTENCY={"KEY_MIN_LENGTH": 4})
    def test_minimum_applies_to_the_key_inside_quotes(self, client: Client):
        assert client.post("/gzipped/", headers={"Idempotency-Key": '"abc"'}).status_code == 400
        assert client.post("/gzipped/", headers={"Idempotency-Key": '"abcd"'}).status_code == 201

    def test_default_minimum_accepts_one_character(self, client: Client):
        assert client.post("/gzipped/", headers={"Idempotency-Key": "a"}).status_code == 201


def session_client() -> Client:
    client = Client()
    session = SessionStore()
    session["seen"] = True
    session.create()
    client.cookies["sessionid"] = session.session_key
    return client


@pytest.mark.django_db
@pytest.mark.urls("tests.test_conf")
class SessionScopeTests:
    def test_two_anonymous_sessions_with_one_key_are_isolated(self):
        first, second = session_client(), session_client()
        a = first.post("/session/", headers={"Idempotency-Key": "shared"})
        b = second.post("/session/", headers={"Idempotency-Key": "shared"})

        assert a.content == b"call 1"
        assert b.content == b"call 2"
        assert "Idempotent-Replayed" not in b
        replay = first.post("/session/", headers={"Idempotency-Key": "shared"})
        assert replay.content == b"call 1"
        assert replay["Idempotent-Replayed"] == "true"

    def test_scope_is_a_digest_never_the_session_key(self):
        client = session_client()
        client.post("/session/", headers={"Idempotency-Key": "k"})
        scope = IdempotencyKey.objects.get().scope
        assert re.fullmatch(r"session:[0-9a-f]{64}", scope)
        assert client.cookies["sessionid"].value not in scope

    def test_a_session_cookie_the_store_does_not_know_is_a_scope_of_its_own(self):
        # As sent: a view that rotated the session (login) has deleted the one its
        # duplicates still send, and they must meet the first in its scope.
        client = Client()
        client.cookies["sessionid"] = "made-up-session-key-0123456789"
        client.post("/session/", headers={"Idempotency-Key": "k"})
        assert IdempotencyKey.objects.get().scope == (
            "session:" + hashlib.sha256(b"made-up-session-key-0123456789").hexdigest()
        )
        anonymous = Client().post("/session/", headers={"Idempotency-Key": "k"})
        assert "Idempotent-Replayed" not in anonymous

    def test_no_session_is_anonymous_even_when_the_view_creates_one(self):
        client = Client()
        first = client.post("/session/?login=1", headers={"Idempotency-Key": "k"})
        assert "sessionid" in first.cookies
        assert IdempotencyKey.objects.get().scope == "anonymous"
        # A retry resends the request as it was: without the new cookie, it replays.
        retry = Client().post("/session/?login=1", headers={"Idempotency-Key": "k"})
        assert retry["Idempotent-Replayed"] == "true"

    def test_authenticated_user_is_scoped_by_user(self):
        user = User.objects.create_user("alice")
        client = Client()
        client.force_login(user)
        client.post("/session/", headers={"Idempotency-Key": "k"})
        assert IdempotencyKey.objects.get().scope == f"user:{user.pk}"


def test_view_options_are_resolved_once_and_again_after_a_settings_change():
    from django_idempotency.options import check_options

    view_options = check_options({"wait": 1})
    assert view_options.resolved is None  # nothing asked yet
    resolved = view_options.resolve()
    assert view_options.resolve() is resolved  # not read again per request
    assert view_options.resolved is resolved  # what a request reads without a call
    with override_settings(IDEMPOTENCY={"TTL": 60, "WAIT": 3}):
        assert view_options.resolved is None  # forgotten with the settings
        changed = view_options.resolve()
        assert changed.ttl == timedelta(seconds=60)
        assert changed.wait == 1  # the view's own option still wins
    assert view_options.resolved is None
    assert view_options.resolve().ttl == timedelta(hours=24)


def test_settings_changes_forget_every_views_options_while_others_are_made():
    # DRF makes a view's options on each request when they are properties,
    # while a test's override_settings (beside a live server) forgets them all.
    import sys
    import threading

    from django_idempotency.options import check_options

    # Many views, and threads switched as often as Python can: listing them
    # all then takes long enough for the other thread to add one meanwhile.
    views = [check_options({"wait": 1}) for _ in range(5000)]
    stop = threading.Event()
    made: list[int] = []

    def make_options() -> None:
        while not stop.is_set():
            check_options({"wait": 2}).resolve()
            made.append(1)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    maker = threading.Thread(target=make_options)
    maker.start()
    try:
        for _ in range(100):
            views[0].resolve()
            with override_settings(IDEMPOTENCY={"TTL": 60}):
                assert views[0].resolved is None
    finally:
        stop.set()
        maker.join()
        sys.setswitchinterval(interval)

    assert made  # the other thread ran beside the changes
    assert all(view.resolved is None for view in views)


def test_a_value_derived_before_a_settings_change_is_not_kept():
    from django_idempotency.conf import idempotency_settings

    kept: list[str] = []
    generation = idempotency_settings.generation
    with override_settings(IDEMPOTENCY={"TTL": 60}):
        idempotency_settings.keep_if_current(generation, lambda: kept.append("stale"))
        current = idempotency_settings.generation
        idempotency_settings.keep_if_current(current, lambda: kept.append("current"))

    assert kept == ["current"]


@pytest.fixture(params=["wsgi", "asgi"])
def any_client(request: pytest.FixtureRequest) -> Client | AsyncClient:
    return Client() if request.param == "wsgi" else AsyncClient()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.django_db(transaction=True)
class CredentialScopeTests:
    """Callers Django did not authenticate are scoped by their ``Authorization`` header."""

    def test_decorated_view_gives_each_callers_credentials_their_own_response(self, any_client):
        url = "/orders/token-auth/"
        alice = post(any_client, url, key="shared", headers=bearer("alice-token"))
        bob = post(any_client, url, key="shared", headers=bearer("bob-token"))

        assert alice.status_code == bob.status_code == 201
        assert "Idempotent-Replayed" not in bob
        assert json.loads(alice.content)["caller"] == "alice-token"
        assert json.loads(bob.content)["caller"] == "bob-token"
        assert calls.value == 2
        again = post(any_client, url, key="shared", headers=bearer("alice-token"))
        assert again["Idempotent-Replayed"] == "true"
        assert again.content == alice.content
        assert calls.value == 2
        scopes = set(IdempotencyKey.objects.values_list("scope", flat=True))
        assert len(scopes) == 2
        assert all(re.fullmatch(r"anonymous\|credential:[0-9a-f]{32}", s) for s in scopes)
        assert not any("token" in scope for scope in scopes)

    def test_drf_view_that_authenticates_nobody_keeps_callers_apart(self):
        # TokenAuthentication knows "Token", not "Bearer": DRF leaves both anonymous.
        first = post(Client(), "/api/orders/", key="shared", headers=bearer("alice-token"))
        second = post(Client(), "/api/orders/", key="shared", headers=bearer("bob-token"))

        assert first.status_code == second.status_code == 201
        assert "Idempotent-Replayed" not in second
        assert first.json()["id"] != second.json()["id"]
        assert calls.value == 2

    def test_no_credentials_is_anonymous(self, any_client):
        post(any_client, "/orders/", key="k")
        post(any_client, "/orders/", key="empty", headers={"Authorization": ""})
        assert set(IdempotencyKey.objects.values_list("scope", flat=True)) == {"anonymous"}

    def test_authenticated_user_is_scoped_by_user_whatever_it_sends(self, any_client):
        user = User.objects.create_user("carol")
        any_client.force_login(user)
        post(any_client, "/orders/", key="k", headers=bearer("carol-token"))
        assert IdempotencyKey.objects.get().scope == f"user:{user.pk}"


class CredentialDigestTests:
    def test_digest_is_keyed_with_the_secret_key(self):
        request = RequestFactory().post("/", headers=bearer("alice-token"))
        scope = user_scope(request)
        digest = scope.removeprefix("anonymous|credential:")
        assert len(digest) == 32
        assert digest not in hashlib.sha256(b"Bearer alice-token").hexdigest()
        with override_settings(SECRET_KEY="another-secret-key"):
            assert user_scope(request) != scope
        assert user_scope(request) == scope

    def test_session_scope_folds_credentials_into_a_sent_session_or_anonymous(self, db):
        factory = RequestFactory()
        with_credentials = factory.post("/", headers=bearer("alice-token"))
        with_credentials.session = SessionStore()
        assert session_scope(with_credentials) == user_scope(with_credentials)
        assert session_scope(with_credentials).startswith("anonymous|credential:")

        sent = SessionStore()
        sent["seen"] = True
        sent.create()
        with_session = factory.post("/", headers=bearer("alice-token"))
        with_session.session = SessionStore(sent.session_key)
        # Two credentials sent from one cookie jar (a proxy, a shared client) stay apart.
        assert session_scope(with_session) == (
            "session:"
            + hashlib.sha256(sent.session_key.encode()).hexdigest()
            + session_scope(with_credentials).removeprefix("anonymous")
        )
        with_bob = factory.post("/", headers=bearer("bob-token"))
        with_bob.session = SessionStore(sent.session_key)
        assert session_scope(with_bob) != session_scope(with_session)
        without_credentials = factory.post("/")
        without_credentials.session = SessionStore(sent.session_key)
        assert session_scope(without_credentials) == (
            "session:" + hashlib.sha256(sent.session_key.encode()).hexdigest()
        )
        assert session_scope(factory.post("/")) == "anonymous"
