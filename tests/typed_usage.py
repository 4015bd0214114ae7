"""What a type checker sees of the public decorators, checked by ``dev.py lint`` (mypy).

Not a test module: nothing runs it. Each ``type: ignore`` marks a mistake
that mypy must report; the lint runs with ``warn_unused_ignores``, so it
fails as soon as one is no longer reported.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse

from django_idempotency import idempotency_exempt, idempotent, idempotent_function


@idempotent_function(key=lambda order_id: f"charge-{order_id}")
def charge(order_id: int) -> dict[str, int]:
    return {"order": order_id}


@idempotent_function()  # type: ignore[call-arg]
def no_key(order_id: int) -> None: ...


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
