"""Recovering abandoned work in lease mode: attempts, checkpoints, heartbeats, the policy.

In process, on every backend: a handler that dies (``SystemExit``, as a
killed process would leave its claim) or fails after a checkpoint, the
clock moved past its lease, and the retry that resumes it. The same over
gunicorn with a worker killed by ``kill -9`` is in ``test_recovery_servers.py``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.utils import timezone

from django_idempotency import clock as database_clock
from django_idempotency import idempotent_function, signals, store
from django_idempotency.exceptions import CallAbandoned, LeaseLost
from django_idempotency.models import IdempotencyKey
from django_idempotency.recovery import Abandoned, hold_call
from example_project.provider.models import Charge
from tests import recovery_views
from tests.clients import post
from tests.polling import in_background, wait_until
from tests.test_concurrency import run_in_threads

pytestmark = pytest.mark.django_db(transaction=True)
State = IdempotencyKey.State
LEASE = timedelta(seconds=2)


@pytest.fixture(autouse=True)
def fresh_views() -> Any:
    recovery_views.reset()
    yield
    recovery_views.reset()


@pytest.fixture
def client() -> Client:
    return Client(raise_request_exception=True)


class Clock:
    """The database's clock (and ``django.utils.timezone.now``), moved forward by the test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.offset = timedelta(0)
        real = timezone.now
        monkeypatch.setattr(timezone, "now", lambda: real() + self.offset)

    @property
    def offset(self) -> timedelta:
        return self._offset

    @offset.setter
    def offset(self, offset: timedelta) -> None:
        self._offset = offset
        database_clock.shift(offset)

    def past_the_lease(self) -> None:
        self.offset += LEASE + timedelta(seconds=1)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    try:
        yield Clock(monkeypatch)
    finally:
        database_clock.shift(timedelta(0))


#: A browser's own ``Accept`` header: it ranks HTML first.
BROWSER = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}


def pay(client: Client, url: str = "/recovery/pay/", key: str = "order-1", amount: int = 10) -> Any:
    return post(client, url, key, amount=amount)


def died(client: Client, url: str = "/recovery/pay/", *, after: str = "charged") -> None:
    """Send a payment whose handler stops after ``after``, as a killed process would."""
    recovery_views.die_after.add(after)
    with pytest.raises(SystemExit):
        pay(client, url)


def failed(client: Client, url: str = "/recovery/pay/") -> None:
    """Send a payment whose handler raises after its ``charged`` checkpoint."""
    recovery_views.fail_after.add("charged")
    with pytest.raises(RuntimeError):
        pay(client, url)


def left_with_checkpoints(client: Client, clock: Any, how: str) -> None:
    """Leave the key's claim with its ``charged`` checkpoint, as ``how`` says.

    ``released``: the handler failed; ``abandoned``: its process was killed;
    ``operator``: killed, then released by ``idempotency_keys release``.
    """
    if how == "released":
        failed(client)
        return
    died(client)
    if how == "operator":
        clock.past_the_lease()
        scope = IdempotencyKey.objects.get().scope
        call_command("idempotency_keys", "release", scope, "order-1", stdout=StringIO())


def steps_run() -> list[str]:
    return [step for _, step in recovery_views.steps]


