"""Signals for metrics and audit.

Each is sent with ``sender`` set to the protected view function (or DRF view
class) and the keyword arguments ``request`` and ``idempotency`` (the
:class:`~django_idempotency.info.IdempotencyInfo` of the request).
"""

from __future__ import annotations

from django.dispatch import Signal

#: A request claimed its key and its handler is about to run.
key_claimed = Signal()
#: A retry received the stored response; the handler did not run.
response_replayed = Signal()
#: A duplicate arrived while the original was in flight and got 409.
request_conflict = Signal()
#: A key was reused with a different request and got 422.
fingerprint_mismatch = Signal()
#: The response was written to the record (in atomic mode inside the request's
#: transaction, so it commits with the effect).
response_stored = Signal()
#: Lease mode: the handler raised, answered 5xx or a transient status, or its
#: response could not be stored, and the claim was given back for a retry.
claim_released = Signal()
#: A duplicate waited ``WAIT`` seconds for the in-flight original
#: and gave up; ``request_conflict`` (the 409) follows.
wait_timed_out = Signal()
#: Lease mode: a request took over a claim whose owner stopped before it
#: finished (its lease ran out); its handler runs again as the next attempt,
#: with the checkpoints recorded so far.
claim_taken_over = Signal()
#: Lease mode: the recovery policy completed an abandoned claim with its own
#: response (reconciliation); the handler did not run.
claim_recovered = Signal()
#: Lease mode: the recovery policy answered an abandoned claim with a response
#: that is not stored (held for an operator); the claim stays abandoned.
claim_held = Signal()
