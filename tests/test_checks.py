from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from django_idempotency.checks import check_settings


def ids(settings_value) -> list[str]:
    with override_settings(IDEMPOTENCY=settings_value):
        return [error.id for error in check_settings()]


def messages(settings_value) -> list[str]:
    with override_settings(IDEMPOTENCY=settings_value):
        return [error.msg for error in check_settings()]


class CheckSettingsTests:
    def test_defaults_pass(self):
        assert ids({}) == []

    def test_valid_values_pass(self):
        valid = {
            "HEADER": "X-Idempotency-Key",
            "REQUIRED": True,
            "METHODS": ["post", "PUT", "PATCH", "DELETE"],
            "TTL": 3600,
            "KEY_MAX_LENGTH": 64,
            "SCOPE": lambda request: "all",
            "FINGERPRINT": "django_idempotency.fingerprint.request_fingerprint",
            "ATOMIC": False,
            "WAIT": 0,
            "LEASE": timedelta(minutes=10),
            "REPLAY_HEADER": "X-Replayed",
            "STORED_HEADERS": ("Content-Type", "Location"),
            "DATABASE": "default",
            "MAX_STORED_BODY": 0,
            "ENABLED": False,
        }
        assert ids(valid) == []

    def test_not_a_dict_is_e001(self):
        assert ids(["TTL"]) == ["django_idempotency.E001"]

    def test_unknown_key_is_e002_with_suggestion(self):
        with override_settings(IDEMPOTENCY={"TTLL": 5}):
            [error] = check_settings()
        assert error.id == "django_idempotency.E002"
        assert "'TTLL'" in error.msg
        assert "'TTL'" in error.hint

    @pytest.mark.parametrize(
        ("key", "value"),
        [
            ("HEADER", "Idempotency Key"),
            ("HEADER", ""),
            ("REQUIRED", "yes"),
            ("METHODS", "POST"),
            ("METHODS", ()),
            ("METHODS", ("POST", "FETCH")),
            ("TTL", 0),
            ("TTL", timedelta(seconds=-1)),
            ("TTL", "1h"),
            ("KEY_MAX_LENGTH", 0),
            ("KEY_MAX_LENGTH", 256),
            ("KEY_MAX_LENGTH", True),
            ("SCOPE", "no.such.module.scope"),
            ("SCOPE", 42),
            ("FINGERPRINT", "django_idempotency.fingerprint.nothing_here"),
            ("ATOMIC", 1),
            ("WAIT", -1),
            ("WAIT", "5"),
            ("LEASE", 0),
            ("REPLAY_HEADER", "bad header"),
            ("STORED_HEADERS", "Content-Type"),
            ("DATABASE", 1),
            ("MAX_STORED_BODY", -1),
            ("MAX_STORED_BODY", 1.5),
            ("ENABLED", None),
        ],
    )
    def test_bad_value_is_e003_naming_the_key(self, key, value):
        with override_settings(IDEMPOTENCY={key: value}):
            errors = check_settings()
        assert [e.id for e in errors] == ["django_idempotency.E003"]
        assert f"IDEMPOTENCY[{key!r}]" in errors[0].msg
        assert errors[0].hint

    def test_unknown_database_alias_is_e004(self):
        assert ids({"DATABASE": "replica"}) == ["django_idempotency.E004"]

    def test_set_cookie_in_stored_headers_is_e005(self):
        assert ids({"STORED_HEADERS": ("Content-Type", "set-cookie")}) == [
            "django_idempotency.E005"
        ]

    @pytest.mark.django_db  # Django's own model checks may ask the database (JSONField)
    @override_settings(IDEMPOTENCY={"TTL": -5})
    def test_checks_are_registered(self):
        with pytest.raises(SystemCheckError, match=r"django_idempotency\.E003"):
            call_command("check")
