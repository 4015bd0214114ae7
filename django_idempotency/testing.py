"""Helpers that prove a project's own protected views are idempotent.

Use them with Django's test client or DRF's ``APIClient``, from pytest or
unittest::

    from django_idempotency.testing import assert_idempotent

    def test_create_order_is_idempotent(client):
        assert_idempotent(
            client, "post", "/orders/", {"item": "book"},
            effect=lambda: Order.objects.count(),
        )

A failed check raises ``AssertionError``. Inside a ``TestCase`` (or a
non-transactional pytest-django test) everything runs in one open
transaction, so duplicates can only be sent one after another; the result
says so. Truly concurrent duplicates need ``TransactionTestCase`` or
``@pytest.mark.django_db(transaction=True)``.
"""

from __future__ import annotations

import copy
import json
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.db import connections
from django.http import HttpResponseBase

from django_idempotency.conf import idempotency_settings

__all__ = ["IdempotencyCheck", "assert_idempotent"]

SEQUENTIAL_NOTE = (
    "Duplicates were sent one after another: this test runs inside one open "
    "transaction (TestCase, or django_db without transaction=True), where "
    "concurrent requests would block each other. Use TransactionTestCase or "
    "django_db(transaction=True) for truly concurrent duplicates."
)


@dataclass
class IdempotencyCheck:
    """What :func:`assert_idempotent` sent and saw, for further assertions."""

    key: str
    first: HttpResponseBase
    retry: HttpResponseBase
    duplicates: list[HttpResponseBase] = field(default_factory=list)
    mismatch: HttpResponseBase | None = None
    concurrent: bool = False
    note: str = ""


def assert_idempotent(
    client: Any,
    method: str,
    path: str,
    data: Any = None,
    *,
    effect: Callable[[], Any],
    duplicates: int = 5,
    concurrent: bool | None = None,
    changed_data: Any = None,
    key: str | None = None,
    content_type: str = "application/json",
    headers: dict[str, str] | None = None,
    using: str | None = None,
    sign: Callable[[bytes], dict[str, str]] | None = None,
    changed_body_replays: bool = False,
) -> IdempotencyCheck:
    """Send a request, its retry and ``duplicates`` more; assert one effect.

    ``effect`` is a callable whose value changes when the view has its
    effect (a row count, a balance); it must change once and only once.
    The retry and every duplicate must be a faithful replay: same status,
    same body, same stored headers, plus the replay header. Concurrent
    duplicates may also be answered 409 while the original is in flight.
    When ``changed_data`` is given (or ``data`` is a dict, from which a
    changed copy is made), the same key with the changed body must get 422.

    ``concurrent=None`` sends duplicates concurrently when the test allows
    it, ``True`` insists (and fails inside a transaction), ``False`` never.

    A webhook receiver checks a signature over the body: ``sign(body)``
    returns the headers that sign each request's bytes (the webhooks
    module's signatures have ``.headers(body)``). A view whose fingerprint
    is its key alone (the webhook presets) replays a changed body rather
    than refuse it: ``changed_body_replays=True`` asserts that instead.
    """
    key = key or f"assert-idempotent-{uuid.uuid4().hex}"
    send = _sender(method, path, content_type, headers or {}, sign)
    alias = using or idempotency_settings.database
    in_transaction = connections[alias].in_atomic_block
    if concurrent and in_transaction:
        raise AssertionError(SEQUENTIAL_NOTE)
    run_concurrently = not in_transaction if concurrent is None else concurrent

    before = effect()
    first = send(client, data, key)
    assert first.status_code < 500, f"the first request failed with {first.status_code}"
    after_first = effect()
    assert after_first != before, (
        f"the first request had no visible effect: effect() stayed {before!r}"
    )

    retry = send(client, data, key)
    _assert_replay(first, retry, "the retry")

    if run_concurrently:
        answers = _send_concurrently(send, client, data, key, duplicates)
    else:
        answers = [send(client, data, key) for _ in range(duplicates)]
    for index, answer in enumerate(answers, start=1):
        if run_concurrently and answer.status_code == 409:
            assert answer.has_header("Retry-After"), f"duplicate {index}: 409 without Retry-After"
            continue
        _assert_replay(first, answer, f"duplicate {index}")

    mismatch = None
    if changed_data is None and isinstance(data, dict):
        changed_data = {**data, "_assert_idempotent_changed": True}
    if changed_data is not None:
        mismatch = send(client, changed_data, key)
        if changed_body_replays:
            _assert_replay(first, mismatch, "the same key with a changed body")
        else:
            assert mismatch.status_code == 422, (
                f"the same key with a changed body got {mismatch.status_code}, expected 422"
            )

    final = effect()
    assert final == after_first, (
        f"the effect happened more than once: {before!r} -> {after_first!r} -> {final!r}"
    )
    return IdempotencyCheck(
        key=key,
        first=first,
        retry=retry,
        duplicates=answers,
        mismatch=mismatch,
        concurrent=run_concurrently,
        note="" if run_concurrently else SEQUENTIAL_NOTE,
    )


