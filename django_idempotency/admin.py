"""Read-only admin for idempotency records, with a way to release stuck claims.

Records are written only by the protocol and deleted by the purge, so the
admin can look but not edit. The key itself is a bearer secret of sorts (it
replays a stored response), so it is shown masked, as in the logs, and is
searched by exact comparison within a scope, never listed in clear. The one
write is releasing in-progress claims whose owner stopped: the next retry of
each takes it over and resumes from its checkpoints
(:func:`django_idempotency.operations.release`). A lease that has not run
out may still have a live owner, so releasing one asks for confirmation on
a page of its own first, and the confirmation releases only the leases that
page showed: one taken over, released or completed since is left alone, and
named. Completed records cannot be deleted here, since that would let a
retry run its handler twice; the purge removes them once they expire
(``manage.py idempotency_keys delete`` is the operator's tool).

Everything reads and writes ``IDEMPOTENCY["DATABASE"]``, the alias the
protocol uses, not ``default``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.crypto import constant_time_compare, salted_hmac
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from django_idempotency import leases, operations
from django_idempotency.conf import idempotency_settings
from django_idempotency.keys import mask_key
from django_idempotency.models import IdempotencyKey

#: How much of a stored body the detail page shows.
BODY_SHOWN = 2000
#: The page asking before a release of leases still held; a project may override it.
RELEASE_CONFIRMATION_TEMPLATE = "admin/django_idempotency/release_confirmation.html"
#: The confirmation page's field naming each held lease it showed.
SEEN_LEASE_FIELD = "seen_lease"
#: The hidden inputs that post those fields, as the confirmation page has them.
SEEN_LEASE_INPUTS = (
    '{% for lease in seen %}<input type="hidden" name="{{ seen_field }}" value="{{ lease }}">'
    "{% endfor %}"
)
_SEEN_LEASE_SALT = "django_idempotency.admin.seen_lease"
#: A record's id as a form posts it: ASCII digits, within a 64-bit integer.
_RECORD_ID = re.compile(r"[0-9]{1,19}")
_LARGEST_ID = 2**63 - 1


class _ConditionFilter(admin.SimpleListFilter):
    """A filter whose every choice is a condition on the records."""

    #: Each choice's value, label and condition (made when filtering).
    conditions: dict[str, tuple[Any, Callable[[], Q]]]

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [(value, label) for value, (label, _condition) in self.conditions.items()]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        chosen = self.conditions.get(self.value() or "")
        return queryset if chosen is None else queryset.filter(chosen[1]())


class ExpiryFilter(_ConditionFilter):
    """Expired records are ignored by claims; the purge deletes them once no longer retained."""

    title = _("expiry")
    parameter_name = "expiry"
    conditions = {
        "expired": (_("expired"), lambda: leases.expiry_q(True)),
        "live": (_("live"), lambda: leases.expiry_q(False)),
    }


class LeaseFilter(_ConditionFilter):
    """In-progress claims by their lease: still held, abandoned (run out), or released."""

    title = _("lease")
    parameter_name = "lease"
    conditions = {
        "held": (_("held"), operations.lease_held),
        "abandoned": (_("abandoned (lease ran out)"), operations.abandoned),
        "released": (_("released"), lambda: leases.q(leases.RELEASED)),
    }


@admin.register(IdempotencyKey)
class IdempotencyKeyAdmin(admin.ModelAdmin):
    list_display = (
        "scope",
        "masked_key",
        "state",
        "attempt",
        "status_code",
        "created_at",
        "expires_at",
    )
    list_filter = ("state", LeaseFilter, ExpiryFilter)
    search_fields = ("scope",)
    search_help_text = _(
        "An exact scope (user:42, anonymous), or a scope and a key separated by a space: "
        "the key is compared, never listed."
    )
    # The primary key index, not created_at (unindexed), orders a large table.
    ordering = ("-pk",)
    show_full_result_count = False
    fields = (
        "scope",
        "masked_key",
        "fingerprint",
        "state",
        "attempt",
        "shown_checkpoints",
        "status_code",
        "response_headers",
        "body_size",
        "stored_body",
        "locked_until",
        "created_at",
        "expires_at",
    )
    readonly_fields = fields
    actions = ["release_in_progress"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return super().get_queryset(request).using(idempotency_settings.database)

    @admin.display(description=_("key (masked)"))
    def masked_key(self, obj: IdempotencyKey) -> str:
        return mask_key(obj.key)

    @admin.display(description=_("stored body"))
    def body_size(self, obj: IdempotencyKey) -> str:
        if obj.response_body is None:
            return "-"
        return ngettext("%(size)d byte", "%(size)d bytes", len(obj.response_body)) % {
            "size": len(obj.response_body)
        }

    @admin.display(description=_("checkpoints"))
    def shown_checkpoints(self, obj: IdempotencyKey) -> str:
        # Escaped by the admin like any read-only value.
        return json.dumps(obj.checkpoints, indent=2, sort_keys=True) if obj.checkpoints else "-"

    @admin.display(description=_("stored body (start)"))
    def stored_body(self, obj: IdempotencyKey) -> str:
        body = obj.response_body
        if body is None:
            return "-"
        shown = bytes(body[:BODY_SHOWN]).decode("utf-8", errors="replace")
        rest = len(body) - BODY_SHOWN
        if rest > 0:
            shown += " " + ngettext(
                "[... %(count)d more byte]", "[... %(count)d more bytes]", rest
            ) % {"count": rest}
        return shown

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        # Scopes and keys compare exactly everywhere else, and an exact match
        # is the (scope, key) unique index, not a table scan. Keys hold no
        # spaces, so "<scope> <key>" splits at the last one; a scope may hold
        # spaces, so the whole term is also tried as a scope.
        term = search_term.strip()
        if not term:
            return queryset, False
        found = Q(scope__in=operations.stored_forms(term))
        scope, _space, key = term.rpartition(" ")
        if scope.strip():
            found |= Q(
                scope__in=operations.stored_forms(scope.strip()),
                key__in=operations.stored_keys(key),
            )
        return queryset.filter(found), False

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_release_permission(self, request: HttpRequest) -> bool:
        return super().has_delete_permission(request)

    @admin.action(
        permissions=["release"],
        description=_("Release selected in-progress records (their retries resume them)"),
    )
    def release_in_progress(
        self, request: HttpRequest, queryset: QuerySet[Any]
    ) -> HttpResponse | None:
        # Owned: its lease held or run out. A released one is given back already:
        # free to any request if it has no checkpoints, else to its own
        # request's retry while it is retained.
        in_progress = queryset.filter(leases.q(leases.HELD) | leases.q(leases.ABANDONED))
        confirmed = request.POST.get("confirm") == "yes"
        if not confirmed:
            held = list(in_progress.filter(operations.lease_held()))
            if held:
                return self._confirm_release(request, queryset, held)
        # Only the leases the confirmation page showed are forced, each while
        # its owner is still the one the operator saw: the statement is
        # fenced by the token read here, which must be the page's. Every
        # other record is fenced by its lease in the same statement, so one
        # renewed or taken over since it was read is kept.
        seen = _seen_leases(request) if confirmed else {}
        # The page shows at least one lease and posts a usable field for
        # each: a confirmation with none (no field, or only empty or
        # malformed ones, as an outdated override of the template posts)
        # forces nothing. Known before the loop below consumes ``seen``.
        seen_none = confirmed and not seen
        acted_on = list(in_progress)
        if seen:
            # A record the page showed that has left the list's filter since
            # (``?lease=held``, and it completed or ran out) is still the
            # operator's: it is looked up among the selected records alone.
            listed = {record.pk for record in acted_on}
            acted_on += self.get_queryset(request).filter(pk__in=seen.keys() - listed)
        released, changed = 0, []
        for record in acted_on:
            shown = seen.pop(record.pk, None)
            if shown is not None and not constant_time_compare(shown, _seen_lease(record)):
                changed.append(record)
                continue
            try:
                if operations.release(record, force=shown is not None):
                    released += 1
                elif shown is not None:
                    changed.append(record)
            except operations.LeaseStillHeld:
                changed.append(record)
        self.message_user(
            request,
            ngettext(
                "Released %(count)d in-progress record.",
                "Released %(count)d in-progress records.",
                released,
            )
            % {"count": released},
            messages.SUCCESS if released else messages.WARNING,
        )
        if seen_none:
            self.message_user(request, _missing_seen_message(changed), messages.ERROR)
        elif changed:
            self.message_user(request, _changed_message(changed, confirmed), messages.WARNING)
        return None

    def _confirm_release(
        self, request: HttpRequest, queryset: QuerySet[Any], held: list[IdempotencyKey]
    ) -> TemplateResponse:
        """Name the leases still held: their owners may be running and would run twice."""
        context = {
            **self.admin_site.each_context(request),
            "title": _("Release leases that are still held?"),
            "opts": self.model._meta,
            "held": [(mask_key(record.key), record) for record in held],
            "selected": [str(pk) for pk in queryset.values_list("pk", flat=True)],
            "seen": [f"{record.pk}:{_seen_lease(record)}" for record in held],
            "seen_field": SEEN_LEASE_FIELD,
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, RELEASE_CONFIRMATION_TEMPLATE, context)


def _seen_lease(record: IdempotencyKey) -> str:
    """Which lease of the record this is: a digest of its owner's token, never the token.

    A new owner (a takeover) gets a new token; the same owner renewing its
    lease keeps it, and the operator saw that owner.
    """
    value = f"{record.pk}:{record.owner_token}"
    return salted_hmac(_SEEN_LEASE_SALT, value, algorithm="sha256").hexdigest()


def _seen_leases(request: HttpRequest) -> dict[int, str]:
    """The leases the confirmation page showed, by record id, among the records selected.

    A malformed value, or one naming a record that is not selected, is
    none: it forces nothing.
    """
    selected = {_record_id(value) for value in request.POST.getlist(ACTION_CHECKBOX_NAME)}
    seen = {}
    for value in request.POST.getlist(SEEN_LEASE_FIELD):
        pk, _colon, digest = value.partition(":")
        record_id = _record_id(pk)
        if record_id is not None and record_id in selected and digest:
            seen[record_id] = digest
    return seen


def _record_id(value: str) -> int | None:
    """A record id posted by a form, or ``None`` if it is not one (other digits, too large)."""
    if _RECORD_ID.fullmatch(value) is None:
        return None
    record_id = int(value)
    return record_id if 0 < record_id <= _LARGEST_ID else None


def _changed_message(changed: list[IdempotencyKey], confirmed: bool) -> str:
    names = ", ".join(f"{record.scope} / {mask_key(record.key)}" for record in changed)
    if confirmed:
        text = ngettext(
            "%(count)d record changed after the confirmation page was shown (taken over by "
            "another worker, renewed after running out, released or completed) and was left "
            "alone: %(records)s. Look at it again before releasing it.",
            "%(count)d records changed after the confirmation page was shown (taken over by "
            "another worker, renewed after running out, released or completed) and were left "
            "alone: %(records)s. Look at them again before releasing them.",
            len(changed),
        )
    else:
        text = ngettext(
            "%(count)d record was taken over or renewed since it was read, and was left "
            "alone: %(records)s.",
            "%(count)d records were taken over or renewed since they were read, and were left "
            "alone: %(records)s.",
            len(changed),
        )
    return text % {"count": len(changed), "records": names}


def _missing_seen_message(left_alone: list[IdempotencyKey]) -> str:
    """A confirmation without a usable seen lease: name the inputs and the docs on them."""
    text = ""
    if left_alone:
        names = ", ".join(f"{record.scope} / {mask_key(record.key)}" for record in left_alone)
        text = ngettext(
            "%(count)d lease still held was left alone: %(records)s. ",
            "%(count)d leases still held were left alone: %(records)s. ",
            len(left_alone),
        ) % {"count": len(left_alone), "records": names}
    return text + _(
        "The confirmation carried no usable %(field)s fields, as an outdated override of "
        "%(template)s would: it did not say which leases its page showed, so it could "
        "release no lease still held. A project that overrides that template keeps the "
        "hidden inputs the package's template has in its form: %(inputs)s "
        '(docs/operations.rst, under "What each action does", and the upgrade note on '
        "the release confirmation in the changelog)."
    ) % {
        "field": SEEN_LEASE_FIELD,
        "template": RELEASE_CONFIRMATION_TEMPLATE,
        "inputs": SEEN_LEASE_INPUTS,
    }
