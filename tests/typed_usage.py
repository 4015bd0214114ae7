"""What a type checker sees of the public decorators, checked by ``dev.py lint`` (mypy).

Not a test module: nothing runs it. Each ``type: ignore`` marks a mistake
that mypy must report; the lint runs with ``warn_unused_ignores``, so it
fails as soon as one is no longer reported.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse

from django_idempotency import idempotency_exempt, idempotent, idempotent_function
from django_idempotency.contrib.celery import idempotent_task
from django_idempotency.contrib.django_tasks import idempotent_task as idempotent_django_task


@idempotent_function(key=lambda order_id: f"charge-{order_id}")
def charge(order_id: int) -> dict[str, int]:
    return {"order": order_id}


@idempotent_function()  # type: ignore[call-arg]
def no_key(order_id: int) -> None: ...


@idempotent_task(key=lambda order_id: f"ship-{order_id}", atomic=False, lease=600)
def ship(order_id: int) -> None: ...


@idempotent_task(ttl="1h")  # type: ignore[arg-type]
def wrong_ttl(order_id: int) -> None: ...


@idempotent_task(leese=60)  # type: ignore[call-arg]
def misspelt_option(order_id: int) -> None: ...


@idempotent_django_task(wait=1.5, priority=10, queue_name="receipts")
def receipt(order_id: int) -> None: ...


@idempotent_django_task(priority="high")  # type: ignore[arg-type]
def wrong_priority(order_id: int) -> None: ...


@idempotent
def bare(request: HttpRequest) -> HttpResponse:
    return HttpResponse()


@idempotent(ttl=60)
def with_options(request: HttpRequest) -> HttpResponse:
    return HttpResponse()


@idempotency_exempt
def exempt(request: HttpRequest) -> HttpResponse:
    return HttpResponse()


def calls() -> None:
    # The decorated functions keep their own signatures.
    charge(7)["order"]
    charge("7")  # type: ignore[arg-type]
    bare(HttpRequest())
    with_options(HttpRequest())
    exempt(HttpRequest())
    bare("request")  # type: ignore[arg-type]
