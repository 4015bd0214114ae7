"""The read-only admin: masked keys, filters, and releasing stuck claims."""

from __future__ import annotations

import re
import threading
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlencode

import pytest
from django.contrib import admin
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.auth.models import Permission
from django.http import HttpResponse
from django.urls import path
from django.utils import timezone

from django_idempotency import admin as admin_module
from django_idempotency.admin import RELEASE_CONFIRMATION_TEMPLATE, SEEN_LEASE_INPUTS
from django_idempotency.clock import DatabaseNow
from django_idempotency.keys import mask_key
from django_idempotency.models import IdempotencyKey
from django_idempotency.scopes import fit_key_column
from tests import admin_leases
from tests.admin_leases import HeldCall
from tests.factories import IdempotencyKeyFactory

State = IdempotencyKey.State
CHANGELIST = "/admin/django_idempotency/idempotencykey/"
#: A project's template dir holding a copy of the release confirmation page
#: from before it posted which leases it showed.
OLD_ADMIN_TEMPLATES = Path(__file__).parent / "old_admin_templates"
#: ...and one whose input posts the field empty, from a context variable the page has not.
EMPTY_SEEN_ADMIN_TEMPLATES = Path(__file__).parent / "empty_seen_admin_templates"

# This module is also the URLconf of its tests: tests.urls has no admin.
urlpatterns = [path("admin/", admin.site.urls)]


@pytest.fixture
def admin_urls(settings):
    settings.ROOT_URLCONF = "tests.test_admin"


@pytest.fixture
def staff(admin_client, admin_urls):
    return admin_client


def row_ids(html: str) -> set[int]:
    """The records a change list page shows."""
    return {int(pk) for pk in re.findall(rf'href="{CHANGELIST}(\d+)/change/', html)}


def changelist(client, query: str = "") -> str:
    response = client.get(CHANGELIST + query)
    assert response.status_code == 200
    return response.content.decode()


