"""A bounded HTTP client that retries the way a careful production client does.

Retries reuse the same ``Idempotency-Key`` (that is the whole point of the
header), back off exponentially with full jitter so that a crowd of clients
does not retry in lockstep, honour ``Retry-After``, and draw on a shared retry
budget so that an outage cannot turn into an unbounded retry storm. Every
attempt is recorded, so the suite can count what it sent and what it saw.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import requests

#: Answers a client should retry with the same key: in flight, throttled, or failed.
RETRY_STATUSES = frozenset({409, 425, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class Attempt:
    status: int | None  # None: no HTTP answer (connection error or timeout)
    error: str = ""
    replayed: bool = False
    body: bytes = b""
    retry_after: str = ""


@dataclass
class Call:
    """One logical request (one key, one body) and every attempt made for it."""

    key: str
    path: str
    body: bytes
    headers: Mapping[str, str | bytes]
    #: The effect this call should leave (its item), and the scope it is sent in.
    label: str = ""
    scope: str = ""
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def final(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def succeeded(self) -> bool:
        final = self.final
        return final is not None and final.status is not None and 200 <= final.status < 300


class RetryBudget:
    """Retries allowed: a floor plus a share of first attempts, shared by all threads.

    Real clients cap retries as a fraction of traffic (gRPC's retry
    throttling, the AWS SDKs' retry quota); when the budget is spent a
    call gives up and its key is left for a later sweep.
    """

    def __init__(self, floor: int, ratio: float) -> None:
        self._lock = threading.Lock()
        self.floor = floor
        self.ratio = ratio
        self.first_attempts = 0
        self.retries = 0

    def start(self) -> None:
        with self._lock:
            self.first_attempts += 1

    def spend(self) -> bool:
        with self._lock:
            if self.retries >= self.floor + self.ratio * self.first_attempts:
                return False
            self.retries += 1
            return True


class RetryingClient:
    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 10.0,
        max_attempts: int = 12,
        base_delay: float = 0.05,
        max_delay: float = 2.0,
        deadline: float = 60.0,
        budget: RetryBudget | None = None,
        seed: int = 0,
    ) -> None:
        self.base_url = base_url
        self.timeout = timeout
        self.max_attempts = max_attempts
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.deadline = deadline
        self.budget = budget or RetryBudget(floor=1000, ratio=1.0)
        self._random = random.Random(seed)
        self._random_lock = threading.Lock()
        self._local = threading.local()

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def _jitter(self, ceiling: float) -> float:
        with self._random_lock:
            return self._random.uniform(0, ceiling)

    def send(self, call: Call) -> Call:
        """Send ``call`` until it gets a final answer, runs out of attempts, time or budget."""
        self.budget.start()
        started = time.monotonic()
        for attempt_number in range(self.max_attempts):
            attempt = self.attempt(call)
            call.attempts.append(attempt)
            if attempt.status is not None and attempt.status not in RETRY_STATUSES:
                return call
            if attempt_number + 1 == self.max_attempts or not self.budget.spend():
                return call
            # Full jitter (AWS architecture blog): uniform over the exponential window.
            delay = self._jitter(min(self.max_delay, self.base_delay * 2**attempt_number))
            retry_after = self._retry_after(attempt)
            if retry_after is not None:
                delay = max(delay, min(retry_after, self.max_delay) + self._jitter(0.2))
            if time.monotonic() - started + delay > self.deadline:
                return call
            time.sleep(delay)
        return call

    def attempt(self, call: Call) -> Attempt:
        """One try, no retry: an HTTP answer, or the client-side error that replaced it."""
        try:
            response = self._session().post(
                self.base_url + call.path,
                data=call.body,
                headers=dict(call.headers),
                timeout=self.timeout,
            )
        except requests.RequestException as exc:
            # A worker killed mid-request, a refused connection, or our own timeout.
            self._local.session = None
            return Attempt(status=None, error=type(exc).__name__)
        return Attempt(
            status=response.status_code,
            replayed=response.headers.get("Idempotent-Replayed") == "true",
            body=response.content,
            retry_after=response.headers.get("Retry-After", ""),
        )

    @staticmethod
    def _retry_after(attempt: Attempt) -> float | None:
        if attempt.retry_after.isdigit():
            return float(attempt.retry_after)
        return None

    def send_all(self, calls: Iterable[Call], threads: int) -> list[Call]:
        """Send every call from a pool of ``threads`` concurrent clients, in order."""
        with ThreadPoolExecutor(max_workers=threads) as pool:
            return list(pool.map(self.send, calls))


def tally(calls: Iterable[Call]) -> Counter[str]:
    """Attempts by outcome: the status code, or the client-side error's name."""
    outcomes: Counter[str] = Counter()
    for call in calls:
        for attempt in call.attempts:
            outcomes[str(attempt.status) if attempt.status is not None else attempt.error] += 1
    return outcomes
