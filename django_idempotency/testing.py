"""Helpers that prove a project's own protected views are idempotent.

With Django's test client or DRF's ``APIClient``, from pytest or unittest::

    from django_idempotency.testing import assert_idempotent, race_duplicates

    def test_order_is_idempotent(client):
        assert_idempotent(client, "post", "/orders/", {"item": "book"}, effect=Order.objects.count)

    @pytest.mark.django_db(transaction=True)
    def test_racing_duplicates_make_one_order(client):
        race_duplicates(client, "post", "/orders/", {"item": "book"}, effect=Order.objects.count)

A failed check raises ``AssertionError``.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal

from django.db import connections
from django.dispatch import Signal
from django.http import HttpResponseBase

from django_idempotency import races, signals
from django_idempotency.conf import idempotency_settings
from django_idempotency.races import RaceSetupError

__all__ = [
    "IdempotencyCheck",
    "RaceCheck",
    "RaceSetupError",
    "assert_idempotent",
    "race_duplicates",
]

SEQUENTIAL_NOTE = (
    "Duplicates were sent one after another: this test runs inside one open "
    "transaction (TestCase, or django_db without transaction=True), where "
    "concurrent requests would block each other. Use TransactionTestCase or "
    "django_db(transaction=True) for concurrent duplicates, and race_duplicates() "
    "to race them against a running original."
)

#: A racing duplicate's answer: the original's replay, or ``409`` while it was in flight.
Outcome = Literal["replayed", "in_flight"]
#: What :func:`race_duplicates` insists every duplicate got: one outcome, or ``"either"``.
Expect = Literal["replayed", "in_flight", "either"]


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

    ``effect()`` returns a value (a row count, a balance) that must change
    once and only once. The retry and every duplicate must be a faithful
    replay: same status, body and stored headers, plus the replay header.
    Duplicates follow the first request's answer (to race it, use
    :func:`race_duplicates`); ``concurrent=None`` sends them concurrently
    with each other in a transactional test, one after another inside a
    ``TestCase``; ``True`` insists (failing there), ``False`` never. A
    concurrent one may get ``409`` with ``Retry-After``, from a database too
    busy to let it claim within ``WAIT`` (SQLite has one writer). With
    ``changed_data`` (or a changed copy of a dict ``data``) the same key
    must get ``422``, or a replay with ``changed_body_replays=True`` (a view
    fingerprinting its key alone, as the webhook presets do). ``sign(body)``
    returns headers signing each request's bytes, for a webhook receiver (a
    webhooks signature's ``.headers``). Returns an :class:`IdempotencyCheck`.
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
    if after_first == before:
        hint = ""
        if method.lower() == "post" and content_type == "application/json":
            # The usual cause: a form view sent JSON, as this helper sends a body by default.
            hint = (
                " If the view reads request.POST, send a form: with Django's Client, the dict "
                "and content_type=django.test.client.MULTIPART_CONTENT; with any client, a "
                "urlencoded str and content_type='application/x-www-form-urlencoded'."
            )
        raise AssertionError(
            f"the first request had no visible effect: effect() stayed {before!r}; "
            f"it was answered {first.status_code}.{hint}"
        )

    retry = send(client, data, key)
    _assert_replay(first, retry, "the retry")

    if run_concurrently:
        answers = _send_concurrently(send, client, data, key, duplicates)
    else:
        answers = [send(client, data, key) for _ in range(duplicates)]
    for index, answer in enumerate(answers, start=1):
        # Only a concurrent duplicate may still find the first in flight.
        if run_concurrently:
            _outcome(first, answer, f"duplicate {index}")
        else:
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


@dataclass
class RaceCheck:
    """What :func:`race_duplicates` sent and saw, for further assertions."""

    key: str
    original: HttpResponseBase
    #: The duplicates' responses, in the order their threads were started.
    duplicates: list[HttpResponseBase]
    #: For each duplicate, how it was answered.
    outcomes: list[Outcome]
    #: For each duplicate, whether its claim was waiting in the database when the
    #: original was let go (PostgreSQL: a lock wait; MariaDB, MySQL: a statement
    #: running; SQLite: a claim not returned). Always ``False`` for an original held
    #: outside a transaction (as in lease mode).
    waited: list[bool]
    #: What every duplicate was expected to get: ``expect``, or by default
    #: ``"replayed"`` for an original held inside a transaction (atomic mode)
    #: and ``"in_flight"`` for one held outside (lease mode).
    expected: Expect = "either"

    @property
    def replayed(self) -> int:
        """How many duplicates got a replay of the original's response."""
        return self.outcomes.count("replayed")

    @property
    def in_flight(self) -> int:
        """How many duplicates got ``409`` while the original was in flight."""
        return self.outcomes.count("in_flight")

    @property
    def note(self) -> str:
        """One line saying what the duplicates met, for a test's output."""
        return (
            f"{len(self.duplicates)} duplicates raced the held original: "
            f"{sum(self.waited)} waited for it in the database, {self.replayed} got its "
            f"replay, {self.in_flight} got 409 while it was in flight"
        )


