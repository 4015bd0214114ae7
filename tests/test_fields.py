"""The key table's column widths, and fitting a scope, key or task name into them."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from django_idempotency.fields import FINGERPRINT_COLUMN_LENGTH, KEY_COLUMN_LENGTH
from django_idempotency.models import IdempotencyKey
from django_idempotency.scopes import fit_key_column


def test_the_model_declares_its_columns_with_these_widths():
    field = IdempotencyKey._meta.get_field

    assert field("scope").max_length == field("key").max_length == KEY_COLUMN_LENGTH == 255
    assert field("fingerprint").max_length == FINGERPRINT_COLUMN_LENGTH == 64


@given(st.text(max_size=KEY_COLUMN_LENGTH).filter(lambda value: not value.startswith("sha256:")))
def test_a_value_that_fits_is_kept_as_it_is(value):
    assert fit_key_column(value) == value


@given(st.text(min_size=1, max_size=2 * KEY_COLUMN_LENGTH))
def test_no_value_is_stored_as_another_value_is(value):
    # A value that spells a long value's digest (a tenant's scope of its own
    # choosing, say) is digested in turn, not stored as that digest.
    long = value * (KEY_COLUMN_LENGTH // len(value) + 1)
    spelled = fit_key_column(long)

    assert fit_key_column(spelled) != spelled
    assert fit_key_column(spelled).startswith("sha256:")
    assert len(fit_key_column(spelled)) <= KEY_COLUMN_LENGTH


LONGER = st.text(min_size=KEY_COLUMN_LENGTH + 1, max_size=2 * KEY_COLUMN_LENGTH)


@given(LONGER, LONGER)
def test_a_longer_value_becomes_its_digest_which_fits_and_keeps_values_apart(one, other):
    fitted = fit_key_column(one)

    assert fitted.startswith("sha256:") and len(fitted) <= KEY_COLUMN_LENGTH
    assert fit_key_column(one) == fitted
    assert (fit_key_column(other) == fitted) == (one == other)
