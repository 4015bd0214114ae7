"""Clock faults: an app server whose clock is wrong, beside one whose clock is right.

Both gunicorn servers share the test database; the skewed one runs under
``faketime`` a day ahead, a day behind or ten minutes ahead. The database's
clock decides every lease, expiry and purge cutoff (SPEC "Time is the
database's"), so whichever server asks, no completed key runs again, no
live lease is taken over, and a purge deletes nothing live. SQLite's clock
is the app host's own, so these run on the server backends.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from django.db import connection

from django_idempotency.models import IdempotencyKey
from tests.factories import IdempotencyKeyFactory
from tests.models import Order
from tests.server import DATABASE_NAME_ENV, ROOT, GunicornServer, wait_for_file
from tests.server_fixtures import (  # noqa: F401  fixtures used by name
    SERVER_TESTS,
    control_dir_fixture,
    controlled,
)

pytestmark = [
    *SERVER_TESTS,
    pytest.mark.skipif(
        shutil.which("faketime") is None,
        reason="needs faketime (Debian/Ubuntu: apt-get install faketime)",
    ),
]

#: The skewed server's clock, as faketime's relative offsets.
SKEWS = {"a day ahead": "+1d", "a day behind": "-1d", "ten minutes ahead": "+10m"}
#: The same offsets in seconds, to check that a faked process sees them.
SKEW_SECONDS = {"+1d": 86_400, "-1d": -86_400, "+10m": 600}
REQUEST_TIMEOUT = 30


#: libfaketime itself, where Debian's ``faketime`` package puts it.
LIBFAKETIME = sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))


def faked(skew: str, command: list[str]) -> list[str]:
    """``command`` with its clocks ``skew`` off the real ones.

    The library preloaded with a relative offset, rather than the
    ``faketime`` wrapper: the wrapper shares its clock with the children
    through a semaphore named after its pid, and one left behind by a
    killed server makes a later wrapper with the same pid fail to start.
    """
    if LIBFAKETIME:
        return ["env", f"LD_PRELOAD={LIBFAKETIME[0]}", f"FAKETIME={skew}", *command]
    return ["faketime", "-f", skew, *command]


class SkewedGunicorn(GunicornServer):
    """Gunicorn whose processes see a wall clock ``skew`` off the real one."""

    skew = "+0"

    def command(self) -> list[str]:
        return faked(self.skew, super().command())


def skewed_by(skew: str) -> type[GunicornServer]:
    return type(f"Gunicorn{skew}", (SkewedGunicorn,), {"skew": skew})


@pytest.fixture(scope="module")
def skew(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def servers(
    django_db_setup: None,
    skew: str,
    control_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, GunicornServer]]:
    """A server with the right clock and one ``skew`` off, on the same database."""
    # A Python started the way the skewed server is must see the skew, or
    # every test below would pass with two right clocks.
    probe = [sys.executable, "-c", "import time; print(time.time())"]
    seen = float(subprocess.run(faked(skew, probe), capture_output=True, check=True).stdout)
    assert abs(seen - time.time() - SKEW_SECONDS[skew]) < 60, (skew, seen)
    settings = "tests.server_settings"
    with (
        controlled(GunicornServer, settings, control_dir, tmp_path_factory, workers=2) as right,
        controlled(skewed_by(skew), settings, control_dir, tmp_path_factory, workers=2) as wrong,
    ):
        yield {"right": right, "skewed": wrong}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "skew" in metafunc.fixturenames:
        metafunc.parametrize("skew", list(SKEWS.values()), ids=list(SKEWS), indirect=True)


def send(server: GunicornServer, path: str, key: str, item: str) -> requests.Response:
    return requests.post(
        server.url + path,
        json={"item": item},
        headers={"Idempotency-Key": key},
        timeout=REQUEST_TIMEOUT,
    )


def effects(item: str) -> int:
    return Order.objects.filter(item=item).count()


def holding(
    server: GunicornServer, control_dir: Path, key: str, item: str
) -> Callable[[], requests.Response]:
    """Start a lease-mode request that holds its (5-minute) lease until released.

    Returns once its handler runs; the returned call lets it finish and
    hands back its response.
    """
    answer: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: answer.update(response=send(server, "/drf/long-lease-hold/", key, item)),
    )
    thread.start()
    wait_for_file(control_dir / f"{key}.pid")

    def finish() -> requests.Response:
        (control_dir / f"{key}.go").touch()
        thread.join(REQUEST_TIMEOUT)
        assert not thread.is_alive(), "the held request never finished"
        return answer["response"]

    return finish


@pytest.mark.parametrize("path", ["/orders/", "/orders/lease/"], ids=["atomic", "lease"])
@pytest.mark.parametrize("first", ["right", "skewed"])
def test_a_completed_key_is_replayed_whichever_clock_asks(servers, path, first):
    key, item = f"done-{uuid.uuid4().hex}", f"item-{uuid.uuid4().hex[:12]}"
    later = "skewed" if first == "right" else "right"

    original = send(servers[first], path, key, item)
    retry = send(servers[later], path, key, item)

    assert original.status_code == 201, original.text
    assert retry.status_code == 201, retry.text
    assert retry.headers.get("Idempotent-Replayed") == "true"
    assert retry.content == original.content
    assert effects(item) == 1


@pytest.mark.parametrize("holder", ["right", "skewed"])
def test_a_live_lease_is_not_taken_over_whichever_clock_asks(servers, control_dir, holder):
    key, item = f"held-{uuid.uuid4().hex}", f"item-{uuid.uuid4().hex[:12]}"
    other = "skewed" if holder == "right" else "right"
    finish = holding(servers[holder], control_dir, key, item)
    try:
        duplicate = send(servers[other], "/drf/long-lease-hold/", key, item)
        assert duplicate.status_code == 409, duplicate.text
        # When to come back, by the database's clock: within the lease, never past it.
        assert 1 <= int(duplicate.headers["Retry-After"]) <= 300
        assert effects(item) == 1
    finally:
        original = finish()
    assert original.status_code == 201, original.text
    assert effects(item) == 1
    replay = send(servers[other], "/drf/long-lease-hold/", key, item)
    assert replay.headers.get("Idempotent-Replayed") == "true"


def manage(skew: str, *arguments: str) -> subprocess.CompletedProcess[str]:
    """``python -m django ARGUMENTS`` on the test database, with the clock ``skew`` off."""
    environment = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.server_settings",
        DATABASE_NAME_ENV: connection.settings_dict["NAME"],
    }
    return subprocess.run(
        faked(skew, [sys.executable, "-m", "django", *arguments]),
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_an_operator_under_a_skewed_clock_sees_and_releases_no_live_lease(
    servers, control_dir, skew
):
    tag = uuid.uuid4().hex[:12]
    finish = holding(servers["right"], control_dir, f"operated-{tag}", f"held-{tag}")
    try:
        listed = manage(skew, "idempotency_keys", "list", "--abandoned", "--show-keys")
        assert listed.returncode == 0, listed.stderr
        assert f"operated-{tag}" not in listed.stdout
        released = manage(skew, "idempotency_keys", "release", "anonymous", f"operated-{tag}")
        assert released.returncode != 0
        assert "may still be running" in released.stderr
        record = IdempotencyKey.objects.get(key=f"operated-{tag}")
        assert record.owner_token != ""
    finally:
        assert finish().status_code == 201
    assert effects(f"held-{tag}") == 1


def test_a_purge_under_a_skewed_clock_deletes_nothing_live(servers, control_dir, skew):
    tag = uuid.uuid4().hex[:12]
    done = send(servers["right"], "/orders/", f"live-{tag}", f"item-{tag}")
    assert done.status_code == 201, done.text
    finish = holding(servers["right"], control_dir, f"lease-{tag}", f"held-{tag}")
    try:
        # Expired by the database's clock (this host's is right): what a purge is for.
        expired = IdempotencyKeyFactory(scope="purge-check", key=f"expired-{tag}", expired=True)
        result = manage(skew, "purge_idempotency_keys")
        assert result.returncode == 0, result.stderr
        keys = set(IdempotencyKey.objects.values_list("key", flat=True))
        assert {f"live-{tag}", f"lease-{tag}"} <= keys
        assert expired.key not in keys
    finally:
        assert finish().status_code == 201
