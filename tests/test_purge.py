"""The purge and its management command, on whichever backend TEST_DATABASE names."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from datetime import timedelta
from io import StringIO
from itertools import pairwise
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_idempotency import purge
from django_idempotency.management.commands.purge_idempotency_keys import Command
from django_idempotency.models import IdempotencyKey
from django_idempotency.purge import DEFAULT_BATCH_SIZE, MIN_BATCH_SIZE, purge_expired
from tests.factories import IdempotencyKeyFactory

State = IdempotencyKey.State
REPO = Path(__file__).resolve().parent.parent


def make_records(expired: int = 3, lease_expired: int = 2) -> set[int]:
    """Live records of both kinds plus some expired ones; returns the live ids."""
    live = {
        IdempotencyKeyFactory().pk,
        IdempotencyKeyFactory().pk,
        IdempotencyKeyFactory(in_flight=True).pk,
        # Expires ahead, by more than a slow test's purge takes: must survive. The
        # exact boundary has its own test.
        IdempotencyKeyFactory(expires_at=timezone.now() + timedelta(minutes=10)).pk,
    }
    IdempotencyKey.objects.bulk_create(
        IdempotencyKeyFactory.build_batch(expired, expired=True)
        + IdempotencyKeyFactory.build_batch(lease_expired, lease_expired=True)
    )
    return live


def delete_statements(queries: CaptureQueriesContext) -> list[str]:
    """The statements that deleted: a ``DELETE``, or on PostgreSQL one inside ``WITH``."""
    deleting = re.compile(r"\s*(WITH \w+ AS \()?DELETE ")
    return [q["sql"] for q in queries.captured_queries if deleting.match(q["sql"])]


@pytest.mark.django_db
class PurgeExpiredTests:
    def test_expired_records_deleted_live_ones_kept(self):
        live = make_records(expired=3, lease_expired=2)

        deleted = purge_expired()

        assert deleted == 5
        assert set(IdempotencyKey.objects.values_list("pk", flat=True)) == live
        assert IdempotencyKey.objects.filter(state=State.IN_PROGRESS).count() == 1

    def test_expiry_at_exactly_now_is_expired(self):
        now = timezone.now()
        IdempotencyKeyFactory(expires_at=now)
        kept = IdempotencyKeyFactory(expires_at=now + timedelta(microseconds=1))

        assert purge_expired(now=now) == 1
        assert list(IdempotencyKey.objects.values_list("pk", flat=True)) == [kept.pk]

    def test_now_fixes_the_cutoff(self):
        IdempotencyKeyFactory(expires_at=timezone.now() + timedelta(hours=1))

        assert purge_expired() == 0
        assert purge_expired(now=timezone.now() + timedelta(hours=2)) == 1
        assert not IdempotencyKey.objects.exists()

    def test_nothing_expired_deletes_nothing(self):
        live = make_records(expired=0, lease_expired=0)

        assert purge_expired() == 0
        assert set(IdempotencyKey.objects.values_list("pk", flat=True)) == live

    def test_dry_run_counts_and_deletes_nothing(self):
        make_records(expired=4, lease_expired=3)
        total = IdempotencyKey.objects.count()

        assert purge_expired(dry_run=True) == 7
        assert IdempotencyKey.objects.count() == total

    def test_batch_size_bounds_each_delete(self):
        live = make_records(expired=7, lease_expired=0)
        reported = []

        with CaptureQueriesContext(connection) as queries:
            deleted = purge_expired(batch_size=3, progress=reported.append)

        assert deleted == 7
        # 3 + 3 + 1, and nothing else: each batch is one DELETE.
        assert len(delete_statements(queries)) == 3
        assert reported == [3, 6, 7]
        assert set(IdempotencyKey.objects.values_list("pk", flat=True)) == live

    def test_default_batch_size_is_in_range(self):
        assert 1000 <= DEFAULT_BATCH_SIZE <= 10000

    @pytest.mark.parametrize("batch_size", [0, -1])
    def test_non_positive_batch_size_rejected(self, batch_size):
        with pytest.raises(ValueError, match="positive"):
            purge_expired(batch_size=batch_size)

    def test_database_setting_is_the_default(self, settings):
        IdempotencyKeyFactory(expired=True)
        settings.IDEMPOTENCY = {"DATABASE": "elsewhere"}

        with pytest.raises(ImproperlyConfigured, match="Unknown database 'elsewhere'"):
            purge_expired()
        assert purge_expired(using="default") == 1

    def test_missing_table_says_to_migrate(self, monkeypatch):
        # A real query against a table that does not exist.
        monkeypatch.setattr(IdempotencyKey._meta, "db_table", "idempotency_missing_table")

        with pytest.raises(ImproperlyConfigured, match="migrate"):
            purge_expired()


@pytest.mark.django_db
class PurgeCommandTests:
    def test_prints_number_deleted(self):
        live = make_records(expired=2, lease_expired=1)
        out = StringIO()

        call_command("purge_idempotency_keys", stdout=out)

        assert out.getvalue().strip() == "3 expired idempotency records deleted."
        assert set(IdempotencyKey.objects.values_list("pk", flat=True)) == live

    def test_dry_run_prints_count_and_deletes_nothing(self):
        make_records(expired=2, lease_expired=2)
        total = IdempotencyKey.objects.count()
        out = StringIO()

        call_command("purge_idempotency_keys", "--dry-run", stdout=out)

        assert out.getvalue().strip() == (
            "4 expired idempotency records would be deleted (dry run)."
        )
        assert IdempotencyKey.objects.count() == total

    def test_batch_size_option(self):
        make_records(expired=5, lease_expired=0)
        out = StringIO()

        with CaptureQueriesContext(connection) as queries:
            call_command("purge_idempotency_keys", "--batch-size", "2", stdout=out)

        assert len(delete_statements(queries)) == 3
        assert out.getvalue().strip() == "5 expired idempotency records deleted."

    def test_database_option(self):
        IdempotencyKeyFactory(expired=True)
        out = StringIO()

        call_command("purge_idempotency_keys", "--database", "default", stdout=out)

        assert "1 expired idempotency records deleted." in out.getvalue()

    def test_progress_lines_on_long_runs(self, monkeypatch):
        make_records(expired=5, lease_expired=0)
        # Every batch counts as "a while" once the interval is zero.
        monkeypatch.setattr(Command, "progress_interval", 0.0)
        out = StringIO()

        call_command("purge_idempotency_keys", "--batch-size", "2", stdout=out)

        lines = out.getvalue().splitlines()
        assert [line.split(" expired")[0] for line in lines[:-1]] == ["... 2", "... 4", "... 5"]
        assert lines[-1] == "5 expired idempotency records deleted."

    def test_verbosity_2_reports_every_batch(self):
        make_records(expired=5, lease_expired=0)
        out = StringIO()

        call_command("purge_idempotency_keys", "--batch-size", "2", "-v", "2", stdout=out)

        lines = out.getvalue().splitlines()
        assert lines[0] == (
            "Purging idempotency records expired by now from database 'default', 2 per batch."
        )
        assert [line.split(" (this batch")[0] for line in lines[1:-1]] == [
            "... 2 expired idempotency records deleted so far",
            "... 4 expired idempotency records deleted so far",
            "... 5 expired idempotency records deleted so far",
        ]
        assert "(this batch 1," in lines[-2]
        assert lines[-1] == "5 expired idempotency records deleted."

    def test_short_run_prints_no_progress(self):
        make_records(expired=5, lease_expired=0)
        out = StringIO()

        call_command("purge_idempotency_keys", "--batch-size", "2", stdout=out)

        assert out.getvalue().count("\n") == 1

    def test_unknown_database_is_command_error(self):
        with pytest.raises(CommandError, match="Unknown database 'nowhere'"):
            call_command("purge_idempotency_keys", "--database", "nowhere", stdout=StringIO())

    def test_missing_table_is_command_error(self, monkeypatch):
        monkeypatch.setattr(IdempotencyKey._meta, "db_table", "idempotency_missing_table")

        with pytest.raises(CommandError, match=r"Run 'python manage\.py migrate"):
            call_command("purge_idempotency_keys", stdout=StringIO())

    @pytest.mark.parametrize("value", ["0", "-5", "many"])
    def test_bad_batch_size_is_command_error(self, value):
        with pytest.raises(CommandError, match="positive integer"):
            call_command("purge_idempotency_keys", "--batch-size", value, stdout=StringIO())


@pytest.mark.parametrize("command", ["purge_idempotency_keys", "idempotency_keys"])
def test_each_commands_help_is_shown(command):
    from django.core.management import load_command_class

    parser = load_command_class("django_idempotency", command).create_parser("manage.py", command)

    shown = parser.format_help()

    assert "usage: manage.py " + command in shown
    if command == "purge_idempotency_keys":
        assert "purging at most 67% of the time" in " ".join(shown.split())


@pytest.mark.django_db
def test_command_failure_exits_non_zero():
    # The child process reaches this run's test database, which exists, so
    # start-up checks that connect (JSONField support on MariaDB) succeed and
    # only the unknown --database fails.
    env = {**os.environ, "TEST_DATABASE_NAME": connection.settings_dict["NAME"]}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "django",
            "purge_idempotency_keys",
            "--database",
            "nowhere",
            "--settings",
            "tests.settings",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert result.returncode == 1
    assert "CommandError: Unknown database 'nowhere'" in result.stderr
    assert result.stdout == ""


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_concurrent_purges_delete_each_row_once():
    expired = 3000
    live = make_records(expired=expired, lease_expired=200)
    workers = 4
    barrier = threading.Barrier(workers)
    counts: list[int] = []
    errors: list[BaseException] = []

    def purge() -> None:
        try:
            # Connected before the start line, so the purges really overlap.
            connections["default"].ensure_connection()
            barrier.wait(timeout=30)
            counts.append(purge_expired(batch_size=100))
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=purge) for _ in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)

    assert not errors
    assert all(not thread.is_alive() for thread in threads)
    assert sum(counts) == expired + 200
    assert set(IdempotencyKey.objects.values_list("pk", flat=True)) == live
    if connection.vendor in ("postgresql", "mysql"):
        # With SKIP LOCKED the work is shared, not done by one purge while
        # the others wait and then find nothing.
        assert sum(1 for count in counts if count) > 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite locks the whole database")
def test_locked_database_is_command_error():
    IdempotencyKeyFactory(expired=True)
    holding, done = threading.Event(), threading.Event()

    def hold_the_write_lock() -> None:
        try:
            with transaction.atomic():
                IdempotencyKeyFactory()
                holding.set()
                done.wait(30)
        finally:
            connection.close()

    holder = threading.Thread(target=hold_the_write_lock)
    holder.start()
    try:
        assert holding.wait(30)
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA busy_timeout = 100")
        with pytest.raises(CommandError, match="Run the command again later") as raised:
            call_command("purge_idempotency_keys", stdout=StringIO())
    finally:
        done.set()
        holder.join(30)
        connection.close()  # back to the configured busy timeout

    assert "locked" in str(raised.value)
    assert IdempotencyKey.objects.count() == 2


@pytest.fixture
def rests(monkeypatch) -> list[float]:
    """The rests the purge took between batches, recorded instead of waited out."""
    taken: list[float] = []
    monkeypatch.setattr(purge, "_rest", taken.append)
    return taken


def batch_sizes(totals: list[int]) -> list[int]:
    """Each batch's size, from the running totals the progress callback was given."""
    return [after - before for before, after in pairwise([0, *totals])]


