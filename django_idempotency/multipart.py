"""Multipart bodies parsed for the fingerprint, with files digested, never stored.

Django's own parser reads the parts, so the fingerprint sees the fields and
files exactly as ``request.POST``/``request.FILES`` (or DRF's
``request.data``) would, whatever the method; an upload handler of our own
hashes each file as it streams past instead of keeping it.
"""

from __future__ import annotations

import hashlib
from typing import IO, Any

from django.core.exceptions import SuspiciousOperation
from django.core.files.uploadedfile import UploadedFile
from django.core.files.uploadhandler import FileUploadHandler
from django.http import QueryDict
from django.http.multipartparser import MultiPartParser, MultiPartParserError
from django.utils.datastructures import MultiValueDict

from django_idempotency.body import CHUNK_SIZE, body_size


def parse_digested(
    body: IO[bytes], content_type: str, encoding: str | None
) -> tuple[QueryDict, MultiValueDict] | None:
    """Fields and digested files, or ``None`` if Django would refuse to parse the body.

    Django's limits (``DATA_UPLOAD_MAX_NUMBER_FIELDS`` and friends) apply
    as they do to ``request.POST``. ``body`` is left at its start.
    """
    meta = {"CONTENT_TYPE": content_type, "CONTENT_LENGTH": body_size(body)}
    try:
        handlers = [_DigestingUploadHandler()]
        # The stubs want read(None), which file objects accept at run time.
        parser = MultiPartParser(meta, body, handlers, encoding)  # type: ignore[arg-type]
        return parser.parse()
    except (MultiPartParserError, SuspiciousOperation):
        return None
    finally:
        body.seek(0)


class DigestedFile(UploadedFile):
    """An uploaded file reduced to its SHA-256; its bytes were never kept."""

    def __init__(self, name: str | None, content_type: str | None, sha256: str) -> None:
        super().__init__(None, name, content_type)
        self.sha256 = sha256

    def close(self) -> None:
        pass  # nothing was opened


class _DigestingUploadHandler(FileUploadHandler):
    chunk_size = CHUNK_SIZE

    def new_file(self, *args: Any, **kwargs: Any) -> None:
        super().new_file(*args, **kwargs)
        self._digest = hashlib.sha256()

    def receive_data_chunk(self, raw_data: bytes, start: int) -> None:
        self._digest.update(raw_data)

    def file_complete(self, file_size: int) -> DigestedFile:
        return DigestedFile(self.file_name, self.content_type, self._digest.hexdigest())
