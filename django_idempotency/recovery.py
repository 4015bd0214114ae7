"""What to do with an abandoned claim: a lease-mode key whose owner stopped before it finished.

The next request with that key finds the claim in progress with its lease
run out. Without a policy it takes the claim over and runs the handler
again (as attempt n + 1, with the checkpoints the dead owner recorded).
With one (the ``recover`` option, the ``RECOVER`` setting) the policy is
asked first, with what is known of the abandoned work, and may take over
(``None``), complete the key with a response of its own (reconciliation,
say after asking a payment provider whether the charge went through), or
return a response that is not stored and keeps the claim abandoned (hold
it for an operator). See the recovery page of the docs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.http import HttpRequest, HttpResponse

from django_idempotency.exceptions import CallAbandoned, RequestAbandoned
from django_idempotency.info import derive
from django_idempotency.keys import mask_key
from django_idempotency.responses import problem


@dataclass(frozen=True)
class Abandoned:
    """What a recovery policy knows of an abandoned claim."""

    scope: str
    # Never in a repr, as for request.idempotency.
    key: str = field(repr=False)
    #: When its last owner claimed it.
    created_at: datetime
    #: The dead owner's attempt: 1 for the key's first owner.
    attempt: int
    #: What its owners recorded as done, name to data.
    checkpoints: dict[str, Any]

    def __repr__(self) -> str:
        return (
            f"Abandoned(scope={self.scope!r}, key=<masked {mask_key(self.key)}>, "
            f"attempt={self.attempt}, checkpoints={sorted(self.checkpoints)!r})"
        )

    def derive(self, name: str) -> str:
        """The key the abandoned request gave a downstream call ``name`` (its ``derive``).

        To ask that system whether the call went through, by the same key.
        """
        return derive(self.scope, self.key, name)


def hold(request: HttpRequest, abandoned: Abandoned) -> HttpResponse:
    """Hold every abandoned claim for an operator: answer 409 ``request-abandoned``.

    The answer is not stored, so the claim stays abandoned and every retry
    asks again, until an operator settles it (``manage.py idempotency_keys
    release`` to let the next retry run, or a reconciling policy). A browser gets the
    page a plain view's other refusals get; a DRF view, DRF's JSON.
    """
    return problem(RequestAbandoned(), request if isinstance(request, HttpRequest) else None)


def hold_call(abandoned: Abandoned) -> Any:
    """:func:`hold` for ``idempotent_function`` and ``idempotent_task``: raise ``CallAbandoned``.

    A task's duplicate is then retried later by Celery, as for an original
    still in flight; a function's caller gets the error.
    """
    raise CallAbandoned(retry_after=60)
