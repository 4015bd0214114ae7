"""Django's Tasks framework: the purge as a task, and tasks whose effect runs once per key.

``django.tasks`` is built into Django 6.0 and later; on Django 5.2 the
``django-tasks`` backport (the ``tasks`` extra) provides the same API. This
module imports whichever is there, so nothing else in the package needs
either. Enqueue the purge from your scheduler of choice (see the purge page
of the docs); :func:`idempotent_task` is described in ``docs/messages.rst``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from asgiref.sync import iscoroutinefunction
from django.core.exceptions import ImproperlyConfigured

try:
    from django.tasks import Task, task
    from django.tasks.base import TaskContext
except ImportError:  # Django 5.2: the backport
    try:
        from django_tasks import task  # type: ignore[no-redef,import-not-found,unused-ignore]
        from django_tasks.base import (  # type: ignore[assignment,no-redef,import-not-found,unused-ignore]
            Task,
            TaskContext,
        )
    except ImportError as exc:
        raise ImproperlyConfigured(
            "django_idempotency.contrib.django_tasks needs Django's Tasks framework: Django 6.0 "
            "or later, or on Django 5.2 the backport: "
            "pip install 'django-idempotency[tasks]'."
        ) from exc

from django_idempotency import functions, purge
from django_idempotency.asynchronous import run_async
from django_idempotency.engine import plain_ending
from django_idempotency.options import CALL_OPTION_NAMES, CallOptions

if TYPE_CHECKING:
    from typing_extensions import Unpack

KeyFunction = Callable[..., str]


#: A task's value is kept as a function's is; no other framework's control
#: flow (Celery's ``Ignore``) means anything to this one: it is a failure.
TASK_VALUES = replace(functions.VALUES, ending=plain_ending)


class TaskOptions(CallOptions, total=False):
    """A task's options: ours, and the framework's own that ``@task`` takes."""

    priority: int
    queue_name: str
    backend: str


def _enqueued_under_its_old_path(function: Callable[..., Any]) -> Callable[..., Any]:
    """Gives the purge the module of its path before ``contrib/``, which re-exports it.

    The framework enqueues a task under its function's module and name, and
    a worker imports that path to run it: keeping the path it has always
    had lets a web server and a worker a release apart agree on it.
    """
    function.__module__ = "django_idempotency.django_tasks"
    return function


@task
@_enqueued_under_its_old_path
@functools.wraps(purge.purge_expired_keys)
def purge_expired_keys(*args: Any, **kwargs: Any) -> int:
    return purge.purge_expired_keys(*args, **kwargs)


def idempotent_task(
    function: Callable[..., Any] | None = None,
    /,
    *,
    key: KeyFunction | None = None,
    takes_context: bool = False,
    recover: functions.Recover | None = None,
    **options: Unpack[TaskOptions],
) -> Any:
    """Make a task of Django's Tasks framework whose body runs once per key.

    Use it *in place of* ``@task``; it makes the task, with the
    framework's own options (``priority``, ``queue_name``, ``backend``)::

        @idempotent_task(key=lambda order_id: f"receipt-{order_id}")
        def send_receipt(order_id): ...

        send_receipt.enqueue(order_id=7)

    The key defaults to the id of the task's result, which the framework
    hands the task in its context: a backend that runs one result again
    (after a worker died) runs its effect once. ``key`` is called with the
    task's own arguments, so that two enqueues of the same work are one
    effect. The scope is the function's dotted name. ``atomic``, ``ttl``,
    ``wait`` and ``lease`` default to the settings of the same name; a
    duplicate gets the first run's return value (JSON) as its own. With
    ``takes_context=True`` the function receives the context first, as
    under ``@task``. ``recover`` is an ``idempotent_function``'s:
    ``recover(abandoned)`` for the claim of a run that died.
    """
    functions.checked_recover(recover, "django_tasks.idempotent_task")
    ours: dict[str, Any] = {}
    framework: dict[str, Any] = {}
    for name, value in options.items():
        (ours if name in CALL_OPTION_NAMES else framework)[name] = value
    declared = functions.declare_task(key, **ours)

    def decorate(func: Callable[..., Any]) -> Any:
        if isinstance(func, Task):
            raise TypeError(
                "django_idempotency.contrib.django_tasks.idempotent_task makes the task itself: "
                "use it in place of @task, not together with it."
            )
        functions.refuse_a_generator(func)
        scope = f"{func.__module__}.{func.__qualname__}"
        protection = functions.ProtectedFunction(
            func, scope, key, declared, recover, TASK_VALUES, f"task {scope!r}"
        )

        def own(context: Any, args: Any) -> tuple[Any, ...]:
            return (context, *args) if takes_context else tuple(args)

        def split(given: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
            """The context and the task's arguments: ``Task.call()`` passes the context only
            to a function that takes it, from the caller (first, or as ``context=``), so
            another gets none."""
            if takes_context and "context" in kwargs:
                return kwargs.pop("context"), given
            if given and (takes_context or isinstance(given[0], TaskContext)):
                return given[0], given[1:]
            return None, given

        def call_once(context: Any, args: Any, kwargs: Any, body: Callable[[], Any]) -> Any:
            if context is None and key is None:
                raise TypeError(
                    f"Task {scope!r} was called without the framework's context (Task.call() "
                    "or acall()), so it has no result id to take its key from. Give "
                    "idempotent_task a key= function of the task's arguments, or enqueue it."
                )
            # The key defaults to the result's id, which a run again of that result keeps.
            return protection.call(
                own(context, args),
                kwargs,
                lambda info: body(),
                lambda: str(context.task_result.id),
                skip_first=takes_context,
            )

        run: Any
        if iscoroutinefunction(func):

            async def run(*given: Any, **kwargs: Any) -> Any:
                context, args = split(given, kwargs)

                async def body() -> Any:
                    return await func(*own(context, args), **kwargs)

                return await run_async(
                    lambda sync_body: call_once(context, args, kwargs, sync_body), body
                )

        else:

            def run(*given: Any, **kwargs: Any) -> Any:
                context, args = split(given, kwargs)
                return call_once(context, args, kwargs, lambda: func(*own(context, args), **kwargs))

        functools.update_wrapper(run, func)
        # The framework finds the task by the function's dotted name and
        # checks that a task taking its context names it first.
        run.__signature__ = _with_context(func, takes_context)
        return task(run, takes_context=True, **framework)

    if function is not None:
        return decorate(function)
    return decorate


def _with_context(func: Callable[..., Any], takes_context: bool) -> inspect.Signature:
    signature = inspect.signature(func)
    if takes_context:
        return signature
    context = inspect.Parameter("context", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return signature.replace(parameters=[context, *signature.parameters.values()])