@pytest.mark.django_db
class ChangelistTests:
    def test_keys_shown_masked_never_in_clear(self, staff):
        record = IdempotencyKeyFactory(key="secret-key-4f1d9a", scope="user:42")

        html = changelist(staff)

        assert mask_key(record.key) in html
        assert "user:42" in html
        assert "secret-key-4f1d9a" not in html

    def test_filter_by_state(self, staff):
        done = IdempotencyKeyFactory(key="done-key-aaaa")
        flying = IdempotencyKeyFactory(key="flying-key-bbbb", in_flight=True)

        html = changelist(staff, "?state__exact=in_progress")

        assert mask_key(flying.key) in html
        assert mask_key(done.key) not in html

    def test_filter_expired_and_live(self, staff):
        live = IdempotencyKeyFactory(key="live-key-cccc")
        old = IdempotencyKeyFactory(key="old-key-dddd", expired=True)
        lapsed = IdempotencyKeyFactory(key="lapsed-key-eeee", lease_expired=True)

        expired_html = changelist(staff, "?expiry=expired")
        live_html = changelist(staff, "?expiry=live")

        assert mask_key(old.key) in expired_html
        assert mask_key(lapsed.key) in expired_html
        assert mask_key(live.key) not in expired_html
        assert mask_key(live.key) in live_html
        assert mask_key(old.key) not in live_html
        assert mask_key(lapsed.key) not in live_html

    def test_search_matches_scope_exactly(self, staff):
        mine = IdempotencyKeyFactory(scope="user:4", key="mine-key-ffff")
        other = IdempotencyKeyFactory(scope="user:42", key="other-key-gggg")
        upper = IdempotencyKeyFactory(scope="USER:4", key="upper-key-hhhh")

        html = changelist(staff, "?q=user:4")

        assert mask_key(mine.key) in html
        assert mask_key(other.key) not in html
        assert mask_key(upper.key) not in html

    def test_search_by_scope_and_exact_key_never_shows_the_key(self, staff):
        wanted = IdempotencyKeyFactory(scope="user:4", key="order-0001-aaaa")
        same_key_elsewhere = IdempotencyKeyFactory(scope="user:5", key="order-0001-aaaa")
        other_case = IdempotencyKeyFactory(scope="user:4", key="ORDER-0001-AAAA")

        html = changelist(staff, "?q=user:4+order-0001-aaaa")

        # The operator's own search is echoed back (the search box, the links
        # that keep the filters); what the result rows show is the key masked.
        start = html.index("<tbody>", html.index('id="result_list"'))
        shown = re.sub(r"<[^>]+>", " ", html[start : html.index("</tbody>", start)])
        assert mask_key(wanted.key) in shown
        assert "order-0001-aaaa" not in shown
        assert f'href="{CHANGELIST}{same_key_elsewhere.pk}/change/' not in html
        assert f'href="{CHANGELIST}{other_case.pk}/change/' not in html
        assert f'href="{CHANGELIST}{wanted.pk}/change/' in html

    def test_search_finds_a_long_key_and_scope_as_typed_though_stored_as_digests(self, staff):
        scope = "tenant:" + " ".join(["Acme Trading"] * 30)
        key = "evt_" + "9" * 300
        wanted = IdempotencyKeyFactory(scope=fit_key_column(scope), key=fit_key_column(key))
        short = IdempotencyKeyFactory(scope=fit_key_column(scope), key="evt_1")
        assert wanted.scope.startswith("sha256:") and wanted.key.startswith("sha256:")

        by_key = changelist(staff, "?" + urlencode({"q": f"{scope} {key}"}))
        by_scope = changelist(staff, "?" + urlencode({"q": scope}))
        by_digest = changelist(staff, "?" + urlencode({"q": wanted.scope}))

        assert row_ids(by_key) == {wanted.pk}
        assert row_ids(by_scope) == row_ids(by_digest) == {wanted.pk, short.pk}

    def test_search_finds_a_function_key_stored_as_its_digest(self, staff, transactional_db):
        order = "order-" + "7" * 300
        admin_leases.complete(order)
        other = IdempotencyKeyFactory(scope=admin_leases.SCOPE, key="order-1")

        html = changelist(staff, "?" + urlencode({"q": f"{admin_leases.SCOPE} {order}"}))

        stored = IdempotencyKey.objects.get(scope=admin_leases.SCOPE, key=fit_key_column(order))
        assert row_ids(html) == {stored.pk}
        assert other.pk not in row_ids(html)

    def test_search_finds_a_key_typed_as_its_header_quotes_it(self, staff):
        wanted = IdempotencyKeyFactory(scope="user:4", key="order-0002-bbbb")

        html = changelist(staff, "?" + urlencode({"q": 'user:4 "order-0002-bbbb"'}))

        assert row_ids(html) == {wanted.pk}

    def test_search_for_a_digest_finds_the_digest_never_a_value_spelling_it(self, staff):
        long_scope = "tenant:" + "Acme Trading " * 30
        digest = fit_key_column(long_scope)
        wanted = IdempotencyKeyFactory(scope=digest, key="k-1")
        # A tenant whose scope of its own choosing spells that digest is
        # stored as a digest of its own: typing the digest must not find it.
        spelled = IdempotencyKeyFactory(scope=fit_key_column(digest), key="k-1")
        assert spelled.scope != digest

        by_scope = changelist(staff, "?" + urlencode({"q": digest}))
        by_scope_and_key = changelist(staff, "?" + urlencode({"q": f"{digest} k-1"}))

        assert row_ids(by_scope) == row_ids(by_scope_and_key) == {wanted.pk}

    def test_search_for_a_key_digest_finds_the_digest_never_a_key_spelling_it(self, staff):
        digest = fit_key_column("evt_" + "9" * 300)
        wanted = IdempotencyKeyFactory(scope="user:4", key=digest)
        spelled = IdempotencyKeyFactory(scope="user:4", key=fit_key_column(digest))
        assert spelled.key != digest

        plain = changelist(staff, "?" + urlencode({"q": f"user:4 {digest}"}))
        quoted = changelist(staff, "?" + urlencode({"q": f'user:4 "{digest}"'}))

        assert row_ids(plain) == row_ids(quoted) == {wanted.pk}

    @pytest.mark.parametrize(
        ("key", "typed"),
        [('a"b-0001', r'"a\"b-0001"'), ("a\\b-0001", r'"a\\b-0001"')],
        ids=["escaped-quote", "escaped-backslash"],
    )
    def test_search_unescapes_a_quoted_key_as_a_header_does(self, staff, key, typed):
        wanted = IdempotencyKeyFactory(scope="user:4", key=key)
        IdempotencyKeyFactory(scope="user:4", key=typed[1:-1])

        html = changelist(staff, "?" + urlencode({"q": f"user:4 {typed}"}))

        assert row_ids(html) == {wanted.pk}

    def test_search_by_a_scope_with_spaces(self, staff):
        wanted = IdempotencyKeyFactory(scope="tenant:Acme Trading", key="k-1")
        IdempotencyKeyFactory(scope="tenant:Acme", key="Trading")

        html = changelist(staff, "?" + urlencode({"q": "tenant:Acme Trading"}))
        keyed = changelist(staff, "?" + urlencode({"q": "tenant:Acme Trading k-1"}))

        # Both readings: the whole term a scope, or a scope and a key.
        assert len(row_ids(html)) == 2
        assert wanted.pk in row_ids(html)
        assert row_ids(keyed) == {wanted.pk}

    def test_filter_by_lease(self, staff):
        held = IdempotencyKeyFactory(in_flight=True)
        abandoned = IdempotencyKeyFactory(lease_expired=True)
        released = IdempotencyKeyFactory(lease_expired=True, owner_token="")
        done = IdempotencyKeyFactory()

        def shown(value: str) -> set[int]:
            html = changelist(staff, f"?lease={value}")
            return {r.pk for r in (held, abandoned, released, done) if f"{r.pk}/change/" in html}

        assert shown("held") == {held.pk}
        assert shown("abandoned") == {abandoned.pk}
        assert shown("released") == {released.pk}


