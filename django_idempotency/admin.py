"""Read-only admin for idempotency records, with a way to release stuck claims.

Records are written only by the protocol and deleted by the purge, so the
admin can look but not edit. The key itself is a bearer secret of sorts (it
replays a stored response), so it is shown masked, as in the logs. The one
write is releasing in-progress claims whose owner died: a retry of each then
runs its handler again. A lease that has not run out may still have a live
owner, so releasing one asks for confirmation on a page of its own first.
Completed records cannot be deleted here, since that too would let a retry
run its handler twice; the purge removes them once they expire.

Everything reads and writes ``IDEMPOTENCY["DATABASE"]``, the alias the
protocol uses, not ``default``.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from django_idempotency.conf import idempotency_settings
from django_idempotency.keys import mask_key
from django_idempotency.models import IdempotencyKey


class ExpiryFilter(admin.SimpleListFilter):
    """Expired records are ignored by claims and wait for the purge."""

    title = _("expiry")
    parameter_name = "expiry"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [("expired", _("expired")), ("live", _("live"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        now = timezone.now()
        if self.value() == "expired":
            return queryset.filter(expires_at__lte=now)
        if self.value() == "live":
            return queryset.filter(expires_at__gt=now)
        return queryset


@admin.register(IdempotencyKey)
class IdempotencyKeyAdmin(admin.ModelAdmin):
    list_display = ("scope", "masked_key", "state", "status_code", "created_at", "expires_at")
    list_filter = ("state", ExpiryFilter)
    search_fields = ("scope",)
    search_help_text = _("Exact scope, e.g. user:42 or anonymous.")
    # The primary key index, not created_at (unindexed), orders a large table.
    ordering = ("-pk",)
    show_full_result_count = False
    fields = (
        "scope",
        "masked_key",
        "fingerprint",
        "state",
        "status_code",
        "response_headers",
        "body_size",
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

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        # Scopes compare exactly everywhere else, and an exact match is the
        # prefix of the (scope, key) unique index, not a table scan.
        term = search_term.strip()
        if not term:
            return queryset, False
        return queryset.filter(scope=term), False

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
        description=_("Release selected in-progress records (their retries run again)"),
    )
    def release_in_progress(
        self, request: HttpRequest, queryset: QuerySet[Any]
    ) -> HttpResponse | None:
        in_progress = queryset.filter(state=IdempotencyKey.State.IN_PROGRESS)
        held = list(in_progress.filter(_lease_held(timezone.now())))
        if held and request.POST.get("confirm") != "yes":
            return self._confirm_release(request, queryset, held)
        # Filtered in the DELETE itself, so a record that completed after the
        # page was loaded is left alone.
        released, _ignored = in_progress.delete()
        self.message_user(
            request,
            ngettext(
                "Released %(count)d in-progress record.",
                "Released %(count)d in-progress records.",
                released,
            )
            % {"count": released},
            messages.SUCCESS,
        )
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
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(
            request, "admin/django_idempotency/release_confirmation.html", context
        )


def _lease_held(now: Any) -> Q:
    return Q(locked_until__gt=now) | Q(locked_until__isnull=True, expires_at__gt=now)
