"""Each local rank of a node bound to one of its fabric devices before MPI starts (``--rails``).

A GPU node has several fabric NICs, each on its own rail (an ND H100 v5: 8 InfiniBand NICs),
and an MPI library left alone uses one of them for all its ranks, or stripes badly. Sites
usually bind each local rank in a wrapper (``UCX_NET_DEVICES``, ``FI_TCP_IFACE``,
``OMPI_MCA_btl_tcp_if_include``); where nothing binds, ``--rails auto`` does the same: local
rank i gets device i mod count, from the launcher's local rank and the node's devices.

The decision (:func:`choose`) is pure: the devices and the environment in, the variables to
set out. The I/O around it is thin: :func:`scan` reads a sysfs tree (the InfiniBand ports
that are ACTIVE, with their NUMA node; else the ``ib*`` network interfaces that are up, as a
TCP fabric and the cluster in a box name theirs) and :func:`bind_before_mpi` sets the
variables in this process's environment, which MPI reads when it starts. Whatever binds the
rank (or nothing: "") is recorded in ``AZCP_RAIL_DEVICE`` for the report.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from azcp_cluster.core.config import RAIL_MODES

RAIL_DEVICE_ENV = "AZCP_RAIL_DEVICE"  # the device this rank is bound to ("" none), for the report

# What binds a rank to a NIC already (a site's wrapper, the user): any one set, nothing is set here.
BINDING_VARS = ("UCX_NET_DEVICES", "FI_TCP_IFACE", "OMPI_MCA_btl_tcp_if_include", "OMPI_MCA_btl_tcp_if_exclude")
# The launcher's local rank: hydra (MPICH, Intel MPI), Open MPI's mpirun, srun, PMIx.
LOCAL_RANK_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "PMIX_LOCAL_RANK")
# How many ranks the launcher started on this node: hydra, Open MPI's mpirun, PMIx, srun (per node).
LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMIX_LOCAL_SIZE")
NETDEV_PREFIX = "ib"  # network interfaces of a TCP fabric (IPoIB's names; the box's rails)


@dataclass(frozen=True)
class Device:
    """One fabric device: an InfiniBand port (``port`` set) or a network interface (``port`` None)."""

    name: str  # mlx5_0, or ib0
    port: int | None = None
    numa: int = -1  # the NUMA node it hangs off (-1: unknown)
    infiniband: bool = True  # an InfiniBand port's link layer (False: RoCE, Ethernet); netdevs: unused

    @property
    def label(self) -> str:
        """How MPI and the report name it: ``mlx5_0:1`` (UCX's form) or ``ib0``."""
        return self.name if self.port is None else f"{self.name}:{self.port}"

    def variables(self) -> dict[str, str]:
        """What binds a rank to this device: UCX's for a port; libfabric tcp's and Open MPI's tcp BTL's for a netdev."""
        if self.port is not None:
            return {"UCX_NET_DEVICES": self.label}
        return {"FI_TCP_IFACE": self.name, "OMPI_MCA_btl_tcp_if_include": self.name}


@dataclass(frozen=True)
class Binding:
    """What :func:`choose` decided: the variables to set (none: ``why``) and the device the rank is on."""

    device: str = ""  # the device's label, the user's own binding, or "" (none known)
    set: Mapping[str, str] = field(default_factory=dict)
    why: str = ""  # why nothing was set ("" when something was)


def natural_key(name: str) -> tuple[object, ...]:
    """``mlx5_2`` before ``mlx5_10``: the digits of a name compared as numbers."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def local_rank(env: Mapping[str, str]) -> int | None:
    """This process's rank on its node as the launcher set it, or None (no launcher's variable)."""
    for var in LOCAL_RANK_VARS:
        value = env.get(var, "").strip()
        if value.isascii() and value.isdigit():
            return int(value)
    return None


def _slurm_tasks_here(env: Mapping[str, str]) -> int | None:
    """srun's tasks on this node: ``SLURM_TASKS_PER_NODE`` ("2(x3),1") at ``SLURM_NODEID``."""
    counts: list[int] = []
    for part in env.get("SLURM_TASKS_PER_NODE", "").split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    node = env.get("SLURM_NODEID", "0").strip()
    return counts[int(node)] if node.isdigit() and int(node) < len(counts) else None


def local_size(env: Mapping[str, str]) -> int | None:
    """How many ranks the launcher started on this node, or None (no launcher says)."""
    for var in LOCAL_SIZE_VARS:
        value = env.get(var, "").strip()
        if value.isascii() and value.isdigit():
            return int(value)
    return _slurm_tasks_here(env)


