"""The purge and lease mode's progress: a claim left in progress is kept for its retry.

A lease-mode claim whose owner released it (the handler failed after a
checkpoint) or abandoned it (the process died; its lease ran out) carries
its attempt and checkpoints to the retry that takes it over. Its
``expires_at`` is where its lease ended, which decides the takeover; the
purge keeps it until ``retained_until`` too, the key's TTL past the end of
its lease (as each claim, takeover, renewal and release left it), so that
a step recorded as done never runs twice because a purge ran between the
crash and the retry. In process, on every backend, with the
database's clock moved forward as ``test_recovery.py`` moves it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, transaction
from django.db.transaction import TransactionManagementError
from django.test import Client

from django_idempotency import clock as database_clock
from django_idempotency import idempotent_function, leases, purge
from django_idempotency.conf import idempotency_settings
from django_idempotency.models import IdempotencyKey
from django_idempotency.purge import purge_expired
from example_project.provider.models import Charge
from tests import recovery_views
from tests.clients import post
from tests.factories import IdempotencyKeyFactory

State = IdempotencyKey.State
#: The recovery views' lease.
LEASE = timedelta(seconds=2)
PAST_THE_LEASE = LEASE + timedelta(seconds=1)


@pytest.fixture(autouse=True)
def fresh_views() -> Iterator[None]:
    recovery_views.reset()
    yield
    recovery_views.reset()


@pytest.fixture
def client() -> Client:
    return Client(raise_request_exception=True)


@pytest.fixture
def moved() -> Iterator[Any]:
    """Moves the database's clock forward by what it is given (and back after the test)."""
    try:
        yield database_clock.shift
    finally:
        database_clock.shift(timedelta(0))


def pay(client: Client, url: str = "/recovery/pay/", key: str = "order-1") -> Any:
    return post(client, url, key, amount=10)


def died(client: Client, url: str = "/recovery/pay/") -> None:
    """A payment whose process stops after charging, as a killed one would."""
    recovery_views.die_after.add("charged")
    with pytest.raises(SystemExit):
        pay(client, url)


def failed(client: Client) -> None:
    """A payment whose handler raises after charging: the claim is released."""
    recovery_views.fail_after.add("charged")
    with pytest.raises(RuntimeError):
        pay(client)


def steps_run() -> list[str]:
    return [step for _, step in recovery_views.steps]


