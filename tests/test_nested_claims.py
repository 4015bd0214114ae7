"""Atomic mode, MariaDB/MySQL: a claim made inside another atomic-mode claim's transaction.

A deadlock in the inner claim's own INSERT (not in a body's statement) reaches the inner
call as ``store.Retry``; the enclosing claim starts over only where nothing else that the
attempt wrote is left behind.
"""

from __future__ import annotations

import threading
from typing import Any, NoReturn

import pytest
from django.db import DatabaseError, connection, connections, transaction

from django_idempotency import idempotent_function
from django_idempotency.exceptions import CallInFlight
from django_idempotency.models import IdempotencyKey
from tests.models import Order
from tests.polling import in_background, updating, wait_until

pytestmark = pytest.mark.skipif(connection.vendor != "mysql", reason="InnoDB's deadlock 1213")


def deadlock_the_next_claim(scope: str, key: str, row: int) -> None:
    """Make the next claim of (``scope``, ``key``) on this connection InnoDB's deadlock victim.

    Share-locks ``row`` here; another, heavier transaction inserts the key's record (left
    uncommitted) and then waits to update ``row``. The claim's INSERT then waits for that
    record: a cycle, and InnoDB rolls back the lighter transaction, ours. The other one rolls
    back once our claim has lost, leaving no record behind.
    """
    if not connection.in_atomic_block:
        set_up_failed("the caller's claim is not on this thread's connection")
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT id FROM tests_order WHERE id = %s LOCK IN SHARE MODE", [row])
    except Exception as error:
        set_up_failed(f"the shared lock: {error!r}")
    other: list[int] = []
    ended = threading.Event()

    class Done(Exception):
        pass

    def heavier() -> None:
        from tests.factories import IdempotencyKeyFactory

        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("SELECT CONNECTION_ID()")
                other.append(cursor.fetchone()[0])
                Order.objects.bulk_create([Order(item="heavier") for _ in range(50)])
                IdempotencyKeyFactory(scope=scope, key=key, in_flight=True)
                cursor.execute("UPDATE tests_order SET quantity = 2 WHERE id = %s", [row])
                raise Done
        except Done:
            pass
        finally:
            ended.set()

    join = in_background(heavier)

    def checked_join() -> None:
        try:
            join()
        except Exception as error:
            set_up_failed(f"the other transaction: {error!r}")

    waiting = updating(other)
    try:
        wait_until(
            lambda: ended.is_set() or waiting(), "the other transaction to wait for our shared lock"
        )
    except Exception as error:
        set_up_failed(repr(error))
    if ended.is_set():
        checked_join()  # its error, if it failed before it waited
        set_up_failed("the other transaction never waited for our shared lock")
    deadlock_the_next_claim.join = checked_join  # type: ignore[attr-defined]


def set_up_failed(why: str) -> NoReturn:
    """Fail the test with ``pytest.fail``, whose ``BaseException`` nothing under test catches.

    No body, ``except`` clause or request handler can take it for the error a test expects.
    """
    pytest.fail(f"the deadlock was not set up: {why}")


def nested(side_alias: str | None) -> tuple[Any, list[str], list[str]]:
    """An outer atomic-mode function whose first attempt's inner claim deadlocks.

    Each attempt of the outer body first writes an ``Order`` on ``side_alias`` (if any).
    """
    row = Order.objects.create(item="shared").pk
    outer_runs: list[str] = []
    inner_runs: list[str] = []

    @idempotent_function(key=lambda item: item, scope="tests.nested.inner")
    def inner(item: str) -> int:
        inner_runs.append(item)
        return Order.objects.create(item=item).pk

    @idempotent_function(key=lambda item: item, scope="tests.nested.outer")
    def outer(item: str) -> int:
        outer_runs.append(item)
        if side_alias is not None:
            Order.objects.using(side_alias).create(item=f"side-{item}")
        if len(outer_runs) == 1:
            deadlock_the_next_claim("tests.nested.inner", item, row)
            try:
                return inner(item)
            finally:
                deadlock_the_next_claim.join()  # type: ignore[attr-defined]
        return inner(item)

    return outer, outer_runs, inner_runs


