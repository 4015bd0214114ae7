"""The gunicorn server settings, with the request-body views routed too."""

from tests.server_settings import *  # noqa: F403

ROOT_URLCONF = "tests.body_urls"