@pytest.mark.django_db
class DetailTests:
    def test_body_shown_escaped_and_truncated(self, staff):
        record = IdempotencyKeyFactory(response_body=b"<script>alert(1)</script>" + b"x" * 3000)

        html = staff.get(f"{CHANGELIST}{record.pk}/change/").content.decode()

        assert "<script>alert(1)</script>" not in html
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
        assert "[... 1025 more bytes]" in html

    def test_checkpoints_and_attempt_shown(self, staff):
        record = IdempotencyKeyFactory(
            lease_expired=True, attempt=3, checkpoints={"charged": {"charge": 17}}
        )

        html = staff.get(f"{CHANGELIST}{record.pk}/change/").content.decode()

        assert "&quot;charged&quot;" in html
        assert "&quot;charge&quot;: 17" in html
        assert ">3<" in html.replace(" ", "").replace("\n", "")

    def test_detail_is_read_only_and_masked(self, staff):
        record = IdempotencyKeyFactory(key="detail-key-iiii", response_body=b"0123456789")

        response = staff.get(f"{CHANGELIST}{record.pk}/change/")

        html = response.content.decode()
        assert response.status_code == 200
        assert "detail-key-iiii" not in html
        assert mask_key(record.key) in html
        assert "10 bytes" in html
        # Shown as text, with no form field to edit and no button to save.
        assert 'name="status_code"' not in html
        assert 'name="scope"' not in html
        assert 'name="_save"' not in html

    def test_post_to_detail_changes_nothing(self, staff):
        record = IdempotencyKeyFactory(status_code=201)

        response = staff.post(
            f"{CHANGELIST}{record.pk}/change/", {"status_code": "500", "scope": "x"}
        )

        assert response.status_code == 403
        record.refresh_from_db()
        assert (record.status_code, record.scope) == (201, "anonymous")

    def test_no_add_and_no_delete(self, staff):
        record = IdempotencyKeyFactory()

        assert staff.get(f"{CHANGELIST}add/").status_code == 403
        assert staff.post(f"{CHANGELIST}{record.pk}/delete/", {"post": "yes"}).status_code == 403
        assert IdempotencyKey.objects.filter(pk=record.pk).exists()
        assert "delete_selected" not in changelist(staff)


