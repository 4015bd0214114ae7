"""Two callers of each kind of protected call, for the isolation table of calls.

A function's or task's scope is its dotted name, or the ``scope=`` it was
given: two of them given one key are two callers, as two consumers of one
message or two tenants' handlers are. Each pair here is alice's and bob's;
each body writes an ``Order`` named after its caller and the key, and
returns it, so a run and a replay can be told apart. The tasks of Django's
Tasks framework are made when the test imports this module, under the
backend its settings give.
"""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async

from django_idempotency import idempotent_function
from django_idempotency.contrib.django_tasks import idempotent_task
from tests.models import Order


def by_key(key: str) -> str:
    return key


def reserve(caller: str, key: str) -> dict[str, Any]:
    order = Order.objects.create(item=f"{caller}:{key}")
    return {"caller": caller, "order": order.pk}


@idempotent_function(key=by_key)
def alice_function(key: str) -> dict[str, Any]:
    return reserve("alice", key)


@idempotent_function(key=by_key)
def bob_function(key: str) -> dict[str, Any]:
    return reserve("bob", key)


# Scopes given by the project, a tenant's each, that differ in case only.
@idempotent_function(key=by_key, scope="tenant:Acme")
def acme_function(key: str) -> dict[str, Any]:
    return reserve("alice", key)


@idempotent_function(key=by_key, scope="tenant:acme")
def other_acme_function(key: str) -> dict[str, Any]:
    return reserve("bob", key)


@idempotent_function(key=by_key)
async def alice_async_function(key: str) -> dict[str, Any]:
    return await sync_to_async(reserve)("alice", key)


@idempotent_function(key=by_key)
async def bob_async_function(key: str) -> dict[str, Any]:
    return await sync_to_async(reserve)("bob", key)


@idempotent_task(key=by_key)
def alice_task(key: str) -> dict[str, Any]:
    return reserve("alice", key)


@idempotent_task(key=by_key)
def bob_task(key: str) -> dict[str, Any]:
    return reserve("bob", key)


@idempotent_task(key=by_key)
async def alice_async_task(key: str) -> dict[str, Any]:
    return await sync_to_async(reserve)("alice", key)


@idempotent_task(key=by_key)
async def bob_async_task(key: str) -> dict[str, Any]:
    return await sync_to_async(reserve)("bob", key)
