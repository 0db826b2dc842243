"""The one configuration object, and the parsing of human-readable sizes.

Pure code: no I/O. The CLI and the Python API both build a :class:`Config`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from azcp_cluster.core.chain import FANOUT_METHODS, MAX_PIECE_OPTION, MIN_PIECE_OPTION
from azcp_cluster.core.errors import UsageError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

_UNITS = {
    "": 1,
    "b": 1,
    "k": KiB,
    "kb": KiB,
    "kib": KiB,
    "m": MiB,
    "mb": MiB,
    "mib": MiB,
    "g": GiB,
    "gb": GiB,
    "gib": GiB,
    "t": TiB,
    "tb": TiB,
    "tib": TiB,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

COMPARE_MODES = ("none", "size", "etag", "md5")
# --verify MODE: "disk" reads every copy back from disk after the fsync and hashes it,
# "stream" hashes the bytes as they stream through each rank. Config.verify is "" (off) or one of these.
VERIFY_MODES = ("disk", "stream")
# --lock: "wait" for another run on the same DEST to finish (up to --lock-timeout), "fail" at once (exit 9).
LOCK_MODES = ("wait", "fail")
# --progress: the bar on a terminal, status lines elsewhere (auto); either; nothing.
PROGRESS_MODES = ("auto", "bar", "lines", "none")
# -q, the default, -v: what reaches the terminal (run/console.py decides what each shows).
VERBOSITY_LEVELS = ("quiet", "normal", "verbose")
# --rails: bind each local rank to one of the node's fabric devices before MPI starts (run/rails.py), or not.
RAIL_MODES = ("auto", "off")

# The range of every numeric option, checked by Config.validate (the CLI and the API alike).
# Below these minimums a run makes absurdly many requests or MPI calls (64 KiB in 1-byte
# GETs takes a minute); above the maximums a buffer cannot be allocated, or a number
# overflows a float or a timer further down.
MIN_BLOCK_SIZE = 64 * KiB
MAX_BLOCK_SIZE = 1 * GiB
MIN_BCAST_CHUNK = 64 * KiB
CHAIN_CHUNK = 16 * MiB  # the default slot of a chain (--fanout auto, chain, ring)
IBCAST_CHUNK = 64 * MiB  # ... and of MPI's broadcast (--fanout ibcast)
MAX_BCAST_CHUNK = 16 * GiB
MIN_SHARD_SIZE = 64 * KiB
MAX_CONCURRENCY = 4096
MAX_BCAST_PIPELINE = 256
MAX_BCAST_WRITERS = 64
MAX_RETRIES_LIMIT = 100
MAX_DOWNLOAD_WORKERS = 64  # download worker processes per rank
MAX_READ_TIMEOUT = 86400.0  # seconds (a day); also the bound of the API's connect_timeout
# Every timeout: shorter than the download watchdog's tick (0.1 s) would abandon every body
# at its first pause (and a lock wait that short is no wait).
MIN_TIMEOUT = 0.1
# A rank's pulse comes every quarter of --peer-timeout: shorter than a second would name a rank
# that the scheduler merely left waiting on a loaded node.
MIN_PEER_TIMEOUT = 1.0
MAX_BANDWIDTH_LIMIT = 10**15  # bytes per second (8 Pb/s)
# Below this a cap paces a 16 MiB ranged GET over hours: a typo, not a setting.
MIN_BANDWIDTH = 1024  # bytes per second
_RATE_LIMIT_TEXT = "10**15 bytes per second (8000Tbps)"
MAX_LOCK_TIMEOUT = 7 * 86400.0  # seconds (a week)
# A number shown in a message is cut to this many characters (a value may have thousands of digits).
_SHOWN_CHARS = 40


def shown(value: object) -> str:
    """``value`` for a one-line message: its repr for strings, cut short when it is very long."""
    if isinstance(value, int) and value.bit_length() > 4 * _SHOWN_CHARS:  # str() refuses over 4300 digits
        return f"a number of about {int(value.bit_length() * 0.30103) + 1} digits"
    text = repr(value) if isinstance(value, str) else str(value)
    if len(text) <= _SHOWN_CHARS:
        return text
    return f"{text[: _SHOWN_CHARS - 10]}... ({len(text)} characters)"


def _bytes_shown(n: int) -> str:
    """A byte count for a message: ``1 bytes``, or shown() for one too long to print."""
    text = shown(n)
    return f"{text} bytes" if text.lstrip("-").isdigit() else text


# --auth: "auto" tries them in the documented order; any other forces that one.
AUTH_METHODS = (
    "auto",
    "sas",
    "connection-string",
    "key",
    "sas-token",
    "workload-identity",
    "managed-identity",
    "azure-cli",
    "anonymous",
)

UNITS = (
    "Units: bytes are binary, in sizes and rates alike (64M = 64MB = 64MiB = 64 x 2**20 bytes; "
    "3GB/s = 3GiB/s); bits are decimal, as networks count them (25Gbps = 25Gb/s = 25 x 10**9 bits/s)."
)
# One unit convention (UNITS, stated in --help and the README): bytes are binary, K, M, G, T
# with or without B or iB (MB = MiB = 2**20), in sizes and in rates alike; bits (a lowercase b:
# Gbps, Gb/s) are decimal, as networks count them. A plain number is bytes (per second).
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*?)(?:/s|ps)?\s*$")
_RATE_UNITS: dict[str, Fraction | int] = {
    "": 1,
    "B": 1,
    "KB": KiB,
    "MB": MiB,
    "GB": GiB,
    "TB": TiB,
    "KiB": KiB,
    "MiB": MiB,
    "GiB": GiB,
    "TiB": TiB,
    "b": Fraction(1, 8),
    "Kb": Fraction(10**3, 8),
    "Mb": Fraction(10**6, 8),
    "Gb": Fraction(10**9, 8),
    "Tb": Fraction(10**12, 8),
}


def parse_rate(text: str) -> float:
    """Parse ``25Gbps``, ``25Gb/s``, ``800Mbps``, ``3GiB/s``, ``500MB/s`` or bytes/s into bytes per second.

    ``b`` is bits and ``B`` bytes, so the case of that letter matters; the prefix may be
    written ``k`` or ``K``. Raises :class:`UsageError` on anything else or on zero.
    """
    match = _RATE_RE.match(text)
    if not match:
        raise UsageError(f"invalid rate {shown(text)} (expected e.g. 25Gbps, 800Mb/s, 3GiB/s or bytes per second)")
    number, unit = match.groups()
    if unit[:1] == "k":
        unit = "K" + unit[1:]
    if text.strip().endswith("ps") and unit and unit[-1] == "B":
        raise UsageError(f"invalid rate {shown(text)}: 'ps' means bits per second, write e.g. 25Gbps or 3GB/s")
    factor = _RATE_UNITS.get(unit)
    if factor is None:
        raise UsageError(f"invalid rate unit in {shown(text)} (use bps, Kbps, Mbps, Gbps, B/s, MB/s, MiB/s, GiB/s)")
    try:
        value = Fraction(number) * factor
    except ValueError:  # more digits than int() converts
        raise UsageError(f"rate {shown(text)} has too many digits") from None
    if value > MAX_BANDWIDTH_LIMIT:  # before float(), which overflows past 1e308
        raise UsageError(f"rate {shown(text)} is beyond the supported {_RATE_LIMIT_TEXT}")
    rate = float(value)
    if rate <= 0:  # also a positive rate too small for a float
        raise UsageError(f"rate {shown(text)} must be greater than zero")
    return rate


def parse_size(text: str) -> int:
    """Parse ``64MiB``, ``1GiB``, ``512M``, ``4k`` or plain bytes into a byte count.

    Units are binary (``M`` = ``MiB`` = 2**20), as in the reference tool. Raises
    :class:`UsageError` on anything else, including zero-free negatives.
    """
    match = _SIZE_RE.match(text)
    if not match:
        raise UsageError(f"invalid size {shown(text)} (expected e.g. 64MiB, 1GiB, 512M or a byte count)")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise UsageError(f"invalid size unit in {shown(text)} (use B, KiB, MiB, GiB, TiB)")
    try:
        value = Fraction(number) * factor  # exact: a float loses bytes above 2**53 and overflows to inf
    except ValueError:  # more digits than int() converts
        raise UsageError(f"size {shown(text)} is too large") from None
    if value.denominator != 1:
        raise UsageError(f"size {shown(text)} is not a whole number of bytes")
    return int(value)


def format_bytes(n: float) -> str:
    """Render a byte count for people, e.g. ``1.50 GiB``."""
    for unit, factor in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= factor:
            return f"{n / factor:.2f} {unit}"
    return f"{int(n)} B"


def json_inside_dest(json_real: str, dest_real: str) -> bool:
    """Whether the ``--json`` report's real path is DEST's real path or lies below it.

    Both are absolute real paths (``os.path.realpath``: resolved as far as they exist) of one
    rank, DEST with ``{rank}`` and ``{host}`` expanded. A report inside DEST would be taken
    for a stray file there, or replaced by a listed file of the same name.
    """
    json_norm = "/" + json_real.strip("/")
    dest_norm = "/" + dest_real.strip("/")
    return json_norm == dest_norm or json_norm.startswith(dest_norm.rstrip("/") + "/")


@dataclass(frozen=True)
class Config:
    """Everything one run needs to know; the same object on every rank."""

    source: str
    dest: str
    compare: str = "size"
    concurrency: int = 64
    block_size: int = 16 * MiB
    # Bytes per fan-out slot (one transfer); None: CHAIN_CHUNK, or IBCAST_CHUNK for --fanout
    # ibcast (see chunk).
    bcast_chunk: int | None = None
    bcast_pipeline: int = 4
    bcast_writers: int = 2
    bcast_direct: bool = True
    shard_size: int = 1 * GiB
    max_retries: int = 5
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    dry_run: bool = False
    # A mirror: after a complete copy on every node, each node's DEST loses the files (among
    # those the filters select) that SOURCE no longer has (dest/mirror.py).
    delete: bool = False
    # "" (no verification), or one of VERIFY_MODES: "disk" (read every copy back after the
    # fsync and hash it) or "stream" (hash the bytes as they stream). Truthy: some verification.
    verify: str = ""
    json_path: str | None = None
    # What rank 0 shows while a stage runs: one of PROGRESS_MODES (progress.py): "auto" is the
    # bar on a terminal and status lines elsewhere (a launcher's pipe, a Slurm log).
    progress: str = "auto"
    # What reaches the terminal: one of VERBOSITY_LEVELS (-q, -v); the log file gets every line.
    verbosity: str = "normal"
    # --log-file: every line of the run, and the libraries' log records ({rank}, {host} expanded).
    log_file: str | None = None
    # A local SOURCE: the rank that reads it (default: the lowest rank that sees it).
    source_rank: int | None = None
    # A local SOURCE on a shared filesystem: this many reader ranks on different nodes.
    source_readers: int = 1
    # Download and fan-out at once (each transfer sent as soon as its bytes land); False:
    # one after the other (--no-overlap, for comparison).
    overlap: bool = True
    # Keep what a stopped run left durably in its temporary files (the block journal,
    # journal.py) and move only the rest; False: --no-resume, every file moved whole.
    resume: bool = True
    # How many ranks download (default all), chosen round-robin over the nodes.
    download_ranks: int | None = None
    # Processes under each downloading rank that make its ranged GETs (TLS on every core of a
    # node); None: auto, from the CPUs the rank may use, the ranks on its host and its share.
    download_workers: int | None = None
    # Cluster-wide download cap in bytes per second, split over the downloading ranks.
    max_bandwidth: float | None = None
    # Which credential: "auto" (first match wins) or one of AUTH_METHODS, forced.
    auth: str = "auto"
    # Seconds before a request that sends no bytes is abandoned and retried.
    read_timeout: float = 60.0
    connect_timeout: float = 30.0
    # Another run holding DEST: "wait" for it (at most lock_timeout seconds; None: no limit)
    # or "fail" at once; either way, one that is still there ends the run with exit 9.
    lock: str = "wait"
    lock_timeout: float | None = None
    # Seconds a rank may send no pulse before the rank watching it ends the job (exit 10);
    # 0 turns the watch off (a rank held in a debugger).
    peer_timeout: float = 30.0
    # A SOURCE (prefix, directory, filters) that yields no file: exit 3 unless allowed (then
    # a finished, empty copy with a warning).
    allow_empty: bool = False
    # How the fan-out moves a transfer between the nodes: one of chain.FANOUT_METHODS ("auto":
    # a pipelined chain unless a probe of the fabric finds MPI's broadcast faster), and the
    # chain's piece size (None: from the bytes and the nodes, chain.piece_size).
    fanout: str = "auto"
    fanout_piece: int | None = None
    # Each local rank bound to one fabric NIC before MPI starts ("auto", where nothing binds it) or "off".
    rails: str = "auto"

    def validate(self) -> Config:
        """Check ranges and combinations; raise :class:`UsageError` naming the option.

        The checks run in this order, each concern's in its own (the first broken rule is
        the one reported): the modes, the sizes and counts, the local reader, the download,
        the timeouts, the checks, then SOURCE, DEST and the report's path.
        """
        self._check_modes()
        self._check_sizes()
        self._check_counts()
        self._check_local_reader()
        self._check_download()
        self._check_timeouts()
        self._check_verify_and_lock()
        self._check_paths()
        return self

    def _check_modes(self) -> None:
        """The options that choose a mode are one of their choices; a chain's piece in range."""
        _check_choice("--progress", self.progress, PROGRESS_MODES)
        _check_choice("verbosity", self.verbosity, VERBOSITY_LEVELS)
        _check_choice("--compare", self.compare, COMPARE_MODES)
        _check_choice("--fanout", self.fanout, FANOUT_METHODS)
        if self.fanout_piece is not None and not MIN_PIECE_OPTION <= self.fanout_piece <= MAX_PIECE_OPTION:
            raise UsageError(
                f"--fanout-piece must be between {format_bytes(MIN_PIECE_OPTION)} and "
                f"{format_bytes(MAX_PIECE_OPTION)} (got {_bytes_shown(self.fanout_piece)})"
            )
        _check_choice("--auth", self.auth, AUTH_METHODS)
        _check_choice("--rails", self.rails, RAIL_MODES)

    def _check_sizes(self) -> None:
        """The byte sizes in their ranges (the shard size has no upper bound)."""
        sizes = {
            "--block-size": (self.block_size, MIN_BLOCK_SIZE, MAX_BLOCK_SIZE),
            "--bcast-chunk": (self.chunk, MIN_BCAST_CHUNK, MAX_BCAST_CHUNK),
            "--shard-size": (self.shard_size, MIN_SHARD_SIZE, None),
        }
        for name, (size, low, high) in sizes.items():
            if high is None and size < low:
                raise UsageError(f"{name} must be at least {format_bytes(low)} (got {_bytes_shown(size)})")
            if high is not None and not low <= size <= high:
                raise UsageError(
                    f"{name} must be between {format_bytes(low)} and {format_bytes(high)} (got {_bytes_shown(size)})"
                )

    def _check_counts(self) -> None:
        """The counts (requests, slots, threads, retries) in their ranges."""
        counts = {
            "--concurrency": (self.concurrency, 1, MAX_CONCURRENCY),
            "--bcast-pipeline": (self.bcast_pipeline, 1, MAX_BCAST_PIPELINE),
            "--bcast-writers": (self.bcast_writers, 1, MAX_BCAST_WRITERS),
            "--max-retries": (self.max_retries, 0, MAX_RETRIES_LIMIT),
        }
        for name, (count, low, high) in counts.items():
            if not low <= count <= high:
                raise UsageError(f"{name} must be between {low} and {high} (got {shown(count)})")

    def _check_local_reader(self) -> None:
        """A local SOURCE's readers: one named rank, or a count of them, never both."""
        if self.source_rank is not None and self.source_rank < 0:
            raise UsageError(f"--source-rank must be zero or more (got {shown(self.source_rank)})")
        if self.source_readers < 1:
            raise UsageError(f"--source-readers must be at least 1 (got {shown(self.source_readers)})")
        if self.source_readers > 1 and self.source_rank is not None:
            raise UsageError("--source-rank names one reader; it cannot be combined with --source-readers")

    def _check_download(self) -> None:
        """The download's workers, ranks and bandwidth cap in their ranges (None: auto, all, none)."""
        if self.download_workers is not None and not 1 <= self.download_workers <= MAX_DOWNLOAD_WORKERS:
            raise UsageError(
                f"--download-workers must be auto or between 1 and {MAX_DOWNLOAD_WORKERS} "
                f"(got {shown(self.download_workers)})"
            )
        if self.download_ranks is not None and self.download_ranks < 1:
            raise UsageError(f"--download-ranks must be at least 1 (got {shown(self.download_ranks)})")
        if self.max_bandwidth is not None and not MIN_BANDWIDTH <= self.max_bandwidth <= MAX_BANDWIDTH_LIMIT:
            raise UsageError(  # also nan
                f"--max-bandwidth must be at least {MIN_BANDWIDTH} bytes per second (8Kbps) and at most "
                f"{_RATE_LIMIT_TEXT} (got {shown(self.max_bandwidth)})"
            )

    def _check_timeouts(self) -> None:
        """Every timeout in its range: the peer timeout first (0 turns it off), then the others
        (None: no limit)."""
        timeouts = {
            "--read-timeout": (self.read_timeout, MAX_READ_TIMEOUT),
            "connect_timeout": (self.connect_timeout, MAX_READ_TIMEOUT),
            "--lock-timeout": (self.lock_timeout, MAX_LOCK_TIMEOUT),
        }
        _check_peer_timeout(self.peer_timeout)
        for name, (seconds, longest) in timeouts.items():
            if seconds is not None and not MIN_TIMEOUT <= seconds <= longest:  # also nan and inf
                raise UsageError(
                    f"{name} must be at least {MIN_TIMEOUT:g} and at most {longest:.0f} seconds (got {shown(seconds)})"
                )

    def _check_verify_and_lock(self) -> None:
        """``--verify``: off ("") or one of its modes; ``--lock``: one of its modes. Shown with
        :func:`shown`, since the API may pass anything (a number, a very long string)."""
        if not isinstance(self.verify, str) or (self.verify and self.verify not in VERIFY_MODES):
            raise UsageError(f"--verify must be one of {', '.join(VERIFY_MODES)}, not {shown(self.verify)}")
        if self.lock not in LOCK_MODES:
            raise UsageError(f"--lock must be one of {', '.join(LOCK_MODES)}, not {shown(self.lock)}")

    def _check_paths(self) -> None:
        """The report's path, SOURCE and DEST: none empty, no control character in the last two."""
        if self.json_path is not None and not self.json_path:
            raise UsageError("--json PATH is empty")
        if self.log_file is not None and not self.log_file:
            raise UsageError("--log-file PATH is empty")
        if not self.source:
            raise UsageError("SOURCE is empty")
        if not self.dest:
            raise UsageError("DEST is empty")
        _check_no_control("SOURCE", self.source)
        _check_no_control("DEST", self.dest)

    @property
    def chunk(self) -> int:
        """Bytes per fan-out slot: ``--bcast-chunk``, else by ``--fanout``. A chain pipelines each
        slot in pieces, so a smaller slot costs it nothing on the fabric, while it maps 4x less
        memory at start-up and a streamed slot leaves as soon as fewer bytes have landed; MPI's
        broadcast pays a collective per slot, so it keeps larger ones."""
        if self.bcast_chunk is not None:
            return self.bcast_chunk
        return IBCAST_CHUNK if self.fanout == "ibcast" else CHAIN_CHUNK

    def check_memory(self, available: int, download_pool: int, ranks_here: int = 1) -> None:
        """Refuse settings whose buffers (slots plus ``download_pool``) cannot fit in ``available``
        bytes, shared by the ``ranks_here`` ranks the launcher started on this machine (each has
        its own: with a rank per rail, four ranks that each fit alone could still not fit together)."""
        need = self.bcast_pipeline * self.chunk + download_pool
        ranks_here = max(1, ranks_here)
        if need * ranks_here > available:
            together = ""
            if ranks_here > 1:
                together = f", {ranks_here} ranks on this machine {format_bytes(need * ranks_here)},"
            raise UsageError(
                f"--bcast-pipeline {self.bcast_pipeline} x --bcast-chunk {format_bytes(self.chunk)} plus "
                f"download buffers need {format_bytes(need)} per rank{together} but only {format_bytes(available)} "
                "of memory is available; lower --bcast-chunk, --bcast-pipeline or --concurrency"
            )


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """Refuse a mode option ``name`` whose ``value`` is not one of ``choices``, listing them."""
    if value not in choices:
        raise UsageError(f"{name} must be one of {', '.join(choices)}, not {value!r}")