@pytest.mark.django_db(transaction=True)
class KeptForTheRetryTests:
    def test_an_abandoned_claim_outlives_its_lease_and_the_retry_resumes(self, client, moved):
        died(client)
        moved(PAST_THE_LEASE)
        claim = IdempotencyKey.objects.get()
        assert IdempotencyKey.objects.filter(leases.q(leases.ABANDONED)).get() == claim

        assert purge_expired() == 0
        retry = pay(client)

        assert retry.status_code == 201, retry.content
        assert retry.json()["attempt"] == 2
        assert retry.json()["resumed"] == ["charged"]
        assert steps_run() == ["charge", "ship"]  # the charge ran once
        assert Charge.objects.count() == 1

    def test_a_released_claim_outlives_its_lease_and_the_retry_resumes(self, client, moved):
        failed(client)
        released = IdempotencyKey.objects.get()
        assert IdempotencyKey.objects.filter(leases.q(leases.RELEASED)).get() == released
        moved(timedelta(hours=1))

        assert purge_expired() == 0
        retry = pay(client)

        assert retry.status_code == 201, retry.content
        assert (retry.json()["attempt"], retry.json()["resumed"]) == (1, ["charged"])
        assert steps_run() == ["charge", "ship"]

    def test_a_released_claim_is_still_taken_over_at_once(self, client):
        failed(client)

        retry = pay(client)  # no clock moved: released is free at once

        assert retry.status_code == 201, retry.content
        assert retry.json()["resumed"] == ["charged"]

    def test_a_held_key_stays_held_past_its_lease_until_an_operator_settles_it(self, client, moved):
        died(client, "/recovery/pay/held/")
        moved(PAST_THE_LEASE)

        assert purge_expired() == 0
        held = pay(client, "/recovery/pay/held/")

        assert held.status_code == 409
        assert held.json()["type"].endswith("request-abandoned")
        out = StringIO()
        call_command("idempotency_keys", "list", "--abandoned", stdout=out, stderr=StringIO())
        assert "in progress, attempt 1, abandoned, charged" in out.getvalue()
        assert steps_run() == ["charge"]
        record = IdempotencyKey.objects.get()
        shown = StringIO()
        call_command("idempotency_keys", "show", record.scope, "order-1", stdout=shown)
        assert f"kept until:   {record.retained_until.isoformat()}" in shown.getvalue()

    def test_the_claim_is_purged_once_the_ttl_past_its_lease_has_passed(self, client, moved):
        died(client)
        claim = IdempotencyKey.objects.get()
        ttl = idempotency_settings.ttl
        assert claim.retained_until is not None
        # Written by the database's clock, the key's TTL past the lease's end.
        assert claim.retained_until - claim.expires_at == ttl

        moved(claim.expires_at - claim.created_at + ttl - timedelta(seconds=1))
        assert purge_expired(dry_run=True) == 0
        assert purge_expired() == 0
        moved(claim.expires_at - claim.created_at + ttl + timedelta(seconds=1))
        assert purge_expired(dry_run=True) == 1
        assert purge_expired() == 1

        assert not IdempotencyKey.objects.exists()

    def test_a_takeover_retains_the_claim_for_the_ttl_from_the_takeover(self, client, moved):
        died(client)
        moved(PAST_THE_LEASE)
        recovery_views.die_after.add("shipped")
        with pytest.raises(SystemExit):
            pay(client)  # attempt 2 dies too, after shipping

        claim = IdempotencyKey.objects.get()
        assert (claim.attempt, set(claim.checkpoints)) == (2, {"charged", "shipped"})
        assert claim.retained_until - claim.expires_at == idempotency_settings.ttl
        # Past the first claim's retention (its lease's end, 2 s, plus the TTL),
        # not the second's (its lease ended at 3 s + 2 s).
        moved(LEASE + idempotency_settings.ttl + timedelta(seconds=1))

        assert purge_expired() == 0
        assert pay(client).json()["resumed"] == ["charged", "shipped"]
        assert steps_run() == ["charge", "ship"]

    def test_a_completed_lease_key_expires_as_before(self, client, moved):
        assert pay(client).status_code == 201
        record = IdempotencyKey.objects.get()
        assert record.state == State.COMPLETED
        # The completion set its expiry; the retention its claim wrote is later.
        assert record.retained_until > record.expires_at + timedelta(seconds=1)

        moved(record.expires_at - database_clock.read(connection) + timedelta(seconds=0.5))
        assert record.expires_at < database_clock.read(connection) < record.retained_until

        assert purge_expired() == 1

    def test_a_recovery_policys_takeover_writes_the_retention_itself(self, client, moved):
        url = "/recovery/pay/taken-over/"  # its policy looks, and lets the retry take over
        died(client, url)
        first = IdempotencyKey.objects.get().retained_until
        moved(PAST_THE_LEASE)
        # Attempt 2 resumes past the charge and dies before it checkpoints:
        # only the takeover wrote its claim.
        recovery_views.die_after.add("charged")
        with pytest.raises(SystemExit):
            pay(client, url)
        assert len(recovery_views.asked) == 1

        claim = IdempotencyKey.objects.get()
        assert (claim.attempt, set(claim.checkpoints)) == (2, {"charged"})
        assert claim.retained_until - claim.expires_at == idempotency_settings.ttl
        assert claim.retained_until >= first + PAST_THE_LEASE
        left = claim.retained_until - database_clock.read(connection)
        moved(PAST_THE_LEASE + left - timedelta(seconds=1))  # past the first claim's retention
        assert purge_expired() == 0
        moved(PAST_THE_LEASE + left + timedelta(seconds=1))
        assert purge_expired() == 1

    def test_an_idempotent_functions_abandoned_claim_is_kept_for_its_ttl(self, moved):
        with pytest.raises(SystemExit):
            shipped("o-1", die=True)
        moved(PAST_THE_LEASE)

        assert purge_expired() == 0
        moved(timedelta(seconds=2 + 600 - 1))
        assert purge_expired() == 0
        moved(timedelta(seconds=2 + 600 + 1))
        assert purge_expired() == 1

    def test_a_ttl_shorter_than_the_lease_keeps_the_claim_past_its_lease(self, moved):
        with pytest.raises(SystemExit):
            short_lived("o-1", die=True)
        moved(timedelta(seconds=31))  # past the lease (30 s) and a TTL (10 s) from the claim

        assert purge_expired() == 0
        moved(timedelta(seconds=41))
        assert purge_expired() == 1


