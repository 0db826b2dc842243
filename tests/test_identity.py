"""Which azure-identity credential applies (azcp_cluster/azure/identity.py): the selection, not the network.

Nothing here asks for a token: no IMDS, no Azure AD, no `az` process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from azcp_cluster.azure import identity
from azcp_cluster.core.errors import CredentialError

WORKLOAD = {
    "AZURE_CLIENT_ID": "00000000-0000-0000-0000-000000000001",
    "AZURE_TENANT_ID": "00000000-0000-0000-0000-000000000002",
    "AZURE_FEDERATED_TOKEN_FILE": "/var/run/secrets/azure/tokens/azure-identity-token",
}


def never(env: object) -> bool:
    return False


def always(env: object) -> bool:
    return True


@pytest.mark.parametrize(
    ("env", "cli", "method"),
    [
        ({}, never, None),
        ({}, always, "azure-cli"),
        (WORKLOAD, always, "workload-identity"),
        ({**WORKLOAD, "IDENTITY_ENDPOINT": "http://localhost:42356/msi/token"}, always, "workload-identity"),
        ({"IDENTITY_ENDPOINT": "http://localhost:42356/msi/token"}, always, "managed-identity"),
        ({"MSI_ENDPOINT": "http://localhost:50342/oauth2/token"}, never, "managed-identity"),
        # Incomplete or blank workload variables are not workload identity.
        ({**WORKLOAD, "AZURE_FEDERATED_TOKEN_FILE": " "}, never, None),
        ({"AZURE_CLIENT_ID": WORKLOAD["AZURE_CLIENT_ID"]}, never, None),  # alone, it names no endpoint
        ({"AZURE_CLIENT_ID": WORKLOAD["AZURE_CLIENT_ID"], "AZURE_TENANT_ID": "t"}, always, "azure-cli"),
    ],
)
def test_automatic_order(env: dict[str, str], cli: object, method: str | None) -> None:
    assert identity.automatic_method(env, cli_ready=cli) == method  # type: ignore[arg-type]


def test_the_vm_metadata_endpoint_is_never_chosen_automatically() -> None:
    # A VM has no variable that says so; the choice needs --auth managed-identity.
    assert identity.automatic_method({"PATH": "/nonexistent", "HOME": "/nonexistent"}) is None


def _profile(directory: Path, content: str | bytes) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    data = content.encode() if isinstance(content, str) else content
    (directory / "azureProfile.json").write_bytes(data)


def test_az_logged_in_reads_the_profile(tmp_path: Path) -> None:
    logged = {"subscriptions": [{"id": "s", "isDefault": True}]}
    _profile(tmp_path / "home" / ".azure", "\ufeff" + json.dumps(logged))  # az writes a BOM
    assert identity.az_logged_in({"HOME": str(tmp_path / "home")})
    _profile(tmp_path / "config", json.dumps(logged))
    assert identity.az_logged_in({"AZURE_CONFIG_DIR": str(tmp_path / "config"), "HOME": "/nonexistent"})
    _profile(tmp_path / "out", json.dumps({"subscriptions": []}))  # after `az logout`
    assert not identity.az_logged_in({"AZURE_CONFIG_DIR": str(tmp_path / "out")})
    _profile(tmp_path / "bad", b"{not json")
    assert not identity.az_logged_in({"AZURE_CONFIG_DIR": str(tmp_path / "bad")})
    _profile(tmp_path / "list", "[]")
    assert not identity.az_logged_in({"AZURE_CONFIG_DIR": str(tmp_path / "list")})
    assert not identity.az_logged_in({"AZURE_CONFIG_DIR": str(tmp_path / "missing")})
    assert not identity.az_logged_in({})


def test_az_on_path(tmp_path: Path) -> None:
    az = tmp_path / "bin" / "az"
    az.parent.mkdir()
    az.write_text("#!/bin/sh\n")
    assert not identity.az_on_path({"PATH": str(az.parent)})  # not executable
    az.chmod(0o755)
    assert identity.az_on_path({"PATH": f"/nonexistent:{az.parent}"})
    assert not identity.az_on_path({"PATH": "/nonexistent"})
    assert not identity.az_on_path({})


def test_the_cli_is_automatic_only_when_installed_and_logged_in(tmp_path: Path) -> None:
    az = tmp_path / "bin" / "az"
    az.parent.mkdir()
    az.write_text("#!/bin/sh\nexit 1\n")
    az.chmod(0o755)
    env = {"PATH": str(az.parent), "AZURE_CONFIG_DIR": str(tmp_path / "cfg")}
    assert identity.automatic_method(env) is None
    _profile(tmp_path / "cfg", json.dumps({"subscriptions": [{"id": "s"}]}))
    assert identity.automatic_method(env) == "azure-cli"
    assert identity.automatic_method({**env, "PATH": "/nonexistent"}) is None


def test_forced_methods_name_what_is_missing() -> None:
    with pytest.raises(CredentialError) as info:
        identity.check_inputs("workload-identity", {"AZURE_TENANT_ID": "t"})
    assert info.value.exit_code == 2
    assert info.value.message == (
        "--auth workload-identity needs AZURE_CLIENT_ID, AZURE_FEDERATED_TOKEN_FILE in the environment"
    )
    with pytest.raises(CredentialError, match=r"--auth azure-cli needs the Azure CLI \('az'\) on PATH"):
        identity.check_inputs("azure-cli", {"PATH": "/nonexistent"})
    identity.check_inputs("workload-identity", WORKLOAD)
    identity.check_inputs("managed-identity", {})  # nothing required: the system-assigned identity


def test_build_makes_the_azure_identity_credentials_without_asking_for_a_token() -> None:
    from azure.identity import AzureCliCredential, ManagedIdentityCredential, WorkloadIdentityCredential

    assert isinstance(identity.build("workload-identity", WORKLOAD), WorkloadIdentityCredential)
    assert isinstance(identity.build("managed-identity", {}), ManagedIdentityCredential)
    assert isinstance(identity.build("managed-identity", {"AZURE_CLIENT_ID": "c"}), ManagedIdentityCredential)
    assert isinstance(identity.build("azure-cli", {}), AzureCliCredential)


def test_build_maps_a_refused_configuration_to_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import azure.identity

    def refuse(**kwargs: object) -> None:
        raise ValueError("Invalid tenant ID provided.\nYou can locate your tenant ID by following the instructions")

    monkeypatch.setattr(azure.identity, "WorkloadIdentityCredential", refuse)
    with pytest.raises(CredentialError) as info:
        identity.build("workload-identity", WORKLOAD)
    assert info.value.one_line() == (
        "azcp-cluster: error [credentials]: cannot use workload identity (AZURE_CLIENT_ID/AZURE_TENANT_ID/"
        "AZURE_FEDERATED_TOKEN_FILE): ValueError: Invalid tenant ID provided."
    )
