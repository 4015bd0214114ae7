from __future__ import annotations

import datetime
import hashlib
import json
import sys
from decimal import Decimal

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.http import QueryDict
from django.test import RequestFactory
from hypothesis import given, settings
from hypothesis import strategies as st

from django_idempotency.body import close_spools_with
from django_idempotency.fingerprint import canonical_json, canonical_parsed
from django_idempotency.fingerprint import request_fingerprint as package_fingerprint


def request_fingerprint(request) -> str:
    """The package's fingerprint, then the request's copies of its body closed.

    Under a protected view the response closes them; called directly, the
    test does.
    """
    try:
        return package_fingerprint(request)
    finally:
        close_spools_with(request, None)


factory = RequestFactory()

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


def fingerprint(body: bytes | str, content_type="application/json", path="/orders/", **extra):
    request = factory.post(path, body, content_type=content_type, **extra)
    return request_fingerprint(request)


def shuffled_dump(value, rng) -> str:
    """Dump JSON with keys in another order, extra whitespace and floats as x.0."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return (
            "{ "
            + " , ".join(f"{json.dumps(k)} :\n{shuffled_dump(v, rng)}" for k, v in items)
            + " }"
        )
    if isinstance(value, list):
        return "[ " + ",\t".join(shuffled_dump(v, rng) for v in value) + " ]"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value}.0" if rng.random() < 0.5 else f"{value}"
    return json.dumps(value)


class JsonCanonicalisationTests:
    @settings(max_examples=200)
    @given(json_values, st.randoms(use_true_random=False))
    def test_reordered_reformatted_json_has_the_same_fingerprint(self, value, rng):
        assert fingerprint(json.dumps(value)) == fingerprint(shuffled_dump(value, rng))

    @given(json_values, json_values)
    def test_different_json_values_have_different_canonical_forms(self, a, b):
        def numeric(v):
            return json.loads(json.dumps(v), parse_float=Decimal, parse_int=Decimal)

        if numeric(a) != numeric(b):
            assert canonical_json(json.dumps(a).encode()) != canonical_json(json.dumps(b).encode())

    def test_numbers_compare_by_value(self):
        assert fingerprint('{"n": 10}') == fingerprint('{"n": 10.0}') == fingerprint('{"n": 1e1}')
        assert fingerprint('{"n": 0}') == fingerprint('{"n": -0.0}')
        assert fingerprint('{"n": 10}') != fingerprint('{"n": 11}')
        big = "1" + "0" * 40
        assert fingerprint(f'{{"n": {big}1}}') != fingerprint(f'{{"n": {big}2}}')

    def test_array_order_is_kept(self):
        assert fingerprint("[1, 2]") != fingerprint("[2, 1]")

    def test_strings_are_not_numbers(self):
        assert fingerprint('{"n": "10"}') != fingerprint('{"n": 10}')

    def test_invalid_json_is_hashed_as_bytes(self):
        assert fingerprint(b"{not json") == fingerprint(b"{not json")
        assert fingerprint(b"{not json") != fingerprint(b"{not  json")
        assert fingerprint(b'{"a": NaN}') != fingerprint(b'{"a": null}')
        assert fingerprint(b"\xff\xfe{") != fingerprint(b"\xff\xfd{")

    def test_deeply_nested_json_does_not_crash(self):
        deep = "[" * 100_000 + "]" * 100_000
        assert len(fingerprint(deep)) == 64

    def test_vendor_json_types_are_canonicalised(self):
        ct = "application/vnd.api+json"
        assert fingerprint('{"a":1,"b":2}', ct) == fingerprint('{"b": 2, "a": 1}', ct)


class RequestPartsTests:
    def test_method_path_query_and_content_type_all_count(self):
        base = fingerprint("{}")
        assert base != fingerprint("{}", path="/other/")
        assert base != fingerprint("{}", path="/orders/?a=1")
        assert base != fingerprint("{}", content_type="text/plain")
        assert base != request_fingerprint(factory.patch("/orders/", "{}", "application/json"))

    def test_query_string_order_does_not_count(self):
        assert fingerprint("{}", path="/o/?a=1&b=2") == fingerprint("{}", path="/o/?b=2&a=1")

    def test_content_type_parameters_do_not_count(self):
        assert fingerprint("{}") == fingerprint(
            "{}", content_type="application/json; charset=utf-8"
        )

    def test_form_bodies_are_sorted(self):
        ct = "application/x-www-form-urlencoded"
        assert fingerprint("a=1&b=2", ct) == fingerprint("b=2&a=1", ct)
        assert fingerprint("a=1&b=2", ct) != fingerprint("a=1&b=3", ct)

    def test_form_past_django_field_limit_is_hashed_as_bytes(self, settings):
        settings.DATA_UPLOAD_MAX_NUMBER_FIELDS = 3
        form = "application/x-www-form-urlencoded"
        assert fingerprint("a=1&b=2&c=3", form) == fingerprint("c=3&b=2&a=1", form)
        assert fingerprint("a=1&b=2&c=3&d=4", form) != fingerprint("d=4&c=3&b=2&a=1", form)
        assert fingerprint("", path="/o/?a=1&b=2&c=3") == fingerprint("", path="/o/?c=3&b=2&a=1")
        assert fingerprint("", path="/o/?a=1&b=2&c=3&d=4") != fingerprint(
            "", path="/o/?d=4&c=3&b=2&a=1"
        )

    def test_other_bodies_are_bytes(self):
        ct = "application/octet-stream"
        assert fingerprint(b"\x00\x01", ct) != fingerprint(b"\x01\x00", ct)

    def test_multipart_boundary_does_not_count_but_content_does(self):
        from django.core.files.uploadedfile import SimpleUploadedFile
        from django.test.client import encode_multipart

        def multipart(boundary: str, content: bytes) -> str:
            upload = SimpleUploadedFile("a.txt", content, content_type="text/plain")
            body = encode_multipart(boundary, {"name": "x", "file": upload})
            request = factory.post(
                "/upload/", body, content_type=f"multipart/form-data; boundary={boundary}"
            )
            return request_fingerprint(request)

        assert multipart("BoUnDaRy1", b"hello") == multipart("OtherBoundary2", b"hello")
        assert multipart("BoUnDaRy1", b"hello") != multipart("BoUnDaRy1", b"hellO")


class ParsedBodyTests:
    def test_body_parsed_by_drf_still_fingerprints_by_content(self):
        from rest_framework.parsers import JSONParser
        from rest_framework.request import Request

        def parsed(body: str) -> str:
            request = Request(
                factory.post("/o/", body, content_type="application/json"),
                parsers=[JSONParser()],
            )
            assert request.data is not None
            return request_fingerprint(request)

        assert parsed('{"b": 1, "a": 2}') == parsed('{"a": 2, "b": 1}')
        assert parsed('{"b": 1, "a": 2}') != parsed('{"b": 1, "a": 3}')

    def test_stream_consumed_before_us_falls_back_to_parsed_data(self):
        from rest_framework.parsers import JSONParser
        from rest_framework.request import Request

        def parsed(body: str) -> Request:
            request = Request(
                factory.post("/o/", body, content_type="application/json"),
                parsers=[JSONParser()],
            )
            assert request.data is not None  # a permission read request.data first
            assert request._request._read_started
            return request

        first = request_fingerprint(parsed('{"a": 1}'))
        assert first == request_fingerprint(parsed('{"a":1}'))
        assert first != request_fingerprint(parsed('{"a": 2}'))

    def test_plain_request_whose_stream_a_middleware_parsed_fingerprints_its_data(self):
        # A middleware did request.data = json.loads(request.read()): only that is left.
        def consumed(body: str) -> str:
            request = factory.post("/o/", body, content_type="application/json")
            request.data = json.loads(request.read())  # type: ignore[attr-defined]
            return request_fingerprint(request)

        assert consumed('{"amount": 10}') == consumed('{"amount":10.0}')
        assert consumed('{"amount": 10}') != consumed('{"amount": 9999}')


class CanonicalParsedTests:
    def test_numbers_compare_by_value_whatever_their_type(self):
        forms = [{"q": 10}, {"q": 10.0}, {"q": Decimal("1e1")}, {"q": Decimal("10.00")}]
        assert len({canonical_parsed(value) for value in forms}) == 1
        assert canonical_parsed({"q": 0.1}) == canonical_parsed({"q": Decimal("0.1")})
        assert canonical_parsed({"q": 0.1}) != canonical_parsed({"q": 0.2})
        assert canonical_parsed({"q": 1}) != canonical_parsed({"q": True})
        assert canonical_parsed({"q": 1}) != canonical_parsed({"q": "1"})

    def test_keys_are_sorted_and_values_keep_their_order(self):
        assert canonical_parsed({"b": 1, "a": [1, 2]}) == canonical_parsed({"a": [1, 2], "b": 1})
        assert canonical_parsed({"a": [1, 2]}) != canonical_parsed({"a": [2, 1]})
        first, second = QueryDict("a=1&a=2&b=3"), QueryDict("b=3&a=1&a=2")
        assert canonical_parsed(first) == canonical_parsed(second)
        assert canonical_parsed(first) != canonical_parsed(QueryDict("a=2&a=1&b=3"))

    def test_uploads_count_by_content_and_are_rewound(self):
        def upload(content: bytes) -> SimpleUploadedFile:
            return SimpleUploadedFile("invoice.pdf", content, content_type="application/pdf")

        one = upload(b"pay 10 EUR")
        assert canonical_parsed({"file": one}) == canonical_parsed({"file": upload(b"pay 10 EUR")})
        assert canonical_parsed({"file": one}) != canonical_parsed({"file": upload(b"pay 99 EUR")})
        assert one.read() == b"pay 10 EUR"

    def test_bytes_and_sets_count_by_content(self):
        assert canonical_parsed(b"abc") == canonical_parsed(bytearray(b"abc"))
        assert canonical_parsed(b"abc") != canonical_parsed(b"abd")
        assert canonical_parsed({1, 2.0}) == canonical_parsed(frozenset({2, 1}))
        assert canonical_parsed({1, 2}) != canonical_parsed([1, 2])

    def test_data_nested_deeper_than_the_canonical_form_goes_still_fingerprints(self):
        from rest_framework.parsers import BaseParser
        from rest_framework.request import Request

        def parsed(data: object) -> Request:
            class Gives(BaseParser):
                """A parser that consumes the stream and returns ``data``, however deep."""

                media_type = "application/json"

                def parse(self, stream, media_type=None, parser_context=None):
                    stream.read()
                    return data

            request = Request(
                factory.post("/o/", "[]", content_type="application/json"), parsers=[Gives()]
            )
            assert request.data is data
            return request

        def nested(depth: int, leaf: object) -> list:
            value: list = [leaf]
            for _ in range(depth):
                value = [value]
            return value

        depth = sys.getrecursionlimit() * 3 // 4
        assert request_fingerprint(parsed(nested(depth, 1))) == request_fingerprint(
            parsed(nested(depth, 1))
        )
        assert request_fingerprint(parsed(nested(depth, 1))) != request_fingerprint(
            parsed(nested(depth, 2))
        )

    def test_other_objects_have_a_deterministic_form(self):
        class Plain:
            def __init__(self, amount: int) -> None:
                self.amount = amount

        assert canonical_parsed(Plain(10)) == canonical_parsed(Plain(10))
        assert canonical_parsed(Plain(10)) != canonical_parsed(Plain(11))
        assert "0x" not in canonical_parsed(Plain(10))

        class Slotted:
            __slots__ = ("amount",)

            def __init__(self, amount: int) -> None:
                self.amount = amount

        assert canonical_parsed(Slotted(10)) == canonical_parsed(Slotted(10))
        assert canonical_parsed(Slotted(10)) != canonical_parsed(Slotted(11))
        assert canonical_parsed(float("inf")) != canonical_parsed("Infinity")
        assert canonical_parsed(float("inf")) == canonical_parsed(Decimal("Infinity"))
        day = datetime.date(2026, 12, 1)
        assert canonical_parsed(day) == canonical_parsed(datetime.date(2026, 12, 1))
        assert canonical_parsed(day) != canonical_parsed("2026-12-01")


class LongFingerprintTests:
    def test_custom_fingerprint_longer_than_the_column_is_digested(self, client, settings, db):
        from django_idempotency.models import IdempotencyKey

        settings.IDEMPOTENCY = {"FINGERPRINT": "tests.test_fingerprint.long_fingerprint"}
        headers = {"Idempotency-Key": "k"}
        client.post("/orders/", "{}", content_type="application/json", headers=headers)
        retry = client.post("/orders/", "{}", content_type="application/json", headers=headers)

        assert retry["Idempotent-Replayed"] == "true"
        assert len(IdempotencyKey.objects.get().fingerprint) == 64


def long_fingerprint(request) -> str:
    return "x" * 500 + request.path


FORM = "application/x-www-form-urlencoded"
pairs_strategy = st.lists(
    st.tuples(st.sampled_from(["a", "b", "name"]), st.text(max_size=3)), max_size=8
)


def interleave_keeping_each_names_order(pairs, rng) -> list:
    """Any order of ``pairs`` in which each name's values keep their order."""
    queues: dict[str, list] = {}
    for name, value in pairs:
        queues.setdefault(name, []).append(value)
    order = [name for name, _ in pairs]
    rng.shuffle(order)
    return [(name, queues[name].pop(0)) for name in order]


