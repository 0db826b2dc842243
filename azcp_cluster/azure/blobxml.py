"""One List Blobs answer, parsed: its blobs, its virtual directories and the next page's marker.

Apart from the listing's strategy (bloblist.py) and its REST calls (blobrest.py) because it is
the one piece with no I/O: bytes in, :class:`~azcp_cluster.core.naming.RawEntry` objects out,
through the standard library's C parser (``xml.etree.ElementTree``, expat) with no model
objects, as the SDK would build for every blob.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from email.utils import parsedate_to_datetime
from functools import lru_cache
from urllib.parse import unquote

from azcp_cluster.core.naming import RawEntry


def parse_page(data: bytes) -> tuple[list[RawEntry], list[str], str]:
    """One List Blobs response: its blobs, its virtual directories (with a delimiter) and the
    marker of the next page ("" at the end)."""
    root = ET.fromstring(data)
    entries: list[RawEntry] = []
    prefixes: list[str] = []
    blobs = root.find("Blobs")
    for item in blobs if blobs is not None else ():
        if item.tag == "Blob":
            entries.append(_entry(item))
        elif item.tag == "BlobPrefix":
            prefixes.append(_name(item))
    return entries, prefixes, root.findtext("NextMarker") or ""


def _name(item: ET.Element) -> str:
    name = item.find("Name")
    if name is None:
        raise ValueError("a listed item without a name")
    text = name.text or ""
    # Names with characters XML cannot carry come percent-encoded (Encoded="true").
    return unquote(text) if name.get("Encoded") == "true" else text


def _entry(item: ET.Element) -> RawEntry:
    props = item.find("Properties")
    if props is None:
        raise ValueError("a listed blob without properties")
    modified = props.findtext("Last-Modified")
    metadata = item.find("Metadata")
    folder = metadata is not None and (metadata.findtext("hdi_isfolder") or "").lower() == "true"
    return RawEntry(
        name=_name(item),
        size=int(props.findtext("Content-Length") or 0),
        etag=props.findtext("Etag") or "",  # as the SDK's listing gives it (no quotes)
        content_md5=props.findtext("Content-MD5") or "",
        last_modified=_timestamp(modified) if modified else 0.0,
        is_folder=folder,
    )


@lru_cache(maxsize=4096)
def _timestamp(http_date: str) -> float:
    """An HTTP date as seconds; cached, since the blobs of a page share their few dates (a
    third of the parse's time per blob, uncached)."""
    return parsedate_to_datetime(http_date).timestamp()
