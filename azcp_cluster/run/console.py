"""One line on stderr, as every rank says its warnings and notices."""

from __future__ import annotations

import contextlib
import sys


def say(line: str) -> None:
    """``line`` on stderr in one write, flushed (a closed stderr loses it, nothing more).

    One write: under ``PYTHONUNBUFFERED`` print() writes the text and its newline apart, and
    two ranks' lines on one launcher's stderr then run together on one line."""
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
