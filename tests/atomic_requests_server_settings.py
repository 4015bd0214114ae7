"""The servers' settings with ``ATOMIC_REQUESTS = True``: lease mode in request transactions."""

from __future__ import annotations

from tests.server_settings import *  # noqa: F403
from tests.server_settings import DATABASES as _DATABASES

DATABASES = {"default": {**_DATABASES["default"], "ATOMIC_REQUESTS": True}}
