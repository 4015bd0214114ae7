"""Operators' tools (operations.py): ``manage.py idempotency_keys list|show|release|delete``."""

from __future__ import annotations

import threading
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction
from django.utils import timezone

from django_idempotency import clock, operations, store
from django_idempotency.backends.base import read_record
from django_idempotency.keys import mask_key
from django_idempotency.management.commands.idempotency_keys import Command
from django_idempotency.models import IdempotencyKey
from django_idempotency.purge import purge_expired
from django_idempotency.scopes import fit_key_column
from tests.factories import IdempotencyKeyFactory
from tests.polling import in_background, wait_until

pytestmark = pytest.mark.django_db
State = IdempotencyKey.State


def run(*args: str) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command("idempotency_keys", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


class ListTests:
    def test_lists_newest_first_with_keys_masked(self):
        old = IdempotencyKeyFactory(scope="user:1", key="older-key-aaaa")
        new = IdempotencyKeyFactory(scope="user:2", key="newer-key-bbbb")

        out, err = run("list")

        lines = out.splitlines()
        assert [line.split("\t")[:2] for line in lines] == [
            ["user:2", mask_key(new.key)],
            ["user:1", mask_key(old.key)],
        ]
        assert "older-key-aaaa" not in out and "newer-key-bbbb" not in out
        assert err.strip() == "2 records."

    def test_show_keys_shows_them_in_clear(self):
        IdempotencyKeyFactory(key="visible-key-cccc")

        out, _ = run("list", "--show-keys")

        assert "\tvisible-key-cccc\t" in out

    def test_filters_by_scope_state_and_abandoned(self):
        done = IdempotencyKeyFactory(scope="user:1")
        running = IdempotencyKeyFactory(scope="user:1", in_flight=True)
        stuck = IdempotencyKeyFactory(scope="user:1", lease_expired=True, checkpoints={"a": 1})
        IdempotencyKeyFactory(scope="user:9", lease_expired=True)

        def keys(*args: str) -> set[str]:
            out, _ = run("list", *args)
            return {line.split("\t")[1] for line in out.splitlines()}

        assert keys("--scope", "user:1", "--state", "completed") == {mask_key(done.key)}
        assert keys("--scope", "user:1", "--state", "in_progress") == {
            mask_key(running.key),
            mask_key(stuck.key),
        }
        assert keys("--scope", "user:1", "--abandoned") == {mask_key(stuck.key)}
        out, _ = run("list", "--scope", "user:1", "--abandoned")
        assert "in progress, attempt 1, abandoned, a" in out


class ShowTests:
    def test_shows_one_record_with_its_checkpoints(self):
        record = IdempotencyKeyFactory(
            scope="user:3",
            key="shown-key-dddd",
            lease_expired=True,
            attempt=2,
            checkpoints={"charged": {"charge": 7}},
        )

        out, _ = run("show", "user:3", "shown-key-dddd")

        assert f"key:          {mask_key(record.key)} (masked)" in out
        assert "attempt:      2" in out
        assert 'checkpoints:  {"charged": {"charge": 7}}' in out
        assert "shown-key-dddd" not in out

    def test_finds_a_long_scope_and_key_as_typed_though_stored_as_digests(self):
        # A long function key (a task's arguments, say) is stored as its digest.
        scope, key = "tenant:" + "s" * 300, "k" * 300
        IdempotencyKeyFactory(scope=fit_key_column(scope), key=fit_key_column(key))

        out, _ = run("show", scope, key)
        listed, _ = run("list", "--scope", scope)

        assert f"scope:        {fit_key_column(scope)}" in out
        assert len(listed.splitlines()) == 1

    def test_a_key_typed_exactly_is_that_record_not_its_quoted_twin(self):
        # A key function's keys have no header syntax: abc and "abc" are two keys.
        plain = IdempotencyKeyFactory(scope="fn:charge", key="abc")
        quoted = IdempotencyKeyFactory(scope="fn:charge", key='"abc"')

        run("delete", "fn:charge", '"abc"')

        assert IdempotencyKey.objects.filter(pk=plain.pk).exists()
        assert not IdempotencyKey.objects.filter(pk=quoted.pk).exists()

    def test_a_quoted_key_finds_the_record_of_its_unquoted_reading(self):
        # As a client's header sends it: "abc" is the key abc.
        record = IdempotencyKeyFactory(scope="user:5", key="abc", lease_expired=True)

        run("release", "user:5", '"abc"')
        out, _ = run("show", "user:5", '"abc"')

        record.refresh_from_db()
        assert record.owner_token == ""

        assert f"key:          {mask_key(record.key)} (masked)" in out

    def test_a_digest_typed_finds_only_the_record_stored_as_it(self):
        # A value that spells a digest is stored as a digest of its own.
        spelled = fit_key_column("x" * 300)
        IdempotencyKeyFactory(scope="user:4", key=fit_key_column(spelled))

        with pytest.raises(CommandError, match="No idempotency record"):
            run("show", "user:4", spelled)

    @pytest.mark.parametrize("action", ["show", "release", "delete"])
    def test_no_such_record_exits_non_zero_with_a_message(self, action):
        IdempotencyKeyFactory(scope="user:3", key="there")

        with pytest.raises(
            CommandError, match=r"No idempotency record for key \w+ in scope 'user:3'"
        ):
            run(action, "user:3", "not-there")

    def test_scope_and_key_compare_exactly(self):
        IdempotencyKeyFactory(scope="user:3", key="Exact")

        with pytest.raises(CommandError):
            run("show", "user:3", "exact")
        with pytest.raises(CommandError):
            run("show", "USER:3", "Exact")


class ReleaseTests:
    def test_release_lets_the_next_retry_resume_the_abandoned_claim(self):
        record = IdempotencyKeyFactory(
            scope="user:4", key="stuck-key", lease_expired=True, checkpoints={"charged": 1}
        )

        out, _ = run("release", "user:4", "stuck-key")

        assert "the next retry takes it over as attempt 2" in out
        released = IdempotencyKey.objects.get(pk=record.pk)
        assert (released.state, released.owner_token) == (State.IN_PROGRESS, "")
        assert released.expires_at <= timezone.now()
        assert released.checkpoints == {"charged": 1}

    def test_a_live_lease_is_refused_unless_forced(self):
        record = IdempotencyKeyFactory(scope="user:4", key="live-key", in_flight=True)

        with pytest.raises(CommandError, match=r"may still be running.*--force"):
            run("release", "user:4", "live-key")
        assert IdempotencyKey.objects.get(pk=record.pk).owner_token == record.owner_token

        run("release", "user:4", "live-key", "--force")
        assert IdempotencyKey.objects.get(pk=record.pk).owner_token == ""

    @pytest.mark.parametrize("status", [200, 201, 204, 400, 422])
    def test_a_completed_record_is_not_released(self, status):
        # A stored result: its handler finished, and its retries get it.
        record = IdempotencyKeyFactory(
            scope="user:4", key="done-key", status_code=status, owner_token="a" * 32
        )

        with pytest.raises(CommandError, match="is completed: there is no claim to release"):
            run("release", "user:4", "done-key")
        kept = IdempotencyKey.objects.get(pk=record.pk)
        assert (kept.state, kept.status_code, kept.expires_at) == (
            State.COMPLETED,
            status,
            record.expires_at,
        )


def refusal(**fields) -> IdempotencyKey:
    """A lease-mode key completed with a refusal (SPEC 4.6): the body ran, its result was lost."""
    values = {
        "scope": "user:5",
        "key": "refused-key",
        "status_code": 500,
        "response_headers": [["Content-Type", "application/problem+json"]],
        "response_body": b'{"type": "result-not-stored"}',
        "owner_token": "a" * 32,
        "checkpoints": {"charged": {"charge": "ch_1"}},
        "attempt": 1,
        "retained_until": timezone.now() + timedelta(hours=1),
        **fields,
    }
    record = IdempotencyKeyFactory(**values)
    return IdempotencyKey.objects.get(pk=record.pk)  # as the database stored it


class ReleaseRefusalTests:
    """``release`` of a refusal: the next retry runs the body again, from its checkpoints."""

    @pytest.mark.parametrize("status", [500, 507])
    def test_a_refusal_becomes_a_released_claim(self, status):
        read = refusal(status_code=status, attempt=2)

        out, _ = run("release", "user:5", "refused-key")

        assert out == (
            f"Released the refusal ({status}, its result was not stored) of idempotency key "
            f"{mask_key('refused-key')} in scope 'user:5': the next retry runs its handler "
            "again as attempt 3, resuming from its checkpoints (charged).\n"
        )
        released = IdempotencyKey.objects.get(pk=read.pk)
        assert (released.state, released.owner_token, released.attempt) == (
            State.IN_PROGRESS,
            "",
            3,
        )
        assert (released.status_code, released.response_headers, released.response_body) == (
            None,
            None,
            None,
        )
        assert released.checkpoints == {"charged": {"charge": "ch_1"}}
        assert released.expires_at == released.locked_until
        assert released.expires_at <= clock.read(connection)
        assert released.created_at == read.created_at
        # What the next retry finds: a claim given back, taken over at once.
        found = read_record(connection, "user:5", "refused-key")
        assert found is not None
        assert (found.completed, found.owner_token, found.expired) == (False, "", True)

    @pytest.mark.parametrize(
        ("retained", "kept_until"),
        [
            (timedelta(hours=1), "expires_at"),  # the refusal outlives its claim's retention
            (timedelta(hours=30), "retained_until"),
            (None, "expires_at"),
        ],
    )
    def test_the_purge_keeps_it_at_least_as_long_as_the_refusal(self, retained, kept_until):
        read = refusal(retained_until=None if retained is None else timezone.now() + retained)

        run("release", "user:5", "refused-key")

        released = IdempotencyKey.objects.get(pk=read.pk)
        assert released.retained_until == getattr(read, kept_until)
        cutoff = released.retained_until
        assert purge_expired(dry_run=True) == 0
        assert purge_expired(dry_run=True, now=cutoff - timedelta(seconds=1)) == 0
        assert purge_expired(dry_run=True, now=cutoff) == 1

    @pytest.mark.parametrize("status", [500, 507])
    def test_an_expired_refusal_is_refused_and_left_as_it_was(self, status):
        # Its key is free already: the next request runs as a new one. A
        # release would bring it back past its TTL, and the purge, which
        # may delete it at once, would lose its checkpoints with it.
        refusal(status_code=status, expires_at=timezone.now() + timedelta(hours=1))
        before = list(IdempotencyKey.objects.values())

        with (
            clock.shifted(timedelta(hours=2)),  # past its expiry by the database's clock
            pytest.raises(CommandError) as refused,
        ):
            run("release", "user:5", "refused-key")

        message = str(refused.value)
        assert message.startswith(
            f"The refusal ({status}) of idempotency key {mask_key('refused-key')} in scope "
            "'user:5' expired at "
        )
        assert (
            "its key is free already, and the next request with it runs its handler as a new "
            "one, attempt 1, without its checkpoints (charged). Nothing was released."
        ) in message
        assert "'idempotency_keys show'" in message
        assert "'idempotency_keys delete'" in message
        assert list(IdempotencyKey.objects.values()) == before

    def test_the_statement_leaves_an_expired_refusal_alone(self):
        read = refusal(expires_at=timezone.now() + timedelta(hours=1))

        with clock.shifted(timedelta(hours=2)):
            assert not store.release_refusal(connection.alias, read.pk, read.owner_token)
        assert store.release_refusal(connection.alias, read.pk, read.owner_token)

    @pytest.mark.parametrize("status", [200, 201, 422])
    def test_the_statement_leaves_a_stored_result_of_the_same_owner_alone(self, status):
        # The status in the fence itself: same record, same token, not a refusal.
        read = refusal(status_code=status)

        assert not store.release_refusal(connection.alias, read.pk, read.owner_token)

        assert IdempotencyKey.objects.get(pk=read.pk).state == State.COMPLETED

    @pytest.mark.parametrize(
        "change",
        [
            "deleted",
            "taken over after it expired",
            "completed anew with a stored result",
            "refused again for another owner",
        ],
    )
    def test_a_refusal_changed_since_it_was_read_is_left_alone(self, monkeypatch, change):
        read = refusal()
        found, as_changed = Command._find, []

        def find_then_change(command, options):
            record = found(command, options)
            rows = IdempotencyKey.objects.filter(pk=read.pk)
            if change == "deleted":
                rows.delete()
            elif change == "taken over after it expired":
                rows.update(state=State.IN_PROGRESS, owner_token="b" * 32, status_code=None)
            elif change == "completed anew with a stored result":
                rows.update(owner_token="b" * 32, status_code=201)
            else:
                rows.update(owner_token="b" * 32)
            as_changed.extend(IdempotencyKey.objects.values())
            return record

        monkeypatch.setattr(Command, "_find", find_then_change)

        with pytest.raises(CommandError, match="The record changed meanwhile"):
            run("release", "user:5", "refused-key")

        assert list(IdempotencyKey.objects.values()) == as_changed


@pytest.mark.parametrize("force", [False, True])
def test_a_lease_taken_over_since_it_was_read_is_not_released(force):
    """The release is fenced by the token read: the next owner's lease is never the one released."""
    read = IdempotencyKeyFactory(scope="user:4", key="taken-key", in_flight=True)
    # The owner stalls past its lease and a retry takes the key over, between
    # the operator's look and its release.
    with clock.shifted(timedelta(minutes=10)):
        abandoned = read_record(connection, "user:4", "taken-key")
        assert abandoned is not None
        lease = timedelta(minutes=5)
        retry = store.NewClaim(
            scope="user:4",
            key="taken-key",
            fingerprint=read.fingerprint,
            owner_token="b" * 32,
            expires_in=lease,
            lease=lease,
        )
        assert store.take_over("default", abandoned, retry) is not None
    taken = IdempotencyKey.objects.get(pk=read.pk)

    if force:
        assert operations.release(read, force=True) is False
    else:
        with pytest.raises(operations.LeaseStillHeld) as held:
            operations.release(read)
        assert held.value.until == taken.expires_at

    kept = IdempotencyKey.objects.get(pk=read.pk)
    assert (kept.state, kept.owner_token, kept.attempt, kept.expires_at) == (
        State.IN_PROGRESS,
        "b" * 32,
        2,
        taken.expires_at,
    )


def test_a_claim_released_again_counts_its_owners_attempt_once():
    IdempotencyKeyFactory(scope="user:4", key="twice-key", lease_expired=True, attempt=3)

    first, _ = run("release", "user:4", "twice-key")
    again, _ = run("release", "user:4", "twice-key")

    released = IdempotencyKey.objects.get()
    assert (released.owner_token, released.attempt) == ("", 4)
    assert "the next retry takes it over as attempt 4," in first
    assert "the next retry takes it over as attempt 4," in again


class DeleteTests:
    def test_delete_removes_the_record(self):
        IdempotencyKeyFactory(
            scope="user:5", key="gone-key", expires_at=timezone.now() + timedelta(hours=1)
        )

        out, _ = run("delete", "user:5", "gone-key")

        assert out.startswith("Deleted idempotency key")
        assert not IdempotencyKey.objects.exists()

    def test_a_live_lease_is_refused_unless_forced(self):
        IdempotencyKeyFactory(scope="user:5", key="live-key", in_flight=True)

        with pytest.raises(CommandError, match="--force"):
            run("delete", "user:5", "live-key")
        assert IdempotencyKey.objects.exists()
        run("delete", "user:5", "live-key", "--force")
        assert not IdempotencyKey.objects.exists()


@pytest.mark.django_db(databases=["default", "other"])
def test_database_option_and_setting(settings):
    settings.IDEMPOTENCY = {"DATABASE": "other"}
    IdempotencyKeyFactory.build(scope="user:6", key="elsewhere").save(using="other")

    out, _ = run("list")
    assert "user:6" in out
    out, _ = run("--database", "default", "list")
    assert "user:6" not in out


@pytest.mark.django_db(databases=["default", "other"])
def test_the_database_option_is_taken_after_the_action_too():
    IdempotencyKeyFactory.build(scope="user:6", key="elsewhere").save(using="other")

    assert "user:6" in run("list", "--database", "other")[0]
    assert "user:6" not in run("list", "--database", "default")[0]
    assert "user:6" in run("--database", "other", "list")[0]  # before it, as ever
    assert "user:6" in run("show", "user:6", "elsewhere", "--database", "other")[0]
    with pytest.raises(CommandError, match="No idempotency record"):
        run("show", "user:6", "elsewhere", "--database", "default")
    run("delete", "user:6", "elsewhere", "--database", "other")
    assert not IdempotencyKey.objects.using("other").exists()


@pytest.mark.parametrize("where", ["before", "after"])
def test_an_unknown_database_is_a_clear_error(where):
    args = ["--database", "nope", "list"] if where == "before" else ["list", "--database", "nope"]
    with pytest.raises(CommandError, match="Unknown database 'nope': --database takes an alias"):
        run(*args)


@pytest.mark.parametrize("limit", ["-1", "0", "many"])
def test_a_limit_below_one_is_a_clear_error(limit):
    with pytest.raises(CommandError, match="1 or more"):
        run("list", "--limit", limit)


def updates_waiting_on_a_row_lock() -> int:
    """How many statements on the test database wait for another transaction's row lock.

    MariaDB: the writes to the key table still running (InnoDB's own
    transaction table is a cache that polling keeps stale); with the row
    locked by the owner, a write to it runs only by waiting.
    """
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        else:
            table = IdempotencyKey._meta.db_table
            cursor.execute(
                "SELECT count(*) FROM information_schema.processlist "
                "WHERE db = DATABASE() AND id <> CONNECTION_ID() AND command = 'Query' "
                "AND (info LIKE %s OR info LIKE %s)",
                [f"UPDATE `{table}`%", f"DELETE FROM `{table}`%"],
            )
        return int(cursor.fetchone()[0])


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(
    connection.vendor == "sqlite", reason="SQLite has no row locks to race the command on"
)
class FencedInTheStatementTests:
    """An owner that renews its lease while the command runs keeps it (no check, then act)."""

    @pytest.mark.parametrize("action", ["release", "delete"])
    def test_a_lease_renewed_while_the_command_runs_is_kept(self, action):
        stuck = IdempotencyKeyFactory(scope="user:1", key="raced-key-dddd", lease_expired=True)
        renewed, commit = threading.Event(), threading.Event()

        def owner_renews() -> None:
            # The owner's checkpoint, caught between the command's look and its act:
            # renewed, but not committed until the command waits on its row.
            with transaction.atomic():
                assert store.record_progress(
                    "default", stuck.pk, owner_token=stuck.owner_token, lease=timedelta(minutes=5)
                )
                renewed.set()
                assert commit.wait(10)

        owner = in_background(owner_renews)
        assert renewed.wait(10)
        command = in_background(lambda: run(action, "user:1", "raced-key-dddd"))
        wait_until(lambda: updates_waiting_on_a_row_lock() > 0, f"{action} to wait on the row")
        commit.set()
        owner()
        with pytest.raises(CommandError, match="lease"):
            command()

        record = IdempotencyKey.objects.get(pk=stuck.pk)
        assert (record.state, record.owner_token) == (State.IN_PROGRESS, stuck.owner_token)
        assert record.locked_until > timezone.now() + timedelta(minutes=4)