@pytest.mark.django_db
class PaceTests:
    def test_unpaced_purge_runs_fixed_batches_back_to_back(self, rests):
        make_records(expired=7, lease_expired=0)
        reported: list[int] = []

        deleted = purge_expired(batch_size=3, batch_seconds=None, pause=0, progress=reported.append)

        assert deleted == 7
        assert batch_sizes(reported) == [3, 3, 1]
        assert rests == []

    def test_pause_rests_after_every_full_batch_but_not_the_last(self, rests):
        make_records(expired=7, lease_expired=0)
        reported: list[int] = []

        deleted = purge_expired(batch_size=3, pause=2.0, progress=reported.append)

        assert deleted == 7
        assert batch_sizes(reported) == [3, 3, 1]
        assert len(rests) == 2
        assert all(rest > 0 for rest in rests)

    def test_rate_bounds_each_batch_to_one_seconds_worth(self, rests):
        live = make_records(expired=7, lease_expired=0)
        reported: list[int] = []

        deleted = purge_expired(rate=2.5, pause=0, progress=reported.append)

        assert deleted == 7
        # 2.5 rows a second: batches of 2, each followed by a rest that makes
        # the batch and its rest last 2 / 2.5 s.
        assert batch_sizes(reported) == [2, 2, 2, 1]
        assert len(rests) == 3
        assert all(0 < rest <= 0.8 for rest in rests)
        assert set(IdempotencyKey.objects.values_list("pk", flat=True)) == live

    def test_batches_grow_from_the_smallest_while_under_the_target(self, rests):
        IdempotencyKey.objects.bulk_create(IdempotencyKeyFactory.build_batch(1000, expired=True))
        reported: list[int] = []

        deleted = purge_expired(batch_size=400, batch_seconds=3600, progress=reported.append)

        assert deleted == 1000
        assert batch_sizes(reported) == [MIN_BATCH_SIZE, 200, 400, 300]

    def test_batches_stay_at_the_smallest_past_the_target(self, rests):
        IdempotencyKey.objects.bulk_create(IdempotencyKeyFactory.build_batch(450, expired=True))
        reported: list[int] = []

        # No batch can take less than a nanosecond: every one is past the target.
        deleted = purge_expired(batch_size=400, batch_seconds=1e-9, progress=reported.append)

        assert deleted == 450
        assert batch_sizes(reported) == [100, 100, 100, 100, 50]

    def test_default_pace_is_the_documented_one(self):
        pace = purge.Pace()

        assert (pace.batch_seconds, pace.pause, pace.rate) == (
            purge.DEFAULT_BATCH_SECONDS,
            purge.DEFAULT_PAUSE,
            None,
        )
        assert 0 < pace.batch_seconds <= 1
        assert 0 < pace.pause <= 2

    @pytest.mark.parametrize(
        ("option", "value", "fix"),
        [
            ("batch_seconds", 0, "positive number of seconds"),
            ("batch_seconds", -0.5, "positive number of seconds"),
            ("batch_seconds", float("nan"), "positive number of seconds"),
            ("batch_seconds", float("inf"), "positive number of seconds"),
            ("batch_seconds", "0.05", "positive number of seconds"),
            ("pause", -1, "0 or more"),
            ("pause", float("nan"), "0 or more"),
            ("pause", None, "0 or more"),
            ("pause", True, "0 or more"),
            ("rate", 0, "positive number of rows per second"),
            ("rate", -10, "positive number of rows per second"),
            ("rate", float("inf"), "positive number of rows per second"),
        ],
    )
    def test_out_of_range_pace_is_refused_before_anything_is_deleted(self, option, value, fix):
        make_records(expired=3, lease_expired=0)
        total = IdempotencyKey.objects.count()

        with pytest.raises(ValueError, match=f"{option} must be a .*{fix}") as raised:
            purge_expired(**{option: value})

        assert repr(value) in str(raised.value)
        assert IdempotencyKey.objects.count() == total

    @pytest.mark.parametrize("batch_size", [True, 2.5, "10"])
    def test_batch_size_that_is_not_an_integer_is_refused(self, batch_size):
        with pytest.raises(ValueError, match="batch_size must be a positive integer"):
            purge_expired(batch_size=batch_size)


