from __future__ import annotations

import gc
import re
from datetime import timedelta
from io import StringIO

import pytest
from django.conf import settings as django_settings
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from django_idempotency.checks import check_middleware_order, check_settings
from django_idempotency.conf import BY_NAME, SETTINGS
from django_idempotency.middleware import IdempotencyMiddleware


def as_started_with(monkeypatch, settings_value) -> None:
    """``IDEMPOTENCY`` as a settings module sets it: no ``setting_changed``, only the checks see it.

    ``override_settings`` refuses a key that is not a setting as soon as it
    applies it (see test_conf.py), so the check's own tests set it this way.
    """
    monkeypatch.setattr(django_settings, "IDEMPOTENCY", settings_value, raising=False)


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

    def test_unknown_key_is_e002_with_suggestion(self, monkeypatch):
        as_started_with(monkeypatch, {"TTLL": 5})
        [error] = check_settings()
        assert error.id == "django_idempotency.E002"
        assert "'TTLL'" in error.msg
        assert "'TTL'" in error.hint

    def test_unknown_key_without_a_close_one_lists_the_known_keys(self, monkeypatch):
        as_started_with(monkeypatch, {"COLOUR": "blue", "TTL": 5})
        [error] = check_settings()
        assert error.id == "django_idempotency.E002"
        assert error.msg == "IDEMPOTENCY['COLOUR'] is not a known setting."
        assert error.hint.startswith("Known keys: HEADER, REQUIRED, METHODS,")

    @pytest.mark.django_db  # Django's own model checks may ask the database (JSONField)
    def test_unknown_key_stops_the_check_command(self, monkeypatch):
        as_started_with(monkeypatch, {"TTLL": 5})
        with pytest.raises(SystemCheckError, match=r"django_idempotency\.E002"):
            call_command("check")

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
            ("KEY_MIN_LENGTH", 0),
            ("KEY_MIN_LENGTH", "16"),
            ("FORM_FIELD", ""),
            ("FORM_FIELD", "idempotency key"),
            ("FORM_FIELD", 1),
        ],
    )
    def test_bad_value_has_its_settings_own_id_naming_the_key(self, key, value):
        with override_settings(IDEMPOTENCY={key: value}):
            errors = check_settings()
        assert [e.id for e in errors] == [BY_NAME[key].check_id]
        assert f"IDEMPOTENCY[{key!r}]" in errors[0].msg
        assert errors[0].hint

    @pytest.mark.parametrize("value", ["idempotency_key", "order-key", None])
    def test_form_field_takes_a_field_name_or_none(self, value):
        with override_settings(IDEMPOTENCY={"FORM_FIELD": value}):
            assert check_settings() == []

    def test_each_setting_has_its_own_check_id(self):
        ids = [setting.check_id for setting in SETTINGS]
        assert len(set(ids)) == len(ids)
        fixed = {"E001", "E002", "E004", "E005", "E006", "E007", "E117"}
        assert not fixed & {check_id.rsplit(".", 1)[1] for check_id in ids}

    @pytest.mark.django_db  # Django's own model checks may ask the database (JSONField)
    def test_one_rule_can_be_silenced_alone(self):
        bad = {"TTL": "1h", "WAIT": "5"}
        with (
            override_settings(IDEMPOTENCY=bad, SILENCED_SYSTEM_CHECKS=[BY_NAME["TTL"].check_id]),
            pytest.raises(SystemCheckError) as raised,
        ):
            call_command("check")
        assert BY_NAME["WAIT"].check_id in str(raised.value)
        assert BY_NAME["TTL"].check_id not in str(raised.value)

    @pytest.mark.parametrize("key", ["SCOPE", "FINGERPRINT"])
    def test_dotted_path_that_fails_to_import_says_why(self, key):
        with override_settings(IDEMPOTENCY={key: "no_such_module_here.scope"}):
            [error] = check_settings()
        assert error.id == BY_NAME[key].check_id
        assert "could not be imported" in error.msg
        assert "No module named 'no_such_module_here'" in error.msg
        with override_settings(IDEMPOTENCY={key: "django_idempotency.scopes.missing"}):
            [error] = check_settings()
        assert 'does not define a "missing"' in error.msg

    def test_dotted_path_to_a_non_callable_says_so(self):
        with override_settings(IDEMPOTENCY={"SCOPE": "django_idempotency.scopes.ANONYMOUS"}):
            [error] = check_settings()
        assert "names 'django_idempotency.scopes.ANONYMOUS', a str, not a callable" in error.msg

    def test_min_key_length_above_max_is_e117(self):
        assert ids({"KEY_MIN_LENGTH": 20, "KEY_MAX_LENGTH": 10}) == ["django_idempotency.E117"]
        assert ids({"KEY_MIN_LENGTH": 10, "KEY_MAX_LENGTH": 10}) == []

    def test_view_dotted_path_that_fails_to_import_is_e118_naming_the_view(self):
        from django_idempotency import idempotent
        from django_idempotency.checks import check_view_options

        @idempotent(fingerprint="tests.no_such_module.fingerprint")
        def broken_view(request):  # pragma: no cover - never called
            raise AssertionError

        [error] = [e for e in check_view_options() if "broken_view" in e.msg]
        assert error.id == "django_idempotency.E118"
        assert "@idempotent(fingerprint=...) on tests.test_checks." in error.msg
        assert "broken_view names 'tests.no_such_module.fingerprint'" in error.msg
        assert "No module named 'tests.no_such_module'" in error.msg
        del broken_view
        gc.collect()  # the view is gone: so are its options
        assert not [e for e in check_view_options() if "broken_view" in e.msg]

    def test_views_dotted_paths_that_import_pass(self):
        from django_idempotency.checks import check_view_options
        from django_idempotency.options import all_deferred_imports

        # tests.drf_views declares idempotency_scope = "tests.drf_views.tenant_scope".
        paths = {path for _, _, path in all_deferred_imports()}
        assert "tests.drf_views.tenant_scope" in paths
        assert not [e for e in check_view_options() if "tenant_scope" in e.msg]

    def test_every_check_id_is_documented(self):
        from pathlib import Path

        page = (Path(__file__).resolve().parent.parent / "docs" / "settings.rst").read_text()
        documented = set(re.findall(r"``([EW]\d{3})``", page))
        used = {setting.check_id.rsplit(".", 1)[1] for setting in SETTINGS}
        assert used | {"E001", "E002", "E004", "E005", "E006", "E007", "E117", "E118"} <= documented
        for setting in SETTINGS:
            assert f"``{setting.name}``" in page

    def test_unknown_database_alias_is_e004(self):
        assert ids({"DATABASE": "replica"}) == ["django_idempotency.E004"]

    def test_set_cookie_in_stored_headers_is_e005(self):
        assert ids({"STORED_HEADERS": ("Content-Type", "set-cookie")}) == [
            "django_idempotency.E005"
        ]

    @pytest.mark.django_db  # Django's own model checks may ask the database (JSONField)
    @override_settings(IDEMPOTENCY={"TTL": -5})
    def test_checks_are_registered(self):
        with pytest.raises(SystemCheckError, match=r"django_idempotency\.E104"):
            call_command("check")


