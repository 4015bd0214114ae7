"""Section 1: SQL statements per request, from Django's own query capture.

Backend-agnostic: it drives the bench views through Django's test client on
whatever database is configured, so the project's test suite runs the same
function on SQLite, PostgreSQL and MariaDB. Transaction control (BEGIN,
COMMIT, SAVEPOINT...) is not counted, as in ``tests/test_queries.py``: the
bound is on the work each request asks of the database.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from django.db import connections
from django.test import Client
from django.test.utils import CaptureQueriesContext

from benchmarks.bench.models import BenchOrder

TRANSACTION_CONTROL = ("BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT", "RELEASE", "START TRANSACTION")
BODY = {"item": "book", "quantity": 1}
OTHER_BODY = {"item": "lamp", "quantity": 2}


@dataclass(frozen=True)
class StatementCounts:
    """What one variant cost for a first request, a replay and a reused key."""

    variant: str
    first: int
    replay: int
    #: Statements for the same key with a different body, and its status code.
    mismatch: int
    mismatch_status: int
    #: Whether the handler wrote a row for the replay (it must not).
    replay_ran_handler: bool
    #: Whether the handler wrote a row for the reused key with another body.
    mismatch_ran_handler: bool


def statements(captured: CaptureQueriesContext) -> list[str]:
    return [
        query["sql"]
        for query in captured.captured_queries
        if not query["sql"].lstrip().upper().startswith(TRANSACTION_CONTROL)
    ]


def _post(client: Client, variant: str, key: str, body: dict) -> int:
    response = client.post(
        f"/{variant}/",
        json.dumps(body),
        content_type="application/json",
        headers={"Idempotency-Key": key},
    )
    return response.status_code


def _rows(variant: str, using: str) -> int:
    return BenchOrder.objects.using(using).filter(variant=variant).count()


def count_statements(variant: str, *, using: str = "default") -> StatementCounts:
    """Count the statements of each kind of request to ``/<variant>/``.

    Keys are UUIDs, which every peer accepts. A warm-up request first takes
    connection set-up and first-use queries out of the count.
    """
    client = Client()
    connection = connections[using]
    _post(client, variant, str(uuid.uuid4()), BODY)
    key = str(uuid.uuid4())
    with CaptureQueriesContext(connection) as first:
        _post(client, variant, key, BODY)
    before = _rows(variant, using)
    with CaptureQueriesContext(connection) as replay:
        _post(client, variant, key, BODY)
    replayed = _rows(variant, using)
    with CaptureQueriesContext(connection) as mismatch:
        mismatch_status = _post(client, variant, key, OTHER_BODY)
    return StatementCounts(
        variant=variant,
        first=len(statements(first)),
        replay=len(statements(replay)),
        mismatch=len(statements(mismatch)),
        mismatch_status=mismatch_status,
        replay_ran_handler=replayed != before,
        mismatch_ran_handler=_rows(variant, using) != replayed,
    )