def multipart_fingerprint(method: str, fields, boundary: str = "BoUnDaRy", files=()) -> str:
    from django.core.files.uploadedfile import SimpleUploadedFile
    from django.test.client import encode_multipart

    data: dict[str, list] = {}
    for name, value in fields:
        data.setdefault(name, []).append(value)
    for name, filename, content in files:
        upload = SimpleUploadedFile(filename, content, content_type="text/plain")
        data.setdefault(name, []).append(upload)
    body = encode_multipart(boundary, data)
    request = factory.generic(
        method, "/upload/", body, content_type=f"multipart/form-data; boundary={boundary}"
    )
    return request_fingerprint(request)


class ValueOrderTests:
    def test_form_values_of_one_name_keep_their_order(self):
        assert fingerprint("name=a&name=b", FORM) != fingerprint("name=b&name=a", FORM)

    def test_query_values_of_one_name_keep_their_order(self):
        assert fingerprint("{}", path="/o/?name=a&name=b") != fingerprint(
            "{}", path="/o/?name=b&name=a"
        )
        assert fingerprint("{}", path="/o/?n=1&m=2&n=3") == fingerprint(
            "{}", path="/o/?m=2&n=1&n=3"
        )

    def test_multipart_values_of_one_name_keep_their_order(self):
        ab = [("name", "a"), ("name", "b")]
        ba = [("name", "b"), ("name", "a")]
        for method in ("POST", "PUT"):
            assert multipart_fingerprint(method, ab) != multipart_fingerprint(method, ba)

    def test_multipart_files_of_one_name_keep_their_order(self):
        one_two = [("f", "1.txt", b"1"), ("f", "2.txt", b"2")]
        two_one = [("f", "2.txt", b"2"), ("f", "1.txt", b"1")]
        assert multipart_fingerprint("PUT", [], files=one_two) != multipart_fingerprint(
            "PUT", [], files=two_one
        )

    @settings(max_examples=150)
    @given(pairs_strategy, st.randoms(use_true_random=False))
    def test_form_order_counts_only_within_a_name(self, pairs, rng):
        from urllib.parse import urlencode

        other = interleave_keeping_each_names_order(pairs, rng)
        assert fingerprint(urlencode(pairs), FORM) == fingerprint(urlencode(other), FORM)
        assert fingerprint("{}", path="/o/?" + urlencode(pairs)) == fingerprint(
            "{}", path="/o/?" + urlencode(other)
        )

    @settings(max_examples=100)
    @given(pairs_strategy, st.randoms(use_true_random=False))
    def test_form_values_swapped_within_a_name_differ(self, pairs, rng):
        from urllib.parse import urlencode

        names = [name for name, _ in pairs]
        swappable = [
            (i, j)
            for i in range(len(pairs))
            for j in range(i + 1, len(pairs))
            if names[i] == names[j] and pairs[i][1] != pairs[j][1]
        ]
        if not swappable:
            return
        i, j = rng.choice(swappable)
        swapped = list(pairs)
        swapped[i], swapped[j] = pairs[j], pairs[i]
        assert fingerprint(urlencode(pairs), FORM) != fingerprint(urlencode(swapped), FORM)
        assert multipart_fingerprint("PATCH", pairs) != multipart_fingerprint("PATCH", swapped)