@pytest.mark.django_db(transaction=True)
def test_a_deadlock_in_the_inner_claim_starts_the_outer_claim_over() -> None:
    outer, outer_runs, inner_runs = nested(side_alias=None)

    outer("x")

    assert outer_runs == ["x", "x"]
    assert inner_runs == ["x"]
    assert Order.objects.filter(item="x").count() == 1
    assert sorted(IdempotencyKey.objects.filter(key="x").values_list("scope", flat=True)) == [
        "tests.nested.inner",
        "tests.nested.outer",
    ]


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_the_outer_claim_does_not_start_over_inside_another_alias_transaction() -> None:
    # As ATOMIC_REQUESTS on another database does around a view under @idempotent: the
    # first attempt's write there is still in that open transaction, so a second attempt
    # would write it again and both would commit. A deadlock in the outer body's own
    # statements reaches the caller here (store.lost_race); one in the inner claim must too.
    outer, outer_runs, _ = nested(side_alias="other")

    with pytest.raises((CallInFlight, DatabaseError)), transaction.atomic(using="other"):
        try:
            outer("y")
        finally:
            sides = Order.objects.using("other").filter(item="side-y").count()
            # The attempts' writes in the open transaction: one, or the caller commits two.
            assert (outer_runs, sides) == (["y"], 1)
    assert outer_runs == ["y"]
    assert connections["other"].in_atomic_block is False
    assert Order.objects.using("other").filter(item="side-y").count() == 0


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_the_outer_claim_does_not_start_over_inside_another_alias_manual_transaction() -> None:
    # The same with the other database's transaction opened by hand, autocommit turned off:
    # its first attempt's write is as open, and a second attempt would write it again.
    outer, outer_runs, _ = nested(side_alias="other")
    other = connections["other"]
    other.set_autocommit(False)
    try:
        with pytest.raises((CallInFlight, DatabaseError)):
            outer("z")
        sides = Order.objects.using("other").filter(item="side-z").count()
        assert (outer_runs, sides) == (["z"], 1)
    finally:
        other.rollback()
        other.set_autocommit(True)
    assert Order.objects.using("other").filter(item="side-z").count() == 0


@pytest.mark.django_db(transaction=True)
def test_an_outer_body_that_catches_the_inner_error_does_not_commit_half_an_attempt() -> None:
    # The server rolled back the outer claim's transaction with the inner one: an outer body
    # that catches the error and carries on must not complete its key on a new transaction.
    row = Order.objects.create(item="shared").pk

    @idempotent_function(key=lambda item: item, scope="tests.nested.inner")
    def inner(item: str) -> int:
        return Order.objects.create(item=item).pk

    @idempotent_function(key=lambda item: item, scope="tests.nested.outer")
    def outer(item: str) -> str:
        Order.objects.create(item=f"before-{item}")
        deadlock_the_next_claim("tests.nested.inner", item, row)
        try:
            inner(item)
        except DatabaseError:
            pass
        finally:
            deadlock_the_next_claim.join()  # type: ignore[attr-defined]
        return "carried on"

    try:
        answer = outer("z")
    except Exception as exc:
        answer = repr(exc)

    stored = list(IdempotencyKey.objects.filter(key="z").values_list("scope", "state"))
    befores = Order.objects.filter(item="before-z").count()
    # Django knows the savepoint is gone: the outer call's own statements fail, and
    # nothing of the attempt is kept.
    assert answer != "carried on"
    assert (stored, befores) == ([], 0)


_view_runs: list[str] = []
_row: list[int] = []


@idempotent_function(key=lambda item: item, scope="tests.nested.view_inner")
def _view_inner(item: str) -> int:
    return Order.objects.create(item=item).pk


def _view(request: Any) -> Any:
    from django.http import JsonResponse

    _view_runs.append("ran")
    Order.objects.using("other").create(item="side-view")
    key = request.headers["Idempotency-Key"]
    if len(_view_runs) == 1:
        deadlock_the_next_claim("tests.nested.view_inner", key, _row[0])
        try:
            return JsonResponse({"id": _view_inner(key)}, status=201)
        finally:
            deadlock_the_next_claim.join()  # type: ignore[attr-defined]
    return JsonResponse({"id": _view_inner(key)}, status=201)


def _protected_view(kind: str) -> Any:
    from django.views.decorators.csrf import csrf_exempt
    from rest_framework.permissions import AllowAny
    from rest_framework.views import APIView

    from django_idempotency import idempotent
    from django_idempotency.contrib.drf import IdempotentMixin

    if kind == "decorator":
        return csrf_exempt(idempotent(_view))

    class View(IdempotentMixin, APIView):
        permission_classes = [AllowAny]
        authentication_classes: list[Any] = []

        def post(self, request: Any) -> Any:
            return _view(request)

    return View.as_view()


