"""A cluster in a box: N hosts on this machine, each with its own hostname and two shaped NICs.

Each host is a network namespace with two interfaces: ``front`` on the frontend bridge, where
the storage emulator listens as "Azure" (in a namespace of its own, so the bytes it serves
are counted on its link), and ``fabric`` on the fabric bridge, which MPI is told to use. With
``rails`` R > 1 a host has R fabric NICs instead, ``ib0`` to ``ibR-1``, each on a bridge (a rail)
of its own with its own subnet, each shaped like the one fabric NIC: launch R ranks per host
and bind local rank i to ``ib<i>`` before MPI starts (the tool's ``--rails auto`` does; for
other programs the box's ``rail`` wrapper, a site's way). Every
veth is shaped on both ends (``tbf``: the bridge side shapes what the host receives, the
namespace side what it sends, so each NIC is full duplex at its rate), and ``netem`` delays
what leaves a host (host-to-host round trip: twice the delay). A cluster is bound by these
links, not by the client's CPU; at a few hundred Mbit/s the two cores of a small machine are
not what binds either, so the figures measured here can be held against physical bounds.

MPI ranks run as hosts through an ssh stand-in: it runs the launcher's command in the
namespace that owns the host's address, inside ``unshare --uts`` with the namespace's name as
hostname. MPICH (hydra, ``-launcher ssh``) uses ofi/tcp on the fabric; Open MPI (PRRTE,
``plm_ssh_agent``) the TCP BTL on the fabric, its launcher's own connections on the frontend.
Each host's DEST is its own directory (``{host}``): hosts share this machine's boot id, so only
DEST's device and inode tell their copies apart, as on real nodes they would be told apart by
the machine.

Everything made carries the box's tag (``azb`` and its owner's pid in hex): namespaces, links,
bridges and its directory. :meth:`Box.close` removes it all, killing what still runs in the
namespaces; a box whose owner died (a crashed test, a killed benchmark) is swept by the next
box that starts. Needs root, iproute2 (``ip``, ``tc``) and ``unshare``: :func:`unavailable`
says why not, for a test to skip with.

Nothing here is used by the tool at run time.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.netns import PREFIX, leftovers, netem_available, sweep, unavailable
from azcp_cluster.devtools.netns import free_subnets as _free_subnets
from azcp_cluster.devtools.netns import remove as _remove
from azcp_cluster.devtools.netns import run as _run
from azcp_cluster.devtools.netns import start_time as _start_time

__all__ = ["Box", "Host", "Link", "flavour_of", "leftovers", "netem_available", "openmpi_env", "sweep", "unavailable"]

FRONT = "front"  # each host's frontend NIC (to "Azure"), as named inside its namespace
FABRIC = "fabric"  # each host's fabric NIC (MPI), with one rail
RAIL = "ib"  # with several rails: each host's fabric NICs ib0, ib1, ...
EMULATOR = "az"  # the emulator's namespace: TAG + this
OPENMPI_ENV = azurite.REPO_ROOT / "scripts" / "openmpi.env"

NSEXEC = """#!/bin/sh
# ssh stand-in for mpiexec: [ssh options] HOST COMMAND... runs COMMAND in HOST's network
# namespace, in a UTS namespace of its own whose hostname is the namespace's name.
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
host="$1"; shift
ns=$(cat "$(dirname "$0")/hosts/$host")
exec ip netns exec "$ns" unshare --uts /bin/sh -c "hostname $ns; $*"
"""

# A site's binding wrapper, for programs that do not bind themselves (the raw patterns): local
# rank i (hydra's, Open MPI's, srun's, PMIx's variable) on rail i mod R, for libfabric tcp and
# Open MPI's tcp BTL. RAILS is replaced by the box's R.
RAIL_WRAPPER = """#!/bin/sh
local_rank=${MPI_LOCALRANKID:-${OMPI_COMM_WORLD_LOCAL_RANK:-${SLURM_LOCALID:-${PMIX_LOCAL_RANK:-0}}}}
nic=ib$((local_rank % RAILS))
export FI_TCP_IFACE=$nic OMPI_MCA_btl_tcp_if_include=$nic
exec "$@"
"""


@dataclass(frozen=True)
class Link:
    """One network's NICs: rate in Mbit/s (None: unshaped) and the delay a packet leaving a host waits."""

    mbit: float | None = None
    delay_ms: float = 0.0

    @property
    def bytes_per_s(self) -> float | None:
        """The rate in bytes per second (None: unshaped)."""
        return None if self.mbit is None else self.mbit * 1e6 / 8


