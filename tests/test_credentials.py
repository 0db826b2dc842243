"""Tests for credential resolution and connection strings (azcp_cluster/azure/credentials.py).

Only the pure parts: nothing here signs a request or asks for a token, so azure-storage-blob
is never imported and no network is used (token credentials are built, never called).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.azure.credentials import Authorizer, Credential, parse_connection_string, resolve_credential
from azcp_cluster.core.errors import CredentialError, UsageError, exit_code_for
from azcp_cluster.core.source import BlobSource, parse_blob_url

PLAIN = parse_blob_url("https://urlacct.blob.core.windows.net/data/ckpt")
WITH_SAS = parse_blob_url("https://urlacct.blob.core.windows.net/data/ckpt?sv=1&sig=URLSASSECRET")

CONN_KEY = (
    "DefaultEndpointsProtocol=https;AccountName=connacct;AccountKey=CONNKEYSECRET==;EndpointSuffix=core.windows.net"
)
CONN_SAS = "BlobEndpoint=https://connacct.blob.core.windows.net/;SharedAccessSignature=?sv=1&sig=CONNSASSECRET"
SECRETS = ("URLSASSECRET", "CONNKEYSECRET", "CONNSASSECRET", "ENVKEYSECRET", "ENVSASSECRET")


def never_leaks(cred: Credential) -> None:
    for text in (repr(cred), str(cred), cred.origin, cred.kind):
        for secret in SECRETS:
            assert secret not in text


# ---------------------------------------------------------------------------------------
# Precedence: SAS in URL > connection string > account + key > SAS token > anonymous


@given(
    url_sas=st.booleans(),
    conn=st.sampled_from([None, CONN_KEY, CONN_SAS]),
    key=st.booleans(),
    account=st.booleans(),
    sas_token=st.booleans(),
    noise=st.sampled_from(["", " ", "\t\n"]),
)
@settings(max_examples=200)
def test_first_match_wins(
    url_sas: bool, conn: str | None, key: bool, account: bool, sas_token: bool, noise: str
) -> None:
    env = {"AZURE_STORAGE_OTHER": "ignored"}
    if conn is not None:
        env["AZURE_STORAGE_CONNECTION_STRING"] = noise + conn + noise
    if key:
        env["AZURE_STORAGE_KEY"] = noise + "ENVKEYSECRET=="
    if account:
        env["AZURE_STORAGE_ACCOUNT"] = "envacct" + noise
    if sas_token:
        env["AZURE_STORAGE_SAS_TOKEN"] = noise + "?sv=2&sig=ENVSASSECRET"
    cred = resolve_credential(WITH_SAS if url_sas else PLAIN, env)
    never_leaks(cred)
    if url_sas:
        assert (cred.kind, cred.origin, cred.sas) == ("sas", "SAS in the URL", "sv=1&sig=URLSASSECRET")
        assert cred.account == "urlacct"
    elif conn == CONN_KEY:
        assert (cred.kind, cred.origin) == ("shared_key", "AZURE_STORAGE_CONNECTION_STRING")
        assert (cred.account, cred.account_key) == ("connacct", "CONNKEYSECRET==")
    elif conn == CONN_SAS:
        assert (cred.kind, cred.origin) == ("sas", "AZURE_STORAGE_CONNECTION_STRING")
        assert cred.sas == "sv=1&sig=CONNSASSECRET"  # the leading '?' is dropped
    elif key:
        assert (cred.kind, cred.origin) == ("shared_key", "AZURE_STORAGE_ACCOUNT/AZURE_STORAGE_KEY")
        assert cred.account_key == "ENVKEYSECRET=="
        assert cred.account == ("envacct" if account else "urlacct")
    elif sas_token:
        assert (cred.kind, cred.origin, cred.sas) == ("sas", "AZURE_STORAGE_SAS_TOKEN", "sv=2&sig=ENVSASSECRET")
    else:
        assert (cred.kind, cred.sas, cred.account_key) == ("anonymous", "", "")


def test_blank_variables_count_as_unset() -> None:
    env = {
        "AZURE_STORAGE_CONNECTION_STRING": "  ",
        "AZURE_STORAGE_KEY": "",
        "AZURE_STORAGE_ACCOUNT": "acct",
        "AZURE_STORAGE_SAS_TOKEN": " ? ",
    }
    assert resolve_credential(PLAIN, env).kind == "anonymous"
    assert resolve_credential(PLAIN, {}).kind == "anonymous"


def test_connection_string_account_falls_back_to_the_url() -> None:
    cred = resolve_credential(PLAIN, {"AZURE_STORAGE_CONNECTION_STRING": "AccountKey=CONNKEYSECRET=="})
    assert (cred.kind, cred.account, cred.account_key) == ("shared_key", "urlacct", "CONNKEYSECRET==")


def test_connection_string_sas_beats_its_key() -> None:
    cred = resolve_credential(PLAIN, {"AZURE_STORAGE_CONNECTION_STRING": CONN_KEY + ";SharedAccessSignature=sig=X"})
    assert (cred.kind, cred.sas) == ("sas", "sig=X")


@pytest.mark.parametrize(
    "conn",
    [
        "AccountName=connacct;EndpointSuffix=core.windows.net",  # neither AccountKey nor SharedAccessSignature
        "AccountName=connacct;AccountKey=",
        "garbage-CONNKEYSECRET",  # not Key=Value
        "AccountName=a;=CONNKEYSECRET",  # empty key
    ],
)
def test_unusable_connection_strings_are_usage_errors(conn: str) -> None:
    with pytest.raises(UsageError) as info:
        resolve_credential(PLAIN, {"AZURE_STORAGE_CONNECTION_STRING": conn, "AZURE_STORAGE_KEY": "fallback"})
    assert exit_code_for(info.value) == 2
    assert "CONNKEYSECRET" not in info.value.one_line()


# ---------------------------------------------------------------------------------------
# parse_connection_string


def test_parse_connection_string_example() -> None:
    assert parse_connection_string(CONN_KEY) == {
        "DefaultEndpointsProtocol": "https",
        "AccountName": "connacct",
        "AccountKey": "CONNKEYSECRET==",  # '=' inside a value is kept
        "EndpointSuffix": "core.windows.net",
    }
    assert parse_connection_string(" A = 1 ; ;B=;") == {"A": "1", "B": ""}
    assert parse_connection_string("") == {}


keys = st.text(st.sampled_from("ABCDEFGHIJKLMNOPQRSTUVWXYZabcxyz"), min_size=1, max_size=12)
values = st.text(st.sampled_from("abcXYZ0123456789+/=:.-_?&%"), max_size=40)


@given(st.dictionaries(keys, values, max_size=8))
@settings(max_examples=200)
def test_parse_connection_string_round_trip(fields: dict[str, str]) -> None:
    text = ";".join(f"{k}={v}" for k, v in fields.items())
    assert parse_connection_string(text) == fields
    assert parse_connection_string(text + ";") == fields


@given(st.text(max_size=40))
@settings(max_examples=200)
def test_parse_connection_string_gives_fields_or_usage_error(text: str) -> None:
    try:
        fields = parse_connection_string(text)
    except UsageError:
        return
    assert all(key and "=" not in key and ";" not in key for key in fields)


@given(st.text(max_size=40))
@settings(max_examples=200)
def test_parse_connection_string_never_echoes_its_input(text: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_connection_string(text + ";AccountKey=CONNKEYSECRET==;CONNKEYSECRET")
    assert "CONNKEYSECRET" not in info.value.one_line()


# ---------------------------------------------------------------------------------------
# Secrets never in repr


@given(secret=st.text(st.sampled_from("abcdefghijklmnop0123456789+/="), min_size=8, max_size=40))
@settings(max_examples=100)
def test_repr_has_no_secret(secret: str) -> None:
    marker = f"@@{secret}@@"
    for cred in (
        Credential(kind="sas", origin="o", account="acct", sas=marker),
        Credential(kind="shared_key", origin="o", account="acct", account_key=marker),
    ):
        assert marker not in repr(cred)
        assert marker not in str(cred)
        assert "acct" in repr(cred)  # the non-secret fields are still shown


# ---------------------------------------------------------------------------------------
# Authorizer, without minting (which needs azure-storage-blob)


def clock() -> float:
    return 0.0


def test_authorizer_sas_and_anonymous_urls() -> None:
    sas = Authorizer(WITH_SAS, resolve_credential(WITH_SAS, {}), clock)
    assert sas.query() == "sv=1&sig=URLSASSECRET"
    assert sas.sdk_credential() == "sv=1&sig=URLSASSECRET"
    assert sas.blob_url("ckpt/a b/ü#?.bin") == (
        "https://urlacct.blob.core.windows.net/data/ckpt/a%20b/%C3%BC%23%3F.bin?sv=1&sig=URLSASSECRET"
    )
    anon = Authorizer(PLAIN, resolve_credential(PLAIN, {}), clock)
    assert anon.query() == ""
    assert anon.sdk_credential() is None
    assert anon.headers() == {}
    assert anon.blob_url("x/~y") == "https://urlacct.blob.core.windows.net/data/x/~y"


def test_sources_are_plain_data() -> None:
    assert isinstance(PLAIN, BlobSource)
    assert PLAIN.sas is None


def test_redact_drops_query_strings_that_may_hold_a_sas() -> None:
    from azcp_cluster.run.cluster import redact

    text = "400, message='Invalid', url='https://a.blob.core.windows.net/c/x?sv=1&sig=SECRET'"
    assert "SECRET" not in redact(text)
    assert "https://a.blob.core.windows.net/c/x?<redacted>" in redact(text)


# ---------------------------------------------------------------------------------------
# Token credentials in the order, --auth / AZCP_AUTH, and the API's credential=

WORKLOAD = {
    "AZURE_CLIENT_ID": "00000000-0000-0000-0000-000000000001",
    "AZURE_TENANT_ID": "00000000-0000-0000-0000-000000000002",
    "AZURE_FEDERATED_TOKEN_FILE": "/var/run/secrets/azure/tokens/azure-identity-token",
}
HTTP = parse_blob_url("http://127.0.0.1:10000/devstoreaccount1/data")


class FakeTokenCredential:
    def __init__(self) -> None:
        self.calls = 0

    def get_token(self, *scopes: str, **kwargs: object) -> object:
        from azure.core.credentials import AccessToken

        self.calls += 1
        return AccessToken(f"TOKENSECRET{self.calls}", 2_000_000_000)


def never(env: object) -> bool:
    return False


@given(
    static=st.sampled_from([None, "url", "conn", "key", "sas_token"]),
    workload=st.booleans(),
    managed=st.booleans(),
    cli=st.booleans(),
    https=st.booleans(),
)
@settings(max_examples=200, deadline=None)  # the first example imports azure-identity
def test_tokens_come_after_the_static_credentials_and_only_over_https(
    static: str | None, workload: bool, managed: bool, cli: bool, https: bool
) -> None:
    env: dict[str, str] = {}
    if static == "conn":
        env["AZURE_STORAGE_CONNECTION_STRING"] = CONN_KEY
    elif static == "key":
        env["AZURE_STORAGE_KEY"] = "ENVKEYSECRET=="
    elif static == "sas_token":
        env["AZURE_STORAGE_SAS_TOKEN"] = "sv=2&sig=ENVSASSECRET"
    if workload:
        env.update(WORKLOAD)
    if managed:
        env["IDENTITY_ENDPOINT"] = "http://localhost:42356/msi/token"
    plain, with_sas = (PLAIN, WITH_SAS) if https else (HTTP, parse_blob_url(HTTP.container_url + "?sig=URLSASSECRET"))
    source = with_sas if static == "url" else plain
    cred = resolve_credential(source, env, cli_ready=lambda e: cli)
    never_leaks(cred)
    if static is not None:
        assert cred.kind in ("sas", "shared_key")
    elif not https or not (workload or managed or cli):
        assert cred.kind == "anonymous"
    else:
        assert cred.kind == "token" and cred.token_credential is not None
        expected = "workload identity" if workload else "managed identity" if managed else "the Azure CLI login"
        assert cred.origin.startswith(expected)


@pytest.mark.parametrize(
    ("method", "env", "kind", "origin"),
    [
        ("sas", {"AZURE_STORAGE_KEY": "K"}, "sas", "SAS in the URL"),
        ("key", {"AZURE_STORAGE_KEY": "ENVKEYSECRET=="}, "shared_key", "AZURE_STORAGE_ACCOUNT/AZURE_STORAGE_KEY"),
        ("connection-string", {"AZURE_STORAGE_CONNECTION_STRING": CONN_SAS}, "sas", "AZURE_STORAGE_CONNECTION_STRING"),
        ("sas-token", {"AZURE_STORAGE_SAS_TOKEN": "sig=S", "AZURE_STORAGE_KEY": "K"}, "sas", "AZURE_STORAGE_SAS_TOKEN"),
        ("anonymous", {"AZURE_STORAGE_KEY": "K"}, "anonymous", "anonymous access"),
        ("workload-identity", WORKLOAD, "token", "workload identity (AZURE_CLIENT_ID/"),
        ("managed-identity", {}, "token", "managed identity"),
    ],
)
def test_auth_forces_one_method_over_the_order(method: str, env: dict[str, str], kind: str, origin: str) -> None:
    # The URL carries a SAS, which would win in the automatic order.
    cred = resolve_credential(WITH_SAS, env, method)
    assert cred.kind == kind and cred.origin.startswith(origin)
    # AZCP_AUTH is the same choice from the environment; --auth wins over it.
    assert resolve_credential(WITH_SAS, {**env, "AZCP_AUTH": method}).origin == cred.origin
    assert resolve_credential(WITH_SAS, {**env, "AZCP_AUTH": "key"}, method).origin == cred.origin


@pytest.mark.parametrize(
    ("method", "env", "words"),
    [
        ("sas", {}, "--auth sas needs a SAS in the SOURCE URL"),
        ("key", {"AZURE_STORAGE_ACCOUNT": "a"}, "--auth key needs AZURE_STORAGE_KEY"),
        ("connection-string", {}, "--auth connection-string needs AZURE_STORAGE_CONNECTION_STRING"),
        ("sas-token", {"AZURE_STORAGE_SAS_TOKEN": " ? "}, "--auth sas-token needs AZURE_STORAGE_SAS_TOKEN"),
        ("workload-identity", {}, "--auth workload-identity needs AZURE_CLIENT_ID, AZURE_TENANT_ID, AZURE_FEDERATED"),
        ("azure-cli", {"PATH": "/nonexistent"}, "--auth azure-cli needs the Azure CLI ('az') on PATH"),
    ],
)
def test_a_forced_method_without_its_inputs_is_a_clear_usage_error(
    method: str, env: dict[str, str], words: str
) -> None:
    with pytest.raises(CredentialError) as info:
        resolve_credential(PLAIN, env, method)
    assert isinstance(info.value, UsageError) and exit_code_for(info.value) == 2
    assert info.value.message.startswith(words)
    assert info.value.one_line().startswith("azcp-cluster: error [credentials]: --auth ")


def test_a_method_forced_by_azcp_auth_is_named_so() -> None:
    with pytest.raises(CredentialError, match=r"^AZCP_AUTH=key needs AZURE_STORAGE_KEY"):
        resolve_credential(PLAIN, {"AZCP_AUTH": "key"})
    with pytest.raises(CredentialError, match=r"^AZCP_AUTH=workload-identity needs AZURE_CLIENT_ID"):
        resolve_credential(PLAIN, {"AZCP_AUTH": "workload-identity"})


def test_azcp_auth_must_be_a_method() -> None:
    with pytest.raises(CredentialError, match="AZCP_AUTH must be one of auto, sas, "):
        resolve_credential(PLAIN, {"AZCP_AUTH": "msi"})
    assert resolve_credential(PLAIN, {"AZCP_AUTH": " "}).kind == "anonymous"


@pytest.mark.parametrize("method", ["workload-identity", "managed-identity", "azure-cli"])
def test_bearer_tokens_need_https(method: str) -> None:
    with pytest.raises(
        CredentialError, match=r"only sent over https; http://127\.0\.0\.1:10000/devstoreaccount1 is http"
    ):
        resolve_credential(HTTP, WORKLOAD, method)
    with pytest.raises(CredentialError, match="only sent over https"):
        resolve_credential(HTTP, {}, explicit=FakeTokenCredential())


def test_the_api_credential_comes_first() -> None:
    env = {"AZURE_STORAGE_KEY": "ENVKEYSECRET==", **WORKLOAD}
    token = FakeTokenCredential()
    cred = resolve_credential(WITH_SAS, env, explicit=token)
    assert (cred.kind, cred.origin, cred.token_credential) == ("token", "credential= (FakeTokenCredential)", token)
    assert token.calls == 0  # no token until a rank needs one
    sas = resolve_credential(PLAIN, env, explicit="?sv=3&sig=APISASSECRET")
    assert (sas.kind, sas.sas, sas.origin, sas.account) == (
        "sas",
        "sv=3&sig=APISASSECRET",
        "credential= (SAS)",
        "urlacct",
    )
    assert "APISASSECRET" not in repr(sas)


def test_the_api_also_takes_azure_core_key_and_sas_credentials() -> None:
    from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential

    named = resolve_credential(PLAIN, {}, explicit=AzureNamedKeyCredential("keyacct", "APIKEYSECRET=="))
    assert (named.kind, named.account, named.account_key) == ("shared_key", "keyacct", "APIKEYSECRET==")
    sas = resolve_credential(PLAIN, {}, explicit=AzureSasCredential("?sv=1&sig=X"))
    assert (sas.kind, sas.sas) == ("sas", "sv=1&sig=X")


@pytest.mark.parametrize(
    ("explicit", "method", "words"),
    [
        (42, "auto", "credential= must be a SAS string or a TokenCredential (an object with get_token), not int"),
        (" ? ", "auto", "credential= is an empty SAS"),
        ("sig=X", "key", "credential= and auth='key' cannot be combined"),
    ],
)
def test_bad_api_credentials(explicit: object, method: str, words: str) -> None:
    with pytest.raises(CredentialError) as info:
        resolve_credential(PLAIN, {}, method, explicit)
    assert info.value.message.startswith(words)


def test_authorizer_with_a_token_credential() -> None:
    token = FakeTokenCredential()
    auth = Authorizer(PLAIN, resolve_credential(PLAIN, {}, explicit=token), lambda: 1_000_000_000.0)
    assert auth.query() == ""
    assert auth.blob_url("ckpt/a b") == "https://urlacct.blob.core.windows.net/data/ckpt/a%20b"
    assert auth.headers() == {"Authorization": "Bearer TOKENSECRET1"}
    # The listing's credential answers from the same cache: one token for the whole rank.
    assert auth.sdk_credential().get_token("https://storage.azure.com/.default").token == "TOKENSECRET1"
    assert token.calls == 1 and auth.tokens is not None and auth.tokens.issued == 1
    assert "TOKENSECRET" not in repr(auth.credential) + repr(auth.sdk_credential())
    # With a SAS in the URL but the token forced by the API, no SAS goes into the URL.
    forced = Authorizer(WITH_SAS, resolve_credential(WITH_SAS, {}, explicit=token), lambda: 1_000_000_000.0)
    assert "URLSASSECRET" not in forced.blob_url("x")


def test_other_credentials_add_no_headers() -> None:
    for env in ({}, {"AZURE_STORAGE_SAS_TOKEN": "sig=S"}):
        assert Authorizer(PLAIN, resolve_credential(PLAIN, env, cli_ready=never), clock).headers() == {}


# ---------------------------------------------------------------------------------------
# --auth on the command line, in Config and in the API


def test_auth_option_everywhere() -> None:
    from azcp_cluster.api import make_config
    from azcp_cluster.core.config import AUTH_METHODS, Config
    from azcp_cluster.options import config_from_args

    url = "https://a.blob.core.windows.net/c"
    assert config_from_args([url, "d"]).auth == "auto"
    for method in AUTH_METHODS:
        assert config_from_args([url, "d", "--auth", method]).auth == method
        assert make_config(url, "d", {"auth": method}).auth == method
    with pytest.raises(UsageError, match="argument --auth: invalid choice: 'msi'"):
        config_from_args(["s", "d", "--auth", "msi"])
    with pytest.raises(UsageError, match="--auth must be one of auto, sas, connection-string, key"):
        Config(source="s", dest="d", auth="msi").validate()
    with pytest.raises(UsageError, match="option auth cannot be 1"):
        make_config("s", "d", {"auth": 1})


# ---------------------------------------------------------------------------------------
# The SASs minted from a key


@settings(max_examples=50, deadline=None)
@given(
    account=st.from_regex(r"[a-z0-9]{3,24}", fullmatch=True),
    container=st.from_regex(r"[a-z0-9](?:[a-z0-9-]{1,61}[a-z0-9])", fullmatch=True),
    key=st.binary(min_size=16, max_size=64),
    permissions=st.sampled_from(["r", "rl"]),
    seconds=st.integers(0, 2**31),
)
def test_a_minted_sas_is_the_sdks_to_the_byte(
    account: str, container: str, key: bytes, permissions: str, seconds: int
) -> None:
    import base64
    import datetime as dt

    from azure.storage.blob import ContainerSasPermissions, generate_container_sas
    from azure.storage.blob._shared.constants import X_MS_VERSION

    from azcp_cluster.azure.credentials import container_sas

    start = dt.datetime.fromtimestamp(seconds, tz=dt.timezone.utc)
    expiry = start + dt.timedelta(hours=12)
    key64 = base64.b64encode(key).decode()
    sdk = generate_container_sas(
        account_name=account,
        container_name=container,
        account_key=key64,
        permission=ContainerSasPermissions(read=True, list=permissions == "rl"),
        start=start,
        expiry=expiry,
    )
    assert container_sas(account, container, key64, permissions, start, expiry, X_MS_VERSION) == sdk


def test_a_key_that_is_not_base64_is_a_usage_error() -> None:
    source = parse_blob_url("https://acct.blob.core.windows.net/data")
    env = {"AZURE_STORAGE_ACCOUNT": "acct", "AZURE_STORAGE_KEY": "not base64!"}
    auth = Authorizer(source, resolve_credential(source, env), clock)
    with pytest.raises(
        UsageError, match="cannot use the account key from AZURE_STORAGE_ACCOUNT/AZURE_STORAGE_KEY: it is not base64"
    ):
        auth.query()
