"""Tests for credential resolution and connection strings (azcp_cluster/credentials.py).

Only the pure parts: nothing here signs a request, so azure-storage-blob is never imported.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.credentials import Authorizer, Credential, parse_connection_string, resolve_credential
from azcp_cluster.errors import UsageError, exit_code_for
from azcp_cluster.source import BlobSource, parse_blob_url

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
    from azcp_cluster.cluster import redact

    text = "400, message='Invalid', url='https://a.blob.core.windows.net/c/x?sv=1&sig=SECRET'"
    assert "SECRET" not in redact(text)
    assert "https://a.blob.core.windows.net/c/x?<redacted>" in redact(text)