def race_duplicates(
    client: Any,
    method: str,
    path: str,
    data: Any = None,
    *,
    effect: Callable[[], Any],
    duplicates: int = 5,
    one_effect: Any = 1,
    expect: Expect | None = None,
    key: str | None = None,
    content_type: str = "application/json",
    headers: dict[str, str] | None = None,
    using: str | None = None,
    sign: Callable[[bytes], dict[str, str]] | None = None,
    hold_on: Signal | None = None,
    hold_sender: Any = None,
    timeout: float = 10.0,
) -> RaceCheck:
    """Race ``duplicates`` copies of a request against the original while it runs; assert.

    The original is sent from a thread and held inside the view when it
    sends ``hold_on`` (default :data:`~django_idempotency.signals.key_claimed`:
    its key claimed, its handler about to run). The duplicates are sent from
    threads of their own; the original is let go once each has answered or
    is seen waiting for it in the database.

    ``effect()`` returns a number or tuple of numbers that one run of the
    view changes by ``one_effect``; after the race it must have changed by
    exactly that. Each duplicate must be answered as ``expect`` says, by
    default from where the original was held: inside a transaction (atomic
    mode) a duplicate waits and must get a faithful replay (``"replayed"``);
    outside (lease mode), ``409`` with ``Retry-After`` (``"in_flight"``).
    ``"either"`` accepts both, for duplicates that may stop waiting
    (``wait=0``, a ``WAIT`` shorter than the race).

    ``client`` is a test client, copied for each thread (cookies included),
    or a callable returning a new one (``Client``, ``APIClient``, a
    function); ``AsyncClient`` is refused with ``TypeError``, since each
    request runs in a thread of its own. ``timeout`` bounds, in seconds,
    each wait: for the hold, for the duplicates to arrive, for every request
    to end. A failed check raises ``AssertionError``. Needs a transactional
    test: inside a ``TestCase`` it raises :class:`RaceSetupError`, as it does
    called from a running event loop (use ``sync_to_async``) and on a
    database reached through a pooler such as PgBouncer. Returns a
    :class:`RaceCheck`.
    """
    if duplicates < 1:
        raise ValueError(f"duplicates must be 1 or more, not {duplicates!r}")
    if expect not in (None, "replayed", "in_flight", "either"):
        raise ValueError(
            f"expect must be None, 'replayed', 'in_flight' or 'either', not {expect!r}"
        )
    _refuse_async_client(client)
    if hold_on is not None and not isinstance(hold_on, Signal):
        raise TypeError(
            f"hold_on must be a django.dispatch.Signal the view sends (post_save, say), "
            f"not {hold_on!r}"
        )
    if hold_on is None and hold_sender is not None:
        raise TypeError("hold_sender needs hold_on: name the signal it sends.")
    alias = using or idempotency_settings.database
    races.refuse_untestable(alias)
    before = effect()
    _difference(before, before)  # a value that cannot be subtracted fails before the race

    from django_idempotency.models import IdempotencyKey

    key = key or f"race-duplicates-{uuid.uuid4().hex}"
    send = _sender(method, path, content_type, headers or {}, sign)
    new_client = _client_maker(client)
    if hold_on is None:
        hold_name = "key_claimed (the key claimed, the handler about to run)"
    else:
        hold_name = "the hold_on signal" + (f" from {hold_sender!r}" if hold_sender else "")
    try:
        run = races.run(
            lambda: send(new_client(), data, key),
            duplicates,
            hold_on=hold_on or signals.key_claimed,
            hold_sender=hold_sender,
            hold_name=hold_name,
            using=alias,
            table=IdempotencyKey._meta.db_table,
            timeout=timeout,
        )
    except races.NotHeld as missed:
        status = missed.response.status_code
        if hold_on is None:
            raise AssertionError(
                f"the original request was answered {status} without claiming its idempotency "
                "key, so there was nothing to race: protect the view (@idempotent, "
                "IdempotentMixin or the middleware), send the key in the "
                f"{idempotency_settings.header} header, and use a key not used before"
            ) from None
        raise AssertionError(
            f"the original request was answered {status} without sending {hold_name}: "
            "hold on a signal the view sends (post_save of the model it writes, say)"
        ) from None
    after = effect()

    original = run.original
    assert original.status_code < 500, f"the original request failed with {original.status_code}"
    change = _difference(before, after)
    if change != _per_element(change, one_effect):
        assert change != _difference(before, before), (
            f"the original request had no visible effect: effect() stayed {before!r}"
        )
        raise AssertionError(
            f"the effect happened {_times(change, one_effect)}: effect() went from "
            f"{before!r} to {after!r} while {duplicates} duplicates raced the original; "
            f"one run changes it by {one_effect!r}"
        )
    outcomes = [
        _outcome(original, answer, f"duplicate {index}")
        for index, answer in enumerate(run.duplicates, start=1)
    ]
    if expect is None:
        expect = "replayed" if run.in_transaction else "in_flight"
    check = RaceCheck(
        key=key,
        original=original,
        duplicates=run.duplicates,
        outcomes=outcomes,
        waited=run.waited,
        expected=expect,
    )
    if expect != "either" and outcomes.count(expect) != duplicates:
        held = "inside a transaction" if run.in_transaction else "outside a transaction"
        raise AssertionError(
            f"expected every duplicate {expect} (the original was held {held}): {check.note}"
            + _WHY_NOT[expect, run.in_transaction]
        )
    return check


