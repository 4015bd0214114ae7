from __future__ import annotations

import hashlib
import re

import pytest
from django.test import override_settings
from hypothesis import given
from hypothesis import strategies as st

from django_idempotency.exceptions import InvalidIdempotencyKey
from django_idempotency.keys import mask_key, parse_key

VISIBLE = st.characters(min_codepoint=0x21, max_codepoint=0x7E)
# A bare key cannot hold a comma: it is what joins repeated headers.
BARE = st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters=",")
valid_keys = st.text(BARE, min_size=1, max_size=255).filter(lambda k: not k.startswith('"'))


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

    @given(st.text(BARE, min_size=256, max_size=400), st.text(VISIBLE, min_size=256, max_size=400))
    def test_key_over_max_length_is_rejected_bare_and_quoted(self, bare, quoted):
        with pytest.raises(InvalidIdempotencyKey, match="255"):
            parse_key(bare.lstrip('"').rjust(256, "k"), 255)
        with pytest.raises(InvalidIdempotencyKey, match="255"):
            parse_key(quote(quoted), 255)

    @pytest.mark.parametrize("value", ["", '""', '"', '"abc', 'a"', '"a\\x"', '"a"b"'])
    def test_empty_or_malformed_quoting_is_rejected(self, value):
        if value == 'a"':
            assert parse_key(value, 255) == 'a"'  # a bare key may contain a quote
            return
        with pytest.raises(InvalidIdempotencyKey):
            parse_key(value, 255)

    def test_length_limit_applies_inside_the_quotes(self):
        assert parse_key('"' + "k" * 10 + '"', 10) == "k" * 10

    @pytest.mark.parametrize("value", ["0\n", "abc\n", '"abc"\n', "a\nb"])
    def test_a_newline_anywhere_is_rejected(self, value):
        # A regular expression's "$" also matches before a final newline.
        with pytest.raises(InvalidIdempotencyKey):
            parse_key(value, 255)


class SeveralKeysTests:
    """Repeated ``Idempotency-Key`` headers arrive joined by commas: never one key."""

    @pytest.mark.parametrize(
        "value",
        [
            "k-a,k-b",
            "k-a, k-b",
            "k-a,k-a",
            "k-a,",
            ",k-a",
            '"k-a","k-b"',
            '"k-a", k-b',
            'k-a,"k-b"',
            '"a,b", "c"',
            # Too long and not visible ASCII as one key: the comma is what went wrong.
            ",".join(["k" * 200] * 2),
        ],
    )
    def test_joined_keys_are_refused_saying_so(self, value):
        with pytest.raises(InvalidIdempotencyKey) as refused:
            parse_key(value, 255)
        assert "more than one Idempotency-Key header" in refused.value.detail
        assert "Send one Idempotency-Key header with one key" in refused.value.detail

    @given(st.lists(valid_keys, min_size=2, max_size=4))
    def test_any_joined_bare_keys_are_refused(self, keys):
        with pytest.raises(InvalidIdempotencyKey, match="more than one"):
            parse_key(",".join(keys), 255)

    @pytest.mark.parametrize(("value", "key"), [('"a,b"', "a,b"), ('","', ","), ('"k,"', "k,")])
    def test_a_quoted_key_may_contain_commas(self, value, key):
        assert parse_key(value, 255) == key

    def test_a_malformed_quoted_key_keeps_its_own_message(self):
        with pytest.raises(InvalidIdempotencyKey, match="not a valid quoted string"):
            parse_key('"a,b', 255)


class MaskKeyTests:
    @given(valid_keys)
    def test_mask_never_contains_the_key(self, key):
        masked = mask_key(key)
        assert len(masked) == 12
        assert key not in masked or len(key) < 3

    def test_mask_is_keyed_with_the_secret_key_not_a_plain_hash(self):
        # A plain hash prefix of a guessable key is found by trying candidates.
        masked = mask_key("receipt-7")
        assert re.fullmatch(r"[0-9a-f]{12}", masked)
        assert masked != hashlib.sha256(b"receipt-7").hexdigest()[:12]
        assert masked == mask_key("receipt-7")
        assert mask_key("receipt-8") != masked
        with override_settings(SECRET_KEY="another-secret-key"):
            assert mask_key("receipt-7") != masked
