"""examples/slurm/stage.sbatch under a real Slurm: a single-node cluster from the distribution's packages.

The fixture starts munged, slurmctld and slurmd on loopback from a private temporary
directory (its own key, configuration, ports, state and logs), submits the unmodified
example with ``sbatch`` (adapted only through environment variables and its arguments),
waits for each job and checks its state and exit code (``scontrol show job``: there is no
accounting database) and the files it staged from the emulator. Every daemon is stopped by
its PID and the directory removed afterwards.

It also runs examples/slurm/download-then-train.sbatch and apptainer.sbatch, with pyxis's
options, ``apptainer`` and ``torchrun`` stubbed on PATH (no container runtime, no GPU).

Slow (about a minute): run it with ``./scripts/slurm-test``, which installs the Debian packages
(slurmctld, slurmd, slurm-client, munge) and runs ``pytest -m slow tests/test_slurm.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from azcp_cluster.devtools import azurite
from tests.conftest import REPO, tree_of

pytestmark = pytest.mark.slow

STAGE = REPO / "examples" / "slurm" / "stage.sbatch"
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "sinfo", "scancel", "squeue")
SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
JOB_TIMEOUT = 180.0
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
TASKS = 4  # ranks of the staging step; the node is configured with at least this many CPUs


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def _missing_reason() -> str | None:
    missing = [name for name in (*DAEMONS, *CLIENTS) if _which(name) is None]
    if missing:
        return (
            f"Slurm/munge not installed ({', '.join(missing)} missing): run ./scripts/slurm-test, which "
            "installs slurmctld, slurmd, slurm-client and munge from the distribution"
        )
    if os.geteuid() != 0:
        return "slurmd must run as root to start job steps (SlurmdUser=root): run as root"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Job:
    """A finished job, as ``scontrol show job`` last reported it, and its output file."""

    id: int
    state: str
    exit_code: str  # "CODE:SIGNAL"
    output: str


@dataclass
class Cluster:
    """A running single-node Slurm: its configuration and the environment its clients need."""

    root: Path
    conf: Path
    node: str
    env: dict[str, str]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def run(self, *args: str, env: dict[str, str] | None = None, check: bool = True) -> str:
        cmd = [_which(args[0]) or args[0], *args[1:]]
        proc = subprocess.run(cmd, env=env or self.env, capture_output=True, text=True, timeout=60)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {proc.returncode}: {proc.stdout}{proc.stderr}")
        return proc.stdout

    def logs(self) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            text = path.read_text(errors="replace")
            parts.append(f"--- {path.name} (last 3000 chars)\n{text[-3000:]}")
        return "\n".join(parts)

    def job_fields(self, job_id: int) -> dict[str, str]:
        text = self.run("scontrol", "show", "job", "-o", str(job_id))
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def submit(self, args: list[str], env: dict[str, str]) -> Job:
        """``sbatch`` the example with ``args``, wait for the job to end, return its state."""
        out_pattern = str(self.root / "job-%j.out")
        submitted = self.run("sbatch", "--parsable", f"--output={out_pattern}", *args, env=env)
        job_id = int(submitted.strip().split(";")[0])
        deadline = time.monotonic() + JOB_TIMEOUT
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = self.job_fields(job_id)
            if fields.get("JobState") in FINAL_STATES:
                break
            time.sleep(0.3)
        else:
            self.run("scancel", str(job_id), check=False)
            raise AssertionError(f"job {job_id} did not finish in {JOB_TIMEOUT}s: {fields}\n{self.logs()}")
        output_path = Path(out_pattern.replace("%j", str(job_id)))
        # The batch step's output file is closed before the job is reported done, but be patient.
        for _ in range(50):
            if output_path.exists():
                break
            time.sleep(0.1)
        output = output_path.read_text(errors="replace") if output_path.exists() else ""
        print(f"--- job {job_id}: JobState={fields.get('JobState')} ExitCode={fields.get('ExitCode')}\n{output}")
        return Job(job_id, fields.get("JobState", "?"), fields.get("ExitCode", "?"), output)


def _start(cluster: Cluster, name: str, args: list[str]) -> None:
    log = open(cluster.root / "log" / f"{name}.out", "wb")  # noqa: SIM115 (closed with the process)
    try:
        cluster.procs[name] = subprocess.Popen(
            [_which(name) or name, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=cluster.env,
            start_new_session=True,
        )
    finally:
        log.close()


def _wait(what: str, ready: Callable[[], bool], cluster: Cluster, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc in cluster.procs.items():
            if proc.poll() is not None:
                status = proc.returncode
                raise RuntimeError(f"{name} exited with status {status} while waiting for {what}\n{cluster.logs()}")
        if ready():
            return
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}\n{cluster.logs()}")


def _stop(cluster: Cluster) -> None:
    """Cancel what is left of our jobs, then stop the daemons by PID (the last started first)."""
    if "slurmctld" in cluster.procs and cluster.procs["slurmctld"].poll() is None:
        with contextlib.suppress(Exception):
            ids = cluster.run("squeue", "-h", "-o", "%i", check=False).split()
            for job_id in ids:
                cluster.run("scancel", job_id, check=False)
            deadline = time.monotonic() + 20
            while ids and time.monotonic() < deadline and cluster.run("squeue", "-h", "-o", "%i", check=False).split():
                time.sleep(0.3)
    for name in reversed(list(cluster.procs)):
        proc = cluster.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _slurm_conf(root: Path, node: str, cpus: int) -> str:
    return f"""\
