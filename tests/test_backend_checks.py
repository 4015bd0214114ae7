from __future__ import annotations

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connection
from django.test import override_settings

from django_idempotency.backend_checks import check_backend

only_sqlite = pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite")


def ids(**kwargs: object) -> list[str]:
    return [message.id for message in check_backend(**kwargs)]


@only_sqlite
class SqliteVersionTests:
    def test_sqlite_without_returning_is_e101(self):
        [error] = check_backend(sqlite_version=lambda connection: (3, 34, 1))
        assert error.id == "django_idempotency.E201"
        assert "3.34.1" in error.msg
        assert "3.35" in error.msg
        assert error.hint

    def test_sqlite_with_returning_passes(self):
        assert ids(sqlite_version=lambda connection: (3, 35, 0)) == []

    def test_the_linked_library_passes(self):
        assert ids() == []

    @pytest.mark.django_db  # Django's own model checks may ask the database
    def test_check_is_registered(self, monkeypatch):
        monkeypatch.setattr(
            "django_idempotency.backend_checks._linked_sqlite_version",
            lambda connection: (3, 31, 0),
        )
        with pytest.raises(SystemCheckError, match=r"django_idempotency\.E201"):
            call_command("check")


@only_sqlite
class SqliteAtomicRequestsTests:
    def configure(self, monkeypatch, atomic_requests: bool, mode: str | None) -> None:
        options = dict(connection.settings_dict.get("OPTIONS", {}))
        options.pop("transaction_mode", None)
        if mode is not None:
            options["transaction_mode"] = mode
        monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", atomic_requests)
        monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)

    def test_immediate_with_atomic_requests_is_w101(self, monkeypatch):
        self.configure(monkeypatch, True, "IMMEDIATE")
        [warning] = check_backend()
        assert warning.id == "django_idempotency.W201"
        assert "ATOMIC_REQUESTS" in warning.msg
        assert "backends" in warning.hint

    @pytest.mark.parametrize(
        ("atomic_requests", "mode"), [(False, "IMMEDIATE"), (True, None), (True, "DEFERRED")]
    )
    def test_other_combinations_pass(self, monkeypatch, atomic_requests, mode):
        self.configure(monkeypatch, atomic_requests, mode)
        assert ids() == []


class OtherDatabasesTests:
    def test_unknown_alias_is_left_to_the_settings_check(self):
        with override_settings(IDEMPOTENCY={"DATABASE": "nowhere"}):
            assert ids(sqlite_version=lambda connection: (3, 0)) == []

    @pytest.mark.skipif(connection.vendor == "sqlite", reason="a server database")
    def test_server_databases_are_not_sqlite(self):
        assert ids(sqlite_version=lambda connection: (3, 0)) == []


@pytest.mark.skipif(connection.vendor != "mysql", reason="MariaDB/MySQL")
@pytest.mark.django_db
class PlainServerGaleraTests:
    """A server that is no Galera node gets no Galera check and no causal wait.

    On a node, ``tests/test_galera.py`` runs the check through ``manage.py``.
    """

    def test_no_galera_message(self):
        from django_idempotency.backend_checks import check_galera

        assert check_galera(databases=["default"]) == []

    def test_no_causal_wait(self):
        from django_idempotency.store import galera_sync_wait

        assert galera_sync_wait(connection) == 0


def test_galera_check_needs_the_databases_checked():
    from django_idempotency.backend_checks import check_galera

    assert check_galera() == []


class NaiveClockTests:
    """E203: SQLite and MySQL/MariaDB keep wall time, which must be UTC for the database's clock."""

    def test_the_test_settings_pass(self):
        assert "django_idempotency.E203" not in ids()

    def test_use_tz_false_is_refused_where_the_database_keeps_wall_time(self, settings):
        settings.USE_TZ = False

        found = [m for m in check_backend() if m.id == "django_idempotency.E203"]

        if connection.vendor == "postgresql":
            assert found == []  # instants, whatever Django's settings
        else:
            [error] = found
            assert "USE_TZ is False" in error.msg
            assert "USE_TZ = True" in error.hint

    def test_a_database_time_zone_other_than_utc_is_refused(self, monkeypatch):
        monkeypatch.setitem(connection.settings_dict, "TIME_ZONE", "Asia/Tokyo")

        found = [m for m in check_backend() if m.id == "django_idempotency.E203"]

        assert len(found) == (0 if connection.vendor == "postgresql" else 1)