@dataclass(frozen=True)
class Host:
    """One host of the box: its namespace (also its hostname) and its addresses (``fabric``: rail 0's)."""

    name: str
    front: str
    fabric: str
    rails: tuple[str, ...] = ()  # its address on each rail, rail 0's first (``fabric``)


def _shape(dev: str, link: Link, namespace: str | None = None, delay: bool = False) -> None:
    """Shape one end of a veth: tbf at the link's rate, and (``delay``) netem below it."""
    tc = ["tc", *(("-n", namespace) if namespace else ()), "qdisc"]
    parent = ["root"]
    if link.mbit is not None:
        rate = link.mbit * 1e6 / 8
        # The bucket holds at least a jiffy's worth at the rate (tbf's rule) and 256 KiB, so
        # TSO's 64 KiB segments pass; 50 ms of queue before it drops.
        burst = max(256 * 1024, int(rate / 100))
        _run(*tc, "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", f"{link.mbit}mbit",
             "burst", str(burst), "latency", "50ms")  # fmt: skip
        parent = ["parent", "1:1"]
    if delay and link.delay_ms > 0:
        _run(*tc, "add", "dev", dev, *parent, "handle", "10:", "netem", "delay", f"{link.delay_ms}ms",
             "limit", "100000")  # fmt: skip