@pytest.mark.django_db(transaction=True)
class RenewedTests:
    """A lease renewed past its first end moves the retention too (TTL 10 s, lease 30 s)."""

    @pytest.fixture(autouse=True)
    def runs_long(self, moved) -> None:
        # The handler's heartbeat comes 100 s after its claim: past the first
        # lease and the retention it was claimed with.
        recovery_views.before_heartbeat.append(lambda: moved(timedelta(seconds=100)))

    def test_a_heartbeat_then_a_failure_keeps_the_claim_for_the_ttl_from_the_release(
        self, client, moved
    ):
        recovery_views.fail_after.add("charged")
        with pytest.raises(RuntimeError):
            pay(client, "/recovery/renewed/")
        recovery_views.before_heartbeat.clear()
        claim = IdempotencyKey.objects.get()
        assert claim.retained_until - claim.expires_at == timedelta(seconds=10)

        moved(timedelta(seconds=100 + 9))
        assert purge_expired() == 0
        retry = pay(client, "/recovery/renewed/")
        assert (retry.status_code, retry.json()["resumed"]) == (201, ["charged"])
        assert steps_run() == ["charge"]

    def test_a_heartbeat_then_a_failure_is_purged_after_the_ttl_from_the_release(
        self, client, moved
    ):
        recovery_views.fail_after.add("charged")
        with pytest.raises(RuntimeError):
            pay(client, "/recovery/renewed/")

        moved(timedelta(seconds=100 + 11))
        assert purge_expired() == 1

    def test_a_heartbeat_then_death_keeps_the_claim_for_the_ttl_past_the_renewed_lease(
        self, client, moved
    ):
        recovery_views.die_after.add("charged")
        with pytest.raises(SystemExit):
            pay(client, "/recovery/renewed/")
        recovery_views.before_heartbeat.clear()
        claim = IdempotencyKey.objects.get()
        assert claim.retained_until - claim.expires_at == timedelta(seconds=10)

        moved(timedelta(seconds=100 + 30 + 9))  # the renewed lease ran out 9 s ago
        assert purge_expired() == 0
        retry = pay(client, "/recovery/renewed/")
        assert retry.status_code == 201, retry.content
        assert (retry.json()["attempt"], retry.json()["resumed"]) == (2, ["charged"])
        assert steps_run() == ["charge"]

    def test_a_heartbeat_then_death_is_purged_after_the_ttl_past_the_renewed_lease(
        self, client, moved
    ):
        recovery_views.die_after.add("charged")
        with pytest.raises(SystemExit):
            pay(client, "/recovery/renewed/")

        moved(timedelta(seconds=100 + 30 + 11))
        assert purge_expired() == 1


@idempotent_function(
    key=lambda order, die: order, scope="purge-progress", atomic=False, lease=2, ttl=600
)
def shipped(order: str, die: bool) -> str:
    if die:
        raise SystemExit("killed")
    return order


@idempotent_function(
    key=lambda order, die: order, scope="purge-short-ttl", atomic=False, lease=30, ttl=10
)
def short_lived(order: str, die: bool) -> str:
    if die:
        raise SystemExit("killed")
    return order


@pytest.fixture
def every_kind_of_row() -> dict[int, bool]:
    """A record for each combination of what the purge reads; whether a purge now deletes it."""
    now = database_clock.read(connection)
    hour = timedelta(hours=1)
    expected: dict[int, bool] = {}
    kinds = itertools.product(
        [State.COMPLETED, State.IN_PROGRESS], ["", "token"], [-hour, hour], [None, -hour, hour]
    )
    for number, (state, token, expiry, retention) in enumerate(kinds):
        retained = state == State.IN_PROGRESS and retention is not None and retention > hour * 0
        if expiry < hour * 0 and retained:
            # Kept, though expired: ahead of every row a batch deletes on the index.
            expiry = -2 * hour
        record = IdempotencyKeyFactory(
            key=f"k{number}",
            state=state,
            owner_token=token,
            expires_at=now + expiry,
            retained_until=None if retention is None else now + retention,
        )
        expected[record.pk] = expiry < hour * 0 and not retained
    return expected


