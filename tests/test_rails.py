"""--rails (azcp_cluster/run/rails.py): which fabric device each local rank is bound to before MPI starts.

The decision is pure (devices and an environment in, variables out) and tested over every
launcher's local rank, every binding variable a user or site may have set, InfiniBand ports
and ``ib*`` interfaces; the scan reads fake sysfs trees under tmp_path.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from azcp_cluster.core.errors import UsageError
from azcp_cluster.options import config_from_args
from azcp_cluster.run.rails import (
    BINDING_VARS,
    LOCAL_RANK_VARS,
    RAIL_DEVICE_ENV,
    Binding,
    Device,
    bind_before_mpi,
    bound_by,
    choose,
    local_rank,
    natural_key,
    ordered,
    scan,
)

IB = [Device(f"mlx5_{i}", 1, numa=i // 4) for i in range(8)]  # an ND H100 v5: 8 ports, 4 per socket
NETDEVS = [Device(f"ib{i}") for i in range(2)]  # the box's two rails


# -- the launcher's local rank ---------------------------------------------------------------


@pytest.mark.parametrize("var", LOCAL_RANK_VARS)
def test_every_launchers_local_rank_is_read(var: str) -> None:
    assert local_rank({var: "3"}) == 3
    assert local_rank({var: " 5 "}) == 5


def test_the_first_launchers_variable_wins_and_junk_is_no_rank() -> None:
    assert local_rank({"MPI_LOCALRANKID": "1", "SLURM_LOCALID": "2"}) == 1
    assert local_rank({}) is None
    for junk in ("", "-1", "x", "1.5", "٣"):  # the last: an Arabic-Indic digit, not ASCII
        assert local_rank({"MPI_LOCALRANKID": junk}) is None
    assert local_rank({"MPI_LOCALRANKID": "x", "PMIX_LOCAL_RANK": "7"}) == 7


# -- what binds already ----------------------------------------------------------------------


@pytest.mark.parametrize("var", BINDING_VARS)
def test_a_rank_bound_by_the_site_is_left_as_it_is(var: str) -> None:
    env = {var: "mlx5_3:1" if var.startswith("UCX") else "eth7", "MPI_LOCALRANKID": "1"}
    for mode in ("auto", "off"):
        binding = choose(mode, IB + NETDEVS, env)
        assert binding.set == {}, "a user's binding is never added to nor overwritten"
        assert binding.why == f"bound by {var}"
        # The device the user's variable names, except an exclusion list (it names none).
        assert binding.device == ("" if var.endswith("exclude") else env[var])
    assert bound_by(env) == var


def test_an_empty_binding_variable_binds_nothing() -> None:
    assert bound_by({"FI_TCP_IFACE": "", "UCX_NET_DEVICES": "  "}) is None
    binding = choose("auto", NETDEVS, {"FI_TCP_IFACE": "", "MPI_LOCALRANKID": "1"})
    # Nothing binds: ib1 is chosen, but the variable that is set (even empty) is not replaced.
    assert binding.device == "ib1" and binding.set == {"OMPI_MCA_btl_tcp_if_include": "ib1"}


def test_off_leaves_mpi_alone() -> None:
    assert choose("off", IB, {"MPI_LOCALRANKID": "2"}) == Binding(why="--rails off")


def test_an_unknown_mode_is_a_bug() -> None:
    with pytest.raises(ValueError, match="rails mode"):
        choose("on", IB, {})


def test_no_local_rank_or_no_device_binds_nothing() -> None:
    assert choose("auto", IB, {}) == Binding(why="no launcher's local rank")
    assert choose("auto", [], {"SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2(x1)"}) == Binding(
        why="no active fabric device"
    )


@pytest.mark.parametrize(
    ("env", "alone"),
    [
        ({"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"}, True),
        ({"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}, False),
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, True),
        ({"PMIX_LOCAL_RANK": "0", "PMIX_LOCAL_SIZE": "8"}, False),
        ({"SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "1(x4)", "SLURM_NODEID": "3"}, True),
        ({"SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "1(x2),8", "SLURM_NODEID": "2"}, False),
        ({"SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "8,1", "SLURM_NODEID": "1"}, True),
        ({"SLURM_LOCALID": "0"}, True),  # no size known: local rank 0 counts as alone
        ({"SLURM_LOCALID": "1"}, False),  # a local rank 1 has company
    ],
)
def test_one_rank_on_its_node_is_left_to_mpi_several_are_each_bound(env: dict[str, str], alone: bool) -> None:
    """One rank per node is the common launch: binding it to one device could only take devices
    from an MPI that stripes over several (a default must never lose where it cannot win)."""
    binding = choose("auto", IB, env)
    assert (binding == Binding(why="one rank on this node")) is alone
    assert bool(binding.set) is not alone


# -- which device ----------------------------------------------------------------------------


@pytest.mark.parametrize("rank", range(17))
def test_local_rank_i_gets_infiniband_port_i_mod_count(rank: int) -> None:
    binding = choose("auto", IB, {"SLURM_LOCALID": str(rank), "SLURM_TASKS_PER_NODE": "17"})
    label = f"mlx5_{rank % 8}:1"
    assert binding == Binding(device=label, set={"UCX_NET_DEVICES": label})


@pytest.mark.parametrize("rank", range(5))
def test_local_rank_i_gets_netdev_i_mod_count_for_libfabric_and_open_mpi(rank: int) -> None:
    binding = choose("auto", NETDEVS, {"MPI_LOCALRANKID": str(rank), "MPI_LOCALNRANKS": "5"})
    name = f"ib{rank % 2}"
    assert binding == Binding(device=name, set={"FI_TCP_IFACE": name, "OMPI_MCA_btl_tcp_if_include": name})


def test_infiniband_ports_come_before_netdevs_and_ethernet_ports_are_no_rails() -> None:
    roce_an = Device("mlx5_an0", 1, numa=0, infiniband=False)  # Azure's accelerated networking VF
    assert [d.label for d in ordered([*NETDEVS, roce_an, *IB])] == [d.label for d in IB]
    roce = [Device("mlx5_1", 1, infiniband=False), Device("mlx5_0", 1, infiniband=False)]
    assert [d.label for d in ordered(roce)] == ["mlx5_0:1", "mlx5_1:1"]  # a RoCE cluster: its ports are the rails
    assert [d.label for d in ordered(NETDEVS[::-1])] == ["ib0", "ib1"]


def test_devices_are_ordered_by_numa_node_then_by_name_naturally() -> None:
    mixed = [Device("mlx5_10", 1, 1), Device("mlx5_2", 1, 1), Device("mlx5_9", 1, 0), Device("mlx5_1", 2, 0),
             Device("mlx5_1", 1, 0)]  # fmt: skip
    assert [d.label for d in ordered(mixed)] == ["mlx5_1:1", "mlx5_1:2", "mlx5_9:1", "mlx5_2:1", "mlx5_10:1"]
    assert natural_key("mlx5_2") < natural_key("mlx5_10")


def test_a_variable_set_for_another_reason_is_never_overwritten() -> None:
    # Only one of the two netdev variables binds the rank here... but the other is the user's own.
    env = {"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2", "OMPI_MCA_btl_tcp_if_include": ""}
    assert choose("auto", NETDEVS, env).set == {"FI_TCP_IFACE": "ib0"}


# -- the sysfs scan --------------------------------------------------------------------------


def _port(
    root: Path, dev: str, port: int, state: str, numa: str | None = "0", layer: str | None = "InfiniBand"
) -> None:
    base = root / "class" / "infiniband" / dev
    (base / "ports" / str(port)).mkdir(parents=True, exist_ok=True)
    (base / "ports" / str(port) / "state").write_text(f"{state}\n")
    if layer is not None:
        (base / "ports" / str(port) / "link_layer").write_text(f"{layer}\n")
    if numa is not None:
        (base / "device").mkdir(exist_ok=True)
        (base / "device" / "numa_node").write_text(f"{numa}\n")


def _netdev(root: Path, name: str, state: str) -> None:
    (root / "class" / "net" / name).mkdir(parents=True)
    (root / "class" / "net" / name / "operstate").write_text(f"{state}\n")


def test_scan_finds_the_active_infiniband_ports_with_their_numa_node(tmp_path: Path) -> None:
    _port(tmp_path, "mlx5_1", 1, "4: ACTIVE", numa="1")
    _port(tmp_path, "mlx5_0", 1, "4: ACTIVE", numa="0")
    _port(tmp_path, "mlx5_0", 2, "1: DOWN", numa="0")
    _port(tmp_path, "mlx5_2", 1, "2: INIT", numa="1")
    _port(tmp_path, "mlx5_an0", 1, "4: ACTIVE", numa="-1", layer="Ethernet")
    _port(tmp_path, "mlx5_3", 1, "4: ACTIVE", numa=None, layer=None)  # no NUMA node, no link layer: IB
    _netdev(tmp_path, "ib0", "up")  # IPoIB beside the ports: the ports are what binds
    found = scan(tmp_path)
    assert found == [Device("mlx5_0", 1, 0), Device("mlx5_1", 1, 1), Device("mlx5_3", 1, -1),
                     Device("mlx5_an0", 1, -1, infiniband=False)]  # fmt: skip
    assert [d.label for d in ordered(found)] == ["mlx5_3:1", "mlx5_0:1", "mlx5_1:1"]


def test_scan_falls_back_to_the_ib_netdevs_that_are_up(tmp_path: Path) -> None:
    _port(tmp_path, "mlx5_0", 1, "1: DOWN")
    for name, state in (("ib1", "up"), ("ib0", "up"), ("ib2", "down"), ("eth0", "up"), ("ib10", "up")):
        _netdev(tmp_path, name, state)
    assert [d.label for d in scan(tmp_path)] == ["ib0", "ib1", "ib10"]


def test_scan_of_a_machine_without_a_fabric_is_empty(tmp_path: Path) -> None:
    assert scan(tmp_path) == []
    _netdev(tmp_path, "eth0", "up")
    (tmp_path / "class" / "net" / "ib0").mkdir(parents=True)  # no operstate: unreadable, left out
    assert scan(tmp_path) == []


# -- binding this process --------------------------------------------------------------------


@pytest.fixture
def no_mpi_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)


def test_bind_sets_the_variables_and_records_the_device(tmp_path: Path, no_mpi_yet: None) -> None:
    _netdev(tmp_path, "ib0", "up")
    _netdev(tmp_path, "ib1", "up")
    env = {"MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "4", RAIL_DEVICE_ENV: "stale"}
    binding = bind_before_mpi("auto", env, tmp_path)
    assert binding is not None and binding.device == "ib1"
    assert env == {"MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "4", "FI_TCP_IFACE": "ib1",
                   "OMPI_MCA_btl_tcp_if_include": "ib1", RAIL_DEVICE_ENV: "ib1"}  # fmt: skip


def test_bind_records_the_users_own_device_and_sets_nothing(tmp_path: Path, no_mpi_yet: None) -> None:
    _port(tmp_path, "mlx5_0", 1, "4: ACTIVE")
    env = {"SLURM_LOCALID": "0", "UCX_NET_DEVICES": "mlx5_5:1"}
    bind_before_mpi("auto", env, tmp_path)
    assert env == {"SLURM_LOCALID": "0", "UCX_NET_DEVICES": "mlx5_5:1", RAIL_DEVICE_ENV: "mlx5_5:1"}


def test_bind_off_records_no_device(tmp_path: Path, no_mpi_yet: None) -> None:
    _port(tmp_path, "mlx5_0", 1, "4: ACTIVE")
    env = {"SLURM_LOCALID": "0"}
    bind_before_mpi("off", env, tmp_path)
    assert env == {"SLURM_LOCALID": "0", RAIL_DEVICE_ENV: ""}


def test_bind_touches_nothing_once_mpi_is_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", sys)  # any module: only its presence counts
    _netdev(tmp_path, "ib0", "up")
    env = {"MPI_LOCALRANKID": "0"}
    assert bind_before_mpi("auto", env, tmp_path) is None
    assert env == {"MPI_LOCALRANKID": "0"}


# -- the option ------------------------------------------------------------------------------


def test_the_option_defaults_to_auto_and_takes_off() -> None:
    assert config_from_args(["/src", "/dst"]).rails == "auto"
    assert config_from_args(["/src", "/dst", "--rails", "off"]).rails == "off"
    with pytest.raises(UsageError, match="--rails"):
        config_from_args(["/src", "/dst", "--rails", "on"])


# -- the report --------------------------------------------------------------------------------


@pytest.mark.parametrize("rails", ["auto", "off"])
def test_the_report_names_each_ranks_device_and_a_users_binding_is_kept(tmp_path: Path, rails: str) -> None:
    """Under mpiexec, two ranks on one host: the user's own binding (FI_TCP_IFACE, here the
    loopback) is kept and is what each rank reports as its device, with auto as with off."""
    from tests.conftest import run_cli

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.bin").write_bytes(b"a" * 5000)
    result = run_cli(
        [str(tmp_path / "src"), str(tmp_path / "d" / "{rank}"), "--no-progress", "--rails", rails],
        n=2,
        env={"FI_TCP_IFACE": "lo"},
        json_path=tmp_path / "r.json",
    )
    assert result.returncode == 0 and result.json is not None, result.output
    assert result.json["rail_devices"] == ["lo", "lo"]
