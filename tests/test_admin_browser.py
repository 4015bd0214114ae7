"""An operator at the admin in a real browser: Chromium, driven by Playwright, against gunicorn.

The operator logs in, finds a key by typing its scope and key into the
search box, narrows the list by the lease filter, and releases a live lease
through the action and its confirmation page. The leases are taken by a
lease-mode ``idempotent_function`` whose calls wait inside their bodies
(``tests/admin_leases.py``), in the database the server reads.

Chromium is Debian's ``chromium`` package, never a downloaded browser;
where it cannot run, the tests fail under CI (``CI`` or ``REQUIRE_BACKENDS``
set) and are skipped with the fix named elsewhere (``tests/browsers.py``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from django_idempotency import operations
from django_idempotency.keys import mask_key
from django_idempotency.models import IdempotencyKey
from tests import admin_leases
from tests.admin_leases import SCOPE, HeldCall
from tests.browsers import (
    BrowserGunicorn,
    chromium_fixture,  # noqa: F401  a fixture used by name
)
from tests.server import GunicornServer, running

pytestmark = [pytest.mark.server, pytest.mark.django_db(transaction=True)]

State = IdempotencyKey.State
CHANGELIST = "/admin/django_idempotency/idempotencykey/"
CHANGE_LINK = re.compile(rf"{CHANGELIST}(\d+)/change/")
OPERATOR, PASSWORD = "operator", "operator-password-1"


class AdminGunicorn(BrowserGunicorn):
    probe_path = "/admin/login/"


@pytest.fixture(scope="module")
def server(
    django_db_setup: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GunicornServer]:
    log_dir = tmp_path_factory.mktemp("admin-gunicorn")
    with running(AdminGunicorn, "tests.admin_server_settings", log_dir, workers=2) as up:
        yield up


@pytest.fixture
def held() -> Iterator[list[HeldCall]]:
    """The calls a test holds open; each is let finish when the test ends, whatever happened."""
    calls: list[HeldCall] = []
    yield calls
    admin_leases.finish_all(calls)


@pytest.fixture
def page(chromium: Any, server: GunicornServer, django_user_model: Any) -> Iterator[Any]:
    """A fresh browser, logged into the admin through its login form as a superuser."""
    django_user_model.objects.create_superuser(OPERATOR, "operator@example.com", PASSWORD)
    context = chromium.new_context(base_url=server.url)
    try:
        page = context.new_page()
        page.goto(f"/admin/login/?next={CHANGELIST}")
        page.fill("#id_username", OPERATOR)
        page.fill("#id_password", PASSWORD)
        page.click("input[type=submit]")
        page.wait_for_url(f"**{CHANGELIST}")
        yield page
    finally:
        context.close()


def hold(calls: list[HeldCall], order: str) -> HeldCall:
    call = admin_leases.hold(order)
    calls.append(call)
    return call


def shown(page: Any) -> set[int]:
    """The records the change list shows, by id."""
    links = page.locator("#result_list tbody th a").evaluate_all("as => as.map(a => a.href)")
    return {int(CHANGE_LINK.search(link).group(1)) for link in links}


def rows_text(page: Any) -> str:
    return str(page.locator("#result_list tbody").inner_text())


def filter_lease(page: Any, choice: str) -> None:
    """Click one of the lease filter's choices, as an operator does."""
    lease = page.locator('#changelist-filter details[data-filter-title="lease"]')
    lease.get_by_role("link", name=choice, exact=True).click()
    # The new page, not the one clicked on: it marks the choice as selected.
    lease.locator("li.selected").get_by_role("link", name=choice, exact=True).wait_for()


def release_selected(page: Any, *records: IdempotencyKey) -> None:
    """Tick the records' boxes, pick the release action and press Go."""
    for record in records:
        page.check(f'#result_list input.action-select[value="{record.pk}"]')
    page.select_option('select[name="action"]', "release_in_progress")
    page.click('button[name="index"]')
    page.get_by_role("heading", name="Release leases that are still held?").wait_for()


def messages_shown(page: Any, level: str) -> list[str]:
    return [text.strip() for text in page.locator(f"ul.messagelist li.{level}").all_inner_texts()]


def test_operator_finds_filters_and_releases_a_live_lease(page: Any, held: list[HeldCall]) -> None:
    admin_leases.complete("order-1040")
    stalled = hold(held, "order-1041")
    admin_leases.run_out(stalled.record())
    running = hold(held, "order-1042")
    done, abandoned, live = (
        IdempotencyKey.objects.get(scope=SCOPE, key=f"order-104{n}") for n in range(3)
    )

    # The search box takes the scope and the key as a support ticket gives them.
    page.goto(CHANGELIST)
    page.fill("#searchbar", f"{SCOPE} order-1042")
    page.press("#searchbar", "Enter")
    page.wait_for_url(re.compile(r"[?&]q="))
    assert shown(page) == {live.pk}
    assert mask_key("order-1042") in rows_text(page)
    assert "order-1042" not in rows_text(page)
    page.fill("#searchbar", SCOPE)
    page.press("#searchbar", "Enter")
    page.wait_for_url(re.compile(r"[?&]q=billing.charge$"))
    assert shown(page) == {done.pk, abandoned.pk, live.pk}

    page.goto(CHANGELIST)
    filter_lease(page, "held")
    assert shown(page) == {live.pk}
    filter_lease(page, "abandoned (lease ran out)")
    assert shown(page) == {abandoned.pk}
    filter_lease(page, "released")
    assert shown(page) == set()

    filter_lease(page, "held")
    release_selected(page, live)
    confirmation = page.locator("#content").inner_text()
    assert f"{SCOPE} / {mask_key('order-1042')}" in confirmation
    assert "order-1042" not in confirmation
    page.get_by_role("button", name="Yes, release them").click()

    page.locator("ul.messagelist").wait_for()
    assert messages_shown(page, "success") == ["Released 1 in-progress record."]
    assert messages_shown(page, "warning") == []
    record = IdempotencyKey.objects.get(pk=live.pk)
    assert (record.state, record.owner_token, record.attempt) == (State.IN_PROGRESS, "", 2)
    # The release wrote the database's clock: compared with that clock, not this host's.
    assert record.expires_at <= operations.database_now()
    filter_lease(page, "released")
    assert shown(page) == {live.pk}

    # The first owner finishes after all: its result is refused, the release stands.
    assert running.finish() == "charged order-1042"
    assert IdempotencyKey.objects.get(pk=live.pk).owner_token == ""


def test_a_lease_taken_over_while_the_confirmation_page_is_open_is_kept(
    page: Any, held: list[HeldCall]
) -> None:
    first = hold(held, "order-2042")
    page.goto(CHANGELIST)
    filter_lease(page, "held")
    release_selected(page, first.record())

    # While the operator reads the page, the owner stalls past its lease
    # and a retry takes the key over.
    admin_leases.run_out(first.record())
    second = hold(held, "order-2042")
    taken = second.record()
    assert taken.attempt == 2
    page.get_by_role("button", name="Yes, release them").click()

    page.locator("ul.messagelist").wait_for()
    assert messages_shown(page, "success") == []
    nothing, warning = messages_shown(page, "warning")
    assert nothing == "Released 0 in-progress records."
    assert warning.startswith("1 record changed after the confirmation page was shown")
    assert f"{SCOPE} / {mask_key('order-2042')}" in warning
    kept = second.record()
    assert (kept.state, kept.owner_token, kept.expires_at) == (
        State.IN_PROGRESS,
        taken.owner_token,
        taken.expires_at,
    )
    assert second.finish() == "charged order-2042"
    assert second.record().state == State.COMPLETED
