"""SQL statements a protected request adds, counted by Django's query capture.

Transaction control (BEGIN, COMMIT, SAVEPOINT...) is not counted: the bound
is on the work each request asks of the database.
"""

from __future__ import annotations

import json
import tempfile

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from tests.views import calls

pytestmark = pytest.mark.django_db

TRANSACTION_CONTROL = ("BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT", "RELEASE", "START TRANSACTION")


def statements(captured: CaptureQueriesContext) -> list[str]:
    return [
        query["sql"]
        for query in captured.captured_queries
        if not query["sql"].lstrip().upper().startswith(TRANSACTION_CONTROL)
    ]


def post(client, key: str | None):
    headers = {"Idempotency-Key": key} if key else {}
    return client.post(
        "/orders/", json.dumps({"item": "book"}), content_type="application/json", headers=headers
    )


def test_first_request_adds_at_most_two_statements(client):
    post(client, "warm-up")  # connection set-up is not per request
    with CaptureQueriesContext(connection) as unprotected:
        post(client, None)
    with CaptureQueriesContext(connection) as first:
        post(client, "first")

    handler_own = len(statements(unprotected))
    assert handler_own == 1
    assert len(statements(first)) - handler_own <= 2, statements(first)


def test_replay_uses_at_most_two_statements_and_never_runs_handler(client):
    post(client, "key")
    before = calls.value
    with CaptureQueriesContext(connection) as replay:
        response = post(client, "key")

    assert response["Idempotent-Replayed"] == "true"
    assert calls.value == before
    assert len(statements(replay)) <= 2, statements(replay)


def test_mismatch_uses_at_most_two_statements(client):
    post(client, "key")
    with CaptureQueriesContext(connection) as rejected:
        response = client.post(
            "/orders/", "{}", content_type="application/json", headers={"Idempotency-Key": "key"}
        )

    assert response.status_code == 422
    assert len(statements(rejected)) <= 2, statements(rejected)


def test_malformed_key_uses_no_statement(client):
    with CaptureQueriesContext(connection) as rejected:
        response = post(client, "bad key")

    assert response.status_code == 400
    assert statements(rejected) == []


class _RoundTrips:
    """Messages the client sends PostgreSQL, read from libpq's own trace.

    Unlike the query capture above this sees transaction control too (the
    BEGIN psycopg sends before the first statement, the COMMIT), so it
    counts what each request waits for: one simple query is one round trip.
    """

    def __init__(self, raw_connection) -> None:
        self._pgconn = raw_connection.pgconn
        self._file = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115  closed in queries()

    def __enter__(self) -> _RoundTrips:
        self._pgconn.trace(self._file.fileno())
        return self

    def __exit__(self, *exc_info) -> None:
        self._pgconn.untrace()

    def queries(self) -> list[str]:
        with self._file:
            self._file.seek(0)
            sent = [line.split("\t") for line in self._file.read().splitlines()]
        return [
            fields[4].strip('" ')[:30]
            for fields in sent
            if fields[1] == "F" and fields[3] == "Query"
        ]


def _traced(client, key: str | None) -> list[str]:
    connection.ensure_connection()
    with _RoundTrips(connection.connection) as trips:
        post(client, key)
    return trips.queries()


@pytest.mark.django_db(transaction=True)
def test_round_trips_on_postgresql(client):
    if connection.vendor != "postgresql" or not hasattr(connection.connection, "pgconn"):
        pytest.skip("libpq's trace: PostgreSQL with psycopg 3")
    post(client, "warm-up")
    post(client, "warm-up")

    handler = _traced(client, None)
    first = _traced(client, "first")
    replay = _traced(client, "first")

    assert [query.split()[0] for query in handler] == ["INSERT"]
    # BEGIN, the claim, the handler's INSERT, the stored response, COMMIT.
    assert [query.split()[0] for query in first] == ["BEGIN", "WITH", "INSERT", "UPDATE", "COMMIT"]
    # A replay waits for BEGIN, the claim and COMMIT only.
    assert [query.split()[0] for query in replay] == ["BEGIN", "WITH", "COMMIT"]