class ProgressTests:
    def test_first_run_is_attempt_one_with_no_checkpoints(self, client):
        response = pay(client)

        assert response.status_code == 201, response.content
        assert response.json()["attempt"] == 1
        assert response.json()["resumed"] == []
        record = IdempotencyKey.objects.get()
        assert (record.state, record.attempt) == (State.COMPLETED, 1)
        assert set(record.checkpoints) == {"charged", "shipped"}

    def test_a_checkpoint_commits_at_once_and_renews_the_lease(self, client, clock):
        recovery_views_hold = threading.Event()
        charged = threading.Event()  # the handler is past its checkpoint() call
        original = recovery_views._after

        def wait_after_charge(request: Any, key: str, step: str) -> None:
            if step == "charged":
                charged.set()
                recovery_views_hold.wait(10)
            original(request, key, step)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(recovery_views, "_after", wait_after_charge)
            clock.offset = timedelta(seconds=30)  # the checkpoint renews from "now"
            join = in_background(lambda: pay(Client()))
            assert charged.wait(10), "the handler never reached its charged checkpoint"
            assert steps_run() == ["charge"]
            # Seen from this thread's own connection: committed, not in a transaction.
            record = IdempotencyKey.objects.get()
            assert record.state == State.IN_PROGRESS
            assert record.checkpoints == {"charged": {"charge": Charge.objects.get().pk}}
            assert record.locked_until >= timezone.now() + LEASE - timedelta(seconds=1)
            recovery_views_hold.set()
            assert join().status_code == 201

    @pytest.mark.parametrize("data", [{"when": object()}, {"amount": float("nan")}])
    def test_data_that_is_not_json_is_refused_and_records_nothing(self, client, data):
        from django.http import HttpResponse

        from django_idempotency import idempotent

        @idempotent(atomic=False)
        def view(request: Any) -> HttpResponse:
            request.idempotency.checkpoint("step", data)
            return HttpResponse(status=201)

        from django.test import RequestFactory

        request = RequestFactory().post(
            "/x/", b"{}", content_type="application/json", HTTP_IDEMPOTENCY_KEY="k"
        )
        with pytest.raises(TypeError, match="JSON-serialisable"):
            view(request)
        request.close()  # the body's copy stays the body after an error, until then
        assert not IdempotencyKey.objects.exists()  # released, nothing recorded

    def test_a_policy_that_answers_neither_none_nor_a_response_is_a_clear_error(self):
        from django.test import RequestFactory

        from django_idempotency import idempotent
        from django_idempotency.fingerprint import request_fingerprint
        from tests.factories import IdempotencyKeyFactory

        @idempotent(atomic=False, recover=lambda request, abandoned: {"charge": 1})
        def view(request: Any) -> Any:
            raise AssertionError("the view must not run")

        request = RequestFactory().post(
            "/x/", b"{}", content_type="application/json", HTTP_IDEMPOTENCY_KEY="k"
        )
        IdempotencyKeyFactory(key="k", fingerprint=request_fingerprint(request), lease_expired=True)
        with pytest.raises(TypeError, match=r"must return an HttpResponse .* or None"):
            view(request)
        assert IdempotencyKey.objects.get().state == State.IN_PROGRESS
        request.close()  # the fingerprint above copied its body: the request's to close

    def test_atomic_mode_writes_checkpoints_in_its_transaction(self, client):
        response = pay(client, "/recovery/pay/atomic/")

        assert response.status_code == 201
        assert response.json()["attempt"] == 1
        record = IdempotencyKey.objects.get()
        assert set(record.checkpoints) == {"charged", "shipped"}

    def test_atomic_mode_failure_rolls_the_checkpoints_back(self, client):
        failed(client, "/recovery/pay/atomic/")

        assert not IdempotencyKey.objects.exists()
        assert not Charge.objects.exists()