IDEMPOTENCY_MIDDLEWARE = "django_idempotency.middleware.IdempotencyMiddleware"
AUTHENTICATION_MIDDLEWARE = "django.contrib.auth.middleware.AuthenticationMiddleware"
SESSION = "django.contrib.sessions.middleware.SessionMiddleware"


class IdempotencyMiddlewareSubclass(IdempotencyMiddleware):
    pass


class MiddlewareOrderTests:
    """``IdempotencyMiddleware`` before ``AuthenticationMiddleware`` scopes every user anonymous."""

    def test_before_authentication_is_e006_naming_both_and_the_fix(self, settings):
        settings.MIDDLEWARE = [SESSION, IDEMPOTENCY_MIDDLEWARE, AUTHENTICATION_MIDDLEWARE]
        [error] = check_middleware_order()
        assert error.id == "django_idempotency.E006"
        assert error.msg == (
            f"{IDEMPOTENCY_MIDDLEWARE!r} must come after {AUTHENTICATION_MIDDLEWARE!r} "
            "in MIDDLEWARE."
        )
        assert f"Move {IDEMPOTENCY_MIDDLEWARE!r} below {AUTHENTICATION_MIDDLEWARE!r}" in error.hint
        assert "'anonymous'" in error.hint

    def test_after_authentication_passes(self, settings):
        settings.MIDDLEWARE = [SESSION, AUTHENTICATION_MIDDLEWARE, IDEMPOTENCY_MIDDLEWARE]
        assert check_middleware_order() == []

    @pytest.mark.parametrize(
        "middleware",
        [
            [SESSION, AUTHENTICATION_MIDDLEWARE],
            [SESSION, IDEMPOTENCY_MIDDLEWARE],
            [IDEMPOTENCY_MIDDLEWARE, "no_such_module.Middleware"],
        ],
    )
    def test_either_one_missing_passes(self, settings, middleware):
        settings.MIDDLEWARE = middleware
        assert check_middleware_order() == []

    def test_a_subclass_counts_and_is_named_as_listed(self, settings):
        subclass = f"{__name__}.IdempotencyMiddlewareSubclass"
        settings.MIDDLEWARE = [subclass, SESSION, AUTHENTICATION_MIDDLEWARE]
        [error] = check_middleware_order()
        assert error.id == "django_idempotency.E006"
        assert error.msg.startswith(f"{subclass!r} must come after")

    @pytest.mark.django_db  # Django's own model checks may ask the database (JSONField)
    def test_check_is_registered(self, settings):
        project_middleware = list(settings.MIDDLEWARE)
        settings.MIDDLEWARE = [IDEMPOTENCY_MIDDLEWARE, *project_middleware]
        with pytest.raises(SystemCheckError, match=r"django_idempotency\.E006"):
            call_command("check")
        settings.MIDDLEWARE = [*project_middleware, IDEMPOTENCY_MIDDLEWARE]
        call_command("check", stdout=StringIO())


