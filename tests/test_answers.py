"""A ranged GET's answer checked against what was asked and listed (answers.check_answer,
httpwire.content_range / same_etag / http_date): a table of answers a hop can give."""

from __future__ import annotations

import pytest

from azcp_cluster.core.errors import DownloadError
from azcp_cluster.core.model import FileEntry
from azcp_cluster.download.answers import BLOB_CHANGED, BLOB_DELETED, BodyCheck, Retryable, check_answer, error_for
from azcp_cluster.download.httpwire import Head, content_range, http_date, same_etag

ENTRY = FileEntry("d/a.bin", "a.bin", 10_000, etag="0x8DC0FFEE", last_modified=1_700_000_000.0)
MODIFIED = "Tue, 14 Nov 2023 22:13:20 GMT"  # ENTRY.last_modified


def head(status: int = 206, **headers: str) -> Head:
    base = {"content-range": "bytes 4096-8191/10000", "etag": '"0x8DC0FFEE"', "last-modified": MODIFIED}
    base.update({k.replace("_", "-"): v for k, v in headers.items()})
    return Head("HTTP/1.1", status, "", {k: v for k, v in base.items() if v != "-"})


def test_the_answer_asked_for_passes() -> None:
    check_answer(head(), 4096, 8192, ENTRY)
    check_answer(head(etag="0x8DC0FFEE"), 4096, 8192, ENTRY)  # unquoted, as some hops give it
    check_answer(head(last_modified="-"), 4096, 8192, ENTRY)  # Last-Modified only where present
    check_answer(head(etag="-"), 4096, 8192, ENTRY._replace(etag=""))  # nothing listed to compare


@pytest.mark.parametrize(
    ("answer", "cause"),
    [
        (head(200, content_range="-"), "HTTP 200 for a ranged GET"),  # a hop dropped the Range
        (head(200), "HTTP 200 for a ranged GET"),
        (head(content_range="bytes 8192-12287/10000"), "wrong Content-Range"),  # another range, same length
        (head(content_range="bytes 4096-8191/20000"), "wrong Content-Range"),  # another total size
        (head(content_range="bytes 4096-8191/*"), "wrong Content-Range"),
        (head(content_range="bytes 4096-8190/10000"), "wrong Content-Range"),
        (head(content_range="-"), "wrong Content-Range"),
        (head(content_range="items 4096-8191/10000"), "wrong Content-Range"),
        (head(content_range="bytes 4096-/10000"), "wrong Content-Range"),
        (head(etag="-"), "no ETag"),
    ],
)
def test_another_range_or_no_range_is_retried_never_written(answer: Head, cause: str) -> None:
    with pytest.raises(Retryable) as caught:
        check_answer(answer, 4096, 8192, ENTRY)
    assert caught.value.cause == cause


@pytest.mark.parametrize(
    "answer",
    [
        head(etag='"0x8DC0FFEF"'),
        head(etag='W/"0x8DC0FFEE"'),
        head(last_modified="Tue, 14 Nov 2023 22:13:21 GMT"),
        head(last_modified="Tue, 14 Nov 2023 22:13:19 GMT"),
    ],
)
def test_another_version_is_the_changed_error(answer: Head) -> None:
    with pytest.raises(DownloadError) as caught:
        check_answer(answer, 4096, 8192, ENTRY)
    assert str(caught.value).endswith(BLOB_CHANGED) and caught.value.path == ENTRY.name


def test_a_listing_with_fractions_of_a_second_matches_whole_seconds() -> None:
    check_answer(head(), 4096, 8192, ENTRY._replace(last_modified=1_700_000_000.75))


def test_content_range_parsing() -> None:
    assert content_range("bytes 0-0/1") == (0, 0, 1)
    assert content_range(" bytes 10-20/*") == (10, 20, None)
    assert content_range("Bytes 1-2/3") == (1, 2, 3)
    for bad in (None, "", "bytes", "bytes 1-2", "bytes -2/3", "bytes 1-2/x", "bytes ١-2/3", "bytes 1 -2/3"):
        assert content_range(bad) is None, bad


def test_etags_and_dates() -> None:
    assert same_etag("0x1", '"0x1"') and same_etag('"0x1"', "0x1") and same_etag("0x1", "0x1")
    assert not same_etag("0x1", '"0x2"') and not same_etag("0x1", 'W/"0x1"') and not same_etag("0x1", '"')
    assert http_date(MODIFIED) == 1_700_000_000.0
    assert http_date(None) is None and http_date("") is None and http_date("yesterday") is None


def test_an_http_date_without_a_zone_is_gmt(monkeypatch: pytest.MonkeyPatch) -> None:
    """RFC 5322's "-0000" parses as a naive time, which must not be read in the local zone (the
    listed blob would be taken for "changed" off UTC): found by the review of issue 38."""
    import time

    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        assert http_date("Mon, 01 Jan 2024 00:00:00 -0000") == http_date("Mon, 01 Jan 2024 00:00:00 GMT") == 1704067200
    finally:
        monkeypatch.undo()
        time.tzset()


def test_a_body_lands_only_once_its_range_md5_matched() -> None:
    import asyncio
    import base64
    import hashlib

    async def check(body: bytes, said: str | None, asked: bool = True) -> str:
        headers = {"content-md5": said} if said is not None else {}
        try:
            checker = BodyCheck.of(Head("HTTP/1.1", 206, "", headers), asked)
        except Retryable as exc:
            return exc.cause
        if checker is None:
            return "not asked"
        checker.md5.update(body)
        checker.finish()
        try:
            await checker.gate
        except Retryable as exc:
            return exc.cause
        return "lands"

    right = base64.b64encode(hashlib.md5(b"abc").digest()).decode()
    assert asyncio.run(check(b"abc", right)) == "lands"
    assert asyncio.run(check(b"abd", right)) == "wrong Content-MD5"
    assert asyncio.run(check(b"abc", None)) == "no Content-MD5"  # a hop that drops it leaves nothing checked
    assert asyncio.run(check(b"abc", None, asked=False)) == "not asked"


@pytest.mark.parametrize(
    ("status", "headers", "want"),
    [
        (503, {"retry-after": "2"}, "503"),
        (429, {}, "429"),
        (412, {}, BLOB_CHANGED),
        (404, {"x-ms-error-code": "BlobNotFound"}, "HTTP 404, BlobNotFound"),
        (403, {"x-ms-error-code": "AuthorizationFailure"}, "access denied"),
        (418, {}, "unexpected HTTP 418"),
    ],
)
def test_error_answers(status: int, headers: dict[str, str], want: str) -> None:
    error = error_for(Head("HTTP/1.1", status, "", headers), ENTRY, None, deleted=False)
    assert want in (error.cause if isinstance(error, Retryable) else str(error))
    assert str(error_for(Head("HTTP/1.1", 412, "", {}), ENTRY, None, deleted=True)).endswith(BLOB_DELETED)
