from django.http import HttpRequest, JsonResponse

from example_project.provider.models import Charge


def list_charges(request: HttpRequest) -> JsonResponse:
    """What the provider has charged, for the walkthrough to count."""
    charges = Charge.objects.order_by("pk")
    if "key" in request.GET:
        charges = charges.filter(idempotency_key=request.GET["key"])
    return JsonResponse(
        {"charges": [{"id": c.pk, "amount": c.amount, "key": c.idempotency_key} for c in charges]}
    )
