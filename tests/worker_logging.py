"""How the logging tests' Celery worker logs: a formatter, and the switches its settings read.

:class:`JsonFieldsFormatter` writes what a JSON log formatter would, the
message and the extra fields, one JSON object per line, so that a test can
read back each record's ``idempotency_*`` fields from the worker's output.
"""

from __future__ import annotations

import json
import logging
from typing import Any

#: Starts every line this formatter writes, so a reader can tell them apart.
MARK = "JSON-LOG "
#: Where the project's LOGGING puts its handler: ``package`` or ``root``.
LOGGING_ENV = "IDEMPOTENCY_TEST_LOGGING"
#: ``0``: ``CELERY_WORKER_HIJACK_ROOT_LOGGER = False``; Celery's default is ``True``.
HIJACK_ENV = "IDEMPOTENCY_TEST_HIJACK"


class JsonFieldsFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = {
            name: value for name, value in vars(record).items() if name.startswith("idempotency_")
        }
        document = {
            "logger": record.name,
            "level": record.levelname,
            "message": record.getMessage(),
            **fields,
        }
        return MARK + json.dumps(document, default=str)


def records_in(text: str) -> list[dict[str, Any]]:
    """The records :class:`JsonFieldsFormatter` wrote into ``text``, in order."""
    return [
        json.loads(line[line.index(MARK) + len(MARK) :])
        for line in text.splitlines()
        if MARK in line
    ]
