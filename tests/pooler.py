"""A stand-in for a connection pooler in front of a database server, on a port of its own.

It forwards each client's connection to the server, statement for
statement, but tells the client the session id it was told to (PostgreSQL's
process id, MariaDB/MySQL's connection id), as a pooler does: PgBouncer
makes one up, and a pooler that passes on the id of a server connection
passes on one that, in transaction pooling, runs other clients'
transactions too. Only what a client is told changes; the server runs
everything as usual. Clients are told that TLS is not offered.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

# The special startup codes (PostgreSQL protocol): TLS and GSSAPI encryption requests.
_ENCRYPTION_REQUESTS = {80877103, 80877104}
# MariaDB/MySQL's capability flag for TLS, in the handshake's lower flags.
_CLIENT_SSL = 0x0800


def server_address(settings: dict[str, Any], vendor: str) -> tuple[str, int] | str | None:
    """Where a database's Django settings reach its server: ``(host, port)``, or a socket's path.

    A ``HOST`` that starts with ``/`` is a Unix socket: for PostgreSQL the
    directory libpq finds the port's socket in, for MariaDB/MySQL the socket
    itself, as Django's backends read it. ``None`` without a ``HOST``, where
    the client library picks a default of its own.
    """
    host = settings["HOST"]
    port = int(settings["PORT"] or (5432 if vendor == "postgresql" else 3306))
    if not host:
        return None
    if not host.startswith("/"):
        return (host, port)
    return os.path.join(host, f".s.PGSQL.{port}") if vendor == "postgresql" else host


class Pooler:
    """Listen on 127.0.0.1 (``port``) and forward to ``server``, telling clients ``session``.

    ``server`` is a TCP address or a Unix socket's path (:func:`server_address`);
    ``vendor`` is Django's: ``"postgresql"`` or ``"mysql"``.
    """

    def __init__(self, server: tuple[str, int] | str, session: int, vendor: str) -> None:
        self.server = server
        self.session = session
        self.vendor = vendor
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def __enter__(self) -> Pooler:
        self._start(self._accept)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self.listener.close()
        with self.lock:
            for sock in self.sockets:
                _shut(sock)
            threads = list(self.threads)
        for thread in threads:
            thread.join(10)
            assert not thread.is_alive(), f"{thread.name} did not end"

    def _start(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name="pooler", daemon=True)
        with self.lock:
            self.threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _address = self.listener.accept()
            except OSError:
                return  # the listener was shut
            with self.lock:
                self.sockets.append(client)
            serve = self._serve if self.vendor == "postgresql" else self._serve_mysql
            self._start(serve, client)

    def _connect(self) -> socket.socket:
        if isinstance(self.server, str):
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                server.connect(self.server)
            except OSError:
                server.close()
                raise
        else:
            server = socket.create_connection(self.server)
        with self.lock:
            self.sockets.append(server)
        return server

    def _serve_mysql(self, client: socket.socket) -> None:
        """The server speaks first: its handshake carries the connection id and what it offers."""
        server = self._connect()
        stream = _Stream(server)
        head = stream.read(4)
        payload = stream.read(int.from_bytes(head[:3], "little")) if head else None
        if head is None or payload is None:
            _shut(client)
            _shut(server)
            return
        # Protocol version, server version (NUL-ended), connection id, 8 + 1
        # bytes of scramble, then the lower capability flags, CLIENT_SSL among them.
        at = payload.index(b"\0", 1) + 1
        flags = struct.unpack_from("<H", payload, at + 13)[0] & ~_CLIENT_SSL
        handshake = bytearray(payload)
        struct.pack_into("<I", handshake, at, self.session)
        struct.pack_into("<H", handshake, at + 13, flags)
        try:
            client.sendall(head + bytes(handshake) + stream.rest)
        except OSError:
            _shut(server)
            return
        self._start(_pipe, client, server)
        _pipe(server, client)

    def _serve(self, client: socket.socket) -> None:
        startup = _startup(client)
        if startup is None:
            _shut(client)
            return
        server = self._connect()
        server.sendall(startup)
        self._start(_pipe, client, server)
        # Up to the first ReadyForQuery the server's messages are read one by
        # one, so that the client's BackendKeyData names the pid chosen here.
        stream = _Stream(server)
        while True:
            kind, body = stream.message()
            if kind is None:
                _shut(client)
                return
            if kind == b"K":
                body = struct.pack("!i", self.session) + body[4:]
            try:
                client.sendall(kind + struct.pack("!i", len(body) + 4) + body)
            except OSError:
                _shut(server)
                return
            if kind == b"Z":
                break
        try:
            client.sendall(stream.rest)
        except OSError:
            _shut(server)
            return
        _pipe(server, client)


def _startup(client: socket.socket) -> bytes | None:
    """The client's startup message, once it has been told that no encryption is offered."""
    stream = _Stream(client)
    while True:
        head = stream.read(8)
        if head is None:
            return None
        length, code = struct.unpack("!ii", head)
        body = stream.read(length - 8)
        if body is None:
            return None
        if code not in _ENCRYPTION_REQUESTS:
            return head + body + stream.rest
        client.sendall(b"N")


class _Stream:
    """Reads exact byte counts off a socket; ``rest`` is what was read beyond them."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.rest = b""

    def read(self, count: int) -> bytes | None:
        while len(self.rest) < count:
            try:
                chunk = self.sock.recv(65536)
            except OSError:
                return None
            if not chunk:
                return None
            self.rest += chunk
        data, self.rest = self.rest[:count], self.rest[count:]
        return data

    def message(self) -> tuple[bytes | None, bytes]:
        head = self.read(5)
        if head is None:
            return None, b""
        body = self.read(struct.unpack("!i", head[1:])[0] - 4)
        if body is None:
            return None, b""
        return head[:1], body


def _pipe(source: socket.socket, target: socket.socket) -> None:
    """Copy ``source`` to ``target`` until either closes; then close both."""
    try:
        while chunk := source.recv(65536):
            target.sendall(chunk)
    except OSError:
        pass
    _shut(source)
    _shut(target)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already shut, by the other side or by us
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
