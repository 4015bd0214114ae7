"""``request.idempotency``: what a protected handler knows about its key."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from django_idempotency.keys import mask_key

# Enough of the fingerprint to tell two requests apart in a log line.
_FINGERPRINT_SHOWN = 12


@dataclass(frozen=True)
class IdempotencyInfo:
    # Never in a repr: a receiver or a log line that shows the object must
    # not reveal the key, which replays the stored response to whoever has it.
    key: str = field(repr=False)
    scope: str
    fingerprint: str

    def __repr__(self) -> str:
        fingerprint = self.fingerprint
        if len(fingerprint) > _FINGERPRINT_SHOWN:
            fingerprint = fingerprint[:_FINGERPRINT_SHOWN] + "..."
        return (
            f"IdempotencyInfo(key=<masked {mask_key(self.key)}>, scope={self.scope!r}, "
            f"fingerprint={fingerprint!r})"
        )

    def derive(self, name: str) -> str:
        """A stable key for a downstream call, the same on every retry and takeover.

        Pass it as the idempotency key of a payment provider or any other
        remote system, so that a retry which runs the handler again (after a
        crash, in lease mode) does not repeat the remote effect. It depends
        only on the scope, the key and ``name``, never on time or on secrets
        that might rotate, and reveals neither.
        """
        material = "\x00".join(("django-idempotency", self.scope, self.key, name))
        return hashlib.sha256(material.encode()).hexdigest()