def released(using: str = "default") -> set[int]:
    """The records released for their next retry: in progress, token cleared, lease over."""
    return set(
        IdempotencyKey.objects.using(using)
        .filter(state=State.IN_PROGRESS, owner_token="", expires_at__lte=DatabaseNow())
        .values_list("pk", flat=True)
    )


@pytest.mark.django_db
class ReleaseActionTests:
    def test_release_frees_only_in_progress_records(self, staff):
        stuck = IdempotencyKeyFactory(lease_expired=True)
        also_stuck = IdempotencyKeyFactory(lease_expired=True)
        done = IdempotencyKeyFactory()
        old = IdempotencyKeyFactory(expired=True)
        selected = [stuck, also_stuck, done, old]

        response = staff.post(
            CHANGELIST,
            {
                "action": "release_in_progress",
                ACTION_CHECKBOX_NAME: [str(record.pk) for record in selected],
                "index": "0",
            },
            follow=True,
        )

        assert response.status_code == 200
        assert "Released 2 in-progress records." in response.content.decode()
        assert released() == {stuck.pk, also_stuck.pk}
        for record in (done, old):
            assert IdempotencyKey.objects.get(pk=record.pk).state == State.COMPLETED

    def test_release_leaves_unselected_records(self, staff):
        chosen = IdempotencyKeyFactory(lease_expired=True)
        other = IdempotencyKeyFactory(lease_expired=True)

        staff.post(
            CHANGELIST,
            {"action": "release_in_progress", ACTION_CHECKBOX_NAME: [str(chosen.pk)]},
        )

        assert released() == {chosen.pk}
        assert IdempotencyKey.objects.get(pk=other.pk).owner_token != ""

    def test_release_needs_delete_permission(self, client, admin_urls, django_user_model):
        viewer = django_user_model.objects.create_user("viewer", password="pw", is_staff=True)
        viewer.user_permissions.add(Permission.objects.get(codename="view_idempotencykey"))
        client.force_login(viewer)
        stuck = IdempotencyKeyFactory(lease_expired=True)

        html = changelist(client)
        client.post(
            CHANGELIST,
            {"action": "release_in_progress", ACTION_CHECKBOX_NAME: [str(stuck.pk)]},
        )

        assert "release_in_progress" not in html
        assert released() == set()

    def test_held_lease_asks_for_confirmation_and_releases_nothing(self, staff):
        running = IdempotencyKeyFactory(in_flight=True, key="running-key-jjjj")
        stuck = IdempotencyKeyFactory(lease_expired=True)

        response = staff.post(
            CHANGELIST,
            {
                "action": "release_in_progress",
                ACTION_CHECKBOX_NAME: [str(running.pk), str(stuck.pk)],
            },
        )

        html = response.content.decode()
        assert response.status_code == 200
        assert "Release leases that are still held?" in html
        assert mask_key(running.key) in html
        assert "running-key-jjjj" not in html
        assert 'name="confirm" value="yes"' in html
        assert released() == set()

    def test_held_lease_released_once_confirmed(self, staff):
        running = IdempotencyKeyFactory(in_flight=True)
        done = IdempotencyKeyFactory()
        page = staff.post(CHANGELIST, release_action(running, done))

        response = staff.post(CHANGELIST, confirmation_form(page), follow=True)

        assert "Released 1 in-progress record." in response.content.decode()
        assert released() == {running.pk}

    def test_a_lease_renewed_by_its_owner_since_the_page_is_still_released(self, staff):
        running = IdempotencyKeyFactory(in_flight=True)
        page = staff.post(CHANGELIST, release_action(running))
        IdempotencyKey.objects.filter(pk=running.pk).update(
            locked_until=timezone.now() + timedelta(minutes=10)
        )

        response = staff.post(CHANGELIST, confirmation_form(page), follow=True)

        assert "Released 1 in-progress record." in response.content.decode()
        assert released() == {running.pk}

    def test_a_confirmation_without_the_page_forces_nothing(self, staff):
        running = IdempotencyKeyFactory(in_flight=True, scope="user:3")

        response = staff.post(
            CHANGELIST, {**release_action(running), "confirm": "yes"}, follow=True
        )

        html = response.content.decode()
        assert "Released 0 in-progress records." in html
        assert f"left alone: user:3 / {mask_key(running.key)}" in html
        assert released() == set()

    def test_an_overridden_page_without_the_seen_leases_names_them_and_the_fix(
        self, staff, settings
    ):
        # A project's copy of the confirmation page from before its hidden
        # seen_lease inputs, found first in the project's template dirs.
        settings.TEMPLATES = [{**settings.TEMPLATES[0], "DIRS": [OLD_ADMIN_TEMPLATES]}]
        running = IdempotencyKeyFactory(in_flight=True, scope="user:3")
        form = confirmation_form(staff.post(CHANGELIST, release_action(running)))
        assert "seen_lease" not in form

        response = staff.post(CHANGELIST, form, follow=True)

        shown = messages_in(response)
        assert shown[0] == ("warning", "Released 0 in-progress records.")
        (error,) = [text for level, text in shown if level == "error"]
        assert error == no_seen_lease_error(running)
        assert not any("changed after the confirmation page" in text for _, text in shown)
        assert released() == set()

    def test_an_overridden_page_posting_an_empty_seen_lease_names_the_inputs_and_the_fix(
        self, staff, settings
    ):
        settings.TEMPLATES = [{**settings.TEMPLATES[0], "DIRS": [EMPTY_SEEN_ADMIN_TEMPLATES]}]
        running = IdempotencyKeyFactory(in_flight=True, scope="user:3")
        form = confirmation_form(staff.post(CHANGELIST, release_action(running)))
        assert form["seen_lease"] == [""]

        response = staff.post(CHANGELIST, form, follow=True)

        shown = messages_in(response)
        assert shown[0] == ("warning", "Released 0 in-progress records.")
        (error,) = [text for level, text in shown if level == "error"]
        assert error == no_seen_lease_error(running)
        assert not any("changed after the confirmation page" in text for _, text in shown)
        assert released() == set()

    def test_the_inputs_the_message_names_are_the_package_template_s(self):
        template = Path(admin_module.__file__).parent / "templates" / RELEASE_CONFIRMATION_TEMPLATE

        assert SEEN_LEASE_INPUTS in template.read_text()

    def test_a_lease_completed_since_the_page_is_named(self, staff):
        running = IdempotencyKeyFactory(in_flight=True, scope="user:3")
        page = staff.post(CHANGELIST, release_action(running))
        IdempotencyKey.objects.filter(pk=running.pk).update(
            state=State.COMPLETED, owner_token="", locked_until=None, status_code=201
        )

        response = staff.post(CHANGELIST, confirmation_form(page), follow=True)

        html = response.content.decode()
        assert "Released 0 in-progress records." in html
        assert "1 record changed after the confirmation page was shown" in html
        assert f"user:3 / {mask_key(running.key)}" in html
        assert IdempotencyKey.objects.get(pk=running.pk).state == State.COMPLETED

    @pytest.mark.parametrize(
        "value",
        [
            "\u00b2:{digest}",  # a superscript two: str.isdigit() says yes, int() says no
            "1" * 5000 + ":{digest}",  # past int()'s limit on digits
            "99999999999999999999999:{digest}",  # past a 64-bit integer
            "9223372036854775808:{digest}",  # 2**63: 19 digits, one past the largest id
            "-{pk}:{digest}",
            " {pk}:{digest}",
            "{pk}",
            "{pk}:",
            ":{digest}",
        ],
        ids=[
            "superscript",
            "5000-digits",
            "23-digits",
            "2-to-the-63",
            "negative",
            "space",
            "no-digest",
            "empty-digest",
            "no-id",
        ],
    )
    def test_a_malformed_seen_lease_forces_nothing(self, staff, value):
        running = IdempotencyKeyFactory(in_flight=True, scope="user:3")
        form = confirmation_form(staff.post(CHANGELIST, release_action(running)))
        (seen,) = form["seen_lease"]
        digest = seen.partition(":")[2]
        form["seen_lease"] = [value.format(pk=running.pk, digest=digest)]

        response = staff.post(CHANGELIST, form, follow=True)

        assert response.status_code == 200
        shown = messages_in(response)
        assert ("warning", "Released 0 in-progress records.") in shown
        assert any(f"left alone: user:3 / {mask_key(running.key)}" in text for _, text in shown)
        assert released() == set()

    def test_an_id_in_other_digits_forces_nothing(self, staff):
        # int() reads Arabic-Indic digits as the id they spell.
        running = IdempotencyKeyFactory(in_flight=True)
        form = confirmation_form(staff.post(CHANGELIST, release_action(running)))
        (seen,) = form["seen_lease"]
        pk, _colon, digest = seen.partition(":")
        other_digits = pk.translate(
            str.maketrans(
                "0123456789", "\u0660\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669"
            )
        )
        form["seen_lease"] = [f"{other_digits}:{digest}"]

        response = staff.post(CHANGELIST, form, follow=True)

        assert ("warning", "Released 0 in-progress records.") in messages_in(response)
        assert released() == set()

    def test_a_tampered_digest_forces_nothing(self, staff):
        running = IdempotencyKeyFactory(in_flight=True, scope="user:3")
        form = confirmation_form(staff.post(CHANGELIST, release_action(running)))
        (seen,) = form["seen_lease"]
        form["seen_lease"] = [seen[:-1] + ("0" if seen[-1] != "0" else "1")]

        response = staff.post(CHANGELIST, form, follow=True)

        shown = messages_in(response)
        assert ("warning", "Released 0 in-progress records.") in shown
        assert any("1 record changed after the confirmation page" in text for _, text in shown)
        assert released() == set()

    def test_swapped_digests_force_nothing(self, staff):
        first = IdempotencyKeyFactory(in_flight=True)
        second = IdempotencyKeyFactory(in_flight=True)
        form = confirmation_form(staff.post(CHANGELIST, release_action(first, second)))
        digests = dict(value.split(":") for value in form["seen_lease"])
        form["seen_lease"] = [
            f"{first.pk}:{digests[str(second.pk)]}",
            f"{second.pk}:{digests[str(first.pk)]}",
        ]

        response = staff.post(CHANGELIST, form, follow=True)

        shown = messages_in(response)
        assert ("warning", "Released 0 in-progress records.") in shown
        assert any("2 records changed after the confirmation page" in text for _, text in shown)
        assert released() == set()

    def test_a_seen_lease_of_a_record_not_selected_forces_nothing(self, staff):
        chosen = IdempotencyKeyFactory(in_flight=True)
        other = IdempotencyKeyFactory(in_flight=True)
        # The digest of the other record's lease is genuine: from a page of its own.
        (other_seen,) = confirmation_form(staff.post(CHANGELIST, release_action(other)))[
            "seen_lease"
        ]
        form = confirmation_form(staff.post(CHANGELIST, release_action(chosen)))
        form["seen_lease"].append(other_seen)

        response = staff.post(CHANGELIST, form, follow=True)

        assert ("success", "Released 1 in-progress record.") in messages_in(response)
        assert released() == {chosen.pk}

    def test_a_lease_completed_since_the_page_is_named_under_a_list_filter(self, staff):
        running = IdempotencyKeyFactory(in_flight=True, scope="user:3")
        held_list = CHANGELIST + "?lease=held"
        page = staff.post(held_list, release_action(running))
        IdempotencyKey.objects.filter(pk=running.pk).update(
            state=State.COMPLETED, owner_token="", locked_until=None, status_code=201
        )

        response = staff.post(held_list, confirmation_form(page), follow=True)

        shown = messages_in(response)
        assert ("warning", "Released 0 in-progress records.") in shown
        (changed,) = [text for level, text in shown if "changed after" in text]
        assert changed.startswith("1 record changed after the confirmation page was shown")
        assert f"user:3 / {mask_key(running.key)}" in changed
        assert IdempotencyKey.objects.get(pk=running.pk).state == State.COMPLETED

    def test_a_lease_run_out_since_the_page_is_released_under_a_list_filter(self, staff):
        """The owner the page showed stalled past its lease: it left the held list, not the page."""
        running = IdempotencyKeyFactory(in_flight=True)
        held_list = CHANGELIST + "?lease=held"
        page = staff.post(held_list, release_action(running))
        IdempotencyKey.objects.filter(pk=running.pk).update(
            locked_until=DatabaseNow(), expires_at=DatabaseNow()
        )

        response = staff.post(held_list, confirmation_form(page), follow=True)

        assert messages_in(response) == [("success", "Released 1 in-progress record.")]
        assert released() == {running.pk}