class BareDecoratedViewsTests:
    """A bad setting is reported by its check id even where views use bare ``@idempotent``.

    The URLconf (``tests.urls``) imports views decorated with bare
    ``@idempotent`` and ``IdempotentMixin`` classes; decorating them reads no
    setting, so ``manage.py check`` reports the check's id instead of ending
    in a traceback while the URLconf is imported.
    """

    @pytest.mark.parametrize(
        ("value", "check_id"),
        [
            ("'not a dict'", "django_idempotency.E001"),
            ("{'ATOMIC': 'yes'}", "django_idempotency.E109"),
        ],
    )
    def test_manage_py_check_reports_the_id(self, value: str, check_id: str) -> None:
        import os
        import subprocess
        import sys
        from pathlib import Path

        root = Path(__file__).resolve().parent.parent
        completed = subprocess.run(
            [sys.executable, "manage.py", "check", "--settings", "tests.check_settings"],
            cwd=root,
            env={**os.environ, "IDEMPOTENCY_CHECK_VALUE": value},
            capture_output=True,
            text=True,
            timeout=120,
        )

        assert completed.returncode == 1, completed.stdout + completed.stderr
        assert check_id in completed.stderr
        assert "Traceback" not in completed.stderr

    def test_silencing_the_id_silences_it(self) -> None:
        import os
        import subprocess
        import sys
        from pathlib import Path

        root = Path(__file__).resolve().parent.parent
        completed = subprocess.run(
            [
                sys.executable,
                "-c",
                "import django, os; os.environ['DJANGO_SETTINGS_MODULE'] = 'tests.check_settings';"
                "from django.conf import settings;"
                "settings.SILENCED_SYSTEM_CHECKS = ['django_idempotency.E109'];"
                "django.setup(); from django.core.management import call_command;"
                "call_command('check')",
            ],
            cwd=root,
            env={**os.environ, "IDEMPOTENCY_CHECK_VALUE": "{'ATOMIC': 'yes'}"},
            capture_output=True,
            text=True,
            timeout=120,
        )

        assert completed.returncode == 0, completed.stdout + completed.stderr
        assert "1 silenced" in completed.stdout
