"""REPLAY_CACHE: replays answered from a Django cache, never as the authority.

Runs against the local-memory cache, the shared Redis server (under a key
prefix of this run's own), a Redis port where nothing listens, and a
redis-server of the test's own that is stopped mid-run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from io import StringIO

import pytest
from django.contrib import admin
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.core.cache import caches
from django.core.management import call_command
from django.db import connection, connections
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext
from django.urls import include, path

from django_idempotency import replay_cache, signals
from django_idempotency.models import IdempotencyKey
from django_idempotency.purge import purge_expired
from tests.clients import post
from tests.models import Order
from tests.server import free_port
from tests.views import calls, fail_next

pytestmark = pytest.mark.django_db(transaction=True)

# The URLconf of the admin test: the admin beside the test views.
urlpatterns = [path("admin/", admin.site.urls), path("", include("tests.urls"))]

BODY = {"item": "book"}


def _redis(port: int, prefix: str) -> dict:
    return {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": f"redis://127.0.0.1:{port}/0",
        "KEY_PREFIX": prefix,
        "OPTIONS": {"socket_connect_timeout": 0.5, "socket_timeout": 0.5},
    }


PREFIX = f"idempotency-tests-{os.getpid()}-{uuid.uuid4().hex[:8]}"
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "replay": {
        "BACKEND": "django.core.cache.backends.locmem.LocMemCache",
        "LOCATION": "replay-cache-tests",
    },
    "redis": _redis(6379, PREFIX),
    # Nothing listens on this port: every cache call fails.
    "dead": _redis(free_port(), PREFIX),
}


def statements(captured: CaptureQueriesContext) -> list[str]:
    return [query["sql"] for query in captured.captured_queries]


def assert_ran_again(retry) -> None:
    """``retry`` was not replayed: the handler ran a second time, and answered anew."""
    assert retry.status_code == 201
    assert "Idempotent-Replayed" not in retry
    assert calls.value == 2


def _settings(alias: str | None, **more):
    return override_settings(CACHES=CACHES, IDEMPOTENCY={"REPLAY_CACHE": alias, **more})


@pytest.fixture(autouse=True, scope="module")
def leave_redis_as_found():
    """Delete this module's entries from the shared Redis server (its own prefix only)."""
    yield
    try:
        import redis
    except ImportError:
        return
    client = redis.Redis(host="127.0.0.1", port=6379, socket_connect_timeout=1)
    try:
        for key in client.scan_iter(match=f"{PREFIX}:*", count=1000):
            client.delete(key)
    except redis.RedisError:
        pass
    finally:
        client.close()


@pytest.fixture(autouse=True)
def clear_caches():
    with override_settings(CACHES=CACHES):
        caches["replay"].clear()
    yield
    with override_settings(CACHES=CACHES):
        caches["replay"].clear()


def _cached(alias: str, key: str, scope: str = "anonymous"):
    with override_settings(CACHES=CACHES):
        return caches[alias].get(replay_cache.cache_key(scope, key))


@pytest.mark.parametrize("alias", ["replay", "redis"])
def test_a_replay_from_the_cache_makes_no_statement(client, alias):
    with _settings(alias):
        first = post(client, "/orders/", "k1")
        assert first.status_code == 201
        with CaptureQueriesContext(connection) as replay:
            again = post(client, "/orders/", "k1")
    assert statements(replay) == []
    assert again.status_code == 201
    assert again.content == first.content
    assert again["Location"] == first["Location"]
    assert again["Content-Type"] == first["Content-Type"]
    assert again["Idempotent-Replayed"] == "true"
    assert "X-Request-Secret" not in again
    assert not again.cookies
    assert calls.value == 1
    assert Order.objects.count() == 1


def test_an_entry_lives_no_longer_than_its_record(client):
    with _settings("replay", TTL=120):
        post(client, "/orders/", "k1")
        entry = _cached("replay", "k1")
        record = IdempotencyKey.objects.get(key="k1")
        cache = caches["replay"]
        lifetime_end = cache._expire_info[cache.make_key(replay_cache.cache_key("anonymous", "k1"))]
    assert record.expires_at.timestamp() - 2 <= entry[-1] <= record.expires_at.timestamp()
    assert lifetime_end <= record.expires_at.timestamp()