urlpatterns: list[Any] = []


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
@pytest.mark.parametrize("kind", ["decorator", "drf_mixin"])
def test_a_view_in_another_database_request_transaction_is_not_run_twice(
    monkeypatch: pytest.MonkeyPatch, settings: Any, kind: str
) -> None:
    # @idempotent below ATOMIC_REQUESTS on "other": the view's first write there stays in
    # that transaction when the function's claim in the view deadlocks. Starting the
    # view's claim over writes it again, and Django commits both.
    from django.test import Client
    from django.urls import path

    monkeypatch.setitem(connections["other"].settings_dict, "ATOMIC_REQUESTS", True)
    monkeypatch.setattr(
        __import__(__name__, fromlist=["_"]), "urlpatterns", [path("v/", _protected_view(kind))]
    )
    settings.ROOT_URLCONF = __name__
    settings.MIDDLEWARE = []
    _view_runs.clear()
    _row[:] = [Order.objects.create(item="shared").pk]

    try:
        response = Client(raise_request_exception=False).post("/v/", HTTP_IDEMPOTENCY_KEY="k-view")
        status = response.status_code
    finally:
        sides = Order.objects.using("other").filter(item="side-view").count()

    # Not started over (the write there would commit twice), nor answered (an answer would
    # commit it, and the retry that answer invites would write it again): the error fails the
    # request, and the other database's transaction rolls back with it.
    assert (status, _view_runs, sides) == (500, ["ran"], 0)


@pytest.mark.django_db(transaction=True)
def test_three_deep_the_outermost_claim_starts_over_once_per_lost_attempt() -> None:
    from django_idempotency import store

    row = Order.objects.create(item="shared").pk
    runs: dict[str, int] = {"a": 0, "b": 0, "c": 0}

    @idempotent_function(key=lambda item: item, scope="tests.nested.c")
    def c(item: str) -> int:
        runs["c"] += 1
        return Order.objects.create(item=item).pk

    @idempotent_function(key=lambda item: item, scope="tests.nested.b")
    def b(item: str) -> int:
        runs["b"] += 1
        deadlock_the_next_claim("tests.nested.c", item, row)
        try:
            return c(item)
        finally:
            deadlock_the_next_claim.join()  # type: ignore[attr-defined]

    @idempotent_function(key=lambda item: item, scope="tests.nested.a")
    def a(item: str) -> int:
        runs["a"] += 1
        return b(item)

    # Every attempt's innermost claim deadlocks: the outermost gives up after its attempts.
    with pytest.raises(CallInFlight):
        a("deep")

    assert runs == {"a": store.CLAIM_ATTEMPTS, "b": store.CLAIM_ATTEMPTS, "c": 0}
    assert not IdempotencyKey.objects.filter(key="deep").exists()
    assert not Order.objects.filter(item="deep").exists()


_runs: dict[str, list[str]] = {}


def _sync_body(request: Any) -> Any:
    from django.http import HttpResponse

    runs = _runs.setdefault(request.path, [])
    runs.append("ran")
    key = request.headers["Idempotency-Key"]
    if len(runs) == 1:
        deadlock_the_next_claim("tests.nested.view_inner", key, _row[0])
        try:
            return HttpResponse(f"order {_view_inner(key)}", status=201)
        finally:
            deadlock_the_next_claim.join()  # type: ignore[attr-defined]
    return HttpResponse(f"order {_view_inner(key)}", status=201)


def _views() -> list[Any]:
    from django.urls import path
    from django.views.decorators.csrf import csrf_exempt

    return [
        path("mw/", csrf_exempt(_sync_body)),
    ]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", ["wsgi", "asgi"])
def test_under_the_middleware_a_view_calling_a_function_whose_claim_deadlocks_runs_again(
    monkeypatch: pytest.MonkeyPatch, settings: Any, kind: str
) -> None:
    from asgiref.sync import async_to_sync
    from django.test import AsyncClient, Client

    monkeypatch.setattr(__import__(__name__, fromlist=["_"]), "urlpatterns", _views())
    settings.ROOT_URLCONF = __name__
    settings.MIDDLEWARE = ["django_idempotency.middleware.IdempotencyMiddleware"]
    _runs.clear()
    _row[:] = [Order.objects.create(item="shared").pk]
    url = "/mw/"

    if kind == "wsgi":
        response = Client().post(url, HTTP_IDEMPOTENCY_KEY="k-mw")
    else:
        response = async_to_sync(AsyncClient().post)(url, headers={"Idempotency-Key": "k-mw"})

    assert response.status_code == 201, response.content[:300]
    assert _runs[url] == ["ran", "ran"]
    [order] = Order.objects.filter(item="k-mw").values_list("pk", flat=True)
    assert response.content == f"order {order}".encode()