class MultipartEveryMethodTests:
    METHODS = ("POST", "PUT", "PATCH", "DELETE")

    def test_changed_field_changes_the_fingerprint(self):
        for method in self.METHODS:
            assert multipart_fingerprint(method, [("item", "a")]) != multipart_fingerprint(
                method, [("item", "b")]
            ), method

    def test_changed_file_changes_the_fingerprint(self):
        for method in self.METHODS:
            hello = multipart_fingerprint(method, [], files=[("f", "a.txt", b"hello")])
            assert hello != multipart_fingerprint(method, [], files=[("f", "a.txt", b"hellO")])
            assert hello != multipart_fingerprint(method, [], files=[("f", "b.txt", b"hello")])

    def test_boundary_does_not_count(self):
        for method in self.METHODS:
            fields, files = [("item", "a")], [("f", "a.txt", b"hello")]
            assert multipart_fingerprint(method, fields, "One1", files) == multipart_fingerprint(
                method, fields, "Two2", files
            )

    def test_form_parsed_before_us_fingerprints_as_the_raw_body(self):
        from django.core.files.uploadedfile import SimpleUploadedFile
        from django.test.client import encode_multipart

        def request():
            upload = SimpleUploadedFile("a.txt", b"hello", content_type="text/plain")
            body = encode_multipart("B0undary", {"item": ["a", "b"], "f": upload})
            ct = "multipart/form-data; boundary=B0undary"
            return factory.post("/upload/", body, content_type=ct)

        parsed_first = request()
        assert parsed_first.POST.getlist("item") == ["a", "b"]  # a middleware read the form
        assert request_fingerprint(parsed_first) == request_fingerprint(request())
        assert parsed_first.FILES["f"].read() == b"hello"

    def test_multipart_django_cannot_parse_is_hashed_as_bytes(self):
        def put(body: bytes):
            return factory.put("/upload/", body, content_type="multipart/form-data")  # no boundary

        broken = put(b"--B\r\nsome bytes")
        try:
            # Twice on one request: the view's stream is back at its start after each.
            first, again = package_fingerprint(broken), package_fingerprint(broken)
            assert first == again == request_fingerprint(put(b"--B\r\nsome bytes"))
            assert first != request_fingerprint(put(b"--B\r\nsome bytez"))
            assert broken.read() == b"--B\r\nsome bytes"
        finally:
            close_spools_with(broken, None)

    def test_multipart_over_django_field_limits_is_hashed_as_bytes(self, settings):
        settings.DATA_UPLOAD_MAX_NUMBER_FIELDS = 1
        fields = [("a", "1"), ("b", "2"), ("c", "3"), ("d", "4")]
        first = multipart_fingerprint("PUT", fields, "One1")
        assert first == multipart_fingerprint("PUT", fields, "One1")
        assert first != multipart_fingerprint("PUT", fields, "Two2")  # raw bytes now


