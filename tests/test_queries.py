"""SQL statements a protected request adds, counted by Django's query capture.

Transaction control (BEGIN, COMMIT, SAVEPOINT...) is not counted: the bound
is on the work each request asks of the database.
"""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from tests.clients import post, post_json
from tests.databases import RoundTrips
from tests.views import calls

pytestmark = pytest.mark.django_db

TRANSACTION_CONTROL = ("BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT", "RELEASE", "START TRANSACTION")


def statements(captured: CaptureQueriesContext) -> list[str]:
    return [
        query["sql"]
        for query in captured.captured_queries
        if not query["sql"].lstrip().upper().startswith(TRANSACTION_CONTROL)
    ]


def test_first_request_adds_at_most_two_statements(client):
    post(client, "/orders/", "warm-up")  # connection set-up is not per request
    with CaptureQueriesContext(connection) as unprotected:
        post(client, "/orders/", None)
    with CaptureQueriesContext(connection) as first:
        post(client, "/orders/", "first")

    handler_own = len(statements(unprotected))
    assert handler_own == 1
    assert len(statements(first)) - handler_own <= 2, statements(first)


def replayed(client) -> CaptureQueriesContext:
    """The statements of a retry of a finished request, which must replay without the handler."""
    post(client, "/orders/", "key")
    before = calls.value
    with CaptureQueriesContext(connection) as replay:
        response = post(client, "/orders/", "key")

    assert response["Idempotent-Replayed"] == "true"
    assert calls.value == before
    return replay


def refused(client) -> CaptureQueriesContext:
    """The statements of a request that reuses a finished request's key, which must get 422."""
    post(client, "/orders/", "key")
    with CaptureQueriesContext(connection) as rejected:
        response = post_json(client, "/orders/", {}, "key")

    assert response.status_code == 422
    return rejected


def test_replay_uses_at_most_two_statements_and_never_runs_handler(client):
    replay = replayed(client)

    assert len(statements(replay)) <= 2, statements(replay)


def test_mismatch_uses_at_most_two_statements(client):
    rejected = refused(client)

    assert len(statements(rejected)) <= 2, statements(rejected)


def test_malformed_key_uses_no_statement(client):
    with CaptureQueriesContext(connection) as rejected:
        response = post(client, "/orders/", "bad key")

    assert response.status_code == 400
    assert statements(rejected) == []


#: PostgreSQL looks for a replay before it claims (``store.reads_before_claiming``).
READS_FIRST = connection.vendor == "postgresql"


@pytest.mark.django_db(transaction=True)
class OutsideATransactionTests:
    """As a request runs in production: no transaction of the test's around it.

    On PostgreSQL a retry of finished work is then answered from one
    indexed read, and a new key pays for that read, its claim and its stored
    response; elsewhere the claim answers the retry, as inside a transaction.
    """

    def test_a_first_request_adds_the_claim_the_store_and_on_postgresql_the_lookup(self, client):
        post(client, "/orders/", "warm-up")
        with CaptureQueriesContext(connection) as unprotected:
            post(client, "/orders/", None)
        with CaptureQueriesContext(connection) as first:
            post(client, "/orders/", "first")

        added = len(statements(first)) - len(statements(unprotected))
        assert added == (3 if READS_FIRST else 2), statements(first)
        if READS_FIRST:
            assert statements(first)[0].lstrip().upper().startswith("SELECT"), statements(first)

    def test_a_replay_is_one_read_and_no_transaction_on_postgresql(self, client):
        replay = replayed(client)

        if READS_FIRST:
            assert len(replay.captured_queries) == 1, replay.captured_queries
            assert replay.captured_queries[0]["sql"].lstrip().upper().startswith("SELECT")
        else:
            assert len(statements(replay)) <= 2, statements(replay)

    def test_a_reused_key_is_refused_from_the_same_read_on_postgresql(self, client):
        rejected = refused(client)

        if READS_FIRST:
            assert len(rejected.captured_queries) == 1, rejected.captured_queries
        else:
            assert len(statements(rejected)) <= 2, statements(rejected)


def _traced(client, key: str | None) -> list[str]:
    with RoundTrips(connection.connection) as trips:
        post(client, "/orders/", key)
    return trips.trips()


@pytest.mark.django_db(transaction=True)
def test_round_trips_on_postgresql(client):
    if connection.vendor != "postgresql":
        pytest.skip("libpq's trace: PostgreSQL")
    connection.ensure_connection()
    if not hasattr(connection.connection, "pgconn"):
        pytest.skip("libpq's trace: psycopg 3")
    post(client, "/orders/", "warm-up")
    post(client, "/orders/", "warm-up")

    handler = _traced(client, None)
    first = _traced(client, "first")
    replay = _traced(client, "first")

    assert len(handler) == 1, handler
    # The lookup, BEGIN, the claim, the handler's INSERT, the stored response, COMMIT.
    assert len(first) == 6, first
    # A replay waits for the lookup only: no transaction.
    assert len(replay) == 1, replay
    if "?" not in first + replay:  # statements not prepared: their text is in the trace
        assert first == ["SELECT", "BEGIN", "WITH", "INSERT", "UPDATE", "COMMIT"]
        assert replay == ["SELECT"]
