import json

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from django_idempotency import idempotent
from example_project.shop.models import Order


@csrf_exempt
@require_POST
@idempotent
def create_order(request: HttpRequest) -> JsonResponse:
    """Place an order; a retry with the same Idempotency-Key gets the same answer."""
    try:
        data = json.loads(request.body or b"{}")
        item = str(data["item"])
        quantity = int(data.get("quantity", 1))
    except (ValueError, KeyError, TypeError):
        return JsonResponse({"error": "send JSON with an 'item'"}, status=400)
    order = Order.objects.create(item=item, quantity=quantity)
    response = JsonResponse(
        {"id": order.pk, "item": order.item, "quantity": order.quantity}, status=201
    )
    response["Location"] = f"/orders/{order.pk}/"
    return response