def test_a_cache_replay_sends_the_same_signal_and_log(client, caplog):
    received = []

    def receiver(sender, request, idempotency, **kwargs):
        received.append((sender, idempotency.key, idempotency.scope))

    signals.response_replayed.connect(receiver)
    try:
        with _settings("replay"):
            post(client, "/orders/", "k1")
            post(client, "/orders/", "k1")  # the database refills nothing: already cached
            with caplog.at_level(logging.DEBUG, logger="django_idempotency.observability"):
                post(client, "/orders/", "k1")
    finally:
        signals.response_replayed.disconnect(receiver)
    assert len(received) == 2
    assert {item[1:] for item in received} == {("k1", "anonymous")}
    outcomes = [getattr(r, "idempotency_outcome", None) for r in caplog.records]
    assert outcomes == ["replayed"]


@contextmanager
def deployment_on(database_name: str):
    """The ``default`` alias pointed at another database, as another deployment's is."""
    saved = connection.settings_dict
    connection.close()
    connection.settings_dict = {**saved, "NAME": database_name}
    try:
        yield
    finally:
        connection.close()
        connection.settings_dict = saved


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
@pytest.mark.parametrize("alias", ["replay", "redis"])
def test_deployments_sharing_a_cache_never_replay_each_others_responses(client, alias):
    other_database = connections["other"].settings_dict["NAME"]
    key = f"k-{uuid.uuid4().hex}"  # the Redis server outlives each test's records
    with _settings(alias):
        first = post(client, "/orders/", key)
        with deployment_on(other_database):
            assert not IdempotencyKey.objects.exists()
            theirs = post(client, "/orders/", key)
            # Not a replay of the first deployment's answer, which it has no record of.
            assert "Idempotent-Replayed" not in theirs
            assert IdempotencyKey.objects.get().key == key
            their_retry = post(client, "/orders/", key)
        mine = post(client, "/orders/", key)
    assert first.status_code == theirs.status_code == 201
    assert calls.value == 2
    # Each deployment wrote its own order, in its own database.
    assert Order.objects.count() == Order.objects.using("other").count() == 1
    assert their_retry.content == theirs.content
    assert mine.content == first.content
    assert mine["Idempotent-Replayed"] == their_retry["Idempotent-Replayed"] == "true"


def test_the_cache_key_holds_the_database_alias_server_and_name():
    base = replay_cache.cache_key("anonymous", "k1")
    assert base == replay_cache.cache_key("anonymous", "k1", using="default")
    assert replay_cache.cache_key("anonymous", "k1", using="other") != base
    saved = connection.settings_dict
    try:
        for name, value in [("NAME", "another_database"), ("HOST", "db2"), ("PORT", "6543")]:
            connection.settings_dict = {**saved, name: value}
            assert replay_cache.cache_key("anonymous", "k1") != base, name
        connection.settings_dict = dict(saved)
        assert replay_cache.cache_key("anonymous", "k1") == base
    finally:
        connection.settings_dict = saved


def test_a_different_body_is_refused_by_the_database_not_replayed(client):
    with _settings("replay"):
        post(client, "/orders/", "k1")
        with CaptureQueriesContext(connection) as rejected:
            response = post(client, "/orders/", "k1", item="lamp")
    assert response.status_code == 422
    assert statements(rejected), "a mismatch must be decided by the database"
    assert calls.value == 1


def test_a_handler_that_raises_after_writing_leaves_nothing(client):
    fail_next.set()
    with _settings("replay"):
        with pytest.raises(RuntimeError):
            post(client, "/orders/", "k1")
        assert _cached("replay", "k1") is None
        assert not IdempotencyKey.objects.filter(key="k1").exists()
        assert Order.objects.count() == 0
        retry = post(client, "/orders/", "k1")
    assert_ran_again(retry)


def test_non_storable_answers_are_never_cached(client):
    with _settings("replay"):
        post(client, "/orders/", "k1", status=503)
    assert _cached("replay", "k1") is None


def test_an_in_progress_record_is_never_cached(client):
    seen = {}

    def on_claimed(sender, request, idempotency, **kwargs):
        seen["entry"] = caches["replay"].get(replay_cache.cache_key("anonymous", idempotency.key))
        seen["state"] = IdempotencyKey.objects.get(key=idempotency.key).state

    signals.key_claimed.connect(on_claimed)
    try:
        with _settings("replay"):
            post(client, "/orders/lease/", "k1")
    finally:
        signals.key_claimed.disconnect(on_claimed)
    assert seen == {"entry": None, "state": IdempotencyKey.State.IN_PROGRESS}
    assert _cached("replay", "k1")[1] == IdempotencyKey.objects.get(key="k1").fingerprint


def test_a_released_lease_is_never_replayed_from_the_cache(client):
    fail_next.set()
    with _settings("replay"):
        with pytest.raises(RuntimeError):
            post(client, "/orders/lease/", "k1")
        assert not IdempotencyKey.objects.filter(key="k1").exists()  # released
        retry = post(client, "/orders/lease/", "k1")
    assert_ran_again(retry)


