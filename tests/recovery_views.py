"""Lease-mode views that record their progress, for the recovery tests.

A payment in two steps, as the recovery docs describe it: charge the
provider (``example_project.provider``, which keeps one charge per
idempotency key, like a real one), checkpoint, then ship, checkpoint. Each
step that really runs is also counted outside the database: in ``steps``
in process, and as a line in ``<CONTROL_DIR>/<key>.steps`` under a server.
``die_after`` makes the next run stop after a step (or after ``started``,
before any) as a killed process would (``SystemExit``: the effect is
unknown, the claim stays); ``fail_after`` makes it raise instead (a
failure: the claim is released, keeping its checkpoints). Under a server,
``<key>.hold-after-<step>`` makes the handler report its PID
(``<key>.pid``) and wait there, for a test to kill it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.template import engines
from django.template.response import TemplateResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import idempotent, store
from django_idempotency.contrib.drf import IdempotentMixin
from django_idempotency.models import IdempotencyKey
from django_idempotency.recovery import Abandoned, hold
from example_project.provider import client as provider
from tests.drf_views import CONTROL_DIR_ENV

#: Steps that ran, in process: ``(key, step)``.
steps: list[tuple[str, str]] = []
die_after: set[str] = set()
fail_after: set[str] = set()
#: Policy calls, in process: the abandoned claims they were asked about.
asked: list[Abandoned] = []
#: Called by :func:`renewed` between its checkpoint and its heartbeat, in process.
before_heartbeat: list[Callable[[], None]] = []
_lock = threading.Lock()
HOLD_LIMIT = 60.0


def reset() -> None:
    steps.clear()
    die_after.clear()
    fail_after.clear()
    asked.clear()
    before_heartbeat.clear()


def _control(key: str) -> Path | None:
    directory = os.environ.get(CONTROL_DIR_ENV)
    return Path(directory) / key if directory else None


def _ran(key: str, step: str) -> None:
    with _lock:
        steps.append((key, step))
    control = _control(key)
    if control is not None:
        with control.with_suffix(".steps").open("a") as runs:
            runs.write(f"{step}\n")


def _after(request: HttpRequest, key: str, step: str) -> None:
    if step in die_after:
        die_after.discard(step)
        raise SystemExit(f"stopped after {step}")
    if step in fail_after:
        fail_after.discard(step)
        raise RuntimeError(f"failed after {step}")
    control = _control(key)
    if control is not None and Path(f"{control}.hold-after-{step}").exists():
        # Whole or not at all: the test reads it as soon as it exists.
        Path(f"{control}.tmp").write_text(json.dumps({"pid": os.getpid(), "step": step}))
        Path(f"{control}.tmp").replace(f"{control}.pid")
        deadline = time.monotonic() + HOLD_LIMIT
        while Path(f"{control}.hold-after-{step}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)


def _pay(request: HttpRequest) -> HttpResponse:
    info = request.idempotency  # type: ignore[attr-defined]
    key = info.key
    amount = json.loads(request.body)["amount"]
    done = info.checkpoints
    _after(request, key, "started")
    if "charged" in done:
        charge_id = done["charged"]["charge"]
    else:
        charge_id = provider.charge(amount, info.derive("charge")).pk
        _ran(key, "charge")
        info.checkpoint("charged", {"charge": charge_id})
    _after(request, key, "charged")
    if "shipped" not in done:
        _ran(key, "ship")
        info.checkpoint("shipped", {"parcel": f"parcel-{charge_id}"})
    _after(request, key, "shipped")
    body = {"charge": charge_id, "attempt": info.attempt, "resumed": sorted(done)}
    return JsonResponse(body, status=201)


def reconcile(request: HttpRequest, abandoned: Abandoned) -> HttpResponse | None:
    """Ask "the provider" whether the charge went through; settle the key if it did."""
    asked.append(abandoned)
    charged = abandoned.checkpoints.get("charged")
    if charged is None:
        return None  # nothing escaped: run it again
    body = {"charge": charged["charge"], "attempt": abandoned.attempt, "reconciled": True}
    return JsonResponse(body, status=201)


def reconcile_with_template(request: HttpRequest, abandoned: Abandoned) -> TemplateResponse:
    """Settle the key with a template response, which is rendered only when finished."""
    asked.append(abandoned)
    template = engines["django"].from_string("reconciled charge {{ charge }}")
    context = {"charge": abandoned.checkpoints["charged"]["charge"]}
    return TemplateResponse(request, template, context, status=201)


def reconcile_with_drf(request: Request, abandoned: Abandoned) -> Response:
    """Settle the key with a DRF response, which has no bytes until the view renders it."""
    asked.append(abandoned)
    return Response({"charge": abandoned.checkpoints["charged"]["charge"]}, status=201)


def reconcile_while_renewed(request: HttpRequest, abandoned: Abandoned) -> HttpResponse | None:
    """:func:`reconcile`, while the owner (slower than its lease, not dead) renews its lease."""
    record = IdempotencyKey.objects.get(scope=abandoned.scope, key=abandoned.key)
    renewed = store.record_progress(
        "default",
        record.id,
        owner_token=record.owner_token,
        lease=timedelta(seconds=2),
    )
    assert renewed
    return reconcile(request, abandoned)


def counting_hold(request: HttpRequest, abandoned: Abandoned) -> HttpResponse:
    asked.append(abandoned)
    return hold(request, abandoned)


def _view(lease: float = 2, **options: Any) -> Any:
    return csrf_exempt(idempotent(atomic=False, lease=lease, **options)(_pay))


pay = _view()
#: A lease that outlasts killing a worker on a loaded machine, for a retry sent inside it.
pay_long_lease = _view(lease=15)
pay_reconciled = _view(recover=reconcile)
pay_held = _view(recover=counting_hold)
pay_held_by_path = _view(recover="django_idempotency.recovery.hold")
pay_reconciled_by_template = _view(recover=reconcile_with_template)
pay_reconciled_while_renewed = _view(recover=reconcile_while_renewed)
#: A policy that looks and lets the handler take over (``None``).
pay_taken_over = _view(recover=lambda request, abandoned: asked.append(abandoned))


class ReconciledPayView(IdempotentMixin, APIView):
    """The payment as a DRF view, whose policy answers with a DRF ``Response``."""

    permission_classes = [AllowAny]
    authentication_classes: list[type] = []
    idempotency_atomic = False
    idempotency_lease = 2
    idempotency_recover = staticmethod(reconcile_with_drf)

    def post(self, request: Request) -> HttpResponse:
        return _pay(request)


@csrf_exempt
@idempotent
def pay_atomic(request: HttpRequest) -> HttpResponse:
    return _pay(request)


@csrf_exempt
@idempotent(atomic=False, lease=2)
def beat(request: HttpRequest) -> HttpResponse:
    """Runs for ``seconds`` (from the body), renewing its 2 s lease every half second."""
    info = request.idempotency  # type: ignore[attr-defined]
    seconds = float(json.loads(request.body)["seconds"])
    _ran(info.key, "start")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.5)
        info.heartbeat()
    _ran(info.key, "end")
    return JsonResponse({"attempt": info.attempt}, status=201)


@csrf_exempt
@idempotent(atomic=False, lease=30, ttl=10)
def renewed(request: HttpRequest) -> HttpResponse:
    """Charges, checkpoints, renews its lease (TTL shorter than it), then ``_after`` decides.

    ``before_heartbeat`` runs between the checkpoint and the heartbeat, for
    a test to move the database's clock past the first lease.
    """
    info = request.idempotency  # type: ignore[attr-defined]
    if "charged" not in info.checkpoints:
        _ran(info.key, "charge")
        info.checkpoint("charged", {"charge": 1})
    for hook in before_heartbeat:
        hook()
    info.heartbeat()
    _after(request, info.key, "charged")
    return JsonResponse({"attempt": info.attempt, "resumed": sorted(info.checkpoints)}, status=201)
