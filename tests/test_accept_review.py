"""The problem page's choice from headers HTTP does not allow, or quotes a comma in."""

from __future__ import annotations

import pytest
from django.test import RequestFactory

from django_idempotency.pages import prefers_html


@pytest.mark.parametrize(
    "accept",
    [
        # A quality above 1 is not a qvalue (RFC 9110, 12.4.2): it ranks nothing above q=1.
        "application/json, text/html;q=1.0001",
        "application/json, text/html;q=2",
        "application/json, text/html;q=inf",
        # A comma inside a quoted parameter value does not end the range.
        'text/html;foo="a,b";q=0.1, application/json;q=0.5',
    ],
)
def test_json_is_kept(accept: str) -> None:
    request = RequestFactory().post("/", HTTP_ACCEPT=accept)

    assert prefers_html(request) is False
