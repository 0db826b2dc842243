"""Where to cut the rest of a huge virtual directory's names, so that several listings of it
run at once (List Blobs' ``startFrom``, from service version 2026-02-06). Pure.

A directory of a million blobs is one listing, page after page, each page waiting for the
one before it (a marker is only known once its page is read). Knowing one page of it
(``first`` .. ``last``) and the end of the range (``hi``), :func:`cut_points` proposes names
in between: cut there, and each piece is listed by itself, from its cut (``startFrom``) to
the next. Nothing is known of the names not yet read, so the cuts are guesses from the ones
read: at each position from where the page's names differ back to the directory's own
prefix, the characters after the page's last one in the alphabet the page shows there
(digits, hex digits, letters; printable ASCII otherwise). ``sample-00004999`` then gives cuts at
``sample-00005`` .. ``sample-00009``, ``sample-0001`` .. ``sample-0009``, ``sample-001`` and
so on: pieces that are empty cost a call each, pieces still too large are cut again (the
listing does that, with its next page). Whatever the guesses, the pieces together are the
whole range, each name in exactly one (:func:`in_piece`), so the listing is complete and
the same as a listing in one go, as long as the service orders names as :func:`order`
does: the listing checks every page against it (:func:`ascending`) and lists the directory
page after page if one is not (a hierarchical-namespace account lists in tree order).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

DIGITS = "0123456789"
LOWER = "abcdefghijklmnopqrstuvwxyz"
UPPER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
PRINTABLE = "".join(chr(c) for c in range(0x21, 0x7F))


def order(name: str) -> bytes:
    """The sort key of a name as the service sorts them: by UTF-16 code unit (as JavaScript,
    and Azure Storage, compare strings), which differs from code point order for characters
    from U+10000 on against those from U+E000 to U+FFFF."""
    return name.encode("utf-16-be", "surrogatepass")


def ascending(names: Sequence[str]) -> bool:
    """Whether ``names`` are strictly ascending in :func:`order` (a page as we expect it)."""
    return all(a < b for a, b in pairwise(order(name) for name in names))


def _common(a: str, b: str) -> int:
    """How many leading characters ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _token_chars(names: Sequence[str], at: int) -> set[str]:
    """The characters of ``names`` from position ``at`` to the end of the token there (a run
    of letters and digits): hex digits show as hex in a token's later characters even where
    its first one does not vary."""
    seen: set[str] = set()
    for name in names:
        for char in name[at:]:
            if not (char.isascii() and char.isalnum()):
                break
            seen.add(char)
    return seen


# Names of the page looked at for the alphabets (evenly spread over it).
SAMPLE = 256
HEX = "0123456789abcdef"
HEX_UPPER = "0123456789ABCDEF"


def alphabet_of(chars: set[str]) -> str:
    """The alphabet names seem to draw from where ``chars`` were seen: hex digits, digits,
    letters of a case, a union of those, or printable ASCII."""
    for alphabet in (DIGITS, HEX, HEX_UPPER):
        if chars <= set(alphabet):
            return alphabet
    classes = [a for a in (DIGITS, LOWER, UPPER) if chars & set(a)]
    if chars <= set("".join(classes)):
        return "".join(sorted("".join(classes)))
    return PRINTABLE


def cut_points(prefix: str, names: Sequence[str], hi: str | None, most: int) -> list[str]:
    """Up to ``most`` names strictly between the page's last name and ``hi`` (None: no end),
    ascending, at which to start listings of the rest of a range whose page held ``names``
    (ascending).

    Names compare as the service orders them (:func:`order`); the cuts all begin with
    ``prefix`` (the directory's), so no piece reaches outside it. At each
    position the cut characters are those after the last name's in the alphabet the page's
    names show there (:func:`alphabet_of`); a position whose character belongs to the
    alphabet of the position after it (the same token: ``0fffe1`` is hex to its start) takes
    that alphabet, since one page rarely shows a token's first character vary.
    """
    if most <= 0 or not names or not names[-1].startswith(prefix):
        return []
    last = names[-1]
    last_key, hi_key = order(last), None if hi is None else order(hi)
    differ = _common(names[0], last)
    sample = names[:: max(1, len(names) // SAMPLE)]
    cuts: list[str] = []
    alphabet = ""
    # From the position where the page's names differ back to the prefix: the finer cuts
    # (the likeliest to hold names) first, the coarser ones while ``most`` allows.
    for at in range(min(differ, len(last) - 1), len(prefix) - 1, -1):
        if last[at] not in alphabet:  # a new token: what the page shows in it from here on
            alphabet = alphabet_of(_token_chars(sample, at) | {last[at]})
        head = last[:at]
        for char in alphabet[alphabet.index(last[at]) + 1 :] if last[at] in alphabet else ():
            cut = head + char
            key = order(cut)
            if key > last_key and (hi_key is None or key < hi_key) and len(cuts) < most:
                cuts.append(cut)
    return sorted(set(cuts), key=order)


def in_piece(name: str, lo: str | None, hi: str | None) -> bool:
    """Whether ``name`` belongs to the piece after cut ``lo`` up to cut ``hi`` (both None at
    the ends): ``lo < name <= hi`` in :func:`order`. A name equal to a cut is the piece's
    before it, which reads on past the cut, so a service that starts at the cut itself or
    just after it gives the same pieces."""
    key = order(name)
    return (lo is None or key > order(lo)) and (hi is None or key <= order(hi))
