"""A guided tour of the example shop over real HTTP.

Run it while ``python3 dev.py serve`` is up (``python3 dev.py walkthrough``).
Each step prints what it sent and what came back. The payment step starts a
gunicorn of its own on port 8001, against the same database, so that it can
kill a worker in the middle of a payment without touching your server; the
receipt step starts a Celery worker of its own (the broker is
``CELERY_BROKER_URL``), which dies in the middle of a task.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from django_idempotency.info import IdempotencyInfo

ROOT = Path(__file__).resolve().parent.parent
DEMO_TOKEN = "demo" + "0" * 36

#: The steps in the order they run: each is numbered by its place here, and
#: its title is formatted with the run id. docs/example.rst is tested
#: against this list.
STEPS = {
    "order": "POST /orders/ with Idempotency-Key: order-{run}",
    "retry": "The same request again (a retry)",
    "changed": "The same key with a different body",
    "async": (
        "POST /async-orders/ (an async view) with Idempotency-Key: async-order-{run}, then a retry"
    ),
    "bookings": (
        "20 concurrent POST /api/bookings/ with Idempotency-Key: booking-{run} (DRF, token auth)"
    ),
    "payment": "A payment whose worker dies after charging, then retried",
    "receipt": "A receipt task whose Celery worker process dies mid-task, then redelivered",
}


class Answer:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self) -> dict:
        return json.loads(self.body)


def call(
    base: str,
    method: str,
    path: str,
    body: dict | None = None,
    key: str | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30,
) -> Answer:
    request = urllib.request.Request(base + path, method=method)
    request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Idempotency-Key", key)
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(request, data, timeout=timeout) as response:
            return Answer(response.status, dict(response.headers), response.read())
    except urllib.error.HTTPError as error:
        return Answer(error.code, dict(error.headers), error.read())


def show(label: str, answer: Answer) -> None:
    replayed = answer.headers.get("Idempotent-Replayed")
    extra = f"  Idempotent-Replayed: {replayed}" if replayed else ""
    retry_after = answer.headers.get("Retry-After")
    extra += f"  Retry-After: {retry_after}" if retry_after else ""
    print(f"  {label:<34} -> {answer.status}{extra}")
    print(f"  {'':<34}    {answer.body.decode(errors='replace')[:110]}")


def step(name: str, run: str) -> None:
    number = list(STEPS).index(name) + 1
    print(f"\n{number}. {STEPS[name].format(run=run)}")


def orders(base: str, run: str) -> None:
    key = f"order-{run}"
    step("order", run)
    show("first request", call(base, "POST", "/orders/", {"item": "book"}, key))
    step("retry", run)
    show("retry", call(base, "POST", "/orders/", {"item": "book"}, key))
    step("changed", run)
    show("changed body", call(base, "POST", "/orders/", {"item": "lamp"}, key))


def async_orders(base: str, run: str) -> None:
    key = f"async-order-{run}"
    step("async", run)
    show("async first request", call(base, "POST", "/async-orders/", {"item": "mug"}, key))
    show("async retry", call(base, "POST", "/async-orders/", {"item": "mug"}, key))


def bookings(base: str, run: str) -> None:
    key = f"booking-{run}"
    slot = f"table-for-two-{run}"
    auth = {"Authorization": f"Token {DEMO_TOKEN}"}
    step("bookings", run)
    answers: list[Answer] = []
    lock = threading.Lock()
    gate = threading.Barrier(20)

    def send() -> None:
        gate.wait()
        answer = call(base, "POST", "/api/bookings/", {"slot": slot, "guests": 2}, key, auth)
        with lock:
            answers.append(answer)

    threads = [threading.Thread(target=send) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    kinds = Counter(
        "replayed" if a.headers.get("Idempotent-Replayed") else str(a.status) for a in answers
    )
    print(f"  answers: {dict(kinds)}")
    listing = call(base, "GET", "/api/bookings/", headers=auth).json()
    made = [b for b in listing if b["slot"] == slot]
    print(f"  bookings for {slot}: {len(made)}")


def payments(base_dir: Path, run: str, port: int) -> None:
    step("payment", run)
    env = {
        **os.environ,
        "EXAMPLE_ALLOW_CRASH": "1",
        "DJANGO_SETTINGS_MODULE": "example_project.settings",
    }
    gunicorn = Path(sys.executable).with_name("gunicorn")
    server = subprocess.Popen(
        [
            str(gunicorn),
            "example_project.wsgi",
            "--bind",
            f"127.0.0.1:{port}",
            "--workers",
            "1",
            "--log-level",
            "warning",
        ],
        cwd=base_dir,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_until_up(base)
        key = f"payment-{run}"
        body = {"reference": f"invoice-{run}", "amount": 4200}
        crash = {"X-Simulate-Crash": "after-charge"}
        try:
            call(base, "POST", "/payments/", body, key, crash, timeout=10)
            print("  the worker did not die (is EXAMPLE_ALLOW_CRASH honoured?)")
        except (ConnectionError, urllib.error.URLError, OSError) as error:
            print(f"  first attempt: the worker was killed mid-request ({type(error).__name__})")
        _wait_until_up(base)
        show("retry at once (lease still held)", call(base, "POST", "/payments/", body, key))
        lease = float(os.environ.get("EXAMPLE_PAYMENT_LEASE", "5"))
        print(f"  ... waiting {lease:.0f} s for the dead worker's lease to run out")
        time.sleep(lease + 0.5)
        resumed = call(base, "POST", "/payments/", body, key)
        show("retry after the lease", resumed)
        if resumed.status == 201:
            print(
                f"  the retry was attempt {resumed.json()['attempt']}, resumed after its "
                f"checkpoints {resumed.json()['resumed after']}: it did not charge again"
            )
        show("one more retry", call(base, "POST", "/payments/", body, key))
        # The provider only ever saw request.idempotency.derive("charge").
        derived = IdempotencyInfo(key=key, scope="anonymous", fingerprint="").derive("charge")
        charges = call(base, "GET", f"/provider/charges/?key={derived}").json()["charges"]
        print(
            f"  charges at the provider under derive('charge') = {derived[:16]}...: {len(charges)}"
        )
    finally:
        server.terminate()
        server.wait(10)


def receipts(base: str, base_dir: Path, run: str) -> None:
    step("receipt", run)
    broker = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
    if not _broker_up(broker):
        print(f"  skipped: no Celery broker answers at {broker}")
        return
    crash_dir = Path(tempfile.mkdtemp(prefix="walkthrough-"))
    log = crash_dir / "worker.log"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "example_project.settings",
        "EXAMPLE_CRASH_TASKS_ONCE": str(crash_dir),
    }
    celery = Path(sys.executable).with_name("celery")
    with log.open("w") as output:
        worker = subprocess.Popen(
            [
                str(celery),
                "-A",
                "example_project",
                "worker",
                "--pool=prefork",
                "--concurrency=1",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "--loglevel=INFO",
                "-n",
                f"walkthrough-{run}@%h",
            ],
            cwd=base_dir,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_for_log(log, lambda text: " ready." in text, "the worker to start")
        order = call(base, "POST", "/orders/", {"item": f"pen-{run}"}, f"pen-{run}").json()["id"]
        show(
            "POST /receipts/ (queued on commit)",
            call(base, "POST", "/receipts/", {"order": order}, f"receipt-{run}"),
        )
        _wait_for_log(log, lambda text: text.count("] succeeded in") == 1, "the receipt task")
        if "signal 9" in log.read_text():
            print(
                "  the worker process died mid-task, transaction open (signal 9);"
                " the broker redelivered the message"
            )
        show(
            "the same order again, new key",
            call(base, "POST", "/receipts/", {"order": order}, f"receipt-again-{run}"),
        )
        _wait_for_log(log, lambda text: text.count("] succeeded in") == 2, "the second message")
        made = call(base, "GET", f"/receipts/list/?order={order}").json()["receipts"]
        print(f"  receipts for order {order}: {len(made)} (2 messages, the first run killed)")
    finally:
        worker.terminate()
        worker.wait(20)


def _broker_up(url: str) -> bool:
    try:
        import kombu
    except ImportError:
        return False
    try:
        with kombu.Connection(url, connect_timeout=2) as connection:
            connection.ensure_connection(max_retries=1)
        return True
    except Exception:
        return False


def _wait_for_log(log: Path, ready: Callable[[str], bool], what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not ready(log.read_text()):
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what}; worker log:\n{log.read_text()}")
        time.sleep(0.2)


def _wait_until_up(base: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            call(base, "GET", "/provider/charges/", timeout=2)
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"nothing answers on {base}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--crash-port", type=int, default=8001)
    args = parser.parse_args()
    try:
        call(args.base_url, "GET", "/provider/charges/", timeout=5)
    except OSError:
        raise SystemExit(
            f"Start the example first: python3 dev.py serve ({args.base_url})"
        ) from None
    run = uuid.uuid4().hex[:8]
    print(f"Walkthrough against {args.base_url} (run {run})")
    orders(args.base_url, run)
    async_orders(args.base_url, run)
    bookings(args.base_url, run)
    payments(ROOT, run, args.crash_port)
    receipts(args.base_url, ROOT, run)
    print(
        "\nDone: one order per key (sync or async), one booking, one charge and one"
        " receipt, however many requests and messages were sent."
    )


if __name__ == "__main__":
    main()