@pytest.mark.django_db
class PredicateTests:
    def test_the_orm_the_dry_run_and_the_batches_delete_the_same_rows(self, every_kind_of_row):
        named = {pk for pk, deleted in every_kind_of_row.items() if deleted}
        cutoff = database_clock.read(connection)

        by_orm = set(
            IdempotencyKey.objects.filter(leases.purgeable_q(cutoff)).values_list("pk", flat=True)
        )
        counted = purge_expired(dry_run=True)
        deleted = purge_expired(batch_size=2)
        left = set(IdempotencyKey.objects.values_list("pk", flat=True))

        # Expired: every completed record, and the claims not retained past now.
        assert len(named) == 6 + 4
        assert by_orm == named
        assert counted == deleted == len(named)
        assert left == set(every_kind_of_row) - named

    def test_the_orm_and_the_statements_agree_at_the_cutoff_itself(self):
        cutoff = database_clock.read(connection)
        tick = timedelta(milliseconds=1)
        cases = {
            # (state, expires_at, retained_until): whether a purge at the cutoff deletes it
            (State.COMPLETED, cutoff, cutoff + tick): True,
            (State.COMPLETED, cutoff + tick, None): False,
            (State.IN_PROGRESS, cutoff, None): True,
            (State.IN_PROGRESS, cutoff, cutoff): True,
            (State.IN_PROGRESS, cutoff, cutoff + tick): False,
            (State.IN_PROGRESS, cutoff - tick, cutoff - tick): True,
        }
        expected = {}
        for number, ((state, expires_at, retained_until), deleted) in enumerate(cases.items()):
            record = IdempotencyKeyFactory(
                key=f"edge{number}",
                state=state,
                owner_token="token" if state == State.IN_PROGRESS else "",
                expires_at=expires_at,
                retained_until=retained_until,
            )
            expected[record.pk] = deleted
        named = {pk for pk, deleted in expected.items() if deleted}

        by_orm = set(
            IdempotencyKey.objects.filter(leases.purgeable_q(cutoff)).values_list("pk", flat=True)
        )
        counted = purge_expired(dry_run=True, now=cutoff)
        deleted = purge_expired(now=cutoff, batch_size=1)
        left = set(IdempotencyKey.objects.values_list("pk", flat=True))

        assert by_orm == named
        assert counted == deleted == len(named) == 4
        assert left == set(expected) - named

    def test_a_claim_written_before_retained_until_existed_goes_at_its_expiry(self):
        IdempotencyKeyFactory(lease_expired=True, checkpoints={"charged": None})

        assert purge_expired() == 1


@pytest.mark.django_db
class InsideATransactionTests:
    def test_a_purge_inside_atomic_is_refused_before_it_deletes(self, monkeypatch):
        IdempotencyKeyFactory.create_batch(3, expired=True)
        rests: list[float] = []
        monkeypatch.setattr(purge, "_rest", rests.append)

        with transaction.atomic():
            with pytest.raises(TransactionManagementError) as raised:
                purge_expired(batch_size=1, pause=1)
            assert IdempotencyKey.objects.count() == 3

        message = str(raised.value)
        assert "outside transaction.atomic()" in message
        assert "transaction.on_commit()" in message
        assert rests == []

    def test_a_dry_run_inside_atomic_only_counts(self):
        IdempotencyKeyFactory.create_batch(2, expired=True)

        with transaction.atomic():
            assert purge_expired(dry_run=True) == 2

    def test_the_tests_own_transaction_is_not_the_callers(self):
        # pytest-django's (Django's TestCase's) transaction around each test.
        assert connection.in_atomic_block
        IdempotencyKeyFactory(expired=True)

        assert purge_expired() == 1

    def test_the_command_inside_atomic_names_the_fix(self):
        IdempotencyKeyFactory(expired=True)

        refused = pytest.raises(CommandError, match=r"outside transaction\.atomic\(\)")
        with transaction.atomic(), refused:
            call_command("purge_idempotency_keys", stdout=StringIO())

        assert IdempotencyKey.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_purge_with_autocommit_off_is_refused_before_it_deletes():
    IdempotencyKeyFactory(expired=True)
    transaction.set_autocommit(False)
    try:
        with pytest.raises(TransactionManagementError, match="autocommit on"):
            purge_expired()
        assert IdempotencyKey.objects.count() == 1
    finally:
        transaction.rollback()
        transaction.set_autocommit(True)

    assert purge_expired() == 1


