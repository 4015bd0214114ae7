"""``request.idempotency``: what a protected handler knows about its key, and its progress."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asgiref.sync import sync_to_async
from django.core.serializers.json import DjangoJSONEncoder

from django_idempotency.exceptions import LeaseLost
from django_idempotency.keys import mask_key

#: Writes the checkpoints given (``None``: only renews the lease); ``False``
#: when the claim is no longer this call's.
ProgressWriter = Callable[[dict[str, Any] | None], bool]


@dataclass
class Progress:
    """Where a protected call stands: its attempt, its checkpoints, and how to record more.

    Set by the engine once the key is claimed; until then (and outside
    lease and atomic mode's claim) nothing can be recorded.
    """

    attempt: int = 1
    checkpoints: dict[str, Any] = field(default_factory=dict)
    write: ProgressWriter | None = None
    #: Lease mode: the checkpoints in force, without those recorded in a
    #: block that rolled back since; ``None``: ``checkpoints`` as recorded.
    in_force: Callable[[], dict[str, Any]] | None = None

    def current(self) -> dict[str, Any]:
        """The checkpoints a retry inside this call may skip (see ``in_force``)."""
        return self.checkpoints if self.in_force is None else self.in_force()


# Enough of the fingerprint to tell two requests apart in a log line.
_FINGERPRINT_SHOWN = 12


@dataclass(frozen=True)
class IdempotencyInfo:
    # Never in a repr: a receiver or a log line that shows the object must
    # not reveal the key, which replays the stored response to whoever has it.
    key: str = field(repr=False)
    scope: str
    fingerprint: str
    progress: Progress = field(default_factory=Progress, repr=False, compare=False)

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
        return derive(self.scope, self.key, name)

    @property
    def attempt(self) -> int:
        """1 for the first owner of the key, n + 1 after n takeovers of an abandoned claim."""
        return self.progress.attempt

    @property
    def checkpoints(self) -> dict[str, Any]:
        """What earlier owners of this key and this request recorded as done, name to data."""
        return dict(self.progress.current())

    def checkpoint(self, name: str, data: Any = None) -> None:
        """Record that the step ``name`` finished, with JSON-serialisable ``data``.

        Lease mode commits it at once, fenced by this request's owner token,
        and renews the lease, so that a retry which takes over after a crash
        can skip what is done (``checkpoints``). Raises
        :class:`~django_idempotency.exceptions.LeaseLost` when the claim is no
        longer this request's: stop before the next effect. Atomic mode
        writes it in the request's transaction.
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"A checkpoint's name must be a non-empty string, not {name!r}.")
        try:
            # As it will be read back, so that this request sees what a retry would.
            # NaN and infinities are not JSON, and PostgreSQL's jsonb refuses them.
            value = json.loads(json.dumps(data, cls=DjangoJSONEncoder, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"The data of checkpoint {name!r} must be JSON-serialisable: {exc}"
            ) from exc
        checkpoints = {**self.progress.current(), name: value}
        self._write(checkpoints)
        self.progress.checkpoints = checkpoints

    def heartbeat(self) -> None:
        """Lease mode: extend the lease to now + ``LEASE``; a no-op in atomic mode.

        Raises :class:`~django_idempotency.exceptions.LeaseLost` when the
        claim was taken over, for a handler that runs longer than its lease
        to call between steps.
        """
        self._write(None)

    async def acheckpoint(self, name: str, data: Any = None) -> None:
        """:meth:`checkpoint` from an ``async def`` view.

        Django's connections belong to a thread: this runs in the one that
        holds the claim (the request's ``thread_sensitive`` thread), where
        a plain call would raise ``SynchronousOnlyOperation``.
        """
        await sync_to_async(self.checkpoint, thread_sensitive=True)(name, data)

    async def aheartbeat(self) -> None:
        """:meth:`heartbeat` from an ``async def`` view (see :meth:`acheckpoint`)."""
        await sync_to_async(self.heartbeat, thread_sensitive=True)()

    def _write(self, checkpoints: dict[str, Any] | None) -> None:
        write = self.progress.write
        if write is None:
            raise RuntimeError("Progress can be recorded only while the protected handler runs.")
        if not write(checkpoints):
            raise LeaseLost


def derive(scope: str, key: str, name: str) -> str:
    """:meth:`IdempotencyInfo.derive` of (scope, key): the downstream key of ``name``."""
    material = "\x00".join(("django-idempotency", scope, key, name))
    return hashlib.sha256(material.encode()).hexdigest()
