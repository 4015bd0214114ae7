"""The gunicorn server settings, with the request-body views routed too.

Bodies past ``FILE_UPLOAD_MAX_MEMORY_SIZE`` are copied to files in a
directory of the test's own, so that the test can see which of them a
worker still holds open.
"""

import os

from tests.server import UPLOAD_TEMP_DIR_ENV
from tests.server_settings import *  # noqa: F403

ROOT_URLCONF = "tests.body_urls"
FILE_UPLOAD_TEMP_DIR = os.environ.get(UPLOAD_TEMP_DIR_ENV)
