"""``request.idempotency``: what a protected handler knows about its key."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class IdempotencyInfo:
    key: str
    scope: str
    fingerprint: str

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
