from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from django_idempotency.exceptions import InvalidIdempotencyKey
from django_idempotency.keys import mask_key, parse_key

VISIBLE = st.characters(min_codepoint=0x21, max_codepoint=0x7E)
valid_keys = st.text(VISIBLE, min_size=1, max_size=255).filter(lambda k: not k.startswith('"'))


def quote(key: str) -> str:
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


class ParseKeyTests:
    @given(valid_keys)
    def test_visible_ascii_key_is_accepted_bare(self, key):
        assert parse_key(key, 255) == key

    @given(st.text(VISIBLE, min_size=1, max_size=255))
    def test_quoted_key_denotes_the_same_key(self, key):
        assert parse_key(quote(key), 255) == key

    @given(
        st.text(min_size=1, max_size=40).filter(
            lambda k: any(not 0x21 <= ord(c) <= 0x7E for c in k)
        )
    )
    def test_key_with_any_other_character_is_rejected(self, key):
        with pytest.raises(InvalidIdempotencyKey):
            parse_key(key.lstrip('"') or " ", 255)

    @given(st.text(VISIBLE, min_size=256, max_size=400))
    def test_key_over_max_length_is_rejected_bare_and_quoted(self, key):
        with pytest.raises(InvalidIdempotencyKey, match="255"):
            parse_key(key.lstrip('"').rjust(256, "k"), 255)
        with pytest.raises(InvalidIdempotencyKey, match="255"):
            parse_key(quote(key), 255)

    @pytest.mark.parametrize("value", ["", '""', '"', '"abc', 'a"', '"a\\x"', '"a"b"'])
    def test_empty_or_malformed_quoting_is_rejected(self, value):
        if value == 'a"':
            assert parse_key(value, 255) == 'a"'  # a bare key may contain a quote
            return
        with pytest.raises(InvalidIdempotencyKey):
            parse_key(value, 255)

    def test_length_limit_applies_inside_the_quotes(self):
        assert parse_key('"' + "k" * 10 + '"', 10) == "k" * 10


class MaskKeyTests:
    @given(valid_keys)
    def test_mask_never_contains_the_key(self, key):
        masked = mask_key(key)
        assert len(masked) == 12
        assert key not in masked or len(key) < 3