# A single-node cluster for tests: every path under {root}, its own ports, munge on its own socket.
ClusterName=azcptest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
PlugStackConfig={root}/plugstack.conf
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=pmi2
ReturnToService=2
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
MinJobAge=3600
# The node claims {cpus} CPUs whatever the machine has, so several ranks fit on it.
SlurmdParameters=config_overrides
InactiveLimit=0
KillWait=5
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def slurm() -> Iterator[Cluster]:
    reason = _missing_reason()
    if reason:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="azcp-slurm-"))
    root.chmod(0o700)
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir(mode=0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    (root / "plugstack.conf").write_text("")
    node = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, node, max(TASKS, os.cpu_count() or 1)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
    env["SLURM_CONF"] = str(conf)
    cluster = Cluster(root=root, conf=conf, node=node, env=env)
    try:
        sock = root / "munge" / "munge.socket"
        _start(
            cluster,
            "munged",
            [
                "--foreground",
                "--force",
                f"--socket={sock}",
                f"--key-file={key}",
                f"--log-file={root / 'log' / 'munged.log'}",
                f"--pid-file={root / 'munge' / 'munged.pid'}",
                f"--seed-file={root / 'munge' / 'munged.seed'}",
            ],
        )
        _wait("munged's socket", sock.exists, cluster)
        _start(cluster, "slurmctld", ["-D", "-i", "-f", str(conf)])
        _wait("slurmctld", lambda: "UP" in cluster.run("scontrol", "ping", check=False), cluster)
        _start(cluster, "slurmd", ["-D", "-f", str(conf), "-N", node])
        _wait(
            "the node to be idle",
            lambda: cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False).strip() == "idle",
            cluster,
        )
        yield cluster
    finally:
        _stop(cluster)
        shutil.rmtree(root, ignore_errors=True)


def _dataset() -> dict[str, bytes]:
    """A small checkpoint-like tree: one file larger than the shard size used below, nested names."""
    rng = random.Random(7)
    return {
        "model-00001-of-00002.safetensors": rng.randbytes(3 * 1024 * 1024 + 123),
        "model-00002-of-00002.safetensors": rng.randbytes(700 * 1024),
        "config.json": b'{"hidden_size": 64}',
        "tokenizer/tokenizer.json": rng.randbytes(40_000),
        "tokenizer/special tokens.txt": b"<s> </s>",
        "empty.bin": b"",
    }


