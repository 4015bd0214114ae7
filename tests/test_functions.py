"""``idempotent_function``: a function's body once per key, its first value given to every call.

The proof is eight processes (as consumers on several hosts would be)
calling with one key at the same moment, in both modes, on each backend;
the rest are the contract's details, in this process: the same key with
other arguments, failures, values, async code, and the mistakes refused
where the function is defined.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import subprocess
import sys
import uuid
from collections import Counter
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from decimal import Decimal
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from celery.exceptions import Ignore
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.db import connection, transaction
from django.test import override_settings

from django_idempotency import clock as database_clock
from django_idempotency import idempotent_function, store
from django_idempotency.contrib.celery import idempotent_task as celery_task
from django_idempotency.contrib.django_tasks import idempotent_task as tasks_framework_task
from django_idempotency.exceptions import (
    ArgumentsMismatch,
    CallInFlight,
    IdempotencyError,
    UnstorableResult,
)
from django_idempotency.models import IdempotencyKey
from tests.function_calls import CONTROL_DIR_ENV
from tests.models import Order
from tests.polling import wait_until
from tests.server import DATABASE_NAME_ENV

ROOT = Path(__file__).resolve().parent.parent
PROCESSES = 8
State = IdempotencyKey.State


def unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
class ProcessesTests:
    """Eight processes call with one key at once: one effect, one value, or in flight."""

    def call(
        self, directory: Path, key: str, mode: str, *, quantity: int = 1, processes: int = PROCESSES
    ) -> list[dict[str, Any]]:
        """What each of ``processes`` calls, made at the same moment, got."""
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.server_settings",
            DATABASE_NAME_ENV: str(connection.settings_dict["NAME"]),
            CONTROL_DIR_ENV: str(directory),
        }
        batch = uuid.uuid4().hex[:8]
        command = [sys.executable, "-m", "tests.function_calls", batch, key, mode, str(quantity)]
        started = [
            subprocess.Popen(
                command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            for _ in range(processes)
        ]
        try:
            wait_until(
                lambda: len(list(directory.glob(f"{batch}-*.ready"))) == processes,
                "every process to be connected",
                60,
            )
        finally:
            (directory / f"{batch}.go").touch()
        outcomes = []
        for process in started:
            out, err = process.communicate(timeout=120)
            assert process.returncode == 0, err.decode()[-3000:]
            outcomes.append(json.loads(out.decode().splitlines()[-1]))
        return outcomes

    @staticmethod
    def runs(directory: Path, key: str) -> int:
        return (directory / f"{key}.runs").read_text().count("\n")

    @pytest.mark.parametrize("mode", ["atomic", "lease"])
    def test_one_key_at_once_is_one_effect(self, tmp_path, mode):
        key = unique(f"at-once-{mode}")

        outcomes = self.call(tmp_path, key, mode)

        statuses = Counter(outcome["status"] for outcome in outcomes)
        assert set(statuses) <= {"SUCCESS", "IN_FLIGHT"}, outcomes
        values = [outcome["value"] for outcome in outcomes if outcome["status"] == "SUCCESS"]
        assert values, outcomes
        assert all(value == values[0] for value in values)
        for outcome in outcomes:
            if outcome["status"] == "IN_FLIGHT":
                assert outcome["error"] == "CallInFlight"
                assert outcome["retry_after"] >= 1
        if mode == "atomic":
            # Duplicates wait on the original's row lock and get its value.
            assert statuses == {"SUCCESS": PROCESSES}
        else:
            # The original holds its lease for a second: the others met it in flight.
            assert statuses["IN_FLIGHT"] >= 1, outcomes
        assert self.runs(tmp_path, key) == 1
        assert list(Order.objects.values_list("item", flat=True)) == [key]
        assert values[0]["order"] == Order.objects.get().pk
        record = IdempotencyKey.objects.get()
        assert (record.scope, record.key, record.state) == (
            "tests.function_calls.place",
            key,
            State.COMPLETED,
        )
        # Later calls, each a process of its own, get the same value and run nothing.
        later = self.call(tmp_path, key, mode, processes=2)
        assert later == [{"status": "SUCCESS", "value": values[0]}] * 2
        assert self.runs(tmp_path, key) == 1
        assert Order.objects.count() == 1

    @pytest.mark.parametrize("mode", ["atomic", "lease"])
    def test_other_arguments_at_once_are_refused_and_change_nothing(self, tmp_path, mode):
        key = unique(f"mismatch-{mode}")
        [original] = self.call(tmp_path, key, mode, quantity=1, processes=1)
        record = IdempotencyKey.objects.get()

        outcomes = self.call(tmp_path, key, mode, quantity=2)

        assert original["status"] == "SUCCESS"
        assert outcomes == [{"status": "MISMATCH", "error": "ArgumentsMismatch"}] * PROCESSES
        assert self.runs(tmp_path, key) == 1
        assert list(Order.objects.values_list("quantity", flat=True)) == [1]
        after = IdempotencyKey.objects.get()
        assert (after.pk, after.fingerprint, after.state, bytes(after.response_body)) == (
            record.pk,
            record.fingerprint,
            State.COMPLETED,
            bytes(record.response_body),
        )
        assert self.call(tmp_path, key, mode, processes=1) == [original]


def counted(atomic: bool = True, **options: Any) -> tuple[Any, list[Any]]:
    """A protected function that writes an Order and records each run of its body."""
    runs: list[Any] = []

    @idempotent_function(
        scope="test.place", key=lambda key, quantity=1: key, atomic=atomic, **options
    )
    def place(key: str, quantity: int = 1) -> dict[str, Any]:
        runs.append((key, quantity))
        order = Order.objects.create(item=key, quantity=quantity)
        return {"order": order.pk, "quantity": quantity}

    return place, runs


MODES = pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "lease"])


@pytest.mark.django_db(transaction=True)
class ContractTests:
    @MODES
    def test_later_calls_get_the_first_value_without_running(self, atomic):
        place, runs = counted(atomic)

        first = place("k", 3)
        again = place("k", quantity=3)

        assert first == again == {"order": Order.objects.get().pk, "quantity": 3}
        assert runs == [("k", 3)]

    @MODES
    def test_other_arguments_raise_and_change_nothing(self, atomic):
        place, runs = counted(atomic)
        place("k", 1)
        record = IdempotencyKey.objects.get()

        with pytest.raises(ArgumentsMismatch) as raised:
            place("k", 2)

        assert isinstance(raised.value, IdempotencyError)
        assert runs == [("k", 1)]
        assert list(Order.objects.values_list("quantity", flat=True)) == [1]
        after = IdempotencyKey.objects.get()
        assert (after.fingerprint, bytes(after.response_body)) == (
            record.fingerprint,
            bytes(record.response_body),
        )
        assert place("k", 1) == {"order": Order.objects.get().pk, "quantity": 1}

    @pytest.mark.parametrize("number", [float("nan"), float("inf")])
    def test_arguments_that_are_not_json_numbers_are_a_clear_error(self, number):
        place, runs = counted()

        with pytest.raises(TypeError, match="must be JSON-serialisable to be fingerprinted"):
            place("k", number)

        assert runs == []
        assert not IdempotencyKey.objects.exists()

    @pytest.mark.skipif(connection.vendor != "mysql", reason="MariaDB's max_allowed_packet")
    @pytest.mark.django_db(transaction=True)
    def test_a_lease_value_the_database_refuses_is_never_run_again(self):
        # Stored without its body, the value would come back as None; left
        # claimed, the key would be taken over, and the body run again, once
        # its lease ran out. The key is completed with a record that says so.
        runs = []

        @idempotent_function(scope="test.report", key=lambda n: f"big-{n}", atomic=False)
        def report(n: int) -> str:
            runs.append(n)
            return "x" * (17 * 1024 * 1024)  # over the server's 16 MiB packet

        assert len(report(1)) == 17 * 1024 * 1024
        connection.close()  # the refused packet ended the connection
        for _ in range(2):
            with pytest.raises(UnstorableResult, match="its value could not be stored"):
                report(1)

        assert runs == [1]
        record = IdempotencyKey.objects.get()
        assert (record.state, record.status_code) == (IdempotencyKey.State.COMPLETED, 507)

    def test_a_long_key_is_stored_as_its_digest_once(self):
        # As every release stored it: a retry across an upgrade finds its record.
        long = "event-" + "x" * 300
        runs = []

        @idempotent_function(scope="test.handle", key=lambda event: event)
        def handle(event: str) -> None:
            runs.append(event)

        handle(long)
        digest = "sha256:" + hashlib.sha256(long.encode()).hexdigest()
        assert IdempotencyKey.objects.get().key == digest
        handle(long)
        assert len(runs) == 1

    @MODES
    def test_a_body_that_ends_a_task_on_purpose_commits_and_ends_later_calls_so(self, atomic):
        # Celery's Ignore: the first call's writes commit, its key is
        # completed, and it ends the task calling it. A later call (a
        # redelivered task's) ends the same way: its caller's code after
        # the call never ran the first time, and must not run now.
        runs = []

        @idempotent_function(scope="test.stop", key=lambda label: label, atomic=atomic)
        def stop(label: str) -> None:
            runs.append(label)
            Order.objects.create(item=label)
            raise Ignore()

        for _ in range(2):
            with pytest.raises(Ignore):
                stop("k")

        assert runs == ["k"]
        assert Order.objects.count() == 1
        record = IdempotencyKey.objects.get()
        assert (record.state, record.status_code) == (IdempotencyKey.State.COMPLETED, 204)

    def test_defaults_and_keywords_are_the_same_work(self):
        place, runs = counted()
        place("k")
        place("k", 1)
        place(key="k", quantity=1)
        assert runs == [("k", 1)]

    def test_first_call_gets_the_value_as_later_calls_will(self):
        @idempotent_function(scope="test.pair", key=lambda n: f"tuple-{n}")
        def pair(n: int) -> tuple[int, int]:
            return (n, n)

        assert pair(1) == [1, 1]
        assert pair(1) == [1, 1]

    @MODES
    def test_body_that_raises_stores_nothing_and_runs_again(self, atomic):
        attempts: list[int] = []

        @idempotent_function(scope="test.flaky", key=lambda key: key, atomic=atomic)
        def flaky(key: str) -> str:
            attempts.append(1)
            Order.objects.create(item=key)
            if len(attempts) == 1:
                raise RuntimeError("the first run fails after writing")
            return "done"

        with pytest.raises(RuntimeError):
            flaky("k")
        assert not IdempotencyKey.objects.exists()
        assert Order.objects.count() == (0 if atomic else 1)  # lease mode's write stands

        assert flaky("k") == "done"
        assert flaky("k") == "done"
        assert len(attempts) == 2

    def test_unstorable_value_rolls_back_in_atomic_mode(self):
        @idempotent_function(scope="test.bad", key=lambda key: key)
        def bad(key: str) -> object:
            Order.objects.create(item=key)
            return object()

        with pytest.raises(UnstorableResult, match="JSON"):
            bad("k")
        assert not Order.objects.exists()
        assert not IdempotencyKey.objects.exists()

    @pytest.mark.parametrize(
        "value", [Decimal("9.99"), datetime(2026, 1, 1, tzinfo=dt_timezone.utc), uuid.uuid4()]
    )
    def test_lease_mode_value_that_is_not_json_never_runs_the_body_again(self, value):
        runs: list[str] = []

        @idempotent_function(scope="test.charge", key=lambda key: key, atomic=False)
        def charge(key: str) -> object:
            runs.append(key)
            Order.objects.create(item=key)
            return value

        with pytest.raises(UnstorableResult, match="cannot be stored as JSON"):
            charge("k")
        with pytest.raises(UnstorableResult, match="its value could not be stored"):
            charge("k")
        # Nor once its lease would have run out: the body has acted.
        with (
            database_clock.shifted(timedelta(hours=1)),
            pytest.raises(UnstorableResult, match="its value could not be stored"),
        ):
            charge("k")
        assert runs == ["k"]
        assert Order.objects.count() == 1
        record = IdempotencyKey.objects.get()
        assert (record.state, record.status_code) == (IdempotencyKey.State.COMPLETED, 507)

    def test_lease_mode_refusal_released_by_an_operator_runs_the_body_again(self):
        runs: list[str] = []

        @idempotent_function(scope="test.charge", key=lambda key: key, atomic=False)
        def charge(key: str) -> object:
            runs.append(key)
            return Decimal("9.99") if len(runs) == 1 else "9.99"

        with pytest.raises(UnstorableResult, match="cannot be stored as JSON"):
            charge("k")
        with pytest.raises(UnstorableResult, match="its value could not be stored"):
            charge("k")
        out = StringIO()

        call_command("idempotency_keys", "release", "test.charge", "k", stdout=out)

        assert "Released the refusal (507, its result was not stored)" in out.getvalue()
        assert "runs its handler again as attempt 2" in out.getvalue()
        assert charge("k") == "9.99"
        assert charge("k") == "9.99"
        assert runs == ["k", "k"]
        record = IdempotencyKey.objects.get()
        assert (record.state, record.status_code, record.attempt) == (
            IdempotencyKey.State.COMPLETED,
            200,
            2,
        )

    @pytest.mark.parametrize("released_by", ["owner", "operator", "nobody"])
    def test_lease_mode_claim_left_with_checkpoints_refuses_other_arguments(self, released_by):
        # "nobody": its owner died and its lease ran out (abandoned), no recovery policy.
        runs: list[int] = []
        endings: list[type[BaseException]] = [SystemExit]
        if released_by == "owner":
            endings.append(RuntimeError)

        @idempotent_function(scope="test.charge", key=lambda key, amount: key, atomic=False)
        def charge(key: str, amount: int) -> dict[str, int]:
            runs.append(amount)
            if endings:
                raise endings.pop(0)("stopped after charging")
            return {"charged": amount}

        with pytest.raises(SystemExit):
            charge("k", 10)
        claim = IdempotencyKey.objects.get()
        # A function's body has no checkpoint() of its own: its claim's
        # progress is written by the statement that writes an owner's.
        progress = {"charged": {"charge": 1}}
        assert store.record_progress(
            "default", claim.pk, owner_token=claim.owner_token, checkpoints=progress
        )
        with database_clock.shifted(timedelta(hours=1)):  # past its lease
            if released_by == "owner":
                with pytest.raises(RuntimeError):
                    charge("k", 10)  # takes it over, then fails: released, kept
            elif released_by == "operator":
                call_command("idempotency_keys", "release", "test.charge", "k", stdout=StringIO())
            before = IdempotencyKey.objects.values().get()
            released = released_by != "nobody"
            assert (before["owner_token"] == "", before["checkpoints"]) == (released, progress)

            with pytest.raises(ArgumentsMismatch):
                charge("k", 99)

            assert IdempotencyKey.objects.values().get() == before
            assert charge("k", 10) == {"charged": 10}  # the same call resumes
        assert 99 not in runs

    def test_lease_mode_released_claim_without_checkpoints_is_taken_by_other_arguments(self):
        runs: list[int] = []

        @idempotent_function(scope="test.charge", key=lambda key, amount: key, atomic=False)
        def charge(key: str, amount: int) -> dict[str, int]:
            runs.append(amount)
            if len(runs) == 1:
                raise SystemExit("stopped before any checkpoint")
            return {"charged": amount}

        with pytest.raises(SystemExit):
            charge("k", 10)
        with database_clock.shifted(timedelta(hours=1)):  # past its lease
            call_command("idempotency_keys", "release", "test.charge", "k", stdout=StringIO())
            assert IdempotencyKey.objects.get().checkpoints is None

            assert charge("k", 99) == {"charged": 99}  # as if there were no record

            with pytest.raises(ArgumentsMismatch):
                charge("k", 10)
        assert runs == [10, 99]
        record = IdempotencyKey.objects.get()
        assert (record.state, record.attempt) == (State.COMPLETED, 1)

    def test_lease_mode_refusal_names_the_command_that_lets_the_body_run_again(self):
        # Delete frees a refused key, whatever its body recorded; release resumes it.
        runs: list[str] = []

        @idempotent_function(scope="test.charge", key=lambda key: key, atomic=False)
        def charge(key: str) -> object:
            runs.append(key)
            return Decimal("9.99")

        with pytest.raises(UnstorableResult):
            charge("k")
        with pytest.raises(UnstorableResult) as refused:
            charge("k")
        named = re.findall(r"manage\.py (idempotency_keys \w+)", str(refused.value))
        assert named == ["idempotency_keys delete"], str(refused.value)
        call_command(*named[0].split(), "test.charge", "k", stdout=StringIO())
        with pytest.raises(UnstorableResult, match="cannot be stored as JSON"):
            charge("k")
        assert runs == ["k", "k"]

    @pytest.mark.skipif(
        connection.vendor == "sqlite", reason="SQLite: the claim is the caller's transaction's"
    )
    def test_lease_mode_value_that_is_not_json_is_refused_after_the_caller_rolled_back(self):
        # The refusal is committed at once, on the lease's own connection:
        # the caller's transaction, rolled back by the error, cannot take it
        # along and let the next call (at once or after the lease) run again.
        runs: list[str] = []

        @idempotent_function(scope="test.charge", key=lambda key: key, atomic=False)
        def charge(key: str) -> object:
            runs.append(key)
            Order.objects.create(item=key)
            return Decimal("9.99")

        with (
            pytest.raises(UnstorableResult, match="cannot be stored as JSON"),
            transaction.atomic(),
        ):
            charge("k")
        assert not Order.objects.exists()  # rolled back with the caller's transaction
        for late in (timedelta(0), timedelta(hours=1)):
            with (
                database_clock.shifted(late),
                pytest.raises(UnstorableResult, match="its value could not be stored"),
                transaction.atomic(),
            ):
                charge("k")
        assert runs == ["k"]
        record = IdempotencyKey.objects.get()
        assert (record.state, record.status_code) == (IdempotencyKey.State.COMPLETED, 507)

    def test_lease_mode_in_flight_call_is_refused(self):
        inner: list[Any] = []

        @idempotent_function(scope="test.outer", key=lambda key: key, atomic=False)
        def outer(key: str) -> str:
            with pytest.raises(CallInFlight) as raised:
                outer(key)  # the same key, while the first call still runs
            inner.append(raised.value.retry_after)
            return "first"

        assert outer("k") == "first"
        assert inner and inner[0] >= 1
        assert outer("k") == "first"

    def test_a_function_built_inside_another_must_name_its_scope(self):
        # Every closure a factory builds has one dotted name: as a default
        # scope, one tenant's call would be answered with another's value.
        def for_tenant(tenant: str) -> Any:
            @idempotent_function(key=lambda event: event)
            def handle(event: str) -> str:
                return tenant

            return handle

        with pytest.raises(TypeError, match=r"defined inside another, needs scope="):
            for_tenant("acme")
        assert not IdempotencyKey.objects.exists()

        @idempotent_function(key=lambda key: key, scope="payments.capture")
        def capture(key: str) -> None:
            Order.objects.create(item=key)

        capture("k")
        assert Order.objects.count() == 1
        assert IdempotencyKey.objects.filter(scope="payments.capture").exists()

    def test_atomic_call_inside_a_transaction_of_the_caller(self):
        place, runs = counted()
        with transaction.atomic():
            place("k")
            place("k")
        assert runs == [("k", 1)]
        assert IdempotencyKey.objects.get().state == State.COMPLETED

    def test_lease_calls_in_transactions_outside_a_request_keep_nothing(self):
        # A worker or a consumer has no request to close: nothing may wait on
        # the lease's own connection (inside a transaction, on a server
        # database) for one, not even a callback for the transaction's commit.
        place, runs = counted(atomic=False)
        for n in range(50):
            with transaction.atomic():
                place(f"k{n}")
                assert transaction.get_connection().run_on_commit == []

        assert len(runs) == 50
        assert IdempotencyKey.objects.filter(state=State.COMPLETED).count() == 50

    def test_disabled_runs_every_time(self):
        place, runs = counted()
        with override_settings(IDEMPOTENCY={"ENABLED": False}):
            place("k")
            place("k")
        assert len(runs) == 2
        assert not IdempotencyKey.objects.exists()

    def test_key_function_must_return_a_string(self):
        @idempotent_function(scope="test.by_number", key=lambda n: n)
        def by_number(n: int) -> None: ...

        with pytest.raises(
            TypeError,
            match=r"^The key function of test\.by_number must return a non-empty string, not int",
        ):
            by_number(7)

    def test_ttl_and_lease_options_reach_the_record(self):
        place, _ = counted(atomic=False, ttl=timedelta(minutes=10), lease=30)
        place("k")
        record = IdempotencyKey.objects.get()
        assert timedelta(minutes=9) < record.expires_at - record.created_at <= timedelta(minutes=11)


@pytest.mark.django_db(transaction=True)
class AsyncTests:
    @MODES
    def test_async_def_function_is_awaited_once_per_key(self, atomic):
        runs: list[str] = []

        @idempotent_function(scope="test.notify", key=lambda key: key, atomic=atomic)
        async def notify(key: str) -> dict[str, Any]:
            runs.append(key)
            order = await Order.objects.acreate(item=key)
            await asyncio.sleep(0)
            return {"order": order.pk}

        async def main() -> list[Any]:
            return [await notify("k"), await notify("k")]

        first, again = async_to_sync(main)()

        assert first == again == {"order": Order.objects.get().pk}
        assert runs == ["k"]
        assert IdempotencyKey.objects.get().state == State.COMPLETED

    def test_async_def_function_with_other_arguments_raises(self):
        @idempotent_function(scope="test.notify", key=lambda key, n: key)
        async def notify(key: str, n: int) -> int:
            return n

        async def main() -> None:
            assert await notify("k", 1) == 1
            with pytest.raises(ArgumentsMismatch):
                await notify("k", 2)

        async_to_sync(main)()

    def test_atomic_async_body_writes_roll_back_when_it_raises(self):
        @idempotent_function(scope="test.failing", key=lambda key: key)
        async def failing(key: str) -> None:
            await Order.objects.acreate(item=key)
            raise RuntimeError("after writing")

        async def main() -> None:
            with pytest.raises(RuntimeError):
                await failing("k")

        async_to_sync(main)()
        assert not Order.objects.exists()
        assert not IdempotencyKey.objects.exists()

    @MODES
    def test_sync_function_called_from_async_code(self, atomic):
        place, runs = counted(atomic)

        async def main() -> list[Any]:
            call = sync_to_async(place)
            return [await call("k", 2), await call("k", 2)]

        first, again = async_to_sync(main)()

        assert first == again == {"order": Order.objects.get().pk, "quantity": 2}
        assert runs == [("k", 2)]


class DefinitionTests:
    """Mistakes fail where the function is defined, not at its first call."""

    def test_bare_decorator_asks_for_a_key(self):
        with pytest.raises(TypeError, match=r"missing 1 required keyword-only argument: 'key'"):

            @idempotent_function  # type: ignore[arg-type, call-arg]
            def no_key() -> None: ...

    def test_no_key_is_refused(self):
        with pytest.raises(TypeError, match=r"missing 1 required keyword-only argument: 'key'"):
            idempotent_function()  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="must be a callable of the function's arguments"):
            idempotent_function(key=None)  # type: ignore[arg-type]

    def test_a_function_with_its_key_is_refused_positionally(self):
        with pytest.raises(TypeError, match=r"keywords only: @idempotent_function\(key=\.\.\.\)"):
            idempotent_function(lambda: None, key=lambda: "k")  # type: ignore[arg-type]

    @pytest.mark.parametrize("key", ["message_id", 42])
    def test_a_key_that_is_not_callable_is_refused(self, key):
        with pytest.raises(TypeError, match=f"returning its key, not {key!r}"):
            idempotent_function(key=key)

    @pytest.mark.parametrize(
        ("options", "message"),
        [
            ({"ttl": -1}, r"idempotent_function\(ttl=\.\.\.\) has an invalid value: -1"),
            ({"ttl": "1h"}, r"idempotent_function\(ttl=\.\.\.\) has an invalid value: '1h'"),
            ({"lease": 0}, r"idempotent_function\(lease=\.\.\.\) has an invalid value: 0"),
            ({"wait": 7200}, r"idempotent_function\(wait=\.\.\.\) has an invalid value: 7200"),
            ({"atomic": "yes"}, r"idempotent_function\(atomic=\.\.\.\) has an invalid value"),
        ],
    )
    def test_a_bad_option_value_is_refused(self, options, message):
        with pytest.raises(ImproperlyConfigured, match=message):
            idempotent_function(key=lambda: "k", **options)

    @pytest.mark.parametrize("scope", ["", 7])
    def test_a_bad_scope_is_refused(self, scope):
        with pytest.raises(TypeError, match=r"scope=\.\.\.\) must be a non-empty string"):
            idempotent_function(key=lambda: "k", scope=scope)

    @pytest.mark.parametrize(
        "decorator",
        [
            idempotent_function(key=lambda: "k", scope="generating"),
            celery_task(key=lambda: "k"),
            tasks_framework_task(key=lambda: "k"),
        ],
        ids=["function", "celery", "tasks framework"],
    )
    def test_a_generator_function_is_refused_where_it_is_decorated(self, decorator):
        def generating():  # type: ignore[no-untyped-def]
            yield 1

        async def generating_async():  # type: ignore[no-untyped-def]
            yield 1

        for function in (generating, generating_async):
            with pytest.raises(TypeError, match=r"is a generator function: its body runs as"):
                decorator(function)

    def test_an_unknown_option_is_a_type_error(self):
        with pytest.raises(TypeError, match="methods"):
            idempotent_function(key=lambda: "k", methods=("POST",))  # type: ignore[call-arg]