class TakeoverTests:
    def test_a_takeover_resumes_after_the_last_checkpoint(self, client, clock):
        died(client, after="charged")
        held = IdempotencyKey.objects.get()
        assert (held.state, held.attempt) == (State.IN_PROGRESS, 1)
        assert set(held.checkpoints) == {"charged"}
        assert pay(client).status_code == 409  # inside the dead owner's lease

        clock.past_the_lease()
        retry = pay(client)

        assert retry.status_code == 201, retry.content
        assert retry.json()["attempt"] == 2
        assert retry.json()["resumed"] == ["charged"]
        assert steps_run() == ["charge", "ship"]  # each step once
        assert Charge.objects.count() == 1
        assert pay(client).json() == retry.json()  # and then replayed

    def test_another_request_takes_an_abandoned_claim_without_checkpoints_over_as_new(
        self, client, clock
    ):
        died(client, after="started")  # before its first checkpoint
        clock.past_the_lease()

        other = pay(client, amount=99)  # same key, other body

        assert other.status_code == 201
        assert other.json()["attempt"] == 1
        assert other.json()["resumed"] == []
        assert IdempotencyKey.objects.get().attempt == 1

    def test_an_abandoned_claim_with_checkpoints_refuses_another_body(self, client, clock):
        died(client)  # killed after charging
        clock.past_the_lease()
        before = IdempotencyKey.objects.values().get()
        assert before["owner_token"] != "" and set(before["checkpoints"]) == {"charged"}

        other = pay(client, amount=99)  # same key, other body

        assert other.status_code == 422, other.content
        assert other["Content-Type"] == "application/problem+json"
        assert IdempotencyKey.objects.values().get() == before  # nothing changed
        assert steps_run() == ["charge"]
        retry = pay(client)  # the same request still resumes, as the next attempt
        assert retry.status_code == 201, retry.content
        assert retry.json()["attempt"] == before["attempt"] + 1
        assert retry.json()["resumed"] == ["charged"]
        assert steps_run() == ["charge", "ship"]
        assert Charge.objects.count() == 1

    @pytest.mark.parametrize("ended", ["released", "abandoned"])
    def test_a_claim_with_checkpoints_is_bound_only_while_it_is_retained(
        self, client, clock, ended
    ):
        left_with_checkpoints(client, clock, ended)
        retained_until = IdempotencyKey.objects.get().retained_until
        assert retained_until is not None
        # Just before its retention ends, by the database's clock: still bound.
        clock.offset += retained_until - database_clock.read(connection) - timedelta(seconds=2)
        assert pay(client, amount=99).status_code == 422

        clock.offset += timedelta(seconds=3)  # its retention is over: the key is free
        other = pay(client, amount=99)

        assert other.status_code == 201, other.content
        assert (other.json()["attempt"], other.json()["resumed"]) == (1, [])
        record = IdempotencyKey.objects.get()
        assert (record.state, record.attempt) == (State.COMPLETED, 1)
        assert pay(client, amount=99)["Idempotent-Replayed"] == "true"
        assert pay(client).status_code == 422  # now bound to the other body's answer
        assert steps_run() == ["charge", "charge", "ship"]

    def test_a_failed_run_keeps_its_checkpoints_for_the_retry(self, client):
        failed(client)
        released = IdempotencyKey.objects.get()
        assert released.state == State.IN_PROGRESS
        assert released.owner_token == ""
        assert set(released.checkpoints) == {"charged"}

        retry = pay(client)  # at once, without waiting for a lease

        assert retry.status_code == 201
        # The same attempt: a failure gives the claim back, it is not taken over.
        assert retry.json()["attempt"] == 1
        assert retry.json()["resumed"] == ["charged"]
        assert steps_run() == ["charge", "ship"]

    @pytest.mark.parametrize("released_by", ["released", "operator"], ids=["owner", "operator"])
    def test_a_released_claim_with_checkpoints_refuses_another_body(
        self, client, clock, released_by
    ):
        left_with_checkpoints(client, clock, released_by)
        before = IdempotencyKey.objects.values().get()
        assert (before["state"], before["owner_token"]) == (State.IN_PROGRESS, "")
        assert set(before["checkpoints"]) == {"charged"}

        other = pay(client, amount=99)  # same key, other body

        assert other.status_code == 422, other.content
        assert other["Content-Type"] == "application/problem+json"
        assert IdempotencyKey.objects.values().get() == before  # nothing changed
        assert steps_run() == ["charge"]
        retry = pay(client)  # the same request still resumes
        assert retry.status_code == 201, retry.content
        assert retry.json()["attempt"] == before["attempt"]
        assert retry.json()["resumed"] == ["charged"]
        assert steps_run() == ["charge", "ship"]
        assert Charge.objects.count() == 1

    @pytest.mark.concurrency
    def test_requests_racing_for_a_released_claim_leave_it_to_its_own(self, client):
        failed(client)
        bodies = [10, *range(100, 107)]  # its own request's amount first, then others'

        responses = run_in_threads(
            [lambda amount=amount: pay(Client(), amount=amount) for amount in bodies],
            threads=len(bodies),
        )

        assert [r.status_code for r in responses] == [201] + [422] * (len(bodies) - 1)
        assert responses[0].json()["resumed"] == ["charged"]
        assert steps_run() == ["charge", "ship"]
        assert Charge.objects.count() == 1

    @pytest.mark.parametrize("kept", [None, {}], ids=["null", "empty"])
    def test_a_released_claim_without_checkpoints_is_taken_by_another_body(
        self, client, clock, kept
    ):
        died(client, after="started")  # before its first checkpoint
        clock.past_the_lease()
        scope = IdempotencyKey.objects.get().scope
        call_command("idempotency_keys", "release", scope, "order-1", stdout=StringIO())
        IdempotencyKey.objects.update(checkpoints=kept)  # none, as SQL NULL or as JSON {}

        other = pay(client, amount=99)  # as if there were no record

        assert other.status_code == 201, other.content
        assert (other.json()["attempt"], other.json()["resumed"]) == (1, [])
        record = IdempotencyKey.objects.get()
        assert (record.state, record.attempt) == (State.COMPLETED, 1)
        assert pay(client, amount=99)["Idempotent-Replayed"] == "true"
        assert pay(client).status_code == 422

    def test_a_failed_run_without_checkpoints_leaves_nothing(self, client):
        from tests.views import calls

        calls.reset()
        response = post(client, "/orders/lease/", "plain", status=503)

        assert response.status_code == 503
        assert not IdempotencyKey.objects.exists()

    def test_a_takeover_is_logged_with_its_attempt(self, client, clock, caplog):
        died(client)
        clock.past_the_lease()
        with caplog.at_level(logging.DEBUG, logger="django_idempotency"):
            pay(client)

        taken = [
            r for r in caplog.records if getattr(r, "idempotency_outcome", None) == "taken_over"
        ]
        assert [r.idempotency_attempt for r in taken] == [2]
        assert "order-1" not in caplog.text

    def test_takeover_signals(self, client, clock):
        sent: list[str] = []

        def taken_over(sender: Any, **kwargs: Any) -> None:
            sent.append(f"taken over, attempt {kwargs['idempotency'].attempt}")

        signals.claim_taken_over.connect(taken_over)
        try:
            died(client)
            clock.past_the_lease()
            pay(client)
        finally:
            signals.claim_taken_over.disconnect(taken_over)
        assert sent == ["taken over, attempt 2"]


