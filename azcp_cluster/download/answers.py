"""A ranged GET's answer checked against what was asked and listed, before a byte of its body is
written; and, over plain HTTP, its body against the service's checksum of the range.

Apart from the requests (downloader.py) because it is the part a hostile hop attacks: the
checks are plain functions of the answer's head, tested as a table (tests/test_answers.py).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time

from azcp_cluster.azure.credentials import ANONYMOUS, Credential, denied
from azcp_cluster.azure.netfailure import network_cause
from azcp_cluster.azure.proxies import Proxy, proxy_refused, refusal_message
from azcp_cluster.core.errors import DownloadError
from azcp_cluster.core.model import FileEntry
from azcp_cluster.core.retry import RETRYABLE_STATUS, parse_retry_after
from azcp_cluster.download.http1 import ConnectFailed, TunnelRefused
from azcp_cluster.download.httpwire import Head, ProtocolError, content_range, http_date, same_etag

# What a ranged GET of a blob that is no longer there fails with.
BLOB_DELETED = "the blob was deleted during the copy; rerun to copy what is there now"
# What a ranged GET answered by another version of the blob fails with (a 412 to If-Match, or an
# answer whose ETag or Last-Modified is not the listed one: a hop that dropped the If-Match).
BLOB_CHANGED = (
    "the blob changed during the copy (its ETag no longer matches the listing); rerun to copy the new version"
)
# The largest range the service gives an MD5 of (x-ms-range-get-content-md5). Asked only over
# plain HTTP: over HTTPS, TLS authenticates every byte of the body (a hop cannot change one
# unseen), and the service's MD5 would cost a core's time for nothing (docs/benchmarks.md).
RANGE_MD5_LIMIT = 4 * 1024 * 1024


class Retryable(Exception):
    """A transient fault of one request (the service's, or a hop's): asked again, counted by ``cause``."""

    def __init__(self, cause: str, retry_after: float | None = None, detail: str = "") -> None:
        super().__init__(cause)
        self.cause = cause
        self.retry_after = retry_after
        self.detail = detail  # the cause in words, where the key is terse ("503": "HTTP 503 ServerBusy")


def error_for(
    head: Head, entry: FileEntry, proxy: Proxy | None, deleted: bool, credential: Credential = ANONYMOUS
) -> Exception:
    """What an answer other than 200 or 206 means: a :class:`Retryable` (429, 5xx: with its
    Retry-After), or the run's :class:`DownloadError` (``deleted``: a 412 whose blob is gone;
    ``credential``: the one a 401 or 403 refused)."""
    status = head.status
    code = head.headers.get("x-ms-error-code", head.reason)
    if status in RETRYABLE_STATUS:
        retry_after = parse_retry_after(head.headers.get("retry-after"), time.time())
        return Retryable(str(status), retry_after, f"HTTP {status} {code}".rstrip())
    if status == 412:
        return DownloadError(BLOB_DELETED if deleted else BLOB_CHANGED, path=entry.name)
    if status == 404:
        return DownloadError(
            f"the blob was deleted during the copy (HTTP 404, {code}); rerun to copy what is there now", path=entry.name
        )
    if proxy is not None and proxy_refused(proxy, status, head.headers):
        # Through a proxy, an answer without the service's x-ms-request-id is the proxy's.
        return DownloadError(refusal_message(proxy, "the request", status, head.reason), path=entry.name)
    if status in (401, 403):
        return DownloadError(denied(status, code, credential), path=entry.name)
    return DownloadError(f"unexpected HTTP {status} ({code})", path=entry.name)


def failed_attempt(exc: BaseException, entry: FileEntry) -> tuple[str, float | None, str]:
    """A failed attempt of a ranged GET of ``entry``: its cause (the retry counts' key), the
    server's Retry-After and the cause in words; raises the run's :class:`DownloadError` where
    asking again will not help. A refused connection is retried: the downloads start after the
    endpoint answered the listing, so it is a blip of one of the service's front-ends (the
    failures no retry mends end the listing, the first contact, at once: blobrest.Lister)."""
    if isinstance(exc, Retryable):
        return exc.cause, exc.retry_after, exc.detail
    if isinstance(exc, asyncio.TimeoutError):  # before OSError: it is one on Python 3.11+
        return "timeout", None, ""
    if isinstance(exc, ConnectFailed):  # the endpoint or the proxy cannot be reached: say which
        return exc.cause_name, None, str(exc)
    if isinstance(exc, TunnelRefused):
        if exc.status not in RETRYABLE_STATUS:  # 403, 407: asking again gets the same answer
            raise DownloadError(str(exc), path=entry.name) from None
        return f"proxy {exc.status}", None, str(exc)
    if isinstance(exc, ProtocolError):  # a malformed response (or a proxy's): retried, said
        return type(exc).__name__, None, str(exc)
    # Reset connections, TLS failures: retried, on a new connection. The cause is the class
    # name only (an OSError's text can carry a URL).
    return type(exc).__name__, None, network_cause(exc) or ""


def check_answer(head: Head, start: int, end: int, entry: FileEntry) -> None:
    """A success answer to the ranged GET of bytes ``start`` to ``end - 1`` of ``entry``, checked
    against what was asked and listed before a byte of its body is written.

    A ``200`` (the Range dropped by a hop) or a ``Content-Range`` other than the one asked
    (another range, another total size, none) is never written as the range: retried, as a
    transient fault of a hop. An ``ETag`` or ``Last-Modified`` other than the listed one is
    another version of the blob (a hop that dropped the If-Match): the same error as a 412.
    """
    if head.status != 206:
        raise Retryable(f"HTTP {head.status} for a ranged GET")
    if content_range(head.headers.get("content-range")) != (start, end - 1, entry.size):
        raise Retryable("wrong Content-Range")
    if entry.etag:
        answered = head.headers.get("etag")
        if answered is None:
            raise Retryable("no ETag")  # the version cannot be told: never written
        if not same_etag(entry.etag, answered):
            raise DownloadError(BLOB_CHANGED, path=entry.name)
    modified = http_date(head.headers.get("last-modified"))
    # Last-Modified has whole seconds; the listing may have the same or finer.
    if entry.last_modified and modified is not None and abs(modified - int(entry.last_modified)) >= 1:
        raise DownloadError(BLOB_CHANGED, path=entry.name)


class BodyCheck:
    """A body checked against the service's MD5 of its range (``x-ms-range-get-content-md5``)
    before any of its blocks lands: each block's landing waits for :attr:`gate`, which
    :meth:`finish` opens once the whole body's MD5 matches, or fails (``wrong Content-MD5``:
    the request is asked again, none of its blocks landed)."""

    def __init__(self, expected: str) -> None:
        self.expected = expected
        self.md5 = hashlib.md5(usedforsecurity=False)
        self.gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @classmethod
    def of(cls, head: Head, asked: bool) -> BodyCheck | None:
        """The check of an answer whose range MD5 was ``asked`` for (None: not asked); an answer
        without one is retried (a hop that drops it leaves the body unchecked)."""
        if not asked:
            return None
        expected = head.headers.get("content-md5")
        if not expected:
            raise Retryable("no Content-MD5")
        return cls(expected)

    def finish(self) -> None:
        """Every byte of the body was hashed: open the gate, or fail it."""
        if base64.b64encode(self.md5.digest()).decode("ascii") == self.expected:
            self.gate.set_result(None)
        else:
            self.gate.set_exception(Retryable("wrong Content-MD5"))

    def abandon(self) -> None:
        """The body was not read whole: whoever waits at the gate stops."""
        if not self.gate.done():
            self.gate.cancel()


__all__ = [
    "BLOB_CHANGED",
    "BLOB_DELETED",
    "RANGE_MD5_LIMIT",
    "BodyCheck",
    "Retryable",
    "check_answer",
    "error_for",
    "failed_attempt",
]