def test_a_record_released_in_the_admin_is_never_replayed_from_the_cache(admin_client, settings):
    settings.ROOT_URLCONF = __name__
    # A lease-mode claim whose handler never finished: in progress, lease run out.
    gone = _aware(time.time() - 60)
    with _settings("replay"):
        record = IdempotencyKey.objects.create(
            scope="anonymous",
            key="k1",
            fingerprint="f" * 64,
            owner_token="t" * 32,
            expires_at=gone,
            locked_until=gone,
        )
        admin_client.post(
            "/admin/django_idempotency/idempotencykey/",
            {"action": "release_in_progress", ACTION_CHECKBOX_NAME: [str(record.pk)]},
        )
        assert IdempotencyKey.objects.get(pk=record.pk).owner_token == ""  # released
        assert _cached("replay", "k1") is None
        retry = post(admin_client, "/orders/", "k1")
    assert retry.status_code == 201
    assert "Idempotent-Replayed" not in retry


def test_a_key_deleted_by_the_command_is_never_replayed_from_the_cache(client):
    with _settings("replay"):
        post(client, "/orders/", "deleted-key")
        assert _cached("replay", "deleted-key") is not None
        call_command("idempotency_keys", "delete", "anonymous", "deleted-key", stdout=StringIO())
        assert _cached("replay", "deleted-key") is None
        retry = post(client, "/orders/", "deleted-key")
    assert_ran_again(retry)


def test_a_refusal_released_by_the_command_is_never_replayed_from_the_cache():
    url, client = "/lease/unrenderable/until-resumed/", Client(raise_request_exception=False)
    with _settings("replay"):
        assert post(client, url, "refused-key").status_code == 500
        refused = post(client, url, "refused-key")
        assert (refused.status_code, refused["Idempotent-Replayed"]) == (500, "true")
        assert _cached("replay", "refused-key") is not None
        call_command("idempotency_keys", "release", "anonymous", "refused-key", stdout=StringIO())
        assert _cached("replay", "refused-key") is None
        with CaptureQueriesContext(connection) as retry:
            resumed = post(client, url, "refused-key")
    assert statements(retry)  # from the database, which let it run
    assert_ran_again(resumed)
    assert json.loads(resumed.content)["attempt"] == 2


def test_a_cache_that_fails_to_evict_is_logged_and_the_delete_stands(client, caplog):
    with _settings(None):
        post(client, "/orders/", "evicted-key")
    with _settings("dead"), caplog.at_level(logging.WARNING, "django_idempotency.replay_cache"):
        call_command("idempotency_keys", "delete", "anonymous", "evicted-key", stdout=StringIO())
    assert not IdempotencyKey.objects.exists()
    warnings = [
        r.getMessage() for r in caplog.records if r.name == "django_idempotency.replay_cache"
    ]
    assert any("Could not evict" in message for message in warnings), warnings
    assert not any("evicted-key" in message for message in warnings)  # keys masked


def _aware(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, tz=timezone.utc)


def test_a_purged_record_is_never_replayed_from_the_cache(client):
    ttl = 2
    with _settings("replay", TTL=ttl):
        post(client, "/orders/", "k1")
        assert post(client, "/orders/", "k1")["Idempotent-Replayed"] == "true"
        assert _cached("replay", "k1") is not None
        expires_at = IdempotencyKey.objects.get(key="k1").expires_at
        # Wait until the record has expired, then purge it as the command does.
        while time.time() <= expires_at.timestamp():
            time.sleep(0.05)
        assert purge_expired() == 1
        response = post(client, "/orders/", "k1")
    assert_ran_again(response)


def test_an_expired_entry_is_not_replayed_even_if_the_cache_keeps_it(client):
    with _settings("replay"):
        post(client, "/orders/", "k1")
        entry = list(_cached("replay", "k1"))
        entry[-1] = time.time() - 1  # as if the cache outlived the record
        caches["replay"].set(replay_cache.cache_key("anonymous", "k1"), tuple(entry), 60)
        with CaptureQueriesContext(connection) as replay:
            response = post(client, "/orders/", "k1")
    assert statements(replay), "an expired entry must go to the database"
    assert response["Idempotent-Replayed"] == "true"


def test_a_replay_from_the_database_refills_the_cache(client):
    with _settings("replay"):
        post(client, "/orders/", "k1")
        caches["replay"].clear()
        post(client, "/orders/", "k1")
        assert _cached("replay", "k1") is not None
        with CaptureQueriesContext(connection) as replay:
            post(client, "/orders/", "k1")
    assert statements(replay) == []