class LeaseLostTests:
    def test_a_heartbeat_keeps_the_lease_past_its_length(self, client):
        started = time.monotonic()
        join = in_background(lambda: post(Client(), "/recovery/beat/", "beat", seconds=4))
        wait_until(lambda: steps_run() == ["start"], "the handler to start")
        # Past the 2 s lease the handler would have without its heartbeats.
        wait_until(lambda: time.monotonic() - started > 3, "three seconds to pass")

        duplicate = post(client, "/recovery/beat/", "beat", seconds=4)

        assert duplicate.status_code == 409  # still the original's, not taken over
        record = IdempotencyKey.objects.get()
        assert record.state == State.IN_PROGRESS
        assert record.locked_until > timezone.now()
        assert join().status_code == 201
        assert steps_run() == ["start", "end"]  # one run

    def test_a_handler_that_lost_its_lease_learns_it_and_never_completes(self, client, clock):
        taken = threading.Event()
        original = recovery_views._after

        def lose_lease_after_charge(request: Any, key: str, step: str) -> None:
            if step == "charged" and not taken.is_set():
                # Another request takes the key over while this one still runs.
                record = IdempotencyKey.objects.get()
                IdempotencyKey.objects.filter(pk=record.pk).update(owner_token="new-owner")
                taken.set()
            original(request, key, step)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(recovery_views, "_after", lose_lease_after_charge)
            response = Client(raise_request_exception=False).post(
                "/recovery/pay/",
                json.dumps({"item": "book", "amount": 10}),
                content_type="application/json",
                headers={"Idempotency-Key": "order-1"},
            )

        # The "ship" checkpoint raised LeaseLost, answered as a 409.
        assert response.status_code == 409
        assert response.json()["type"].endswith("lease-lost")
        assert response["Retry-After"] == "1"
        assert steps_run() == ["charge", "ship"]
        record = IdempotencyKey.objects.get()
        assert (record.state, record.owner_token) == (State.IN_PROGRESS, "new-owner")
        assert set(record.checkpoints) == {"charged"}  # the lost one wrote nothing

    def test_a_heartbeat_after_a_takeover_raises(self):
        from django.test import RequestFactory

        from django_idempotency import idempotent

        raised: list[BaseException] = []

        @idempotent(atomic=False)
        def view(request: Any) -> Any:
            IdempotencyKey.objects.update(owner_token="someone-else")
            try:
                request.idempotency.heartbeat()
            except LeaseLost as exc:
                raised.append(exc)
                raise
            raise AssertionError("the heartbeat did not notice")

        request = RequestFactory().post(
            "/x/", b"{}", content_type="application/json", HTTP_IDEMPOTENCY_KEY="k"
        )
        response = view(request)
        request.close()  # as Django's handler does: the body's copy stays until then

        assert response.status_code == 409
        assert len(raised) == 1


