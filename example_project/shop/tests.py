"""The shop's own tests, written with django_idempotency.testing as a user would."""

from __future__ import annotations

from django.contrib.auth.models import User
from django.test import TestCase, TransactionTestCase
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from django_idempotency.testing import assert_idempotent
from example_project.provider.models import Charge
from example_project.shop.models import Booking, Order, Payment


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