def _check_no_control(name: str, text: str) -> None:
    """Refuse a control character in SOURCE or DEST, naming it and its place (counted from 1).

    URL parsing drops a tab or a line break without a word (``urlsplit`` strips them), so a
    SOURCE with one pasted in was parsed, and its error worded, as a container nobody typed; a
    DEST would make a directory whose name no one can type. A stray character in a job script
    is the usual cause, a name someone meant hardly ever. The text itself is not shown: a URL
    may hold a SAS.
    """
    for index, char in enumerate(text):
        if char >= " " and char != "\x7f":  # C0 (U+0000 to U+001F) and DEL are control characters
            continue
        raise UsageError(
            f"{name} has a control character (U+{ord(char):04X}, {char!r}) at character {index + 1} of "
            f"{len(text)}; remove it (a stray tab or line break in a job script?)"
        )


def _check_peer_timeout(seconds: object) -> None:
    """``--peer-timeout``: 0 (off), or a number of seconds in range (also refuses nan and inf)."""
    if not isinstance(seconds, int | float) or (seconds != 0 and not MIN_PEER_TIMEOUT <= seconds <= MAX_READ_TIMEOUT):
        raise UsageError(
            f"--peer-timeout must be 0 (off) or at least {MIN_PEER_TIMEOUT:g} and at most "
            f"{MAX_READ_TIMEOUT:.0f} seconds (got {shown(seconds)})"
        )
