"""Reading the request body for the fingerprint without taking it from the view.

A request body is a stream that can be read once. Loading it with
``request.body`` would apply ``DATA_UPLOAD_MAX_MEMORY_SIZE`` and turn a
large upload the view streams into a 400, only because a key was sent. So
the body is copied, as it arrives, into a temporary file that stays in
memory up to ``FILE_UPLOAD_MAX_MEMORY_SIZE`` and moves to
``FILE_UPLOAD_TEMP_DIR`` past it (as Django does for uploads and for ASGI
bodies), and that copy becomes the stream the view reads. Nothing else
about the request changes: ``request.body``, ``request.POST``,
``request.read()`` and DRF's ``request.data`` behave, limits and errors
included, as they would have without a key.

A body the caller says is only ever loaded whole (JSON, forms) is kept only
up to its limit plus one byte: past it, the rest is hashed as it streams
past and dropped, and the view's stream holds what Django itself would read
before refusing the body (``docs/fingerprint.rst``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from io import BytesIO
from tempfile import SpooledTemporaryFile
from typing import IO, Any, cast

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponseBase, UnreadablePostError

CHUNK_SIZE = 64 * 1024


@contextmanager
def readable_body(request: HttpRequest, limit: int | None = None) -> Iterator[IO[bytes] | None]:
    """The whole body as a stream at its start, or ``None`` if already consumed.

    ``None`` means something (a middleware, DRF's parsers) read the raw
    stream before us without keeping it, so only its parsed result is left.
    The stream is seekable, except for a body that had to be read from the
    client and is longer than ``limit``: that one can be read once, and only
    its first ``limit + 1`` bytes are kept for the view, whose reads past
    them raise ``RequestDataTooBig``. On exit the view's stream is back at
    the start of the body.
    """
    if hasattr(request, "_body"):
        # Read before us with request.body: the bytes are kept.
        yield BytesIO(request._body)
        return
    if getattr(request, "_read_started", False):
        yield None
        return
    stream: Any = getattr(request, "_stream", None)
    if stream is None:
        # A bare HttpRequest built by hand has no body at all.
        yield BytesIO()
        return
    if not _rewindable(stream):
        keep = None if limit is None else limit + 1
        spool, past_limit = _spool(stream, keep)
        _spools(request).append(spool)
        if past_limit is not None:
            try:
                # Enough of IO for a reader: read() and a seekable() saying no.
                yield cast(IO[bytes], past_limit)
            finally:
                spool.seek(0)
                request._stream = cast(Any, _KeptPrefix(spool))
            return
        stream = spool
        # Django reads the body through request._stream (read(), body, POST,
        # the multipart parser, DRF's parsers all go through it).
        request._stream = stream
    try:
        yield stream
    finally:
        stream.seek(0)


def body_size(body: IO[bytes]) -> int:
    """The body's length in bytes, leaving the stream at its start."""
    size = body.seek(0, os.SEEK_END)
    body.seek(0)
    return size


_SPOOLS = "_idempotency_spools"


def _spools(request: HttpRequest) -> list[IO[bytes]]:
    spools: list[IO[bytes]] | None = getattr(request, _SPOOLS, None)
    if spools is None:
        spools = []
        setattr(request, _SPOOLS, spools)
    return spools


def close_spools_with(request: Any, response: HttpResponseBase | None) -> None:
    """Close the request's copies of its body when ``response`` is closed (now if ``None``).

    The copy is the view's stream until then; the server closes the
    response once it is sent, as Django closes the request's uploads.
    """
    http_request = getattr(request, "_request", request)  # DRF wraps it
    spools: list[IO[bytes]] = getattr(http_request, _SPOOLS, None) or []
    if not spools:
        return
    setattr(http_request, _SPOOLS, [])
    if response is None:
        for spool in spools:
            spool.close()
    else:
        response._resource_closers.extend(spool.close for spool in spools)  # type: ignore[attr-defined]


def is_seekable(stream: Any) -> bool:
    """Whether ``stream`` can seek.

    Python 3.10's ``SpooledTemporaryFile`` can, but has no ``seekable()``.
    """
    if isinstance(stream, SpooledTemporaryFile):
        return True
    seekable = getattr(stream, "seekable", None)
    return bool(seekable and seekable())


def _rewindable(stream: Any) -> bool:
    # Under ASGI the body already is a spooled temporary file at its start.
    return is_seekable(stream) and stream.tell() == 0


def _spool(stream: Any, keep: int | None) -> tuple[IO[bytes], _PastLimit | None]:
    """Copy the body, or its first ``keep`` bytes and a reader of the whole if it is longer."""
    spool: IO[bytes] = SpooledTemporaryFile(  # noqa: SIM115 (it outlives this function)
        max_size=settings.FILE_UPLOAD_MAX_MEMORY_SIZE,
        mode="w+b",
        dir=settings.FILE_UPLOAD_TEMP_DIR,
    )
    kept = 0
    try:
        while chunk := _read(stream, CHUNK_SIZE):
            if keep is not None and kept + len(chunk) > keep:
                spool.write(chunk[: keep - kept])
                spool.seek(0)
                return spool, _PastLimit(spool, chunk[keep - kept :], stream)
            spool.write(chunk)
            kept += len(chunk)
    except BaseException:
        spool.close()
        raise
    spool.seek(0)
    return spool, None


def _read(stream: Any, size: int) -> bytes:
    try:
        chunk: bytes = stream.read(size)
    except OSError as error:
        # What request.read() raises when the client goes away mid-body.
        raise UnreadablePostError(*error.args) from error
    return chunk


class _PastLimit:
    """The whole body, read once: the kept prefix, then the client's stream, copied nowhere.

    The fingerprint reads it to its end, so the whole body is hashed.
    """

    def __init__(self, prefix: IO[bytes], rest: bytes, stream: Any) -> None:
        self._prefix: IO[bytes] | None = prefix
        self._rest = rest
        self._stream = stream

    def seekable(self) -> bool:
        return False

    def read(self, size: int = -1) -> bytes:
        size = CHUNK_SIZE if size < 0 else size
        if self._prefix is not None:
            if chunk := self._prefix.read(size):
                return chunk
            self._prefix = None
        if self._rest:
            chunk, self._rest = self._rest[:size], self._rest[size:]
            return chunk
        return _read(self._stream, size)


class _KeptPrefix:
    """The view's stream for a body past its limit: what was kept, then ``RequestDataTooBig``.

    Its size is past the limit, so ``request.body`` refuses it as Django
    would (it checks a seekable stream's size); a reader streaming it gets
    the kept bytes and then the same error rather than a truncated body.
    """

    def __init__(self, spool: IO[bytes]) -> None:
        self._spool = spool

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._spool.seek(offset, whence)

    def tell(self) -> int:
        return self._spool.tell()

    def read(self, size: int | None = -1) -> bytes:
        wanted = -1 if size is None else size
        chunk = self._spool.read(wanted)
        if wanted < 0 or len(chunk) < wanted:
            self._too_big()
        return chunk

    def readline(self, size: int | None = -1) -> bytes:
        line = self._spool.readline(-1 if size is None else size)
        if not line.endswith(b"\n") and (size is None or size < 0 or len(line) < size):
            self._too_big()
        return line

    def close(self) -> None:
        self._spool.close()

    @staticmethod
    def _too_big() -> None:
        raise RequestDataTooBig("Request body exceeded settings.DATA_UPLOAD_MAX_MEMORY_SIZE.")
