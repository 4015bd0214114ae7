"""``{% load idempotency %}``: an idempotency key for a browser form, htmx or a page's script.

A plain form cannot send a header, so ``{% idempotency_key_field %}`` puts
a fresh key in a hidden field (the ``FORM_FIELD`` setting names it), read
by the decorator, the DRF mixin and the middleware when no header came.
Every render makes a new key: a form re-rendered with errors is a new
submission, while the two POSTs of one double-clicked form share their key.
"""

from __future__ import annotations

import uuid

from django import template
from django.core.exceptions import ImproperlyConfigured
from django.utils.html import format_html
from django.utils.safestring import SafeString

from django_idempotency.conf import idempotency_settings

register = template.Library()


@register.simple_tag
def idempotency_key() -> str:
    """A fresh random key (a UUID4), for htmx's ``hx-headers`` or a page's own ``fetch``."""
    return str(uuid.uuid4())


@register.simple_tag
def idempotency_key_field() -> SafeString:
    """``<input type="hidden" name="idempotency_key" value="...">`` with a fresh key."""
    field = idempotency_settings.form_field
    if field is None:
        raise ImproperlyConfigured(
            "{% idempotency_key_field %} needs the FORM_FIELD setting: "
            "IDEMPOTENCY['FORM_FIELD'] is None, so the key it renders would never be read. "
            "Set it to a field name such as 'idempotency_key'."
        )
    return format_html('<input type="hidden" name="{}" value="{}">', field, idempotency_key())
