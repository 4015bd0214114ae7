"""``manage.py idempotency_keys``: find stuck keys and resolve them.

    idempotency_keys list [--scope S] [--state in_progress|completed] [--abandoned]
    idempotency_keys show SCOPE KEY
    idempotency_keys release SCOPE KEY [--force]
    idempotency_keys delete SCOPE KEY [--force]

Each takes ``--database ALIAS``, before or after the action.

Arguments and output only; what each action does is in
:mod:`django_idempotency.operations`. Keys are shown masked, as in the logs,
unless ``list --show-keys`` asks for them in clear.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections

from django_idempotency import leases, operations
from django_idempotency.keys import mask_key
from django_idempotency.management.arguments import whole_number
from django_idempotency.models import IdempotencyKey
from django_idempotency.operations import database_now

State = IdempotencyKey.State


#: ``--limit``: a whole number of records, at least 1.
_limit = whole_number("a whole number of records, 1 or more")

_DATABASE_HELP = "The alias to use (default: IDEMPOTENCY's)."


def _database_after_action(action: CommandParser) -> None:
    """``--database`` after the action too (``list --database replica``), as operators type it.

    Left unset there unless given, so that one given before the action still counts.
    """
    action.add_argument("--database", default=argparse.SUPPRESS, help=_DATABASE_HELP)


class Command(BaseCommand):
    help = "List, show, release or delete idempotency records."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--database", default=None, help=_DATABASE_HELP)
        actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        listing = actions.add_parser("list", help="List records, newest first.")
        _database_after_action(listing)
        listing.add_argument("--scope", help="Only this scope (compared exactly).")
        listing.add_argument("--state", choices=[State.IN_PROGRESS, State.COMPLETED])
        listing.add_argument(
            "--abandoned",
            action="store_true",
            help="Only claims whose lease ran out before their owner finished.",
        )
        listing.add_argument("--limit", type=_limit, default=100, help="At most this many (100).")
        listing.add_argument("--show-keys", action="store_true", help="Keys in clear.")
        for name, text in [
            ("show", "Show one record, its checkpoints included."),
            (
                "release",
                "Let the next retry take an in-progress claim (or a refused result) over, "
                "resuming it.",
            ),
            ("delete", "Delete one record: the next request with its key runs anew."),
        ]:
            action = actions.add_parser(name, help=text)
            _database_after_action(action)
            action.add_argument("scope")
            action.add_argument("key")
            if name != "show":
                action.add_argument(
                    "--force",
                    action="store_true",
                    help="Even a live lease, whose request may still be running.",
                )

    def handle(self, *args: Any, **options: Any) -> None:
        database = options["database"]
        if database is not None and database not in connections:
            raise CommandError(
                f"Unknown database {database!r}: --database takes an alias of DATABASES "
                f"({', '.join(sorted(connections.settings))})."
            )
        action = options["action"]
        if action == "list":
            self._list(options)
            return
        record = self._find(options)
        if action == "show":
            self._show(record)
        elif action == "release":
            self._release(record, options["force"])
        else:
            self._delete(record, options["force"])

    def _find(self, options: dict[str, Any]) -> IdempotencyKey:
        records = operations.records(options["database"])
        scope, key = options["scope"], options["key"]
        scopes = operations.stored_forms(scope)
        # The key as typed (or its digest, when long) first: a key function's
        # abc and "abc" are two keys. Only then the header's reading of it.
        found = records.filter(scope__in=scopes, key__in=operations.stored_forms(key)).first()
        if found is None:
            found = records.filter(scope__in=scopes, key__in=operations.stored_keys(key)).first()
        if found is None:
            raise CommandError(f"No idempotency record for key {mask_key(key)} in scope {scope!r}.")
        return found

    def _list(self, options: dict[str, Any]) -> None:
        now = database_now(options["database"])
        found = operations.records(options["database"]).order_by("-pk")
        if options["scope"] is not None:
            found = found.filter(scope__in=operations.stored_forms(options["scope"]))
        if options["state"] is not None:
            found = found.filter(state=options["state"])
        if options["abandoned"]:
            found = found.filter(operations.abandoned())
        shown = 0
        for record in found[: options["limit"]]:
            key = record.key if options["show_keys"] else mask_key(record.key)
            self.stdout.write(f"{record.scope}\t{key}\t{self._status(record, now)}")
            shown += 1
        self.stderr.write(f"{shown} record{'s' if shown != 1 else ''}.")

    @staticmethod
    def _status(record: IdempotencyKey, now: Any) -> str:
        if record.state == State.COMPLETED:
            return f"completed {record.status_code}, expires {record.expires_at.isoformat()}"
        done = ", ".join(record.checkpoints or {}) or "no checkpoints"
        lease: str = leases.state_of(False, record.owner_token, record.expires_at, now)
        if lease == leases.HELD:
            lease = f"lease until {record.expires_at.isoformat()}"
        return f"in progress, attempt {record.attempt}, {lease}, {done}"

    def _show(self, record: IdempotencyKey) -> None:
        now = database_now(record._state.db)
        lines = [
            f"scope:        {record.scope}",
            f"key:          {mask_key(record.key)} (masked)",
            f"state:        {self._status(record, now)}",
            f"fingerprint:  {record.fingerprint}",
            f"created at:   {record.created_at.isoformat()}",
            f"expires at:   {record.expires_at.isoformat()}",
            f"attempt:      {record.attempt}",
            f"checkpoints:  {json.dumps(record.checkpoints or {}, sort_keys=True)}",
        ]
        if record.state == State.IN_PROGRESS and record.retained_until is not None:
            # Past its lease, the purge keeps it for the retry until then.
            lines.append(f"kept until:   {record.retained_until.isoformat()}")
        if record.state == State.COMPLETED:
            body = record.response_body
            size = "not stored" if body is None else f"{len(body)} bytes"
            lines += [
                f"status:       {record.status_code}",
                f"headers:      {json.dumps(record.response_headers or [])}",
                f"body:         {size}",
            ]
        self.stdout.write("\n".join(lines))

    def _release(self, record: IdempotencyKey, force: bool) -> None:
        if operations.is_refusal(record):
            self._release_refusal(record)
            return
        if record.state != State.IN_PROGRESS:
            raise CommandError(
                f"Idempotency key {mask_key(record.key)} in scope {record.scope!r} is "
                "completed: there is no claim to release (delete it to run its request anew)."
            )
        if not self._unless_live(operations.release, record, force, "release"):
            raise CommandError("The record changed meanwhile (completed or taken over).")
        # The release counts an owned claim's attempt as its owner's; a claim
        # already given back keeps its number, and its takeover adds none.
        attempt = record.attempt + 1 if leases.owned(record.owner_token) else record.attempt
        self.stdout.write(
            f"Released idempotency key {mask_key(record.key)} in scope {record.scope!r}: "
            f"the next retry takes it over as attempt {attempt}, resuming from "
            f"its checkpoints ({', '.join(record.checkpoints or {}) or 'none'})."
        )

    def _release_refusal(self, record: IdempotencyKey) -> None:
        """A refusal's release: its body ran, so no lease can still be live to refuse."""
        try:
            released = operations.release(record)
        except operations.RefusalExpired as expired:
            done = ", ".join(record.checkpoints or {}) or "none"
            raise CommandError(
                f"The refusal ({record.status_code}) of idempotency key {mask_key(record.key)} "
                f"in scope {record.scope!r} expired at {expired.expired_at.isoformat()}: its key "
                "is free already, and the next request with it runs its handler as a new one, "
                f"attempt 1, without its checkpoints ({done}). Nothing was released. Read "
                "them with 'idempotency_keys show' before the purge deletes the record, and "
                "settle by hand what they say was done; 'idempotency_keys delete' drops it now."
            ) from None
        if not released:
            raise CommandError(
                "The record changed meanwhile (deleted, taken over, or no longer the "
                "refusal that was read): show it again."
            )
        self.stdout.write(
            f"Released the refusal ({record.status_code}, its result was not stored) of "
            f"idempotency key {mask_key(record.key)} in scope {record.scope!r}: the next "
            f"retry runs its handler again as attempt {record.attempt + 1}, resuming from "
            f"its checkpoints ({', '.join(record.checkpoints or {}) or 'none'})."
        )

    def _delete(self, record: IdempotencyKey, force: bool) -> None:
        if not self._unless_live(operations.delete, record, force, "delete"):
            raise CommandError("The record was deleted meanwhile.")
        self.stdout.write(
            f"Deleted idempotency key {mask_key(record.key)} in scope {record.scope!r}: "
            "the next request with it runs as a new one."
        )

    @staticmethod
    def _unless_live(
        operation: Callable[..., bool], record: IdempotencyKey, force: bool, action: str
    ) -> bool:
        """What ``operation`` returned for ``record``; a live lease refused, and said so.

        ``release`` and ``delete`` both refuse a claim whose request may
        still be running, unless forced: one message says why, and how.
        """
        try:
            return operation(record, force=force)
        except operations.LeaseStillHeld as held:
            raise CommandError(
                f"The lease of idempotency key {mask_key(record.key)} in scope {record.scope!r} "
                f"runs until {held.until.isoformat()}: its request may still be running, "
                f"and would then run twice. Wait for the lease, or {action} with --force."
            ) from None
