"""The shop's own tests, written with django_idempotency.testing as a user would."""

from __future__ import annotations

import re

from django.contrib.auth.models import User
from django.test import TestCase, TransactionTestCase, override_settings
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from django_idempotency.testing import assert_idempotent
from example_project.provider import client as provider
from example_project.provider.models import Charge
from example_project.shop.models import Booking, Order, Payment, Receipt
from example_project.shop.tasks import send_receipt


class OrderTests(TestCase):
    def test_create_order_is_idempotent(self) -> None:
        assert_idempotent(
            self.client, "post", "/orders/", {"item": "book"}, effect=Order.objects.count
        )

    def test_async_create_order_is_idempotent(self) -> None:
        assert_idempotent(
            self.client, "post", "/async-orders/", {"item": "lamp"}, effect=Order.objects.count
        )


class BookingTests(TransactionTestCase):
    def test_concurrent_bookings_are_one_booking(self) -> None:
        user = User.objects.create_user("ada")
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")

        check = assert_idempotent(
            client,
            "post",
            "/api/bookings/",
            {"slot": "fri-19", "guests": 2},
            effect=Booking.objects.count,
            duplicates=8,
        )

        self.assertTrue(check.concurrent)
        self.assertEqual(Booking.objects.get().user, user)


class PaymentTests(TestCase):
    def test_payment_charges_once(self) -> None:
        assert_idempotent(
            self.client,
            "post",
            "/payments/",
            {"reference": "inv-1", "amount": 500},
            effect=lambda: (Payment.objects.count(), Charge.objects.count()),
        )
        self.assertEqual(Charge.objects.count(), 1)


class ReceiptTests(TestCase):
    def test_receipt_is_published_on_commit_and_written_once(self) -> None:
        order = Order.objects.create(item="book")
        headers = {"Idempotency-Key": "receipt-1"}
        with self.captureOnCommitCallbacks() as published:
            first = self.client.post(
                "/receipts/", {"order": order.pk}, "application/json", headers=headers
            )
        with self.captureOnCommitCallbacks() as replayed:
            self.client.post("/receipts/", {"order": order.pk}, "application/json", headers=headers)

        self.assertEqual(first.status_code, 202)
        self.assertEqual((len(published), len(replayed)), (1, 0))
        # What the worker does with that message, and with a second publish:
        results = [send_receipt.apply(args=[order.pk]).get() for _ in range(2)]
        self.assertEqual(Receipt.objects.filter(order=order).count(), 1)
        self.assertEqual(results[0], results[1])


class CorsTests(TestCase):
    """A browser front end on another origin can send the key and read the replay marker."""

    origin = "http://localhost:3000"

    def test_preflight_allows_the_key_header(self) -> None:
        response = self.client.options(
            "/orders/",
            headers={
                "Origin": self.origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type, idempotency-key",
            },
        )

        self.assertIn("idempotency-key", response["Access-Control-Allow-Headers"])

    def test_replay_and_retry_after_headers_are_exposed(self) -> None:
        headers = {"Origin": self.origin, "Idempotency-Key": "cors-1"}
        for _ in range(2):
            response = self.client.post(
                "/orders/", {"item": "book"}, content_type="application/json", headers=headers
            )

        self.assertEqual(response["Idempotent-Replayed"], "true")
        exposed = {name.strip() for name in response["Access-Control-Expose-Headers"].split(",")}
        self.assertLessEqual({"Idempotent-Replayed", "Retry-After"}, exposed)


class ProviderWebhookTests(TransactionTestCase):
    """The provider's signed ``charge.settled`` webhook, received with ``webhooks.STANDARD``."""

    def deliver(self, charge: Charge, event_id: str) -> object:
        body, headers = provider.settled_event(charge, event_id)
        return self.client.post(
            "/webhooks/provider/", body, content_type="application/json", headers=headers
        )

    def test_a_redelivered_settlement_takes_effect_once(self) -> None:
        charge = provider.charge(10, "charge-1")
        payment = Payment.objects.create(reference="r-1", amount=10, charge_id=charge.pk)

        answers = [self.deliver(charge, "msg_settled_1") for _ in range(3)]

        assert [a.status_code for a in answers] == [200, 200, 200]
        assert [a.get("Idempotent-Replayed") for a in answers] == [None, "true", "true"]
        payment.refresh_from_db()
        assert payment.settlements == 1

    def test_a_settlement_that_comes_too_early_runs_when_redelivered(self) -> None:
        charge = provider.charge(10, "charge-2")

        early = self.deliver(charge, "msg_settled_2")
        payment = Payment.objects.create(reference="r-2", amount=10, charge_id=charge.pk)
        later = self.deliver(charge, "msg_settled_2")

        assert (early.status_code, later.status_code) == (404, 200)
        assert later.get("Idempotent-Replayed") is None
        payment.refresh_from_db()
        assert payment.settlements == 1

    def test_a_forged_settlement_is_refused(self) -> None:
        charge = provider.charge(10, "charge-3")
        Payment.objects.create(reference="r-3", amount=10, charge_id=charge.pk)
        body, headers = provider.settled_event(charge, "msg_settled_3")
        headers["webhook-signature"] = "v1,Zm9yZ2Vk"

        forged = self.client.post(
            "/webhooks/provider/", body, content_type="application/json", headers=headers
        )

        assert forged.status_code == 400
        assert Payment.objects.get(reference="r-3").settlements == 0


@override_settings(EXAMPLE_CHECKOUT_SECONDS=0)
class CheckoutTests(TestCase):
    """The browser checkout: the key comes from the form's hidden field."""

    def test_a_form_posted_twice_is_one_order_and_the_same_redirect(self) -> None:
        page = self.client.get("/checkout/")
        key = re.search(r'name="idempotency_key" value="([^"]+)"', page.content.decode())
        assert key is not None
        data = {"item": "book", "quantity": "2", "idempotency_key": key.group(1)}

        first = self.client.post("/checkout/", data)
        second = self.client.post("/checkout/", data)

        self.assertEqual(first.status_code, 302)
        self.assertEqual(second["Location"], first["Location"])
        self.assertEqual(second["Idempotent-Replayed"], "true")
        self.assertEqual(Order.objects.get().quantity, 2)
        self.assertContains(self.client.get(first["Location"]), "2 x book")