class Box:
    """N hosts with a frontend and a fabric NIC each; use as a context manager (see the module).

    ``front``, ``fabric``: every host's NIC on that network; ``azure``: the emulator's own NIC
    (the storage account's egress limit; unshaped by default). ``tmpfs_dest``: the hosts'
    DESTs on a tmpfs of the box's own (the disk taken out, to show whether it binds).
    ``rails``: fabric NICs per host, each on its own bridge and subnet, each shaped as ``fabric``.
    """

    def __init__(
        self,
        hosts: int,
        *,
        front: Link = Link(),
        fabric: Link = Link(),
        azure: Link = Link(),
        tmpfs_dest: bool = False,
        rails: int = 1,
    ) -> None:
        if rails < 1:
            raise ValueError(f"rails must be 1 or more, not {rails}")
        self.hosts_count, self.rails = hosts, rails
        self.front, self.fabric, self.azure = front, fabric, azure
        self.tmpfs_dest = tmpfs_dest
        self.tag = ""  # PREFIX and the owner's pid, once started
        self.dir = Path()  # the box's directory (the ssh stand-in, the host map, DEST)
        self.hosts: list[Host] = []
        self.front_net = ipaddress.IPv4Network("10.232.0.0/24")  # chosen free at start
        self.rail_nets = [ipaddress.IPv4Network(f"10.232.{1 + r}.0/24") for r in range(rails)]  # chosen free at start
        self._made = False

    def __enter__(self) -> Box:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- names ---------------------------------------------------------------------------

    @property
    def emulator_ns(self) -> str:
        """The namespace the emulator runs in."""
        return self.tag + EMULATOR

    @property
    def emulator_address(self) -> str:
        """The emulator's address on the frontend network."""
        return str(self.front_net.network_address + 2)

    @property
    def front_bridge(self) -> str:
        """The frontend bridge (its address is this namespace's way onto the network)."""
        return self.tag + "fe"

    @property
    def fabric_net(self) -> ipaddress.IPv4Network:
        """The fabric's subnet (rail 0's)."""
        return self.rail_nets[0]

    @property
    def fabric_bridge(self) -> str:
        """The fabric bridge (rail 0's; mpiexec's own address for its hosts is on it)."""
        return self.rail_bridge(0)

    def rail_bridge(self, rail: int) -> str:
        """The bridge of fabric rail ``rail`` (0: the fabric bridge)."""
        return self.tag + ("fab" if rail == 0 else f"fab{rail}")

    def rail_nic(self, rail: int) -> str:
        """A host's fabric NIC on rail ``rail``, as named inside its namespace: ``fabric``, or ``ib<rail>``."""
        return FABRIC if self.rails == 1 else f"{RAIL}{rail}"

    def _rail_veth(self, host: int, rail: int) -> str:
        """The bridge's end of host ``host``'s veth on rail ``rail`` (rail 0: as with one rail)."""
        return f"{self.tag}b{host}" + ("" if rail == 0 else f"r{rail}")

    @property
    def rail_wrapper(self) -> str:
        """A site's binding wrapper (``wrapper PROGRAM ARGS...``): local rank i on rail i mod R."""
        return str(self.dir / "rail")

    @property
    def dest_template(self) -> str:
        """A DEST for the tool: each host writes its own directory below the box's."""
        return str(self.dir / "dest" / "{host}")

    def dest_of(self, host: Host) -> Path:
        """Where ``host``'s copy lands with :attr:`dest_template`."""
        return self.dir / "dest" / host.name

    # -- making and removing -------------------------------------------------------------

    def start(self) -> None:
        """Sweep what dead boxes left, then make this one's bridges, hosts and directory."""
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        sweep()
        if any(link.delay_ms > 0 for link in (self.front, self.fabric, self.azure)) and not netem_available():
            raise RuntimeError("this kernel has no netem (CONFIG_NET_SCH_NETEM): links cannot be delayed here")
        self.tag = f"{PREFIX}{os.getpid():06x}"  # pids stay below 2**22
        if leftovers(self.tag):
            raise RuntimeError(f"box {self.tag} is already up in this process (one box per process)")
        self.dir = Path(tempfile.gettempdir()) / f"azcp-box-{self.tag}"
        self.dir.mkdir(mode=0o755)
        started = _start_time(os.getpid())
        (self.dir / "owner").write_text(f"{os.getpid()} {started}\n")
        self._made = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        self.front_net, *self.rail_nets = _free_subnets(1 + self.rails, os.getpid())
        (self.dir / "hosts").mkdir()
        (self.dir / "dest").mkdir()
        if self.tmpfs_dest:
            _run("mount", "-t", "tmpfs", "-o", "mode=0755", f"{self.tag}dest", str(self.dir / "dest"))
        script = self.dir / "nsexec"
        script.write_text(NSEXEC)
        script.chmod(0o755)
        wrapper = Path(self.rail_wrapper)
        wrapper.write_text(RAIL_WRAPPER.replace("RAILS", str(self.rails)))
        wrapper.chmod(0o755)
        bridges = [(self.front_bridge, self.front_net)]
        bridges += [(self.rail_bridge(r), net) for r, net in enumerate(self.rail_nets)]
        for bridge, net in bridges:
            _run("ip", "link", "add", bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{net.network_address + 1}/{net.prefixlen}", "dev", bridge)
            _run("ip", "link", "set", bridge, "up")
        self._namespace(self.emulator_ns)
        self._attach(self.emulator_ns, self.tag + "az", FRONT, self.front_bridge, self.emulator_address,
                     self.front_net, self.azure)  # fmt: skip
        for i in range(self.hosts_count):
            ns = f"{self.tag}h{i}"
            rails = tuple(str(net.network_address + 10 + i) for net in self.rail_nets)
            host = Host(ns, str(self.front_net.network_address + 10 + i), rails[0], rails)
            self._namespace(ns)
            self._attach(ns, f"{self.tag}f{i}", FRONT, self.front_bridge, host.front, self.front_net, self.front)
            for r, (address, net) in enumerate(zip(rails, self.rail_nets, strict=True)):
                self._attach(ns, self._rail_veth(i, r), self.rail_nic(r), self.rail_bridge(r), address, net,
                             self.fabric)  # fmt: skip
            (self.dir / "hosts" / host.fabric).write_text(ns)
            (self.dir / "hosts" / host.name).write_text(ns)
            self.hosts.append(host)

    @staticmethod
    def _namespace(ns: str) -> None:
        _run("ip", "netns", "add", ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")

    @staticmethod
    def _attach(
        ns: str, outside: str, inside: str, bridge: str, address: str, net: ipaddress.IPv4Network, link: Link
    ) -> None:
        """A veth from ``bridge`` into ``ns`` (named ``inside`` there, with ``address``), shaped both ways."""
        _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside, "netns", ns)
        _run("ip", "link", "set", outside, "master", bridge, "up")
        _run("ip", "-n", ns, "addr", "add", f"{address}/{net.prefixlen}", "dev", inside)
        _run("ip", "-n", ns, "link", "set", inside, "up")
        _shape(outside, link)  # what the host receives
        _shape(inside, link, ns, delay=True)  # what it sends, delayed

    def close(self) -> None:
        """Kill what runs in the box's namespaces; remove them, the bridges, mounts and the directory."""
        if self._made:
            _remove(self.tag)
            self._made = False
            self.hosts = []

    def processes(self) -> list[int]:
        """The pids of what runs in the box's namespaces now (the emulator, ranks, MPI's daemons)."""
        namespaces = [self.emulator_ns, *(h.name for h in self.hosts)]
        return sorted(int(p) for ns in namespaces for p in _run("ip", "netns", "pids", ns, check=False).stdout.split())

    # -- counters ------------------------------------------------------------------------

    def emulator_sent(self) -> int:
        """Bytes the emulator has sent on its link so far (IP packets: bodies, headers, TCP/IP overhead)."""
        return self._counter(self.tag + "az", "rx")  # the bridge's end receives what the emulator sends

    def fabric_bytes(self) -> int:
        """Bytes the hosts have received on their fabric NICs so far (every rail's)."""
        return sum(self.rail_bytes())

    def rail_bytes(self) -> list[int]:
        """Per rail, the bytes the hosts have received on their NIC of that rail so far."""
        return [sum(row) for row in zip(*self.rail_bytes_by_host(), strict=True)] or [0] * self.rails

    def rail_bytes_by_host(self) -> list[list[int]]:
        """Per host, per rail, the bytes its fabric NIC of that rail has received so far: what the
        bridge's end of its veth sent it (the namespace's NIC's rx_bytes, but for what it dropped)."""
        return [[self._counter(self._rail_veth(i, r), "tx") for r in range(self.rails)] for i in range(len(self.hosts))]

    def front_bytes(self) -> int:
        """Bytes the hosts have received on their frontend NICs so far."""
        return sum(self._counter(f"{self.tag}f{i}", "tx") for i in range(len(self.hosts)))

    @staticmethod
    def _counter(dev: str, direction: str) -> int:
        return int(Path(f"/sys/class/net/{dev}/statistics/{direction}_bytes").read_text())

    # -- the emulator --------------------------------------------------------------------

    @contextlib.contextmanager
    def emulator(self, env: Mapping[str, str] | None = None) -> Iterator[azurite.Emulator]:
        """An in-memory emulator in its own namespace on the frontend network ("Azure")."""
        with azurite.running(
            host=self.emulator_address,
            port=10000,  # the emulator's namespace is its own: every port is free there
            wrap=("ip", "netns", "exec", self.emulator_ns),
            env=env,
        ) as emu:
            yield emu

    # -- MPI -----------------------------------------------------------------------------

    def mpiexec(self, mpiexec: str, flavour: str, argv: Sequence[str], per_host: int = 1) -> list[str]:
        """The command that runs ``argv`` on ``per_host`` ranks of every host, MPI over the fabric.

        ``flavour``: "mpich" (hydra; ofi/tcp on the fabric NIC) or "openmpi" (PRRTE; the TCP BTL on
        the fabric network). Run it with :meth:`env` added to the environment. With several rails,
        ``per_host`` is a multiple of them (each rail gets as many ranks of a host), or 1 (rail 0 alone).
        """
        if per_host % self.rails and per_host != 1:
            raise ValueError(f"{per_host} ranks per host on {self.rails} rails: make it a multiple of the rails (or 1)")
        script = str(self.dir / "nsexec")
        hosts = ",".join(f"{h.fabric}:{per_host}" for h in self.hosts)
        count = str(per_host * len(self.hosts))
        if flavour == "mpich":
            return [mpiexec, "-launcher", "ssh", "-launcher-exec", script, "-iface", self.fabric_bridge,
                    "-hosts", hosts, "-n", count, *argv]  # fmt: skip
        if flavour == "openmpi":
            return [mpiexec, "--prtemca", "plm_ssh_agent", script, "--host", hosts, "-n", count, *argv]
        raise ValueError(f"unknown MPI flavour {flavour!r} (mpich or openmpi)")

    def env(self, flavour: str) -> dict[str, str]:
        """What the ranks' environment needs on top of the caller's: MPI between hosts over the fabric only.

        MPICH: the ofi netmod with its tcp provider, on the fabric NIC (by default it would use
        shared memory between the namespaces: they are one machine). Open MPI: ob1 with the TCP
        BTL on the fabric network, PRRTE's and PMIx's own connections on the frontend (a
        cluster's launcher runs over its management network: ssh, the pod network), a rank
        yielding its core while it waits (the hosts share the machine's cores); plus
        scripts/openmpi.env (root, oversubscription, start-up). With several rails nothing
        binds a rank to a NIC (``FI_TCP_IFACE``, ``OMPI_MCA_btl_tcp_if_include``): the tool's
        ``--rails auto``, or the :attr:`rail_wrapper`, binds each.
        """
        net = str(self.fabric_net)
        if flavour == "mpich":
            env = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}
            return env if self.rails > 1 else {**env, "FI_TCP_IFACE": FABRIC}
        if flavour == "openmpi":
            env = openmpi_env()
            if self.rails == 1:
                env["OMPI_MCA_btl_tcp_if_include"] = net
            env.update({
                # The launcher's daemons on the frontend: on the fabric, a host cut off it took
                # its daemon's connection along, and prterun waited for that daemon (a silent
                # TCP connection) until the link came back, long after every rank had ended.
                "PRTE_MCA_oob_tcp_if_include": str(self.front_net),
                "PMIX_MCA_ptl_tcp_if_include": str(self.front_net),
                # Fill each host's slots in turn (openmpi.env's oversubscription put every rank on the first).
                "PRTE_MCA_rmaps_default_mapping_policy": "slot",
                # The hosts share this machine's cores, which Open MPI cannot know: each host
                # has its slots, so it spins in every wait instead of yielding, as it does on a
                # node it knows is oversubscribed. With 8 hosts on 2 cores, a waiting rank then
                # holds a core for its whole time slice: an allgather of 8 took 64 to 84 ms, a
                # Comm.Split 130 to 200 ms (MPICH: 1 ms); yielding, 0.8 to 1.6 ms. The caller's
                # own setting wins (0: Open MPI spinning, to compare).
                "OMPI_MCA_mpi_yield_when_idle": os.environ.get("OMPI_MCA_mpi_yield_when_idle", "1"),  # noqa: SIM112 (its name)
            })  # fmt: skip
            return env
        raise ValueError(f"unknown MPI flavour {flavour!r} (mpich or openmpi)")


def openmpi_env() -> dict[str, str]:
    """The variables of scripts/openmpi.env (KEY=VALUE lines): Open MPI as root, oversubscribed, quick to start."""
    env = {}
    for line in OPENMPI_ENV.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            if not sep or not key.isidentifier():
                raise ValueError(f"{OPENMPI_ENV}: not KEY=VALUE: {line!r}")
            env[key] = value
    return env


def flavour_of(mpiexec: str) -> str:
    """What ``mpiexec --version`` says: "openmpi", "mpich" or "unknown"."""
    try:
        proc = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = proc.stdout + proc.stderr
    if "Open MPI" in text or "OpenRTE" in text:
        return "openmpi"
    if "HYDRA" in text or "MPICH" in text:
        return "mpich"
    return "unknown"
