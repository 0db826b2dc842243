"""Token credentials from azure-identity: which one applies, and building it (lazily).

The choice is made from the environment alone, without any network call, so that every
rank makes the same choice quickly and a run with no credential (anonymous) stays fast and
never waits on an endpoint that is not there:

* workload identity when ``AZURE_CLIENT_ID``, ``AZURE_TENANT_ID`` and
  ``AZURE_FEDERATED_TOKEN_FILE`` are all set (AKS and other federated setups);
* managed identity when the environment names a managed-identity endpoint
  (``IDENTITY_ENDPOINT``: App Service, Functions, Container Apps, Azure ML, Arc;
  ``MSI_ENDPOINT``: Cloud Shell). The VM/VMSS metadata endpoint (IMDS) is never probed:
  there, ``--auth managed-identity`` (or ``AZCP_AUTH=managed-identity``) selects it;
* the Azure CLI when ``az`` is on ``PATH`` and has a login profile with at least one
  account (``$AZURE_CONFIG_DIR`` or ``~/.azure``, ``azureProfile.json``).

azure-identity is imported only when one of them is built.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from typing import Any

from azcp_cluster.core.errors import CredentialError

WORKLOAD_VARS = ("AZURE_CLIENT_ID", "AZURE_TENANT_ID", "AZURE_FEDERATED_TOKEN_FILE")
MANAGED_IDENTITY_VARS = ("IDENTITY_ENDPOINT", "MSI_ENDPOINT")
TOKEN_METHODS = ("workload-identity", "managed-identity", "azure-cli")

ORIGINS = {
    "workload-identity": "workload identity (AZURE_CLIENT_ID/AZURE_TENANT_ID/AZURE_FEDERATED_TOKEN_FILE)",
    "managed-identity": "managed identity",
    "azure-cli": "the Azure CLI login",
}


def _set(env: Mapping[str, str], name: str) -> bool:
    return bool(env.get(name, "").strip())


def az_on_path(env: Mapping[str, str]) -> bool:
    """Whether an ``az`` executable is on the ``PATH`` of ``env``."""
    path = env.get("PATH", "")
    return bool(path) and shutil.which("az", path=path) is not None


def az_logged_in(env: Mapping[str, str]) -> bool:
    """Whether the Azure CLI's profile (read from disk, no process started) lists an account."""
    config_dir = env.get("AZURE_CONFIG_DIR", "").strip()
    if not config_dir:
        home = env.get("HOME", "").strip()
        if not home:
            return False
        config_dir = os.path.join(home, ".azure")
    try:
        with open(os.path.join(config_dir, "azureProfile.json"), encoding="utf-8-sig") as fh:
            profile = json.load(fh)
    except (OSError, ValueError):
        return False
    return isinstance(profile, dict) and bool(profile.get("subscriptions"))


def automatic_method(
    env: Mapping[str, str],
    *,
    cli_ready: Callable[[Mapping[str, str]], bool] | None = None,
) -> str | None:
    """The token method the automatic order picks from ``env``, or None (then: anonymous).

    ``cli_ready`` decides whether the Azure CLI is usable (default: ``az`` on ``PATH`` and
    a login profile on disk); tests inject it.
    """
    if all(_set(env, name) for name in WORKLOAD_VARS):
        return "workload-identity"
    if any(_set(env, name) for name in MANAGED_IDENTITY_VARS):
        return "managed-identity"
    ready = cli_ready or (lambda e: az_on_path(e) and az_logged_in(e))
    if ready(env):
        return "azure-cli"
    return None


def check_inputs(method: str, env: Mapping[str, str], label: str = "") -> None:
    """Raise :class:`CredentialError` when a forced ``method`` lacks what it needs in ``env``.

    ``label`` names how it was forced in the message (default ``--auth METHOD``).
    """
    label = label or f"--auth {method}"
    if method == "workload-identity":
        missing = [name for name in WORKLOAD_VARS if not _set(env, name)]
        if missing:
            raise CredentialError(f"{label} needs {', '.join(missing)} in the environment")
    elif method == "azure-cli" and not az_on_path(env):
        raise CredentialError(f"{label} needs the Azure CLI ('az') on PATH")


def build(method: str, env: Mapping[str, str]) -> Any:
    """The azure-identity credential for ``method`` (one of :data:`TOKEN_METHODS`)."""
    try:
        import azure.identity as identity
    except ImportError:  # pragma: no cover - a declared dependency
        raise CredentialError(f"--auth {method} needs the azure-identity package") from None
    try:
        if method == "workload-identity":
            return identity.WorkloadIdentityCredential(
                tenant_id=env["AZURE_TENANT_ID"].strip(),
                client_id=env["AZURE_CLIENT_ID"].strip(),
                token_file_path=env["AZURE_FEDERATED_TOKEN_FILE"].strip(),
            )
        if method == "managed-identity":
            # AZURE_CLIENT_ID names a user-assigned identity; without it, the system-assigned one.
            client_id = env.get("AZURE_CLIENT_ID", "").strip() or None
            return identity.ManagedIdentityCredential(client_id=client_id)
        if method == "azure-cli":
            return identity.AzureCliCredential()
    except ValueError as exc:  # malformed tenant or client IDs
        from azcp_cluster.azure.tokens import summarize

        raise CredentialError(f"cannot use {ORIGINS[method]}: {summarize(exc)}") from None
    raise ValueError(f"not a token method: {method!r}")
