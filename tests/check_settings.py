"""The test settings with ``IDEMPOTENCY`` taken from the environment, for ``manage.py check``.

``IDEMPOTENCY_CHECK_VALUE`` holds a Python literal: a project whose
setting is wrong, checked the way ``manage.py check`` checks it, in a
process of its own.
"""

from __future__ import annotations

import ast
import os

from tests.settings import *  # noqa: F403

IDEMPOTENCY = ast.literal_eval(os.environ["IDEMPOTENCY_CHECK_VALUE"])
