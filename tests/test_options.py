"""``options.py``: what a view's ``_non_atomic_requests`` says, read at each request."""

from __future__ import annotations

import pytest
from django.test import override_settings

from django_idempotency.options import DeclaredOptions, NonAtomicRequests


def declared(**given: object) -> DeclaredOptions:
    return DeclaredOptions(given, lambda name: f"the test's {name}")


class NonAtomicRequestsTests:
    def test_lease_mode_leaves_every_database_out_of_request_transactions(self, settings) -> None:
        marks = NonAtomicRequests(declared(atomic=False))

        assert set(marks) == set(settings.DATABASES)
        assert len(marks) == len(settings.DATABASES)
        assert "default" in marks

    def test_atomic_mode_keeps_only_what_the_view_was_marked_with(self) -> None:
        marks = NonAtomicRequests(declared(atomic=True), frozenset({"other"}))

        assert set(marks) == {"other"}
        assert "default" not in marks
        assert repr(marks) == "NonAtomicRequests({'other'})"

    def test_the_mode_follows_the_setting_at_each_request(self) -> None:
        marks = NonAtomicRequests(declared())

        with override_settings(IDEMPOTENCY={"ATOMIC": False}):
            assert "default" in marks
        with override_settings(IDEMPOTENCY={"ATOMIC": True}):
            assert "default" not in marks

    @pytest.mark.parametrize("atomic", [True, False])
    def test_set_operations_give_a_plain_set_decided_now(self, atomic: bool) -> None:
        marks = NonAtomicRequests(declared(atomic=atomic), frozenset({"other"}))

        joined = marks | {"extra"}

        assert isinstance(joined, frozenset)
        assert joined == set(marks) | {"extra"}