class PolicyTests:
    def test_a_reconciling_policy_completes_the_key_without_running_it(self, client, clock):
        died(client, "/recovery/pay/reconciled/")
        clock.past_the_lease()

        settled = pay(client, "/recovery/pay/reconciled/")

        assert settled.status_code == 201
        assert settled.json()["reconciled"] is True
        assert steps_run() == ["charge"]  # nothing ran again
        (abandoned,) = recovery_views.asked
        assert (abandoned.attempt, sorted(abandoned.checkpoints)) == (1, ["charged"])
        assert abandoned.key == "order-1" and "order-1" not in repr(abandoned)
        record = IdempotencyKey.objects.get()
        assert record.state == State.COMPLETED
        replay = pay(client, "/recovery/pay/reconciled/")
        assert replay["Idempotent-Replayed"] == "true"
        assert replay.content == settled.content
        assert len(recovery_views.asked) == 1  # a completed key asks no one

    def test_a_policy_returning_none_takes_over(self, client, clock):
        died(client, "/recovery/pay/reconciled/", after="shipped")  # hmm: both checkpoints
        # With "charged" recorded, reconcile settles; a claim abandoned before
        # any checkpoint is taken over instead:
        IdempotencyKey.objects.update(checkpoints={})
        clock.past_the_lease()

        retry = pay(client, "/recovery/pay/reconciled/")

        assert retry.status_code == 201
        assert retry.json()["attempt"] == 2
        assert len(recovery_views.asked) == 1

    @pytest.mark.parametrize("url", ["/recovery/pay/held/", "/recovery/pay/held-by-path/"])
    def test_hold_answers_409_and_keeps_the_claim_until_an_operator_releases_it(
        self, client, clock, url
    ):
        died(client, url)
        clock.past_the_lease()

        for _ in range(2):
            held = pay(client, url)
            assert held.status_code == 409
            assert held["Content-Type"] == "application/problem+json"
            assert held.json()["type"].endswith("request-abandoned")
            assert held["Retry-After"] == "60"
        record = IdempotencyKey.objects.get()
        assert (record.state, record.attempt) == (State.IN_PROGRESS, 1)
        assert steps_run() == ["charge"]

        out = StringIO()
        call_command(
            "idempotency_keys", "release", record.scope, "order-1", stdout=out, stderr=StringIO()
        )
        assert out.getvalue().startswith("Released idempotency key")
        again = pay(client, url)  # the policy is not asked about a released claim
        assert again.status_code == 201
        assert again.json()["attempt"] == 2
        assert again.json()["resumed"] == ["charged"]
        assert steps_run() == ["charge", "ship"]
        assert Charge.objects.count() == 1

    def test_hold_answers_a_browser_with_a_page(self, client, clock):
        died(client, "/recovery/pay/held/")
        clock.past_the_lease()

        held = post(client, "/recovery/pay/held/", "order-1", amount=10, headers=BROWSER)

        assert held.status_code == 409
        assert held["Content-Type"].startswith("text/html")
        assert held["Retry-After"] == "60"
        assert "waiting for our staff" in held.content.decode()  # the page: test_browsers.py
        assert IdempotencyKey.objects.get().state == State.IN_PROGRESS

    def test_an_abandoned_claim_with_another_body_is_422_under_a_policy(self, client, clock):
        died(client, "/recovery/pay/held/")
        clock.past_the_lease()

        other = pay(client, "/recovery/pay/held/", amount=99)

        assert other.status_code == 422
        assert recovery_views.asked == []

    @pytest.mark.parametrize(
        ("url", "body"),
        [
            ("/recovery/pay/reconciled-by-template/", b"reconciled charge %d"),
            ("/recovery/pay/reconciled-by-drf/", b'{"charge":%d}'),
        ],
    )
    def test_a_policys_response_is_rendered_as_a_handlers_is(self, client, clock, url, body):
        died(client, url)
        clock.past_the_lease()

        settled = pay(client, url)

        assert settled.status_code == 201
        (charge,) = Charge.objects.all()
        assert settled.content == body % charge.pk
        replay = pay(client, url)
        assert replay["Idempotent-Replayed"] == "true"
        assert replay.content == settled.content
        assert steps_run() == ["charge"]
        assert len(recovery_views.asked) == 1

    def test_a_policy_loses_to_an_owner_that_renewed_its_lease_meanwhile(self, client, clock):
        url = "/recovery/pay/reconciled-while-renewed/"
        died(client, url)
        clock.past_the_lease()
        original = IdempotencyKey.objects.get()

        answer = pay(client, url)

        assert answer.status_code == 409
        record = IdempotencyKey.objects.get()
        assert (record.state, record.owner_token) == (State.IN_PROGRESS, original.owner_token)
        # The claim is still the owner's: its own result is the one stored.
        stored = store.StoredResponse(201, [], b"{}")
        assert store.complete(
            "default", record.id, stored, owner_token=original.owner_token, ttl=timedelta(hours=1)
        )
        assert pay(client, url)["Idempotent-Replayed"] == "true"

    def test_a_takeover_the_policy_allows_is_counted_once(self, client, clock):
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader

        from django_idempotency import metrics

        reader = InMemoryMetricReader()
        provider = MeterProvider(metric_readers=[reader])
        metrics.use_meter_provider(provider)
        try:
            died(client, "/recovery/pay/taken-over/")
            clock.past_the_lease()
            assert pay(client, "/recovery/pay/taken-over/").status_code == 201
            data = reader.get_metrics_data()
        finally:
            metrics.use_meter_provider(None)
            provider.shutdown()
        started = [
            point.value
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name == "idempotency.recoveries.started"
            for point in metric.data.data_points
        ]
        assert started == [1]
        assert len(recovery_views.asked) == 1

    def test_recovery_signals(self, client, clock):
        sent: list[str] = []

        def receiver(sender: Any, signal: Any, **kwargs: Any) -> None:
            sent.append(signal)

        for signal in (signals.claim_recovered, signals.claim_held):
            signal.connect(receiver)
        try:
            died(client, "/recovery/pay/held/")
            clock.past_the_lease()
            pay(client, "/recovery/pay/held/")
            IdempotencyKey.objects.all().delete()
            died(client, "/recovery/pay/reconciled/")
            clock.past_the_lease()
            pay(client, "/recovery/pay/reconciled/")
        finally:
            for signal in (signals.claim_recovered, signals.claim_held):
                signal.disconnect(receiver)
        assert sent == [signals.claim_held, signals.claim_recovered]


