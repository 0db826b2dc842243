# syntax=docker/dockerfile:1
# azcp-cluster with an MPI runtime: the distribution's Open MPI, which is built with UCX
# (InfiniBand, RoCE, shared memory) wherever the distribution builds UCX. One image for
# linux/amd64 and linux/arm64: every base image and package here exists for both, and every
# Python dependency installs from a binary wheel on both (no compiler in any stage).
#
#   docker buildx build --platform linux/amd64,linux/arm64 -t azcp-cluster .
#   docker run --rm azcp-cluster --help
#   docker run --rm --user azcp -v /mnt/nvme:/mnt/nvme azcp-cluster SOURCE /mnt/nvme/data   # as non-root
#   docker buildx build --target ssh -t azcp-cluster:ssh .   # plus sshd, for a hand-rolled MPI bootstrap
#
# It runs as root unless asked otherwise: `--user azcp` (uid 10001), or in Kubernetes
# securityContext.runAsUser: 10001; nothing in the image needs root, only a DEST the user
# cannot write does. How this file was checked: docs/troubleshooting.md ("The container image").

ARG PYTHON_IMAGE=python:3.12-slim-bookworm

# --- build: the package and its dependencies in a virtual environment, from wheels only.
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY azcp_cluster ./azcp_cluster
# The azcp-cluster command, a script of the package (pyproject.toml: script-files).
COPY bin/azcp-cluster ./bin/
RUN python -m venv /opt/azcp \
    && /opt/azcp/bin/pip install --only-binary=:all: . \
    && /opt/azcp/bin/azcp-cluster --version

# --- runtime: Python, Open MPI (+ UCX), the environment; no compiler, no pip cache, no apt lists.
FROM ${PYTHON_IMAGE} AS runtime
# The distribution's packages, not pinned: the base image's tag pins the release, and its
# security updates are wanted. ucx-utils (ucx_info, for troubleshooting) where it exists.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends openmpi-bin \
    && { apt-get install -y --no-install-recommends ucx-utils || echo "no ucx-utils on $(dpkg --print-architecture)"; } \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 azcp \
    && useradd --system --uid 10001 --gid azcp --create-home --home-dir /home/azcp --shell /bin/bash azcp
COPY --from=build /opt/azcp /opt/azcp
ENV PATH=/opt/azcp/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    OMPI_MCA_btl_vader_single_copy_mechanism=none
# (Open MPI's single-copy shared memory needs ptrace rights that containers rarely have.)
RUN azcp-cluster --version \
    && python -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
WORKDIR /home/azcp
LABEL org.opencontainers.image.title="azcp-cluster" \
      org.opencontainers.image.description="Stage one dataset from Azure Blob Storage or a shared path onto every node: download once, broadcast over MPI" \
      org.opencontainers.image.licenses="MIT"
ENTRYPOINT ["azcp-cluster"]
CMD ["--help"]

# --- ssh: the runtime plus sshd and ssh, for launchers that start ranks over ssh
# (examples/aks/indexed-job/indexed-job-init-stage.yaml). Runs as root: sshd needs it.
FROM runtime AS ssh
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends openssh-server openssh-client \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /run/sshd
ENV OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# --- the default target is the runtime.
FROM runtime