# What the answers the race did get mean, and what to expect of them instead.
_WHY_NOT = {
    ("replayed", True): (
        ". A duplicate of an original held in its transaction (atomic mode) waits for it "
        "and gets its replay, unless its wait is cut short (wait=0, a WAIT shorter than "
        "the race): pass expect='either' if that is what the view means to do"
    ),
    ("replayed", False): (
        ". An original held outside a transaction (lease mode) has committed its claim, "
        "and a duplicate gets 409 while it runs: expect='in_flight'"
    ),
    ("in_flight", True): (
        ". A duplicate of an original held in its transaction (atomic mode) waits for it "
        "and gets its replay: expect='replayed', or 'either'"
    ),
    ("in_flight", False): "",
}


def _refuse_async_client(client: Any) -> None:
    """``AsyncClient`` answers with a coroutine, which no thread of the race would await."""
    from django.test import AsyncClient

    if isinstance(client, AsyncClient) or (
        isinstance(client, type) and issubclass(client, AsyncClient)
    ):
        raise TypeError(_ASYNC_CLIENT)


_ASYNC_CLIENT = (
    "AsyncClient is not supported: these helpers send requests through a synchronous test "
    "client (race_duplicates() from threads of its own), and AsyncClient's methods return "
    "coroutines that nothing here awaits. Pass a Client (or DRF's APIClient), which runs "
    "async views too."
)


def _client_maker(client: Any) -> Callable[[], Any]:
    """One client per thread: Django's test client is not thread-safe."""
    if callable(client):
        return client  # a class or a factory

    return functools.partial(_own_copy, client)


def _own_copy(client: Any) -> Any:
    """A copy for one thread (a test client is not thread-safe), with cookies of its own."""
    own_client = copy.copy(client)
    own_client.cookies = copy.deepcopy(client.cookies)
    return own_client


def _difference(before: Any, after: Any) -> Any:
    """``after - before`` for a number, or element by element for a tuple of numbers."""
    if _is_number(before) and _is_number(after):
        return after - before
    if (
        isinstance(before, tuple | list)
        and isinstance(after, tuple | list)
        and len(before) == len(after) > 0
        and all(_is_number(value) for value in (*before, *after))
    ):
        return tuple(a - b for b, a in zip(before, after, strict=True))
    raise TypeError(
        "race_duplicates() needs effect() to return a number or a tuple of numbers "
        f"(a row count, a balance), to tell one effect from several; it returned {after!r}"
    )


def _is_number(value: Any) -> bool:
    # bool is an int, but a flag cannot count effects.
    return isinstance(value, int | float | Decimal) and not isinstance(value, bool)


def _per_element(change: Any, one_effect: Any) -> Any:
    """``one_effect`` for each element of a tuple ``change``, when it is one number."""
    if isinstance(change, tuple) and not isinstance(one_effect, tuple | list):
        return (one_effect,) * len(change)
    return tuple(one_effect) if isinstance(one_effect, list) else one_effect


def _times(change: Any, one_effect: Any) -> str:
    """``"3 times"`` when ``change`` is a whole multiple of one effect, else "more than once"."""
    changes = change if isinstance(change, tuple) else (change,)
    ones = _per_element(change, one_effect)
    ones = ones if isinstance(ones, tuple) else (ones,)
    ratios = {c / o for c, o in zip(changes, ones, strict=False) if o}
    if len(ratios) == 1:
        ratio = ratios.pop()
        if ratio == int(ratio) and ratio > 1:
            return f"{int(ratio)} times"
    return "more than once"


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
        if inspect.iscoroutine(response):
            response.close()  # never awaited: nothing was sent
            raise TypeError(_ASYNC_CLIENT)
        if not isinstance(response, HttpResponseBase):
            raise TypeError(
                f"the client's {method.lower()}() returned {response!r}, not a response: "
                "pass a test client (Client, DRF's APIClient) or a callable returning one"
            )
        if response.streaming:
            # Read to its end, as a client would: the test client closes the
            # response (and the request's copy of its body) only then.
            streamed: Any = response  # the test client's attribute, untyped
            streamed.streamed_content = b"".join(streamed.streaming_content)
        return response

    return send


def _assert_replay(first: HttpResponseBase, answer: HttpResponseBase, what: str) -> None:
    # Imported here: responses imports the models, not ready yet for a conftest.py.
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


def _outcome(original: HttpResponseBase, answer: HttpResponseBase, what: str) -> Outcome:
    """How a duplicate sent while the original ran was answered; anything else fails."""
    if answer.status_code == 409:
        assert answer.has_header("Retry-After"), f"{what}: 409 without Retry-After"
        return "in_flight"
    _assert_replay(original, answer, what)
    return "replayed"


def _assert_no_body_headers(answer: HttpResponseBase, what: str) -> None:
    """A replay without its body has no header describing one but ``Content-Length: 0``."""
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
        own_client = _own_copy(client)
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