class PaceSizingTests:
    """How the next batch's size follows from the last one's time: numbers in, numbers out."""

    def test_a_batch_past_the_target_shrinks_the_next_in_proportion(self):
        assert purge.Pace(batch_seconds=0.05).next_size(4000, 0.1, 5000) == 2000

    def test_a_batch_under_half_the_target_doubles_the_next_up_to_batch_size(self):
        pace = purge.Pace(batch_seconds=0.05)

        assert pace.next_size(1000, 0.01, 5000) == 2000
        assert pace.next_size(4000, 0.01, 5000) == 5000

    def test_a_batch_near_the_target_keeps_its_size(self):
        assert purge.Pace(batch_seconds=0.05).next_size(3000, 0.04, 5000) == 3000

    def test_no_batch_is_smaller_than_the_smallest(self):
        assert purge.Pace(batch_seconds=0.05).next_size(200, 60.0, 5000) == MIN_BATCH_SIZE

    def test_rest_is_the_pause_times_the_batch_or_what_the_rate_needs(self):
        assert purge.Pace(pause=1.5).rest(5000, 0.02) == pytest.approx(0.03)
        assert purge.Pace(pause=0, rate=1000).rest(500, 0.1) == pytest.approx(0.4)
        assert purge.Pace(pause=1, rate=1000).rest(500, 0.4) == pytest.approx(0.4)


