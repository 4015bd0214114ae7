"""``manage.py purge_idempotency_keys``: arguments and output over the purge."""

from __future__ import annotations

import time
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError

from django_idempotency.conf import idempotency_settings
from django_idempotency.management.arguments import number, whole_number
from django_idempotency.purge import (
    DEFAULT_BATCH_SECONDS,
    DEFAULT_BATCH_SIZE,
    DEFAULT_PAUSE,
    purge_expired,
)
from django_idempotency.store import Busy

_batch_size = whole_number("a positive integer")
_positive_seconds = number(
    "a positive number of seconds, or 'off' to keep every batch at --batch-size"
)
_pause = number("a number of batch durations, 0 or more (0 rests not at all)", zero=True)
_rate = number("a positive number of records per second (leave --rate out for no limit)")


def _batch_seconds(value: str) -> float | None:
    return None if value == "off" else _positive_seconds(value)


class Command(BaseCommand):
    help = "Delete expired idempotency records in batches."

    #: Seconds before the first progress line, and between two of them: short
    #: runs print only their total, long ones show they are still working.
    progress_interval = 5.0

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="Count the expired records without deleting any.",
        )
        parser.add_argument(
            "--batch-size",
            type=_batch_size,
            default=DEFAULT_BATCH_SIZE,
            help=f"Most records deleted per transaction (default {DEFAULT_BATCH_SIZE}).",
        )
        parser.add_argument(
            "--batch-seconds",
            type=_batch_seconds,
            default=DEFAULT_BATCH_SECONDS,
            metavar="SECONDS",
            help="Keep each batch's transaction under this many seconds by adapting its "
            f"size, up to --batch-size (default {DEFAULT_BATCH_SECONDS}); 'off' keeps "
            "every batch at --batch-size.",
        )
        parser.add_argument(
            "--pause",
            type=_pause,
            default=DEFAULT_PAUSE,
            metavar="RATIO",
            help="Rest after each batch for this many times as long as it took, leaving "
            f"the database to requests (default {DEFAULT_PAUSE:g}: purging at most "
            # argparse formats help with %: the percent sign is written %%.
            f"{1 / (1 + DEFAULT_PAUSE) * 100:.0f}%% of the time); 0 runs batches back to back.",
        )
        parser.add_argument(
            "--rate",
            type=_rate,
            default=None,
            metavar="RECORDS",
            help="Delete at most this many records per second (default: no limit).",
        )
        parser.add_argument(
            "--database",
            default=None,
            help='Database alias holding the records (default: IDEMPOTENCY["DATABASE"]).',
        )

    def handle(self, *args: Any, **options: Any) -> None:
        using = options["database"] or idempotency_settings.database
        dry_run = options["dry_run"]
        started = time.monotonic()
        next_report = started + self.progress_interval

        deleted_so_far = 0
        # -v 2 (or more) says what is purged and reports every batch.
        every_batch = options["verbosity"] >= 2
        if every_batch:
            self.stdout.write(
                f"Purging idempotency records expired by now from database {using!r}, "
                f"{options['batch_size']} per batch{' (dry run)' if dry_run else ''}."
            )

        def report(deleted: int) -> None:
            nonlocal next_report, deleted_so_far
            batch = deleted - deleted_so_far
            deleted_so_far = deleted
            now = time.monotonic()
            if every_batch:
                self.stdout.write(
                    f"... {deleted} expired idempotency records deleted so far "
                    f"(this batch {batch}, {now - started:.1f}s)."
                )
            elif now >= next_report:
                next_report = now + self.progress_interval
                self.stdout.write(
                    f"... {deleted} expired idempotency records deleted "
                    f"so far ({now - started:.0f}s)."
                )

        try:
            count = purge_expired(
                using=using,
                batch_size=options["batch_size"],
                dry_run=dry_run,
                batch_seconds=options["batch_seconds"],
                pause=options["pause"],
                rate=options["rate"],
                progress=report,
            )
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from exc
        except Busy as exc:
            raise CommandError(
                f"Database {using!r} stayed locked: {exc} {deleted_so_far} expired "
                "idempotency records were deleted before that and stay deleted. "
                "Run the command again later."
            ) from exc
        except DatabaseError as exc:
            raise CommandError(f"Purging expired idempotency records failed: {exc}") from exc
        if dry_run:
            self.stdout.write(f"{count} expired idempotency records would be deleted (dry run).")
        else:
            self.stdout.write(self.style.SUCCESS(f"{count} expired idempotency records deleted."))