def _job_env(cluster: Cluster, emulator: azurite.Emulator, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in cluster.env.items() if not k.startswith(("AZURE_", "AZCP_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # azcp-cluster from the venv
    env["AZURE_STORAGE_CONNECTION_STRING"] = emulator.connection_string
    env.update(extra)
    return env


def test_stage_sbatch_on_a_real_slurm(slurm: Cluster, emulator: azurite.Emulator) -> None:
    blobs = _dataset()
    container = f"slurm{os.getpid()}"
    azurite.upload(emulator, container, {f"llama-tiny/{name}": data for name, data in blobs.items()})
    source = emulator.url(container, "llama-tiny")
    work = slurm.root / "nvme"
    dest = str(work / "node{rank}" / "llama-tiny")  # one machine stands in for TASKS nodes
    env = _job_env(
        slurm,
        emulator,
        AZCP_LAUNCH=f"srun --ntasks-per-node={TASKS}",  # the site's MpiDefault (pmi2 here) wires up MPICH
        AZCP_OPTS="--shard-size 1MiB --block-size 1MiB",
    )
    nodes_args = ["--nodes=1", f"--ntasks-per-node={TASKS}"]

    # 1. The first run stages every file onto every "node".
    report = slurm.root / "first.json"
    first = slurm.submit([*nodes_args, str(STAGE), source, dest, "--json", str(report)], env)
    assert (first.state, first.exit_code) == ("COMPLETED", "0:0"), first.output + slurm.logs()
    assert f"[cluster] {TASKS} ranks on 1 host, {TASKS} copies, {TASKS} downloading" in first.output
    assert "[stage] exit 0" in first.output
    doc = json.loads(report.read_text())
    assert (doc["ranks"], doc["files"], doc["transfer_files"], doc["exit_code"]) == (TASKS, len(blobs), len(blobs), 0)
    assert doc["downloaded_bytes"] == sum(map(len, blobs.values()))
    copies = [work / f"node{rank}" / "llama-tiny" for rank in range(TASKS)]
    for copy in copies:
        assert tree_of(copy) == blobs
    stamps = {p: p.stat().st_mtime_ns for copy in copies for p in copy.rglob("*") if p.is_file()}

    # 2. A rerun of the same step moves nothing and leaves every file as it was.
    report2 = slurm.root / "rerun.json"
    rerun = slurm.submit([*nodes_args, str(STAGE), source, dest, "--json", str(report2)], env)
    assert (rerun.state, rerun.exit_code) == ("COMPLETED", "0:0"), rerun.output + slurm.logs()
    assert f"[diff] 0 to transfer (0 peer, 0 azure), {len(blobs)} skipped" in rerun.output
    doc2 = json.loads(report2.read_text())
    assert (doc2["transfer_files"], doc2["downloaded_bytes"], doc2["broadcast_bytes"]) == (0, 0, 0)
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps

    # 3. The default launcher (one rank per node), SOURCE and DEST from the environment.
    plain = str(work / "shared-dest")
    env_default = _job_env(slurm, emulator, AZCP_SOURCE=source, AZCP_DEST=plain)
    default = slurm.submit(["--nodes=1", str(STAGE)], env_default)
    assert (default.state, default.exit_code) == ("COMPLETED", "0:0"), default.output + slurm.logs()
    assert "[stage] launcher: srun --ntasks=1 --ntasks-per-node=1" in default.output
    assert "[cluster] 1 rank on 1 host, 1 copy, 1 downloading" in default.output
    assert tree_of(Path(plain)) == blobs

    # 4. A failure is the job's failure, with the tool's exit code (3: the listing failed).
    missing = emulator.url(f"missing{os.getpid()}", "x")
    failed = slurm.submit([*nodes_args, str(STAGE), missing, str(work / "never")], env)
    assert (failed.state, failed.exit_code) == ("FAILED", "3:0"), failed.output + slurm.logs()
    assert "azcp-cluster: error [list]" in failed.output and "[stage] exit 3" in failed.output
    assert not (work / "never").exists() or not any((work / "never").rglob("*.safetensors"))


def test_stage_sbatch_without_source_fails_with_usage(slurm: Cluster) -> None:
    env = {k: v for k, v in slurm.env.items() if not k.startswith("AZCP_")}
    job = slurm.submit(["--nodes=1", str(STAGE)], env)
    assert (job.state, job.exit_code) == ("FAILED", "2:0"), job.output
    assert "usage: sbatch" in job.output


def test_srun_with_no_mpi_plugin_exits_2_instead_of_copying_once_per_task(slurm: Cluster) -> None:
    """``srun --mpi=none``: each task is a one-rank MPI job; the tool says so (exit 2) and copies nothing.

    The same job script's plain ``python`` (no srun) in the two-task allocation is one process
    and copies, as it should.
    """
    source = slurm.root / "launcher-src"
    source.mkdir(exist_ok=True)
    (source / "a.bin").write_bytes(b"abc" * 1000)
    dest = slurm.root / "launcher-dest-{rank}"
    python = f"{sys.executable} -m azcp_cluster"
    script = slurm.root / "launcher.sh"
    script.write_text(
        "#!/bin/bash\n"
        f'{python} {source} {slurm.root / "plain-dest"} --no-progress; echo "[plain] exit $?"\n'
        f'srun --ntasks=2 --mpi=none {python} {source} {dest} --no-progress; echo "[srun] exit $?"\n'
    )
    env = {k: v for k, v in slurm.env.items() if not k.startswith("AZCP_")}
    job = slurm.submit(["--nodes=1", "--ntasks=2", str(script)], env)
    assert "[plain] exit 0" in job.output, job.output + slurm.logs()
    assert (slurm.root / "plain-dest" / "a.bin").read_bytes() == b"abc" * 1000
    assert "[srun] exit 2" in job.output, job.output
    lines = [line for line in job.output.splitlines() if line.startswith("azcp-cluster: error")]
    assert len(lines) == 1, job.output
    assert "srun started 2 tasks (SLURM_STEP_NUM_TASKS=2) but MPI's world has 1 rank" in lines[0]
    assert "srun --mpi=pmix or --mpi=pmi2" in lines[0]
    assert not any(slurm.root.glob("launcher-dest-*"))


APPTAINER_STUB = """#!/bin/bash
# Stands in for apptainer: checks the image file exists, then runs the command (no container).
set -euo pipefail
[ "$1" = exec ] || { echo "apptainer stub: only 'exec'" >&2; exit 64; }
shift
while [ "$#" -gt 0 ]; do
    case "$1" in
        --nv) shift ;;
        --bind|--pwd) shift 2 ;;
        -*) echo "apptainer stub: unexpected option $1" >&2; exit 64 ;;
        *) break ;;
    esac
done
image="$1"
shift
[ -s "$image" ] || { echo "apptainer stub: no image at $image" >&2; exit 65; }
echo "[apptainer-stub] $image"
exec "$@"
"""

TORCHRUN_STUB = """#!/bin/bash
# Stands in for torchrun: prints its arguments and what it finds under --weights.
set -euo pipefail
echo "[torchrun-stub] $*"
weights=""
while [ "$#" -gt 0 ]; do
    if [ "$1" = --weights ]; then weights="$2"; fi
    shift
done
find "$weights" -type f ! -name '.azcp-manifest.json' -printf '[torchrun-stub] file %P %s\\n' | sort
"""


def test_apptainer_sbatch_stages_image_and_weights_then_runs_the_container_step(
    slurm: Cluster, emulator: azurite.Emulator
) -> None:
    """examples/slurm/apptainer.sbatch end to end, with apptainer and torchrun stubbed on PATH."""
    blobs = _dataset()
    container = f"appt{os.getpid()}"
    image = b"SIF" + bytes(range(256)) * 100
    azurite.upload(emulator, container, {f"models/tiny/{k}": v for k, v in blobs.items()})
    azurite.upload(emulator, container, {"images/pytorch.sif": image})
    stubs = slurm.root / "stubs"
    stubs.mkdir(exist_ok=True)
    for name, text in (("apptainer", APPTAINER_STUB), ("torchrun", TORCHRUN_STUB)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    nvme = slurm.root / "nvme-apptainer"
    nvme.mkdir()
    env = _job_env(
        slurm,
        emulator,
        MODEL_SOURCE=emulator.url(container, "models/tiny"),
        IMAGE_SOURCE=emulator.url(container, "images/pytorch.sif"),
        NVME=str(nvme),
        STAGE_RANKS="2",
        GPUS_PER_NODE="1",
        UCX_TLS="tcp,sm,self",  # no InfiniBand here: the documented override
    )
    env["PATH"] = f"{stubs}{os.pathsep}{env['PATH']}"
    script = REPO / "examples" / "slurm" / "apptainer.sbatch"
    job = slurm.submit(["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", str(script)], env)
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), job.output + slurm.logs()
    assert (nvme / "images" / "pytorch.sif").read_bytes() == image
    assert tree_of(nvme / "models" / "tiny") == blobs
    assert f"[apptainer-stub] {nvme}/images/pytorch.sif" in job.output
    assert f"--nnodes=1 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint={slurm.node}:29500" in job.output
    assert f"train.py --weights {nvme}/models/tiny" in job.output
    for name, data in blobs.items():
        assert f"[torchrun-stub] file {name} {len(data)}" in job.output
    assert job.output.count("[cluster] 2 ranks on 1 host, 1 copy, 2 downloading") == 2  # image, then weights
    assert job.output.count("[torchrun-stub] --nnodes") == 1  # one torchrun per node, whatever the job's tasks


PYXIS_SRUN_STUB = """#!/bin/bash
# Stands in for srun with the pyxis plugin: drops the --container-* options (no container
# runtime here) after checking that the image is a staged file, then runs the real srun.
set -euo pipefail
args=()
for arg in "$@"; do
    case "$arg" in
        --container-image=*)
            image="${arg#--container-image=}"
            [ -s "$image" ] || { echo "srun stub: no image at $image" >&2; exit 65; }
            echo "[pyxis-stub] $image" ;;
        --container-*|--no-container-entrypoint) ;;
        *) args+=("$arg") ;;
    esac
done
exec "$REAL_SRUN" "${args[@]}"
"""


def test_download_then_train_sbatch_stages_then_runs_torchrun_once_per_node(
    slurm: Cluster, emulator: azurite.Emulator
) -> None:
    """examples/slurm/download-then-train.sbatch, with pyxis's options and torchrun stubbed."""
    blobs = _dataset()
    container = f"pyxis{os.getpid()}"
    image = b"hsqs" + bytes(range(256)) * 50
    azurite.upload(emulator, container, {f"models/tiny/{k}": v for k, v in blobs.items()})
    azurite.upload(emulator, container, {"images/pytorch.sqsh": image})
    stubs = slurm.root / "pyxis-stubs"
    stubs.mkdir()
    for name, text in (("srun", PYXIS_SRUN_STUB), ("torchrun", TORCHRUN_STUB)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    nvme = slurm.root / "nvme-pyxis"
    nvme.mkdir()
    env = _job_env(
        slurm,
        emulator,
        MODEL_SOURCE=emulator.url(container, "models/tiny"),
        IMAGE_SOURCE=emulator.url(container, "images/pytorch.sqsh"),
        NVME=str(nvme),
        STAGE_RANKS="2",
        GPUS_PER_NODE="1",
        UCX_TLS="tcp,sm,self",
        REAL_SRUN=_which("srun") or "srun",
    )
    env["PATH"] = f"{stubs}{os.pathsep}{env['PATH']}"
    script = REPO / "examples" / "slurm" / "download-then-train.sbatch"
    job = slurm.submit(["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", str(script)], env)
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), job.output + slurm.logs()
    assert (nvme / "images" / "pytorch.sqsh").read_bytes() == image
    assert tree_of(nvme / "models" / "tiny") == blobs
    assert f"[train] {nvme}/images/pytorch.sqsh on 1 node(s), rendezvous at {slurm.node}:29500" in job.output
    assert job.output.count(f"[pyxis-stub] {nvme}/images/pytorch.sqsh") == 1
    assert job.output.count("[torchrun-stub] --nnodes=1 --nproc-per-node=1 --rdzv-backend=c10d") == 1
    for name, data in blobs.items():
        assert f"[torchrun-stub] file {name} {len(data)}" in job.output

    # Resubmitted, the staging steps move nothing and training starts again on the same files.
    again = slurm.submit(["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", str(script)], env)
    assert (again.state, again.exit_code) == ("COMPLETED", "0:0"), again.output
    nothing = again.output.count("azcp-cluster: nothing to do: ")
    assert nothing == 2 and "[download]" not in again.output and again.output.count("[torchrun-stub] --nnodes") == 1