@pytest.mark.django_db
class PaceCommandTests:
    def test_pace_options_reach_the_purge(self, rests):
        make_records(expired=5, lease_expired=0)
        out = StringIO()

        call_command(
            "purge_idempotency_keys",
            *("--rate", "2", "--pause", "0", "--batch-seconds", "off", "-v", "2"),
            stdout=out,
        )

        lines = out.getvalue().splitlines()
        assert [line.split(" (this batch")[0].split()[1] for line in lines[1:-1]] == [
            "2",
            "4",
            "5",
        ]
        assert len(rests) == 2
        assert lines[-1] == "5 expired idempotency records deleted."

    def test_unpaced_command_rests_not_at_all(self, rests):
        make_records(expired=5, lease_expired=0)

        call_command(
            "purge_idempotency_keys",
            *("--batch-size", "2", "--pause", "0", "--batch-seconds", "off"),
            stdout=StringIO(),
        )

        assert rests == []
        assert IdempotencyKey.objects.filter(expires_at__lte=timezone.now()).count() == 0

    @pytest.mark.parametrize(
        ("option", "value", "fix"),
        [
            ("--batch-seconds", "0", "positive number of seconds, or 'off'"),
            ("--batch-seconds", "-1", "positive number of seconds, or 'off'"),
            ("--batch-seconds", "soon", "positive number of seconds, or 'off'"),
            ("--pause", "-0.5", "0 or more"),
            ("--pause", "nan", "0 or more"),
            ("--rate", "0", "leave --rate out for no limit"),
            ("--rate", "inf", "leave --rate out for no limit"),
            ("--rate", "fast", "leave --rate out for no limit"),
        ],
    )
    def test_bad_pace_option_is_command_error_naming_the_fix(self, option, value, fix):
        make_records(expired=2, lease_expired=0)
        total = IdempotencyKey.objects.count()

        with pytest.raises(CommandError, match=re.escape(fix)) as raised:
            call_command("purge_idempotency_keys", option, value, stdout=StringIO())

        assert f"argument {option}: " in str(raised.value)
        assert IdempotencyKey.objects.count() == total
