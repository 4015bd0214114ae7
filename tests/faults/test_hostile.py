"""Scenario 6: hostile input through the real server.

Keys and bodies a fuzzer or a broken client sends, headers past gunicorn's
limits, one key raced with different bodies, one key from several scopes.
Whatever arrives: never a 5xx, never a record for a rejected request, never
one scope's response in another.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from django_idempotency.models import IdempotencyKey
from tests.faults.client import Call, tally
from tests.faults.harness import CLIENT_THREADS, Scale, client_for, order_call, settle
from tests.faults.plugin import Row
from tests.models import Order
from tests.server import GunicornServer

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True)]

KEY_MAX_LENGTH = 255
#: Our 400, or gunicorn's 400/431 for a header it will not parse.
REJECTED = (400, 431)


def _valid_key(raw: bytes) -> str | None:
    """The key the server must accept ``raw`` as, or ``None`` if it must answer 400."""
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        return None
    if text.startswith('"') and text.endswith('"') and len(text) >= 2:
        inner = text[1:-1]
        if '"' in inner.replace('\\"', "") or "\\" in inner.replace('\\"', "").replace("\\\\", ""):
            return None
        text = inner.replace('\\"', '"').replace("\\\\", "\\")
    elif "," in text:
        return None  # servers join repeated headers with commas: a bare comma is two keys
    ok = 0 < len(text) <= KEY_MAX_LENGTH and all(0x21 <= ord(c) <= 0x7E for c in text)
    return text if ok else None


def random_keys(rng: random.Random, count: int) -> list[bytes]:
    """Keys from every class a hostile client tries, valid ones among them."""
    alphabet = bytes(range(0x21, 0x7F))
    keys: list[bytes] = []
    seen: set[str | None] = set()
    for index in range(count):
        kind = index % 8
        length = rng.choice([1, 8, 36, 254, 255, 256, 1000, 8000])
        if kind == 0:
            raw = bytes(rng.choice(alphabet) for _ in range(length))
        elif kind == 1:  # invalid UTF-8 and Latin-1 bytes
            raw = b"k" + bytes(rng.randrange(0x80, 0x100) for _ in range(rng.randint(1, 40)))
        elif kind == 2:  # valid UTF-8, not ASCII
            raw = "clé-ключ-鍵-🔑".encode()
        elif kind == 3:  # spaces and tabs inside
            raw = b"a b\tc" + bytes(rng.choice(alphabet) for _ in range(8))
        elif kind == 4:  # RFC 8941 strings, well and badly formed
            raw = rng.choice([b'"quoted-%d"' % index, b'"bad"quote"', b'""', b'"\\x"'])
        elif kind == 5:  # control characters a lax client lets through
            raw = b"ctl" + bytes([rng.choice([0, 1, 0x1B, 0x7F])]) + b"z"
        elif kind == 6:  # over gunicorn's header field limit
            raw = b"h" * rng.choice([9000, 20000])
        else:
            raw = b"fine-%d-" % index + bytes(rng.choice(alphabet) for _ in range(20))
        raw = raw.strip() or b"x"
        key = _valid_key(raw)
        if key is not None and key in seen:
            raw = b"fine-unique-%d" % index  # a repeat would be the same key with another body
        seen.add(_valid_key(raw))
        keys.append(raw)
    return keys


class HostileInputTests:
    def test_hostile_requests_never_fail_store_rejects_or_cross_scopes(
        self, server: GunicornServer, sizes: Scale, record: Callable[[Row], None]
    ) -> None:
        rng = random.Random(2024)
        client = client_for(server, max_attempts=6)
        sent: list[Call] = []

        # 1. Random keys, each sent twice: the second replays, or is rejected alike.
        keyed = []
        for index, raw in enumerate(random_keys(rng, sizes.hostile_keys)):
            label = f"hostile-key:{index}"
            call = order_call("/faults/orders/", "", label, tenant="keys")
            call.headers = {**call.headers, "Idempotency-Key": raw}
            keyed.append((raw, call))
        for _ in range(2):
            client.send_all([call for _, call in keyed], threads=CLIENT_THREADS)
        sent += [call for _, call in keyed]
        accepted: dict[str, bytes] = {}
        for raw, call in keyed:
            statuses = [(a.status, a.replayed) for a in call.attempts]
            key = _valid_key(raw)
            if key is None:
                assert statuses[0] == statuses[1] and statuses[0][0] in REJECTED, (
                    raw[:60],
                    statuses,
                )
            else:
                assert statuses == [(201, False), (201, True)], (raw[:60], call.attempts)
                assert call.attempts[0].body == call.attempts[1].body
                accepted[key] = call.attempts[0].body
        stored = dict(
            IdempotencyKey.objects.filter(scope="tenant:keys").values_list("key", "response_body")
        )
        # Exactly the accepted keys have records: nothing stored for a rejected request.
        assert set(stored) == set(accepted)
        for key, body in accepted.items():
            assert bytes(stored[key]) == body

        # 2. Hostile bodies under valid keys: the handler's own 400, stored and replayed;
        # a body over Django's upload limit rejected before any record is written.
        nested = b"[" * 100_000 + b"]" * 100_000
        almost = b"[" * 950 + b"]" * 950  # parses, but deeper than a naive recursion allows
        bodies = {
            "invalid-utf8": b'{"item": "\xff\xfe\xfa"}',
            "nested": nested,
            "almost-nested": almost,
            "not-object": b"[1, 2, 3]",
            "truncated": b'{"item": "x"',
            "huge-valid": json.dumps({"item": "big", "pad": "x" * 1_500_000}).encode(),
        }
        body_calls = {}
        for name, body in bodies.items():
            call = order_call("/faults/orders/", f"body-{name}", f"hostile-body:{name}", "bodies")
            call.body = body
            body_calls[name] = call
        body_calls["huge-valid"].label = "big"
        too_big = order_call("/faults/orders/", "body-too-big", "hostile-body:too-big", "bodies")
        too_big.body = b'{"item": "x", "pad": "' + b"x" * 3_000_000 + b'"}'
        for call in [*body_calls.values(), too_big]:
            client.send(call)
            client.send(call)  # the retry
        sent += [*body_calls.values(), too_big]
        for name, call in body_calls.items():
            first, second = call.attempts
            expected = 201 if name == "huge-valid" else 400
            assert first.status == expected and not first.replayed, (name, first)
            assert second.status == expected and second.replayed, (name, second)
            assert second.body == first.body
        assert [a.status for a in too_big.attempts] == [400, 400]
        assert not IdempotencyKey.objects.filter(key="body-too-big").exists()
        assert Order.objects.filter(item="big").count() == 1

        # 3. A response over MAX_STORED_BODY: replayed without its body, run once.
        large = order_call("/faults/large/?size=2000000", "large-1", "hostile-large", "bodies")
        client.send(large)
        client.send(large)
        sent.append(large)
        first, second = large.attempts
        assert (first.status, len(first.body), first.replayed) == (201, 2_000_000, False)
        assert (second.status, second.body, second.replayed) == (201, b"", True)
        assert Order.objects.filter(item="hostile-large").count() == 1

        # 4. Huge and numerous headers: gunicorn's 400, never ours, never a record.
        for name, headers in {
            "many": {f"X-Junk-{i}": "v" for i in range(150)},
            "huge-other": {"X-Junk": "v" * 20_000},
        }.items():
            call = order_call("/faults/orders/", f"headers-{name}", f"hostile-h:{name}", "hdr")
            call.headers = {**call.headers, **headers}
            client.send(call)
            sent.append(call)
            assert call.final is not None and call.final.status in REJECTED, (name, call.attempts)
        assert not IdempotencyKey.objects.filter(scope="tenant:hdr").exists()

        # 5. One key raced with different bodies: one winner, the others 422.
        for index in range(sizes.conflict_keys):
            variants = [
                order_call("/faults/orders/", f"race-{index}", f"race:{index}:{v}", "race")
                for v in range(10)
            ]
            client.send_all(variants, threads=10)
            settle(client, variants)
            sent += variants
            finals = Counter(call.final.status for call in variants)  # type: ignore[union-attr]
            assert finals == {201: 1, 422: 9}, (index, finals)
            (winner,) = [call for call in variants if call.final.status == 201]  # type: ignore[union-attr]
            effects = Order.objects.filter(item__startswith=f"race:{index}:")
            assert list(effects.values_list("item", flat=True)) == [winner.label]
            record_ = IdempotencyKey.objects.get(scope="tenant:race", key=f"race-{index}")
            assert bytes(record_.response_body) == winner.final.body  # type: ignore[union-attr]

        # 6. One key from several scopes at once, case variants included.
        tenants = ["Acme", "acme", "ACME", "other"]
        for index in range(sizes.conflict_keys):
            scoped = [
                order_call("/faults/orders/", f"shared-{index}", f"scope:{t}:{index}", t)
                for t in tenants
                for _ in range(3)
            ]
            with ThreadPoolExecutor(max_workers=len(scoped)) as pool:
                list(pool.map(client.send, scoped))
            settle(client, scoped)
            sent += scoped
            for call in scoped:
                assert call.succeeded, call.attempts
                answer = json.loads(call.final.body)  # type: ignore[union-attr]
                assert answer["scope"] == call.scope and answer["item"] == call.label, answer
            # Counted in Python: the test table's collation ignores case on MariaDB.
            items = Counter(
                Order.objects.filter(item__startswith="scope:").values_list("item", flat=True)
            )
            for tenant in tenants:
                assert items[f"scope:{tenant}:{index}"] == 1, items

        outcomes = tally(sent)
        server_errors = sum(n for status, n in outcomes.items() if status.startswith("5"))
        labels = {call.label for call in sent if call.succeeded}
        effects = Order.objects.filter(item__in=labels).count()
        record(
            Row(
                scenario="hostile input",
                requests=sum(outcomes.values()),
                faults=len(sent),
                keys=len({(call.scope, repr(call.headers["Idempotency-Key"])) for call in sent}),
                effects=effects,
                duplicates=max(0, effects - len(labels)),
                lost=0,
                server_errors=server_errors,
            )
        )
        assert server_errors == 0, outcomes
        assert effects == len(labels)