def messages_in(response: HttpResponse) -> list[tuple[str, str]]:
    """The admin's messages on a page: (level, text)."""
    html = response.content.decode()
    return re.findall(r'<li class="(\w+)">(.*?)</li>', html[html.find('class="messagelist"') :])


def no_seen_lease_error(running: IdempotencyKey) -> str:
    """The error, as the page shows it, for a confirmation of ``running`` without a seen lease."""
    return (
        f"1 lease still held was left alone: {running.scope} / {mask_key(running.key)}. "
        "The confirmation carried no usable seen_lease fields, as an outdated override of "
        "admin/django_idempotency/release_confirmation.html would: it did not say which "
        "leases its page showed, so it could release no lease still held. A project that "
        "overrides that template keeps the hidden inputs the package&#x27;s template has in "
        "its form: {% for lease in seen %}&lt;input type=&quot;hidden&quot; "
        "name=&quot;{{ seen_field }}&quot; value=&quot;{{ lease }}&quot;&gt;{% endfor %} "
        "(docs/operations.rst, under &quot;What each action does&quot;, and the upgrade note "
        "on the release confirmation in the changelog)."
    )


def release_action(*selected: IdempotencyKey) -> dict[str, object]:
    """The change list's form: the release action on ``selected``."""
    return {
        "action": "release_in_progress",
        ACTION_CHECKBOX_NAME: [str(record.pk) for record in selected],
        "index": "0",
    }


