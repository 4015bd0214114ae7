"""Put a database behind added network latency, for the in-process latency rows.

The first choice is the kernel's ``netem`` queueing discipline in a network
namespace of the benchmark's own; :func:`netem_available` says whether this
kernel has it (many container kernels are built without
``CONFIG_NET_SCH_NETEM``). Where it has not, :class:`DelayProxy` adds the
delay in user space: a TCP relay on 127.0.0.1 that holds every chunk the
server sends for the round-trip delay before passing it on. Both ends stay
on this machine's loopback; the relay runs in a process of its own, so its
work does not share the measured process's interpreter lock.
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NETNS_EXEC = ("ip", "netns", "exec")
NETEM_PROBE = ("tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")


def netem_available() -> tuple[bool, str]:
    """Whether ``tc ... netem`` works here, tried in a throwaway namespace; and why not."""
    namespace = f"idem-probe-{uuid.uuid4().hex[:8]}"
    try:
        added = subprocess.run(["ip", "netns", "add", namespace], capture_output=True, text=True)
    except OSError as exc:
        return False, f"iproute2 is not installed ({exc.strerror})"
    if added.returncode:
        return False, f"cannot create a network namespace: {added.stderr.strip()}"
    try:
        netem = subprocess.run(
            [*NETNS_EXEC, namespace, *NETEM_PROBE],
            capture_output=True,
            text=True,
        )
    finally:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
    if netem.returncode:
        return False, f"tc netem failed: {netem.stderr.strip() or netem.returncode}"
    return True, "tc netem in a network namespace"


class DelayProxy:
    """A relay on 127.0.0.1 adding ``delay_ms`` to every round trip to ``target``."""

    def __init__(self, target_port: int, delay_ms: float) -> None:
        self.target_port = target_port
        self.delay_ms = delay_ms
        self.port = 0
        self._process: subprocess.Popen[str] | None = None

    def __enter__(self) -> DelayProxy:
        self._process = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                *("--target", str(self.target_port)),
                *("--delay-ms", str(self.delay_ms)),
            ],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert self._process.stdout is not None
        self.port = int(self._process.stdout.readline().strip())
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)
            if self._process.stdout is not None:
                self._process.stdout.close()


def _relay(source: socket.socket, sink: socket.socket, delay: float) -> None:
    """Copy ``source`` to ``sink``, each chunk ``delay`` seconds after it arrived."""
    due: queue.Queue[tuple[float, bytes]] = queue.Queue()

    def writer() -> None:
        while True:
            at, chunk = due.get()
            if not chunk:
                break
            pause = at - time.monotonic()
            if pause > 0:
                time.sleep(pause)  # clock_nanosleep: microsecond precision
            try:
                sink.sendall(chunk)
            except OSError:
                break
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    while True:
        try:
            chunk = source.recv(65536)
        except OSError:
            chunk = b""
        due.put((time.monotonic() + delay, chunk))
        if not chunk:
            break
    thread.join()


def _serve(target_port: int, delay_ms: float) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    while True:
        client, _address = listener.accept()
        server = socket.create_connection(("127.0.0.1", target_port))
        for sock in (client, server):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # The whole round trip's delay on the way back: one sleep per trip.
        threading.Thread(target=_relay, args=(client, server, 0.0), daemon=True).start()
        threading.Thread(target=_relay, args=(server, client, delay_ms / 1000), daemon=True).start()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=int, required=True)
    parser.add_argument("--delay-ms", type=float, required=True)
    arguments = parser.parse_args()
    _serve(arguments.target, arguments.delay_ms)