class NegotiatedFormatTests:
    def drf_fingerprint(self, accept: str) -> str:
        from rest_framework.negotiation import DefaultContentNegotiation
        from rest_framework.renderers import BrowsableAPIRenderer, JSONRenderer
        from rest_framework.request import Request

        request = Request(factory.post("/o/", "{}", "application/json", HTTP_ACCEPT=accept))
        renderer, media_type = DefaultContentNegotiation().select_renderer(
            request, [JSONRenderer(), BrowsableAPIRenderer()]
        )
        request.accepted_renderer, request.accepted_media_type = renderer, media_type
        return request_fingerprint(request)

    def test_format_negotiated_by_drf_counts(self):
        assert self.drf_fingerprint("text/html") != self.drf_fingerprint("application/json")

    def test_accept_headers_negotiating_one_format_agree(self):
        assert self.drf_fingerprint("*/*") == self.drf_fingerprint("application/json")
        assert self.drf_fingerprint("text/html") == self.drf_fingerprint(
            "text/html,application/xhtml+xml;q=0.9"
        )


class StableAcrossReleasesTests:
    """A fingerprint is stored with its key: one computed otherwise by a later release would
    answer a retry sent across the upgrade 422 instead of its stored response."""

    def test_a_json_request_keeps_its_fingerprint(self):
        request = factory.post(
            "/orders/\u00e9?b=2&a=1",
            '{"b": [1, 2.50, "\u00e9"], "a": null}',
            content_type="application/json; charset=utf-8",
        )
        expected = "e8bdc4c690996e09adc496e25e76919e62c749da21f18bd23db6d61986a35d10"
        assert request_fingerprint(request) == expected

    def test_a_byte_body_keeps_its_fingerprint(self):
        request = factory.put("/upload/", b"\x00\x01raw", content_type="application/octet-stream")
        expected = "ce2cb0770a98b216d75e0f0c6874a88e0eded1ca9abc0dde02131fb31a41811e"
        assert request_fingerprint(request) == expected

    @given(
        method=st.sampled_from(["POST", "PUT", "PATCH", "DELETE", "post", "M\u00e9THOD"]),
        path=st.text(
            st.characters(exclude_characters="?#%", exclude_categories=("Cs", "Cc")),
            max_size=12,
        ),
        data=st.binary(max_size=32),
    )
    @settings(max_examples=60)
    def test_the_request_line_is_hashed_as_its_json_array(self, method, path, data):
        request = factory.generic(method, "/" + path, data, "application/octet-stream")
        # RequestFactory sets no content type without a body.
        head = [request.method, request.path, "", request.META.get("CONTENT_TYPE", "")]
        expected = hashlib.sha256(json.dumps(head).encode() + b"\nbytes:" + data).hexdigest()
        assert request_fingerprint(request) == expected

    @given(method=st.none() | st.text(max_size=8))  # lone surrogates and controls too
    @settings(max_examples=80)
    def test_a_method_set_by_hand_is_hashed_as_json_dumps_writes_it(self, method):
        request = factory.put("/upload/", b"x", content_type="application/octet-stream")
        request.method = method
        head = [method, "/upload/", "", "application/octet-stream"]
        expected = hashlib.sha256(json.dumps(head).encode() + b"\nbytes:x").hexdigest()
        assert request_fingerprint(request) == expected