def confirmation_form(page: HttpResponse) -> dict[str, list[str]]:
    """What the confirmation page's "Yes" button sends: its hidden fields."""
    assert page.status_code == 200
    html = page.content.decode()
    assert "Release leases that are still held?" in html
    form: dict[str, list[str]] = {}
    for name, value in re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', html):
        form.setdefault(name, []).append(value)
    assert form["confirm"] == ["yes"]
    return form


@pytest.mark.django_db(transaction=True)
class TakenOverSinceTheConfirmationTests:
    """The confirmation releases the lease the operator saw, never its next holder's."""

    def test_a_lease_taken_over_since_the_page_is_kept(self, staff):
        first = admin_leases.hold("order-2001")
        page = staff.post(CHANGELIST, release_action(first.record()))
        # Meanwhile the first owner stalls past its lease, and a retry takes
        # the key over: a new owner, running.
        admin_leases.run_out(first.record())
        second = admin_leases.hold("order-2001")
        assert second.record().attempt == 2
        taken = second.record()

        response = staff.post(CHANGELIST, confirmation_form(page), follow=True)

        html = response.content.decode()
        assert "Released 0 in-progress records." in html
        assert "1 record changed after the confirmation page was shown" in html
        assert f"{admin_leases.SCOPE} / {mask_key('order-2001')}" in html
        kept = second.record()
        assert (kept.state, kept.owner_token, kept.expires_at) == (
            State.IN_PROGRESS,
            taken.owner_token,
            taken.expires_at,
        )
        # The new owner finishes, and its result is the one stored.
        assert second.finish() == "charged order-2001"
        assert first.finish() == "charged order-2001"
        done = second.record()
        assert (done.state, done.attempt, bytes(done.response_body)) == (
            State.COMPLETED,
            2,
            b'"charged order-2001"',
        )

    def test_an_abandoned_lease_taken_over_since_the_page_is_kept(self, staff):
        """Selected with a held one, a run-out lease is released unforced: a new owner keeps it."""
        running = admin_leases.hold("order-2002")
        stalled = admin_leases.hold("order-2003")
        admin_leases.run_out(stalled.record())
        page = staff.post(CHANGELIST, release_action(running.record(), stalled.record()))
        retry = admin_leases.hold("order-2003")

        response = staff.post(CHANGELIST, confirmation_form(page), follow=True)

        html = response.content.decode()
        assert "Released 1 in-progress record." in html
        assert f"{admin_leases.SCOPE} / {mask_key('order-2003')}" in html
        assert released() == {running.record().pk}
        assert retry.record().owner_token != ""
        for call in (running, stalled, retry):
            call.finish()
        assert retry.record().state == State.COMPLETED