def _answers(client, key: str) -> list[tuple[int, str | None]]:
    first = post(client, "/orders/", key)
    replay = post(client, "/orders/", key)
    mismatch = post(client, "/orders/", key, item="lamp")
    return [
        (response.status_code, response.get("Idempotent-Replayed"))
        for response in (first, replay, mismatch)
    ]


def test_a_cache_that_fails_changes_no_answer(client, caplog):
    with _settings(None):
        expected = _answers(client, "without-cache")
    with _settings("dead"), caplog.at_level(logging.WARNING, "django_idempotency.replay_cache"):
        answers = _answers(client, "with-dead-cache")
    assert answers == expected == [(201, None), (201, "true"), (422, None)]
    assert calls.value == 2
    warnings = [
        r.getMessage() for r in caplog.records if r.name == "django_idempotency.replay_cache"
    ]
    assert warnings and all("using the database" in message for message in warnings)
    assert not any("with-dead-cache" in message for message in warnings)  # keys masked


@pytest.fixture
def own_redis():
    """A redis-server of this test's own, which the test may stop."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                server.kill()
                raise
            time.sleep(0.05)
    yield server, port
    if server.poll() is None:
        server.terminate()
    server.wait(timeout=10)


def test_redis_stopped_mid_run_changes_no_answer(client, own_redis):
    server, port = own_redis
    caches_here = {**CACHES, "own": _redis(port, PREFIX)}
    with override_settings(CACHES=caches_here, IDEMPOTENCY={"REPLAY_CACHE": "own"}):
        post(client, "/orders/", "k1")
        with CaptureQueriesContext(connection) as cached:
            assert post(client, "/orders/", "k1")["Idempotent-Replayed"] == "true"
        assert statements(cached) == []
        server.terminate()
        server.wait(timeout=10)
        responses = [post(client, "/orders/", "k1") for _ in range(3)]
        responses.append(post(client, "/orders/", "k2"))
        responses.append(post(client, "/orders/", "k2"))
        mismatch = post(client, "/orders/", "k1", item="lamp")
    assert [r.status_code for r in responses] == [201] * 5
    assert [r.get("Idempotent-Replayed") for r in responses] == ["true"] * 3 + [None, "true"]
    assert mismatch.status_code == 422
    assert calls.value == 2


def test_the_setting_names_a_cache_alias(settings):
    from django_idempotency.checks import check_settings

    settings.CACHES = CACHES
    settings.IDEMPOTENCY = {"REPLAY_CACHE": "nope"}
    errors = check_settings()
    assert [error.id for error in errors] == ["django_idempotency.E120"]
    assert "REPLAY_CACHE" in errors[0].msg and "CACHES" in errors[0].msg
    settings.IDEMPOTENCY = {"REPLAY_CACHE": 3}
    errors = check_settings()
    assert [error.id for error in errors] == ["django_idempotency.E120"]
    settings.IDEMPOTENCY = {"REPLAY_CACHE": "replay"}
    assert check_settings() == []


def test_the_default_is_off(client):
    with override_settings(CACHES=CACHES):
        post(client, "/orders/", "k1")
        assert _cached("replay", "k1") is None
        assert _cached("default", "k1") is None


def test_admin_commands_are_unaffected(client):
    with _settings("replay", TTL=timedelta(hours=1)):
        post(client, "/orders/", "k1")
        call_command("purge_idempotency_keys", verbosity=0)
        assert post(client, "/orders/", "k1")["Idempotent-Replayed"] == "true"


def test_a_response_whose_outer_transaction_rolls_back_is_never_cached(client, rf):
    from django.db import transaction

    from tests.views import create_order

    request = rf.post(
        "/orders/",
        json.dumps(BODY),
        content_type="application/json",
        headers={"Idempotency-Key": "k1"},
    )
    with _settings("replay"):
        with pytest.raises(RuntimeError), transaction.atomic():
            assert create_order(request).status_code == 201
            raise RuntimeError("the request's transaction fails after the view")
        assert _cached("replay", "k1") is None
        retry = post(client, "/orders/", "k1")
    assert_ran_again(retry)


def test_a_drf_view_replays_from_the_cache_as_from_the_database(client):
    with _settings("replay"):
        first = post(client, "/drf/apiview/", "k1")
        from_database = _settings(None)
        with from_database:
            database = post(client, "/drf/apiview/", "k1")
        with CaptureQueriesContext(connection) as replay:
            cached = post(client, "/drf/apiview/", "k1")
    assert statements(replay) == []
    assert first.status_code == database.status_code == cached.status_code
    assert cached.content == database.content == first.content
    assert dict(cached.headers) == dict(database.headers)
    assert calls.value == 1