@pytest.mark.parametrize(
    "encoding",
    ["utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"],
)
@pytest.mark.parametrize("text", ['{"a": [1, "\u00e9"]}', '[{"a": 1}]', "[]"])
def test_json_in_each_encoding_json_allows_is_read_as_json(encoding, text):
    """RFC 8259 readers may accept UTF-16 and UTF-32, as Python's json does: same meaning."""
    assert fingerprint(text.encode(encoding)) == fingerprint(text.encode())


FORM = "application/x-www-form-urlencoded"
#: Form and query text as a form sends it: any characters, UTF-8 escaped.
form_fields = st.lists(st.tuples(st.text(max_size=6), st.text(max_size=6)), max_size=5)


class EscapesThatAreNotUtf8Tests:
    """``%E9`` and ``%E8`` are é and è in Latin-1, which Django and DRF read in that charset."""

    def test_form_values_differing_in_such_an_escape_differ(self):
        # Read as U+FFFD both, they would replay one request's response to the other.
        latin_1 = f"{FORM}; charset=iso-8859-1"

        assert fingerprint("item=%E9", latin_1) != fingerprint("item=%E8", latin_1)
        assert fingerprint("item=%E9", latin_1) != fingerprint("item=%EF%BF%BD", latin_1)

    def test_query_values_differing_in_such_an_escape_differ(self):
        assert fingerprint("{}", path="/o/?item=%E9") != fingerprint("{}", path="/o/?item=%E8")

    def test_such_escapes_are_still_sorted_by_name(self):
        assert fingerprint("{}", path="/o/?b=%E9&a=%FF") == fingerprint(
            "{}", path="/o/?a=%FF&b=%E9"
        )

    @given(form_fields)
    @settings(max_examples=200, deadline=None)
    def test_utf8_forms_and_queries_fingerprint_as_before(self, fields):
        # What earlier releases computed: parse_qsl's default, which replaced bad escapes.
        from urllib.parse import parse_qsl, urlencode

        from django_idempotency.fingerprint import canonical_body

        text = urlencode(fields)
        before = sorted(parse_qsl(text, keep_blank_values=True), key=lambda pair: pair[0])
        assert canonical_body(FORM, text.encode()) == b"form:" + urlencode(before).encode()