@pytest.mark.django_db(transaction=True)
class HeldCallsTests:
    def test_every_held_call_is_let_finish_when_one_raises(self):
        def failed() -> None:
            raise RuntimeError("the first call failed")

        broken = HeldCall("order-2090", threading.Event(), failed)
        running = admin_leases.hold("order-2091")

        with pytest.raises(RuntimeError, match="the first call failed"):
            admin_leases.finish_all([broken, running])

        # Let go and waited for: it ran to its end, not to its time limit.
        assert running.record().state == State.COMPLETED


@pytest.mark.django_db(databases=["default", "other"])
class OtherDatabaseTests:
    """IDEMPOTENCY["DATABASE"] names the alias the admin reads and writes."""

    @pytest.fixture(autouse=True)
    def idempotency_on_other(self, settings):
        settings.IDEMPOTENCY = {"DATABASE": "other"}

    def test_changelist_and_detail_read_the_configured_alias(self, staff):
        there = IdempotencyKeyFactory._meta.model.objects.using("other").create(
            scope="user:7",
            key="other-db-key-kkkk",
            fingerprint="f" * 64,
            state=State.COMPLETED,
            status_code=201,
            expires_at=IdempotencyKeyFactory.build().expires_at,
        )
        here = IdempotencyKeyFactory(key="default-db-key-llll")

        html = changelist(staff)
        detail = staff.get(f"{CHANGELIST}{there.pk}/change/")

        assert mask_key(there.key) in html
        assert mask_key(here.key) not in html
        assert detail.status_code == 200
        assert mask_key(there.key) in detail.content.decode()

    def test_release_frees_on_the_configured_alias(self, staff):
        stuck = IdempotencyKeyFactory.build(lease_expired=True)
        stuck.save(using="other")

        staff.post(
            CHANGELIST,
            {"action": "release_in_progress", ACTION_CHECKBOX_NAME: [str(stuck.pk)]},
        )

        assert released("other") == {stuck.pk}