Sender = Callable[[Any, Any, str], HttpResponseBase]


def _sender(
    method: str,
    path: str,
    content_type: str,
    headers: dict[str, str],
    sign: Callable[[bytes], dict[str, str]] | None,
) -> Sender:
    header = idempotency_settings.header

    def send(client: Any, data: Any, key: str) -> HttpResponseBase:
        body = data
        if content_type == "application/json" and not isinstance(data, str | bytes):
            body = json.dumps(data)
        sent = {**headers, header: key}
        if sign is not None:
            if not isinstance(body, str | bytes):
                raise TypeError(
                    "sign= needs the body as bytes: pass data as bytes or str, or as JSON "
                    "(content_type='application/json'), so that what is signed is what is sent."
                )
            sent.update(sign(body.encode() if isinstance(body, str) else body))
        request = getattr(client, method.lower())
        response = request(path, body, content_type=content_type, headers=sent)
        if response.streaming:
            # Read to its end, as a client would: the test client closes the
            # response (and the request's copy of its body) only then.
            response.streamed_content = b"".join(response.streaming_content)
        return response

    return send


def _assert_replay(first: HttpResponseBase, answer: HttpResponseBase, what: str) -> None:
    # Imported here: responses imports the models, and this module may be
    # imported before the app registry is ready (a conftest.py, say).
    from django_idempotency.responses import BODY_HEADERS

    replay_header = idempotency_settings.replay_header
    assert answer.get(replay_header) == "true", (
        f"{what} was not a replay (status {answer.status_code}, no {replay_header} header)"
    )
    assert answer.status_code == first.status_code, (
        f"{what} replayed status {answer.status_code}, the original was {first.status_code}"
    )
    # A body too large to store, or streamed, is replayed empty (by design).
    first_body = _content(first)
    body_stored = not first.streaming and len(first_body) <= idempotency_settings.max_stored_body
    expected_body = first_body if body_stored else b""
    assert _content(answer) == expected_body, f"{what} replayed a different body"
    if not body_stored:
        _assert_no_body_headers(answer, what)
    for name in idempotency_settings.stored_headers:
        if name in BODY_HEADERS and not body_stored:
            continue  # asserted absent above
        assert answer.get(name) == first.get(name), f"{what} replayed a different {name} header"


def _assert_no_body_headers(answer: HttpResponseBase, what: str) -> None:
    """A replay without the stored body must not describe one (docs/http.rst).

    ``Content-Length: 0`` is the one exception: it describes the empty body
    that was sent, and Django's ``CommonMiddleware`` adds it to every answer.
    """
    from django_idempotency.responses import BODY_HEADERS

    for name in sorted(BODY_HEADERS):
        if name == "content-length" and answer.get(name) == "0":
            continue
        assert not answer.has_header(name), (
            f"{what} replayed an empty body with {name}: {answer[name]!r}; "
            "a body too large to store, or streamed, is replayed without the "
            "headers that describe a body"
        )


def _content(response: HttpResponseBase) -> bytes:
    return b"" if response.streaming else bytes(getattr(response, "content", b""))


def _send_concurrently(
    send: Sender, client: Any, data: Any, key: str, count: int
) -> list[HttpResponseBase]:
    results: list[Any] = [None] * count
    start = threading.Barrier(count)

    def worker(index: int) -> None:
        own_client = copy.copy(client)  # clients are not thread-safe; cookies are copied
        own_client.cookies = copy.deepcopy(client.cookies)
        try:
            start.wait()
            results[index] = send(own_client, data, key)
        except BaseException as exc:  # re-raised in the test's thread
            results[index] = exc
        finally:
            for connection in connections.all(initialized_only=True):
                connection.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
