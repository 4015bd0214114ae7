"""Settings for the fault suite's gunicorn: persistent connections that heal themselves.

``CONN_MAX_AGE`` keeps each worker's connection across requests, as
production deployments do, and ``CONN_HEALTH_CHECKS`` makes a worker notice
at the start of its next request that the connection was killed or the
database restarted, and reconnect instead of failing. On PostgreSQL the
connections carry an ``application_name`` so the suite can terminate exactly
this server's backends and no one else's.
"""

from __future__ import annotations

import os

from tests.faults.database import APPLICATION_NAME_ENV
from tests.server_settings import *  # noqa: F403
from tests.server_settings import DATABASES as _SERVER_DATABASES

_default = {**_SERVER_DATABASES["default"], "CONN_MAX_AGE": 60, "CONN_HEALTH_CHECKS": True}
_options = dict(_default.get("OPTIONS", {}))
if _default["ENGINE"].endswith("postgresql"):
    _options.update(application_name=os.environ[APPLICATION_NAME_ENV], connect_timeout=5)
else:
    _options.update(connect_timeout=5)
_default["OPTIONS"] = _options
DATABASES = {"default": _default}