def bound_by(env: Mapping[str, str]) -> str | None:
    """The variable that binds the rank already (the first of :data:`BINDING_VARS` set), or None."""
    return next((var for var in BINDING_VARS if env.get(var, "").strip()), None)


def ordered(devices: Sequence[Device]) -> list[Device]:
    """The devices in the order local ranks take them: InfiniBand ports only where there are any
    (an Azure node's Ethernet VF, ``mlx5_an0``, is no rail), by NUMA node, then by name."""
    ports = [d for d in devices if d.port is not None]
    if ports:
        ib = [d for d in ports if d.infiniband]
        devices = ib or ports
    return sorted(devices, key=lambda d: (d.numa, natural_key(d.name), d.port or 0))


def choose(mode: str, devices: Sequence[Device], env: Mapping[str, str]) -> Binding:
    """The binding of this rank: ``mode`` (:data:`RAIL_MODES`), the node's ``devices``, its environment.

    Nothing is set with ``off``, where a variable already binds the rank (then its value names the
    device, an exclusion list none), without the launcher's local rank, with one rank on the node
    (the launcher's local size; unknown: a local rank 0 counts as alone), or without a device.
    Otherwise local rank i gets device i mod count, and no variable the environment has is set.
    """
    if mode not in RAIL_MODES:
        raise ValueError(f"rails mode {mode!r} (one of {', '.join(RAIL_MODES)})")
    var = bound_by(env)
    if var is not None:
        named = "" if var == "OMPI_MCA_btl_tcp_if_exclude" else env[var].strip()
        return Binding(device=named, why=f"bound by {var}")
    if mode == "off":
        return Binding(why="--rails off")
    rank = local_rank(env)
    if rank is None:
        return Binding(why="no launcher's local rank")
    # One rank on the node: binding it to one device can only take devices away from it (an
    # MPI left alone may stripe over several); with several, each its own is what spreads them.
    size = local_size(env)
    if (size if size is not None else rank + 1) < 2:
        return Binding(why="one rank on this node")
    candidates = ordered(devices)
    if not candidates:
        return Binding(why="no active fabric device")
    device = candidates[rank % len(candidates)]
    wanted = {k: v for k, v in device.variables().items() if k not in env}
    return Binding(device=device.label, set=wanted)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return ""


def _numa(path: Path) -> int:
    text = _read(path)
    return int(text) if text.lstrip("-").isdigit() else -1


def scan(sysfs: Path = Path("/sys")) -> list[Device]:
    """The node's fabric devices under ``sysfs``: every ACTIVE InfiniBand port; none, the ``ib*``
    network interfaces that are up. Unreadable entries are left out (never an error)."""
    found: list[Device] = []
    ib = sysfs / "class" / "infiniband"
    for dev in sorted(ib.glob("*"), key=lambda p: natural_key(p.name)):
        numa = _numa(dev / "device" / "numa_node")
        for port in sorted(dev.glob("ports/*"), key=lambda p: natural_key(p.name)):
            state = _read(port / "state")  # "4: ACTIVE"
            if port.name.isdigit() and state.split(":")[-1].strip() == "ACTIVE":
                layer = _read(port / "link_layer")
                found.append(Device(dev.name, int(port.name), numa, infiniband=layer in ("", "InfiniBand")))
    if found:
        return found
    net = sysfs / "class" / "net"
    for dev in sorted(net.glob(f"{NETDEV_PREFIX}*"), key=lambda p: natural_key(p.name)):
        if _read(dev / "operstate") == "up":
            found.append(Device(dev.name, None, _numa(dev / "device" / "numa_node")))
    return found


def bind_before_mpi(
    mode: str, env: MutableMapping[str, str] | None = None, sysfs: Path = Path("/sys")
) -> Binding | None:
    """Bind this rank (:func:`choose`) in ``env`` (default ``os.environ``) and record its device in
    :data:`RAIL_DEVICE_ENV`; None, touching nothing, where MPI is already up in this process
    (a host program's: too late to bind it)."""
    if "mpi4py.MPI" in sys.modules:
        return None
    env = os.environ if env is None else env
    devices = scan(sysfs) if mode == "auto" and bound_by(env) is None else []
    binding = choose(mode, devices, env)
    env.update(binding.set)
    env[RAIL_DEVICE_ENV] = binding.device
    return binding
