"""examples/, the Dockerfiles and the cluster docs: linted, validated and, where this machine allows, run.

- every shell script in examples/ and scripts/, and every script embedded in a Kubernetes
  manifest, passes shellcheck;
- the Dockerfiles pass hadolint, and what they COPY exists and is in the build context;
- the Kubernetes manifests validate against the Kubernetes schemas (kubernetes-validate,
  strict, offline) and the MPIJob against a kubeflow v2beta1 schema (examples/aks/schemas/),
  its pod templates against the Kubernetes one; broken copies of them are rejected;
- examples/slurm/stage.sbatch runs (without Slurm: the launcher is an environment variable)
  against the emulator; tests/test_slurm.py runs it under a real Slurm (slow);
- docs/usage.md names every option of the parser, every exit code, report line and JSON field.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from azcp_cluster.devtools import azurite
from azcp_cluster.errors import EXIT_CODES
from azcp_cluster.options import build_parser
from azcp_cluster.report import STAGES, Report, report_lines
from tests.conftest import REPO, clean_env, mpiexec_path, tree_of

EXAMPLES = REPO / "examples"
MANIFESTS = sorted((EXAMPLES / "aks").glob("*.yaml"))
DOCKERFILES = [REPO / "Dockerfile", EXAMPLES / "aks" / "Dockerfile.training"]
MPIJOB_SCHEMA = json.loads((EXAMPLES / "aks" / "schemas" / "mpijob-v2beta1.schema.json").read_text())
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
    if doc["kind"] == "Job":
        return [("Job", doc["spec"]["template"])]
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
    kinds = {p.name: [d["kind"] for d in _docs(p)] for p in MANIFESTS}
    assert kinds == {
        "indexed-job-init-stage.yaml": ["ServiceAccount", "Service", "Job"],
        "mpijob-stage-then-train.yaml": ["ServiceAccount", "MPIJob"],
    }


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
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


WORKER_POD = ("spec", "mpiReplicaSpecs", "Worker", "template", "spec")
INDEXED_POD = ("spec", "template", "spec")


@pytest.mark.parametrize(
    ("manifest", "index", "path", "value", "words"),
    [
        ("mpijob-stage-then-train.yaml", 1, ("spec", "mpiReplicaSpecs", "Worker", "replicas"), "four", "not of type"),
        ("mpijob-stage-then-train.yaml", 1, ("spec", "mpiReplicaSpecs"), ("rename", "mpiReplicaSpec"), "required"),
        ("mpijob-stage-then-train.yaml", 1, ("spec", "mpiImplementation"), "MVAPICH", "is not one of"),
        ("mpijob-stage-then-train.yaml", 1, ("spec", "mpiReplicaSpecs", "Launcher", "replicas"), 2, "was expected"),
        ("mpijob-stage-then-train.yaml", 1, ("spec", "runPolicy", "cleanPodPolicy"), "Always", "is not one of"),
        ("mpijob-stage-then-train.yaml", 1, (*WORKER_POD, "containers", 0, "imagePullPolicyy"), "Always", "imagePull"),
        ("mpijob-stage-then-train.yaml", 1, (*WORKER_POD, "containers", 0, "name"), DELETE, "'name' is a required"),
        ("mpijob-stage-then-train.yaml", 0, ("metadata", "annotation"), {}, "annotation"),
        ("indexed-job-init-stage.yaml", 2, ("spec", "completions"), "4", "not of type"),
        (
            "indexed-job-init-stage.yaml",
            2,
            (*INDEXED_POD, "initContainers", 0, "volumeMounts", 0, "mountPath"),
            ("rename", "mountpath"),
            "'mountPath' is a required",
        ),
        ("indexed-job-init-stage.yaml", 2, (*INDEXED_POD, "restartPolicy"), ["Never"], "not of type"),
        ("indexed-job-init-stage.yaml", 1, ("spec", "publishNotReadyAddresses"), "yes", "not of type"),
    ],
)
def test_schema_validation_rejects_a_broken_manifest(
    manifest: str, index: int, path: tuple[Any, ...], value: Any, words: str
) -> None:
    doc = _docs(EXAMPLES / "aks" / manifest)[index]
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
                    found.append((f"{manifest.name}: {where}", command[2], env))
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


def test_the_manifests_agree_with_themselves() -> None:
    sa_mpi, mpijob = _docs(EXAMPLES / "aks" / "mpijob-stage-then-train.yaml")
    worker = mpijob["spec"]["mpiReplicaSpecs"]["Worker"]["template"]
    affinity = worker["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert affinity["labelSelector"]["matchLabels"].items() <= worker["metadata"]["labels"].items()
    for _, template in _pod_templates(mpijob):
        assert template["spec"]["serviceAccountName"] == sa_mpi["metadata"]["name"]
        assert template["metadata"]["labels"]["azure.workload.identity/use"] == "true"

    sa, service, job = _docs(EXAMPLES / "aks" / "indexed-job-init-stage.yaml")
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
    assert "[cluster] 1 node, 2 ranks, 2 writers, 2 downloading" in result.stdout
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
    report = Report(verified_files=1, retries=1, retry_causes={"503": 1})
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
