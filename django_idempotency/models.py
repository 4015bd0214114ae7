"""One record per (scope, key): the durable truth about who owns a key."""

from __future__ import annotations

from django.db import models
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from django_idempotency.fields import (
    FINGERPRINT_COLUMN_LENGTH,
    KEY_COLUMN_LENGTH,
    ExactCharField,
)


class IdempotencyKey(models.Model):
    class State(models.TextChoices):
        IN_PROGRESS = "in_progress", _("in progress")
        COMPLETED = "completed", _("completed")

    id = models.BigAutoField(primary_key=True)
    scope = ExactCharField(_("scope"), max_length=KEY_COLUMN_LENGTH)
    key = ExactCharField(_("key"), max_length=KEY_COLUMN_LENGTH)
    fingerprint = models.CharField(_("fingerprint"), max_length=FINGERPRINT_COLUMN_LENGTH)
    state = models.CharField(
        _("state"), max_length=16, choices=State.choices, default=State.IN_PROGRESS
    )
    # The stored response. A completed record with a NULL body had a
    # response too large (or streaming) to store: it replays without a body.
    status_code = models.PositiveSmallIntegerField(_("status code"), null=True, blank=True)
    response_headers = models.JSONField(_("response headers"), null=True, blank=True)
    response_body = models.BinaryField(_("response body"), null=True, blank=True)
    # Lease mode: the claim commits on its own and is owned by this random
    # token until locked_until; completion and release match on the token.
    owner_token = models.CharField(_("owner token"), max_length=32, blank=True, default="")
    locked_until = models.DateTimeField(_("locked until"), null=True, blank=True)
    created_at = models.DateTimeField(_("created at"), default=timezone.now)
    # Lease mode: 1 for a key's first owner, n + 1 after n takeovers of an
    # abandoned claim; and the steps its owners recorded as done
    # (``request.idempotency.checkpoint``), name to JSON data.
    attempt = models.PositiveIntegerField(_("attempt"), default=1)
    checkpoints = models.JSONField(_("checkpoints"), null=True, blank=True)
    # While a lease is held this equals locked_until, so one indexed column
    # answers "may this key be taken over?"; it is also where the purge walks.
    expires_at = models.DateTimeField(_("expires at"))
    # Lease mode: the end of the lease (as the claim, a takeover, a renewal
    # or a release last wrote it) plus the key's TTL. A claim left in progress
    # (released, or abandoned by an owner that died) carries its progress
    # to the retry, so the purge keeps it until then even once its lease
    # (expires_at) is over; NULL in atomic mode, which leaves no claim behind.
    retained_until = models.DateTimeField(_("retained until"), null=True, blank=True)

    class Meta:
        verbose_name = _("idempotency key")
        verbose_name_plural = _("idempotency keys")
        constraints = [
            models.UniqueConstraint(fields=["scope", "key"], name="idempotency_scope_key_uniq"),
        ]
        indexes = [
            models.Index(fields=["expires_at"], name="idempotency_expires_at_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.scope} / {self.state}"