@pytest.fixture(params=["chosen", "bounded"])
def batches(request, monkeypatch) -> list[Any]:
    """Where each batch of a purge started; each backend's own batch, or the read-then-delete one.

    ``bounded`` is MySQL's (which has no ``DELETE ... RETURNING``), run on
    every backend here.
    """
    chosen = purge._delete_batch
    started: list[Any] = []

    def recorded(connection: Any) -> Any:
        delete_batch = (
            purge._delete_batch_bounded if request.param == "bounded" else chosen(connection)
        )

        def batch(connection: Any, cutoff: Any, size: int, passed: Any) -> purge.Batch:
            started.append(passed)
            return delete_batch(connection, cutoff, size, passed)

        return batch

    monkeypatch.setattr(purge, "_delete_batch", recorded)
    return started


@pytest.mark.django_db
class KeptClaimsAheadTests:
    """Claims the purge keeps at the head of the ``expires_at`` index, and many small batches."""

    def test_every_purgeable_row_goes_the_kept_stay_and_no_batch_starts_over(self, batches):
        now = database_clock.read(connection)
        minute = timedelta(minutes=1)

        def claim(expiry: timedelta, retention: timedelta) -> int:
            return IdempotencyKeyFactory(
                lease_expired=True, expires_at=now + expiry, retained_until=now + retention
            ).pk

        # Kept: expired claims still retained, ahead of everything on the index,
        # and two among the purgeable rows, sharing an expiry with some.
        kept = {claim(-minute * (60 + n), minute * 60) for n in range(5)}
        kept |= {claim(-minute * 30, minute * 60), claim(-minute * 20, minute)}
        # Purgeable: expiries shared by three rows each (ties across batches of
        # two), completed records and claims past their retention, the last at
        # the cutoff itself.
        gone = set()
        for n in range(12):
            expiry = -minute * (30 - 5 * (n // 3)) if n < 11 else timedelta(0)
            if n % 2:
                gone.add(claim(expiry, -minute))
            else:
                gone.add(IdempotencyKeyFactory(expires_at=now + expiry).pk)
        live = {
            IdempotencyKeyFactory(expires_at=now + timedelta(microseconds=1)).pk,
            IdempotencyKeyFactory(in_flight=True).pk,
        }

        deleted = purge_expired(batch_size=2, now=now, batch_seconds=None, pause=0)

        assert deleted == len(gone)
        assert set(IdempotencyKey.objects.values_list("pk", flat=True)) == kept | live
        # Six full batches and the short one that ends the purge; each after the
        # first starts where the one before ended, past the kept claims ahead.
        assert len(batches) == 7
        assert batches[0] is None
        assert None not in batches[1:]


@idempotent_function(key=lambda order: order, scope="tied expiries", atomic=False, ttl=60)
def ship(order: str) -> str:
    return order


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("whole_second", [False, True], ids=["milliseconds", "whole-second"])
def test_expiries_the_database_wrote_and_shares_all_go_in_one_run(batches, whole_second):
    """Ties across batches, each expiry written by the database's own clock expression.

    On SQLite that is text of its own format, which a batch must send back
    as it is to start the next one from it (a whole second included).
    """
    now = database_clock.read(connection)
    if whole_second:
        now = now.replace(microsecond=0)
    database_clock.pin(now)
    try:
        for n in range(5):
            ship(f"order {n}")
    finally:
        database_clock.pin(None)

    later = now + timedelta(minutes=5)
    deleted = purge_expired(batch_size=2, now=later, batch_seconds=None, pause=0)

    assert (deleted, IdempotencyKey.objects.count()) == (5, 0)


@pytest.mark.django_db(transaction=True)
def test_a_record_expiring_at_a_whole_second_cutoff_is_purged():
    """The cutoff compares as the database's own expiries do, a whole second included."""
    now = database_clock.read(connection).replace(microsecond=0)
    database_clock.pin(now)
    try:
        ship("order at a whole second")
    finally:
        database_clock.pin(None)
    expiry = IdempotencyKey.objects.get().expires_at

    assert purge_expired(now=expiry, dry_run=True) == 1
    assert purge_expired(now=expiry, batch_seconds=None, pause=0) == 1
