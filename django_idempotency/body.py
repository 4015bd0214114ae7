"""Reading the request body for the fingerprint without taking it from the view.

A request body is a stream that can be read once. Loading it with
``request.body`` would apply ``DATA_UPLOAD_MAX_MEMORY_SIZE`` and turn a
large upload the view streams into a 400, only because a key was sent. So
the body is copied, in memory up to ``FILE_UPLOAD_MAX_MEMORY_SIZE`` and into
a temporary file in ``FILE_UPLOAD_TEMP_DIR`` past it (as Django does for
uploads; with the setting ``None`` or 0, always in memory, as Django's ASGI
handler keeps a body), and the copy becomes the stream the view reads.
``request.body``, ``request.POST``, ``request.read()`` and a framework's
parsers behave, limits and errors included, as they would have without a key.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from io import BytesIO
from tempfile import SpooledTemporaryFile
from typing import IO, Any

from django.conf import settings
from django.core.handlers.wsgi import LimitedStream
from django.http import HttpRequest, HttpResponseBase, UnreadablePostError

from django_idempotency import adapters

CHUNK_SIZE = 64 * 1024


def django_request(request: Any) -> HttpRequest:
    """The Django request under a framework's own request object (its adapter says how)."""
    if isinstance(request, HttpRequest):
        return request
    return adapters.reach(request)[0]


def body_stream(request: HttpRequest) -> IO[bytes] | None:
    """The whole body as a seekable stream at its start, or ``None`` if already consumed.

    ``None``: something read the raw stream before us without keeping it.
    The caller seeks back to 0 once done, for the view.
    """
    if hasattr(request, "_body"):
        # Read before us with request.body: the bytes are kept.
        return BytesIO(request._body)
    if getattr(request, "_read_started", False):
        return None
    stream: Any = getattr(request, "_stream", None)
    if stream is None:
        # A bare HttpRequest built by hand has no body at all.
        return BytesIO()
    # Under ASGI the body already is a spooled temporary file at its start.
    if isinstance(stream, SpooledTemporaryFile):
        # Python 3.10's can seek, but has no seekable().
        if stream.tell() == 0:
            return stream
    else:
        seekable = getattr(stream, "seekable", None)
        if seekable and seekable() and stream.tell() == 0:
            return stream
    max_size = settings.FILE_UPLOAD_MAX_MEMORY_SIZE
    spool: Any
    if type(stream) is LimitedStream and (not max_size or stream.limit <= max_size):
        # In memory, where the spooled file would stay too (it never rolls over to disk
        # with no threshold): Django's own WSGI stream ends at its limit.
        spool = BytesIO()
    else:
        spool = SpooledTemporaryFile(  # noqa: SIM115 (closed with the request)
            max_size=max_size, mode="w+b", dir=settings.FILE_UPLOAD_TEMP_DIR
        )
    try:
        while True:
            try:
                chunk = stream.read(CHUNK_SIZE)
            except OSError as error:
                # What request.read() raises when the client goes away mid-body.
                raise UnreadablePostError(*error.args) from error
            if not chunk:
                break
            spool.write(chunk)
    except BaseException:
        spool.close()
        raise
    spool.seek(0)
    spools: list[IO[bytes]] | None = getattr(request, SPOOLS, None)
    if spools is None:
        setattr(request, SPOOLS, [spool])
    else:
        spools.append(spool)
    # Closed with the request too: an error after the view may replace the response.
    callbacks: list[Callable[[], None]] | None = getattr(request, _ON_CLOSE, None)
    if callbacks is None:
        # _called_on_close, inline: a body is copied once per request.
        callbacks = [request.close]
        setattr(request, _ON_CLOSE, callbacks)
        request.close = partial(_run_all, callbacks)  # type: ignore[method-assign]
    callbacks.append(spool.close)
    # Every reader of the body (read(), body, POST, parsers) goes through _stream.
    request._stream = spool
    return spool


def body_size(body: IO[bytes]) -> int:
    """The body's length in bytes, leaving the stream at its start."""
    size = body.seek(0, os.SEEK_END)
    body.seek(0)
    return size


#: Where the copies of its body made so far are listed on Django's request.
SPOOLS = "_idempotency_spools"
_ON_CLOSE = "_idempotency_on_close"


def when_closed(request: HttpRequest, callback: Callable[[], None]) -> None:
    """Call ``callback`` when Django closes ``request``, whatever response it sends.

    Also when an error after the view (a request transaction failing to
    commit) replaces the view's response, whose own closers never run.
    Callbacks run in order, each whatever the others did.
    """
    callbacks: list[Callable[[], None]] | None = getattr(request, _ON_CLOSE, None)
    if callbacks is None:
        callbacks = _called_on_close(request)
    callbacks.append(callback)


def _called_on_close(request: HttpRequest) -> list[Callable[[], None]]:
    """A list of callbacks that ``request.close`` calls from now on, after its own work."""
    callbacks: list[Callable[[], None]] = [request.close]
    setattr(request, _ON_CLOSE, callbacks)
    request.close = partial(_run_all, callbacks)  # type: ignore[method-assign]
    return callbacks


def _run_all(callbacks: list[Callable[[], None]]) -> None:
    """Call each callback, also when one before it raised; the last error raised propagates."""
    # One registered while they run is called at the next close only.
    pending = callbacks[:]
    for index, callback in enumerate(pending):
        try:
            callback()
        except BaseException:
            # The rest run while this error is handled, as in a finally.
            _run_all(pending[index + 1 :])
            raise


def read_in_part(request: HttpRequest) -> bool:
    """Whether the view began to read the body without Django keeping it (``read()``).

    What is left is not the body: Django's own readers refuse it without the stream
    (``RawPostDataException``), and the same request sent through again must fail on the
    closed copy rather than run the view on the rest.
    """
    return bool(request.__dict__.get("_read_started")) and "_body" not in request.__dict__


def close_spools_with(
    request: Any, response: HttpResponseBase | None, made_before: int = 0
) -> None:
    """Close the request's copies of its body when ``response`` is closed (now if ``None``).

    Those made before (``made_before``: the length of the list at ``SPOOLS`` then) are left
    to whoever made them, and to the request's close: a view that called this one may still
    read the body from them.
    """
    http_request = request if isinstance(request, HttpRequest) else django_request(request)
    spools: list[IO[bytes]] | None = getattr(http_request, SPOOLS, None)
    if not spools or len(spools) <= made_before:
        return
    spools, kept = spools[made_before:], spools[:made_before]
    setattr(http_request, SPOOLS, kept)
    if response is None:
        for spool in spools:
            spool.close()
    else:
        closers = response._resource_closers  # type: ignore[attr-defined]
        for spool in spools:
            closers.append(spool.close)
