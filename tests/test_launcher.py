"""A launcher that started several tasks while MPI's world has one rank: exit 2 with one line.

``srun`` with an ``--mpi`` plugin the MPI does not speak (``--mpi=none``, or pmix for an MPICH
without it), or another MPI's ``mpiexec``, starts N processes that are each a one-rank job:
each would copy the whole dataset alone and exit 0. Here two plain processes carry the
variables ``srun`` sets in each task of a two-task step (as a real Slurm showed them;
tests/test_slurm.py runs the real ``srun --mpi=none``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from azcp_cluster.run.mpi import launched_tasks, launcher_mismatch
from tests.conftest import clean_env

# What `srun -n 2 --mpi=none` sets in each task (beside the job's own variables).
SRUN_TASK = {
    "SLURM_JOB_ID": "7",
    "SLURM_NTASKS": "2",
    "SLURM_NPROCS": "2",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_TASKS_PER_NODE": "2",
}
PMI_LAUNCHER = "a PMI launcher (MPICH's or Intel MPI's mpiexec, srun --mpi=pmi2)"
# A batch script's own environment in a two-task allocation: no step of its own.
BATCH = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_NPROCS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}


def _launch_without_mpi(
    tmp_path: Path, extra: dict[str, str], count: int = 2
) -> list[subprocess.CompletedProcess[str]]:
    """``count`` plain processes (no mpiexec), each with ``extra`` and its own SLURM_PROCID."""
    source = tmp_path / "src"
    source.mkdir(exist_ok=True)
    (source / "a.bin").write_bytes(b"x" * 1000)
    procs = []
    for task in range(count):
        env = clean_env({**extra, "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task)})
        env = {k: v for k, v in env.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL"))}
        cmd = [sys.executable, "-m", "azcp_cluster", str(source), str(tmp_path / "dest{rank}"), "--no-progress"]
        cmd += ["--json", str(tmp_path / f"report{task}.json")]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def test_two_srun_tasks_of_one_rank_worlds_exit_2_naming_srun_and_the_fix(tmp_path: Path) -> None:
    first, second = _launch_without_mpi(tmp_path, SRUN_TASK)
    assert (first.returncode, second.returncode) == (2, 2), first.stderr + second.stderr
    lines = [line for line in first.stderr.splitlines() if line.startswith("azcp-cluster: error")]
    assert len(lines) == 1, first.stderr
    line = lines[0]
    assert line.startswith("azcp-cluster: error [topology]: srun started 2 tasks (SLURM_STEP_NUM_TASKS=2)"), line
    assert "MPI's world has 1 rank" in line and "srun --mpi=pmix or --mpi=pmi2" in line and "srun --mpi=list" in line
    assert "mpi4py uses " in line
    assert "azcp-cluster: error" not in second.stderr  # the launcher's rank 0 speaks, once
    assert "Traceback" not in first.stderr + second.stderr
    # Nothing copied, DEST never made; the JSON report (rank 0's) says the same.
    assert not (tmp_path / "dest0").exists() and not (tmp_path / "dest1").exists()
    doc = json.loads((tmp_path / "report0.json").read_text())
    assert (doc["exit_code"], doc["error"]) == (2, line)
    assert not (tmp_path / "report1.json").exists()


def test_a_plain_process_in_a_batch_script_of_many_tasks_runs(tmp_path: Path) -> None:
    """An sbatch script of a two-task allocation that runs the tool without srun: one process, a world of one."""
    (only,) = _launch_without_mpi(tmp_path, BATCH, count=1)
    assert only.returncode == 0, only.stderr
    assert (tmp_path / "dest0" / "a.bin").read_bytes() == b"x" * 1000


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        (BATCH, None),
        ({**SRUN_TASK, "SLURM_STEP_NUM_TASKS": "1"}, None),  # srun -n 1
        ({"SLURM_STEP_NUM_TASKS": "4"}, None),  # no step id: not a step's task
        ({**SRUN_TASK, "SLURM_STEP_NUM_TASKS": "4"}, (4, "SLURM_STEP_NUM_TASKS", "srun")),
        ({"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "0"}, (3, "OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun")),
        ({"PMI_SIZE": "2", "PMI_RANK": "1"}, (2, "PMI_SIZE", PMI_LAUNCHER)),
        ({"PMI_SIZE": "two"}, None),
    ],
)
def test_launched_tasks(env: dict[str, str], expected: tuple[int, str, str] | None) -> None:
    assert launched_tasks(env) == expected


def test_no_mismatch_when_the_world_has_the_tasks() -> None:
    def library() -> str:
        return "Open MPI v5.0.3"

    assert launcher_mismatch({**SRUN_TASK}, 2, library) is None
    assert launcher_mismatch({}, 1, library) is None
    error = launcher_mismatch({"OMPI_COMM_WORLD_SIZE": "2"}, 1, library)
    assert error is not None and error.exit_code == 2
    assert "mpi4py uses Open MPI v5.0.3: launch it with the mpiexec of that MPI" in error.one_line()
