"""Celery integration: the purge task, and idempotent tasks.

The only module that imports Celery. ``django_idempotency.tasks``
re-exports it, so that Celery's autodiscovery registers the purge.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from celery import current_task, shared_task
from celery.app.task import Task
from celery.exceptions import Ignore, SoftTimeLimitExceeded
from celery.local import Proxy

from django_idempotency import engine, functions, purge
from django_idempotency.adapters import Adapter, register
from django_idempotency.conf import idempotency_settings
from django_idempotency.exceptions import CallAbandoned, TaskArgumentsMismatch, TaskInFlight
from django_idempotency.options import CallOptions
from django_idempotency.store import StoredResponse

if TYPE_CHECKING:
    from typing_extensions import Unpack

F = TypeVar("F", bound=Callable[..., Any])
KeyFunction = Callable[..., str]

# The name it has logged under since before the move to contrib/, which projects'
# LOGGING configurations name.
logger = logging.getLogger("django_idempotency.tasks")


# The task name it has always had: beat schedules and django-celery-beat rows name it.
purge_expired_keys = shared_task(name="django_idempotency.tasks.purge_expired_keys")(
    purge.purge_expired_keys
)


def _ending(exc: BaseException) -> engine.Ending | None:
    """How Celery's control flow ends a body, or ``None`` for another exception.

    ``Ignore`` (also raised by ``self.replace(...)``) ends it on purpose: its
    writes commit and the key is completed. ``SoftTimeLimitExceeded``
    interrupts it anywhere, as a cancellation does: its effect is unknown.
    """
    if isinstance(exc, Ignore):
        return engine.Ending.COMPLETED
    if isinstance(exc, SoftTimeLimitExceeded):
        return engine.Ending.UNKNOWN
    return None


def _end_on_purpose() -> None:
    raise Ignore()


#: What the package knows of Celery, for every function and task body.
ADAPTER = Adapter(name="Celery", ending=_ending, end_on_purpose=_end_on_purpose)
register(ADAPTER)


#: A task's value is kept as a function's is; its errors are Celery's to retry.
TASK_VALUES = replace(
    functions.VALUES,
    in_flight=lambda retry_after: TaskInFlight(retry_after=retry_after),
    mismatch=TaskArgumentsMismatch,
)


def _replacement_values(task_name: str) -> engine.Kind:
    """:data:`TASK_VALUES` for a message after a replacement, keyed by ``key=``: it warns.

    A replacement with the same arguments has the key its first step
    completed, so it ends ignored and the work stops: correct, but silent
    without this warning. A redelivered step or a chain's later task gets the same
    warning, as a record does not say which message ended it.
    """

    def decode(stored: StoredResponse) -> Any:
        if stored.status_code == functions.ENDED_STATUS:
            logger.warning(
                "Task %r ends ignored: its key= names work that already ended on "
                "purpose. For a redelivered message that is expected; but if the task "
                "replaced itself with arguments that give the same key, the work stops "
                "here: a task that replaces itself needs a key for each step (put the "
                "step among its arguments).",
                task_name,
            )
        return functions.decode(stored)

    return replace(TASK_VALUES, decode=decode)


def idempotent_task(
    func: Callable[..., Any] | None = None,
    /,
    *,
    key: KeyFunction | None = None,
    recover: functions.Recover | None = None,
    **options: Unpack[CallOptions],
) -> Any:
    """Run a Celery task's body once per key, and give duplicates its stored result.

    Goes *below* ``@shared_task`` (or ``@app.task``), next to the function::

        @shared_task(acks_late=True)
        @idempotent_task(key=lambda order_id, **kwargs: f"charge-{order_id}")
        def charge(order_id): ...

    The key defaults to the task id, which a redelivered message keeps;
    ``key`` is called with the task's arguments (never the bound task), so
    two publishes of the same work are one effect. The scope is the task's
    name. ``atomic``, ``ttl``, ``wait`` and ``lease`` default to their
    settings. In the body, ``task.request.idempotency`` (``self.request``
    when bound) has the key and ``derive(name)``, and in lease mode the
    attempt, the checkpoints and ``checkpoint()``/``heartbeat()``.
    ``recover`` is an ``idempotent_function``'s: ``recover(abandoned)``
    decides for the claim of a run that died (``recovery.hold_call``
    retries it later).
    """
    declared = functions.declare_task(key, **options)
    functions.checked_recover(recover, "idempotent_task")

    def decorate(function: F) -> F:
        if issubclass(type(function), (Task, Proxy)):
            raise TypeError(
                "@idempotent_task must go below @shared_task / @app.task, directly above "
                "the function: it wraps the task's body, not the task."
            )
        if not callable(function):
            raise TypeError(f"@idempotent_task decorates a function, not {function!r}.")
        functions.refuse_a_generator(function)

        @functools.wraps(function)
        def body(*args: Any, **kwargs: Any) -> Any:
            task = _running_task(body)
            if task is None or not idempotency_settings.enabled:
                # Called as a plain function, not as this task: nothing to protect.
                return function(*args, **kwargs)
            if key is None and task.request.id is None:
                # Called directly, not as a message: no message id to key it by.
                return function(*args, **kwargs)
            protection = functions.ProtectedFunction(
                function, task.name, key, declared, recover, TASK_VALUES, f"task {task.name!r}"
            )
            with_task = bool(args) and args[0] is task  # bind=True
            task_key = protection.key_of(
                args, kwargs, lambda: _message_key(task.request), skip_first=with_task
            )
            kind = TASK_VALUES
            if key is not None and _nesting(task.request):
                kind = _replacement_values(task.name)
            running = _running.get()
            this_run = (task.name, task_key, task.request.id)
            if this_run in running:
                # Called from its own body (Celery lends it the running
                # message's id): part of that run, not a run of its own.
                task.request.idempotency = running[this_run]
                return function(*args, **kwargs)

            def run(info: Any) -> Any:
                task.request.idempotency = info
                inside = _running.set({**running, this_run: info})
                try:
                    return function(*args, **kwargs)
                finally:
                    _running.reset(inside)

            try:
                return protection.run(task_key, args, kwargs, run, skip_first=with_task, kind=kind)
            except (TaskInFlight, CallAbandoned) as exc:
                # Never run alongside the original: come back once it is done.
                raise task.retry(countdown=exc.retry_after, exc=exc) from None

        # Celery checks a publish's arguments against this signature.
        body.__signature__ = inspect.signature(function)  # type: ignore[attr-defined]
        return body  # type: ignore[return-value]

    if func is not None:
        return decorate(func)
    return decorate


#: Each body running here: (task name, key, task id) to its ``request.idempotency``.
_running: ContextVar[dict[tuple[str, str, Any], Any]] = ContextVar(
    "django_idempotency_running_tasks",
    default={},  # noqa: B039 (never mutated)
)


def _message_key(request: Any) -> str:
    """The default key: the message's task id, and how many times it was replaced.

    A replacement keeps the replaced task's id but is new work; a
    redelivered message keeps both, so it is still one effect.
    """
    nesting = _nesting(request)
    return str(request.id) if not nesting else f"{request.id}:replaced:{nesting}"


def _nesting(request: Any) -> int:
    """How many times this message's task was replaced (Celery 5.3+), 0 for none."""
    return request.get("replaced_task_nesting") or 0


def _running_task(body: Callable[..., Any]) -> Any:
    """The task whose body this is, if it is the one running now."""
    task = current_task._get_current_object()
    if task is None:
        return None
    # Celery's autoretry_for keeps the original run as _orig_run.
    for name in ("_orig_run", "run"):
        run = getattr(task, name, None)
        if getattr(run, "__func__", run) is body:
            return task
    return None
