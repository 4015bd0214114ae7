"""Which peer packages are installed, so settings, URLs and tables include only those.

The peers live in the bench virtualenv only; the project's own test
environment imports this module without them.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.util import find_spec


@dataclass(frozen=True)
class Peer:
    #: The distribution name on PyPI, as the tables show it.
    name: str
    #: Its import package, looked up to decide whether it is installed.
    module: str
    #: The bench variant (URL path and ``BenchOrder.variant``) that uses it.
    variant: str
    #: Whether its view is a DRF ``APIView`` (compared to the DRF baseline).
    drf: bool


ALL = (
    Peer("django-idempotency-key", "idempotency_key", "dik", drf=False),
    Peer("drf-idempotency", "drf_idempotency", "drfi", drf=True),
    Peer(
        "djangorestframework-idempotency-key",
        "rest_framework_idempotency_key",
        "drfik",
        drf=True,
    ),
)


def installed() -> list[Peer]:
    return [peer for peer in ALL if find_spec(peer.module) is not None]


def is_installed(variant: str) -> bool:
    return any(peer.variant == variant for peer in installed())