settled_calls: list[Abandoned] = []


def settle(abandoned: Abandoned) -> Any:
    settled_calls.append(abandoned)
    return {"settled": abandoned.attempt}


@idempotent_function(key=lambda n, die: f"job-{n}", atomic=False, lease=2, recover=settle)
def reconciled_job(n: int, die: bool) -> dict:
    idempotency = reconciled_job_info[-1] if reconciled_job_info else None
    del idempotency
    if die:
        raise SystemExit("stopped")
    return {"ran": n}


reconciled_job_info: list[Any] = []


@idempotent_function(key=lambda n: f"held-{n}", atomic=False, lease=2, recover=hold_call)
def held_job(n: int) -> dict:
    if n < 0:
        raise SystemExit("stopped")
    return {"ran": n}


class FunctionPolicyTests:
    def test_a_functions_policy_value_completes_the_key(self, clock):
        settled_calls.clear()
        with pytest.raises(SystemExit):
            reconciled_job(1, True)
        clock.past_the_lease()

        assert reconciled_job(1, True) == {"settled": 1}
        assert reconciled_job(1, True) == {"settled": 1}
        assert len(settled_calls) == 1

    def test_hold_call_raises_call_abandoned(self, clock):
        with pytest.raises(SystemExit):
            held_job(-1)
        clock.past_the_lease()

        with pytest.raises(CallAbandoned):
            held_job(-1)
        assert IdempotencyKey.objects.get().state == State.IN_PROGRESS

    def test_recover_must_be_callable(self):
        with pytest.raises(TypeError, match=r"recover=\.\.\.\) must be a callable"):
            idempotent_function(key=lambda: "k", recover="nope")


def test_connection_is_the_tests_own() -> None:
    # The in-process tests read the record from this thread's connection
    # while a handler holds another: they need a database that allows it.
    assert connection.vendor in {"sqlite", "postgresql", "mysql"}


def test_a_policy_derives_the_keys_the_abandoned_request_gave_its_calls() -> None:
    from django_idempotency.info import IdempotencyInfo

    abandoned = Abandoned(
        scope="user:1", key="order-7", created_at=timezone.now(), attempt=1, checkpoints={}
    )
    info = IdempotencyInfo(key="order-7", scope="user:1", fingerprint="f" * 64)

    assert abandoned.derive("charge") == info.derive("charge")
    assert abandoned.derive("charge") != abandoned.derive("refund")
    assert "order-7" not in abandoned.derive("charge")
