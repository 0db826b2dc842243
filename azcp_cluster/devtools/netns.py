"""The namespaces, links and directories of the cluster in a box (box.py): made with ``ip``, found by
their tag, and swept once their owner has died.

Every name a box makes starts with its tag: ``azb`` and its owner's pid in six hex digits. A
box whose owner is gone (by its pid and the start time it recorded) is removed by the next box
that starts: its processes killed, its namespaces, links and mounts removed, its directory too.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

PREFIX = "azb"  # every name a box makes starts with it, then the owner's pid in six hex digits


def unavailable() -> str | None:
    """Why a box cannot be built here (a test's skip reason), or None."""
    if os.geteuid() != 0:
        return "needs root to make network namespaces, bridges and qdiscs"
    missing = [tool for tool in ("ip", "tc", "unshare") if not shutil.which(tool)]
    if missing:
        return f"needs {', '.join(missing)} (iproute2, util-linux)"
    return None


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc


def start_time(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (field 22 of /proc/PID/stat), None if it is gone.

    With the pid it names one process: a pid reused by another process has another start time.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[19]


def _tag_of(name: str) -> str | None:
    """The box tag a name starts with (``azb`` and six hex digits), or None."""
    tag = name[: len(PREFIX) + 6]
    digits = tag[len(PREFIX) :]
    if tag.startswith(PREFIX) and len(digits) == 6 and all(ch in "0123456789abcdef" for ch in digits):
        return tag
    return None


def _owner_alive(tag: str) -> bool:
    """Whether the process that made box ``tag`` still runs (by its pid and recorded start time)."""
    pid = int(tag[len(PREFIX) :], 16)
    started = start_time(pid)
    if started is None:
        return False
    owner = Path(tempfile.gettempdir()) / f"azcp-box-{tag}" / "owner"
    try:
        recorded = owner.read_text().split()
    except OSError:
        return True  # no record: the pid alone says it may be alive; leave its things be
    return recorded == [str(pid), started]


def _kill_in(namespace: str) -> None:
    """SIGKILL every process in a network namespace (what a box left running there), and wait for them."""
    for _ in range(50):
        pids = [int(p) for p in run("ip", "netns", "pids", namespace, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _unmount_below(directory: Path) -> None:
    """Unmount whatever is mounted at or below ``directory`` (a tmpfs DEST), deepest first."""
    here = str(directory)
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for mount in sorted((m for m in mounts if m == here or m.startswith(here + "/")), key=len, reverse=True):
        if run("umount", mount, check=False).returncode != 0:
            run("umount", "-l", mount, check=False)


def remove(tag: str) -> None:
    """Remove everything of box ``tag``: its processes, namespaces, links, mounts and directory."""
    namespaces = [line.split()[0] for line in run("ip", "netns", "list", check=False).stdout.splitlines() if line]
    for ns in namespaces:
        if _tag_of(ns) == tag:
            _kill_in(ns)
            run("ip", "netns", "del", ns, check=False)  # takes its ends of the veths, and so the pairs
    for link in _links():
        if _tag_of(link) == tag:
            run("ip", "link", "del", link, check=False)
    directory = Path(tempfile.gettempdir()) / f"azcp-box-{tag}"
    if directory.exists():
        _unmount_below(directory)
        shutil.rmtree(directory, ignore_errors=True)


def _links() -> list[str]:
    """The names of this namespace's network interfaces."""
    return sorted(os.listdir("/sys/class/net"))


def leftovers(tag: str | None = None) -> list[str]:
    """What boxes (or box ``tag``) left behind: namespaces, links and directories (for a test to assert on)."""
    namespaces = [line.split()[0] for line in run("ip", "netns", "list", check=False).stdout.splitlines() if line]
    dirs = [p.name for p in Path(tempfile.gettempdir()).glob("azcp-box-azb*")]
    found = [*namespaces, *_links(), *(d.removeprefix("azcp-box-") for d in dirs)]
    return sorted(n for n in found if _tag_of(n) is not None and (tag is None or _tag_of(n) == tag))


def sweep() -> list[str]:
    """Remove what boxes whose owner has died left behind; returns their tags."""
    tags = {_tag_of(name) for name in leftovers()}
    dead = sorted(t for t in tags if t is not None and not _owner_alive(t))
    for tag in dead:
        remove(tag)
    return dead


def free_subnets(count: int, seed: int) -> list[ipaddress.IPv4Network]:
    """``count`` /24 networks in 10.232.0.0/14 that no interface of this namespace uses (two boxes at once differ)."""
    used = run("ip", "-o", "-4", "addr", "show", check=False).stdout
    taken = {ipaddress.IPv4Interface(word).network for word in used.split() if "/" in word and word[0].isdigit()}
    space = list(ipaddress.IPv4Network("10.232.0.0/14").subnets(new_prefix=24))
    found: list[ipaddress.IPv4Network] = []
    for i in range(len(space)):
        net = space[(seed + i) % len(space)]
        if not any(net.overlaps(t) for t in taken):
            found.append(net)
            if len(found) == count:
                return found
    raise RuntimeError("no free /24 left in 10.232.0.0/14")


def netem_available() -> bool:
    """Whether this kernel has netem, the qdisc that delays packets (some kernels are built without it)."""
    probe = f"{PREFIX}probe{os.getpid()}"
    run("ip", "netns", "add", probe)
    try:
        return run("tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
                    check=False).returncode == 0  # fmt: skip
    finally:
        run("ip", "netns", "del", probe, check=False)
