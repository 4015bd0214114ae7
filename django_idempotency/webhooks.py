"""Webhook receivers: the provider's event id as the key, and only a 2xx completes it.

A provider redelivers an event until it gets a 2xx, sometimes several
deliveries at once. Each preset is a dict of per-view options::

    @csrf_exempt
    @webhooks.stripe_signature(lambda: settings.STRIPE_WEBHOOK_SECRET)
    @idempotent(**webhooks.STRIPE)
    def stripe_webhook(request): ...

Each keys and fingerprints by the event id alone (a redelivery whose
envelope changed is the same event), scopes by ``webhook:<provider>``,
answers 400 to a delivery without an id, keeps the record past the
provider's redelivery window, and stores only a 2xx (:func:`success_only`).
Override by merging: ``@idempotent(**{**webhooks.STRIPE, "ttl": timedelta(days=30)})``.

The signature checks (:func:`stripe_signature`, :func:`github_signature`,
:func:`standard_signature`) go *above* ``@idempotent``, so that a forged
delivery is refused before it can claim an event id. They need no provider SDK.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import time
from collections.abc import Callable
from datetime import timedelta
from functools import wraps
from typing import Any, TypeVar

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse, HttpResponseBase

__all__ = [
    "GITHUB",
    "STANDARD",
    "STRIPE",
    "Signature",
    "github_signature",
    "standard_signature",
    "stripe_signature",
    "success_only",
]

View = TypeVar("View", bound=Callable[..., Any])
Secret = str | bytes | Callable[[], str | bytes]

#: How far a signed timestamp may be from this host's clock, as the
#: providers' own libraries allow by default (Stripe, Standard Webhooks).
DEFAULT_TOLERANCE = 300


def success_only(response: HttpResponseBase) -> bool:
    """True for a 2xx answer only: a provider redelivers on anything else.

    Any other answer rolls back (atomic mode) or releases the key (lease
    mode), so the next delivery runs instead of replaying, say, a 404.
    """
    return 200 <= response.status_code < 300


def stripe_event_id(request: HttpRequest) -> str | None:
    """The ``id`` of a Stripe event (``evt_...``), from the JSON body; ``None`` without one."""
    try:
        event = json.loads(request.body)
    except (ValueError, RecursionError):  # not JSON, or nested past Python's limit
        return None
    event_id = event.get("id") if isinstance(event, dict) else None
    return event_id if isinstance(event_id, str) else None


stripe_event_id.source = 'the event\'s "id" in the JSON body'  # type: ignore[attr-defined]


def github_delivery_id(request: HttpRequest) -> str | None:
    """The ``X-GitHub-Delivery`` header: one GUID per event, kept by a redelivery."""
    value: str | None = request.META.get("HTTP_X_GITHUB_DELIVERY")
    return value


github_delivery_id.source = "the X-GitHub-Delivery header"  # type: ignore[attr-defined]


def standard_webhook_id(request: HttpRequest) -> str | None:
    """The ``webhook-id`` header of the Standard Webhooks convention (Svix and others)."""
    value: str | None = request.META.get("HTTP_WEBHOOK_ID")
    return value


standard_webhook_id.source = "the webhook-id header"  # type: ignore[attr-defined]


def _fingerprint_of(event_id: Callable[[HttpRequest], str | None]) -> Callable[[HttpRequest], str]:
    """A fingerprint of the event id alone: the envelope changes between deliveries."""

    def fingerprint(request: HttpRequest) -> str:
        material = f"webhook-event:{event_id(request) or ''}"
        return hashlib.sha256(material.encode()).hexdigest()

    fingerprint.__name__ = fingerprint.__qualname__ = f"{event_id.__name__}_fingerprint"
    return fingerprint


def _scope(provider: str) -> Callable[[HttpRequest], str]:
    scope = f"webhook:{provider}"

    def provider_scope(request: HttpRequest) -> str:
        return scope

    provider_scope.__name__ = provider_scope.__qualname__ = f"{provider}_scope"
    return provider_scope


def _preset(
    provider: str, event_id: Callable[[HttpRequest], str | None], ttl: timedelta
) -> dict[str, Any]:
    return {
        "key": event_id,
        "fingerprint": _fingerprint_of(event_id),
        "scope": _scope(provider),
        "required": True,
        "ttl": ttl,
        "store": success_only,
    }


#: Stripe retries for up to three days, and an event can be resent by hand
#: (docs.stripe.com/webhooks, "Retry behavior"); seven days outlasts both.
STRIPE: dict[str, Any] = _preset("stripe", stripe_event_id, timedelta(days=7))

#: GitHub redelivers only by hand, within three days (seven on Enterprise
#: Server), with the same ``X-GitHub-Delivery`` GUID (docs.github.com,
#: "Redelivering webhooks"); eight days outlasts both.
GITHUB: dict[str, Any] = _preset("github", github_delivery_id, timedelta(days=8))

#: Standard Webhooks' example schedule retries for 75.5 hours
#: (standardwebhooks.com, "Deliverability and reliability"); seven days outlasts it.
STANDARD: dict[str, Any] = _preset("standard", standard_webhook_id, timedelta(days=7))


class Signature:
    """A provider's signature check, usable as a view decorator or called on a request.

    As a decorator above ``@idempotent`` (sync or async view), it answers
    400 to a bad signature before the key is claimed. ``is_valid(request)``
    is the check alone; ``headers(body)`` signs a body as the provider
    would, for tests.
    """

    #: The header that carries the signature, for the 400's message.
    header = ""

    def __init__(self, secret: Secret, tolerance: int = DEFAULT_TOLERANCE) -> None:
        if not (isinstance(secret, str | bytes) or callable(secret)):
            raise TypeError(
                f"{type(self).__name__}'s secret must be a str, bytes, or a callable returning "
                f"one (e.g. lambda: settings.WEBHOOK_SECRET), not {type(secret).__name__}."
            )
        self._secret = secret
        self.tolerance = tolerance
        if not callable(secret):
            self.secret()  # a literal secret is checked where it is written

    def secret(self) -> bytes:
        """The key to sign with; an empty or malformed one raises ``ImproperlyConfigured``.

        An empty HMAC key would let anyone sign. A callable's value is read,
        and so checked, at each delivery, so a bad secret fails it with a 500, which the provider
        redelivers once the secret is fixed.
        """
        value = self._secret() if callable(self._secret) else self._secret
        if not isinstance(value, str | bytes) or not value:
            raise ImproperlyConfigured(
                f"The webhook signing secret is {value!r}: set the endpoint's secret, as the "
                "provider's dashboard shows it."
            )
        return value.encode() if isinstance(value, str) else value

    def is_valid(self, request: HttpRequest) -> bool:
        raise NotImplementedError

    def headers(self, body: bytes, **fields: Any) -> dict[str, str]:
        raise NotImplementedError

    def _age(self, timestamp: str) -> int | None:
        """Seconds since ``timestamp`` by this host's clock; ``None`` for no number."""
        if not (timestamp.isascii() and timestamp.isdigit()) or len(timestamp) > 12:
            return None
        return int(time.time()) - int(timestamp)

    def _fresh(self, timestamp: str) -> bool:
        age = self._age(timestamp)
        return age is not None and abs(age) <= self.tolerance

    def __call__(self, view: View) -> View:
        def refused() -> HttpResponse:
            detail = (
                f"The {self.header} header is missing, too old, or does not match the body "
                "and the endpoint's secret."
            )
            document = {"type": "about:blank", "title": "Bad Request", "status": 400}
            return HttpResponse(
                json.dumps({**document, "detail": detail}),
                status=400,
                content_type="application/problem+json",
            )

        if iscoroutinefunction(view):

            @wraps(view)
            async def acheck(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
                if not self.is_valid(request):
                    return refused()
                return await view(request, *args, **kwargs)

            return markcoroutinefunction(acheck)  # type: ignore[return-value]

        @wraps(view)
        def check(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            if not self.is_valid(request):
                return refused()
            return view(request, *args, **kwargs)

        return check  # type: ignore[return-value]


def _hmac(key: bytes, message: bytes) -> bytes:
    return hmac.new(key, message, hashlib.sha256).digest()


def _same(expected: str, sent: str) -> bool:
    """A constant-time comparison that is false, not an error, for a value that is not ASCII."""
    return sent.isascii() and hmac.compare_digest(expected.encode(), sent.encode())


def _fields(header: str) -> list[tuple[str, str]]:
    return [
        (name.strip(), value.strip())
        for name, _, value in (item.partition("=") for item in header.split(","))
    ]


class _Stripe(Signature):
    header = "Stripe-Signature"

    def is_valid(self, request: HttpRequest) -> bool:
        fields = _fields(request.META.get("HTTP_STRIPE_SIGNATURE", ""))
        timestamps = [value for name, value in fields if name == "t"]
        if len(timestamps) != 1:
            return False
        # As Stripe's own libraries: too old is refused, a host clock behind is not.
        age = self._age(timestamps[0])
        if age is None or age > self.tolerance:
            return False
        expected = _hmac(self.secret(), timestamps[0].encode() + b"." + request.body).hex()
        # More than one v1 while the endpoint's secret is being rolled.
        return any(_same(expected, value) for name, value in fields if name == "v1")

    def headers(self, body: bytes, **fields: Any) -> dict[str, str]:
        timestamp = str(fields.get("timestamp", int(time.time())))
        digest = _hmac(self.secret(), timestamp.encode() + b"." + body).hex()
        return {self.header: f"t={timestamp},v1={digest}"}


class _GitHub(Signature):
    header = "X-Hub-Signature-256"

    def is_valid(self, request: HttpRequest) -> bool:
        sent = request.META.get("HTTP_X_HUB_SIGNATURE_256", "")
        expected = "sha256=" + _hmac(self.secret(), request.body).hex()
        return _same(expected, sent)

    def headers(self, body: bytes, **fields: Any) -> dict[str, str]:
        return {self.header: "sha256=" + _hmac(self.secret(), body).hex()}


class _Standard(Signature):
    header = "webhook-signature"

    def secret(self) -> bytes:
        # Serialised as whsec_<base64>; what is signed with is the decoded bytes.
        raw = super().secret()
        encoded = raw.removeprefix(b"whsec_")
        try:
            key = base64.b64decode(encoded, validate=True)
        except binascii.Error:
            key = b""
        if not key:
            raise ImproperlyConfigured(
                "A Standard Webhooks secret is base64, usually prefixed whsec_ "
                "(as the provider's dashboard shows it); this one does not decode to a key."
            )
        return key

    def _signed(self, webhook_id: str, timestamp: str, body: bytes) -> str:
        content = f"{webhook_id}.{timestamp}.".encode() + body
        return base64.b64encode(_hmac(self.secret(), content)).decode()

    def is_valid(self, request: HttpRequest) -> bool:
        webhook_id = request.META.get("HTTP_WEBHOOK_ID", "")
        timestamp = request.META.get("HTTP_WEBHOOK_TIMESTAMP", "")
        if not webhook_id or not self._fresh(timestamp):
            return False
        expected = self._signed(webhook_id, timestamp, request.body)
        # Space-separated "v1,<base64>" entries: several while a secret is rolled.
        sent = request.META.get("HTTP_WEBHOOK_SIGNATURE", "").split()
        return any(
            _same(expected, signature)
            for version, _, signature in (entry.partition(",") for entry in sent)
            if version == "v1"
        )

    def headers(self, body: bytes, **fields: Any) -> dict[str, str]:
        webhook_id = str(fields["id"])
        timestamp = str(fields.get("timestamp", int(time.time())))
        return {
            "webhook-id": webhook_id,
            "webhook-timestamp": timestamp,
            "webhook-signature": "v1," + self._signed(webhook_id, timestamp, body),
        }


def stripe_signature(secret: Secret, tolerance: int = DEFAULT_TOLERANCE) -> Signature:
    """Stripe's ``Stripe-Signature``: ``t=...,v1=<HMAC-SHA256 of "t.body">``.

    The timestamp may be at most ``tolerance`` seconds old by this host's
    clock; as in Stripe's libraries, one from the future is not refused.
    """
    return _Stripe(secret, tolerance)


def github_signature(secret: Secret) -> Signature:
    """GitHub's ``X-Hub-Signature-256`` (``sha256=<HMAC-SHA256 of the body>``)."""
    return _GitHub(secret)


def standard_signature(secret: Secret, tolerance: int = DEFAULT_TOLERANCE) -> Signature:
    """Standard Webhooks' ``webhook-signature`` (``v1,<base64 HMAC of "id.timestamp.body">``).

    ``secret`` as the provider shows it (``whsec_<base64>``). ``headers(body,
    id=...)`` signs a body under a ``webhook-id``.
    """
    return _Standard(secret, tolerance)
