"""Unit and property tests for SOURCE URL parsing (azcp_cluster/core/source.py)."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.core.errors import UsageError, exit_code_for
from azcp_cluster.core.source import BlobSource, is_url, parse_blob_url

SECRET = "sig=TOPSECRETsignature%3D"
SAS = f"sv=2023-11-03&ss=b&sp=rl&{SECRET}"


# ---------------------------------------------------------------------------------------
# Virtual-host style


def test_virtual_host_url() -> None:
    src = parse_blob_url(f"https://myacct.blob.core.windows.net/models/llama/7b?{SAS}")
    assert src == BlobSource(
        endpoint="https://myacct.blob.core.windows.net",
        account="myacct",
        container="models",
        prefix="llama/7b",
        sas=SAS,
    )
    assert src.container_url == "https://myacct.blob.core.windows.net/models"


@pytest.mark.parametrize(
    ("url", "endpoint", "container", "prefix"),
    [
        ("https://acct.blob.core.windows.net/c0n", "https://acct.blob.core.windows.net", "c0n", ""),
        ("https://acct.blob.core.windows.net/c0n/", "https://acct.blob.core.windows.net", "c0n", ""),
        ("https://acct.blob.core.windows.net/c0n/dir/", "https://acct.blob.core.windows.net", "c0n", "dir/"),
        ("HTTPS://ACCT.Blob.Core.Windows.Net/c0n/Dir", "https://acct.blob.core.windows.net", "c0n", "Dir"),
        ("https://acct.blob.core.chinacloudapi.cn/data", "https://acct.blob.core.chinacloudapi.cn", "data", ""),
        ("https://acct.blob.core.windows.net:443/data/x", "https://acct.blob.core.windows.net:443", "data", "x"),
        ("https://acct.blob.core.windows.net/$root/x", "https://acct.blob.core.windows.net", "$root", "x"),
        (
            "https://acct.blob.core.windows.net/a-b-c/x%20y/%C3%BC",
            "https://acct.blob.core.windows.net",
            "a-b-c",
            "x y/ü",
        ),
        ("https://acct.blob.core.windows.net/abc/a%2Fb", "https://acct.blob.core.windows.net", "abc", "a/b"),
    ],
)
def test_virtual_host_variants(url: str, endpoint: str, container: str, prefix: str) -> None:
    src = parse_blob_url(url)
    assert (src.endpoint, src.account, src.container, src.prefix, src.sas) == (
        endpoint,
        "acct",
        container,
        prefix,
        None,
    )


# ---------------------------------------------------------------------------------------
# Path style (emulator, custom endpoints)


@pytest.mark.parametrize(
    ("service", "tail", "container", "prefix"),
    [
        ("http://127.0.0.1:10000", "data/ckpt", "data", "ckpt"),
        ("http://localhost:10000", "data", "data", ""),
        ("http://[::1]:10000", "data/a/b", "data", "a/b"),
        ("https://[::1]", "data", "data", ""),
        ("https://storage.example.com", "data/x", "data", "x"),
    ],
)
def test_path_style(service: str, tail: str, container: str, prefix: str) -> None:
    endpoint = f"{service}/devstoreaccount1"
    src = parse_blob_url(f"{endpoint}/{tail}?{SAS}")
    assert (src.endpoint, src.account, src.container, src.prefix, src.sas) == (
        endpoint,
        "devstoreaccount1",
        container,
        prefix,
        SAS,
    )
    assert src.container_url == f"{endpoint}/{container}"


# ---------------------------------------------------------------------------------------
# Errors: UsageError, exit code 2, and the SAS is never repeated


@pytest.mark.parametrize(
    "url",
    [
        "ftp://acct.blob.core.windows.net/data",
        "file:///tmp/data",
        "https:///data",
        "https://acct.blob.core.windows.net",
        "https://acct.blob.core.windows.net/",
        "https://acct.blob.core.windows.net//x",
        "https://acct.blob.core.windows.net/data#frag",
        "https://acct.blob.core.windows.net/UPPER",
        "https://acct.blob.core.windows.net/ab",
        "https://acct.blob.core.windows.net/a--b",
        "https://acct.blob.core.windows.net/-ab",
        "https://acct.blob.core.windows.net/ab-",
        "https://acct.blob.core.windows.net/" + "a" * 64,
        "https://acct.blob.core.windows.net/da_ta",
        "http://127.0.0.1:10000/",
        "http://127.0.0.1:10000/devstoreaccount1",
        "http://127.0.0.1:10000/devstoreaccount1/",
        "http://127.0.0.1:10000/Dev_Store/data",
        "http://127.0.0.1:10000/ab/data",
        "http://127.0.0.1:notaport/devstoreaccount1/data",
        "http://127.0.0.1:99999/devstoreaccount1/data",
        "http://[::1/devstoreaccount1/data",
    ],
)
def test_malformed_urls_raise_usage_error_without_the_sas(url: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_blob_url(f"{url}?{SAS}")
    assert exit_code_for(info.value) == 2
    assert "TOPSECRET" not in str(info.value)
    assert "TOPSECRET" not in info.value.one_line()


def test_error_names_the_url_part_that_is_wrong() -> None:
    with pytest.raises(UsageError, match="not a valid container name"):
        parse_blob_url("https://acct.blob.core.windows.net/UPPER")
    with pytest.raises(UsageError, match="unsupported scheme"):
        parse_blob_url("s3://bucket/x")
    with pytest.raises(UsageError, match="missing account"):
        parse_blob_url("http://127.0.0.1:10000/")


# ---------------------------------------------------------------------------------------
# redacted()


def test_redacted_hides_the_sas() -> None:
    src = parse_blob_url(f"https://acct.blob.core.windows.net/data/dir/file?{SAS}")
    assert src.redacted() == "https://acct.blob.core.windows.net/data/dir/file?<SAS>"
    assert parse_blob_url("https://acct.blob.core.windows.net/data").redacted() == (
        "https://acct.blob.core.windows.net/data"
    )


sas_values = st.text(st.sampled_from("abcdefXYZ0123456789%=&-_"), min_size=1, max_size=60)


@given(sas=sas_values)
@settings(max_examples=150)
def test_redacted_never_contains_the_sas(sas: str) -> None:
    secret = f"sig=QQ{sas}QQ"
    src = parse_blob_url(f"https://acct.blob.core.windows.net/data/p?sv=1&{secret}")
    assert src.sas == f"sv=1&{secret}"
    assert secret not in src.redacted()
    assert secret not in src.container_url
    assert src.redacted().endswith("?<SAS>")


# ---------------------------------------------------------------------------------------
# Round trip of generated URLs

lower_digits = "abcdefghijklmnopqrstuvwxyz0123456789"
accounts = st.text(st.sampled_from(lower_digits), min_size=3, max_size=24)
# Container names: runs of letters/digits joined by single hyphens, 3..63 characters.
containers = (
    st.lists(st.text(st.sampled_from(lower_digits), min_size=1, max_size=8), min_size=1, max_size=5)
    .map("-".join)
    .filter(lambda c: 3 <= len(c) <= 63)
)
segment = st.text(st.characters(codec="utf-8", exclude_characters="/\x00"), min_size=1, max_size=8)
prefixes = st.lists(segment, max_size=4).map("/".join)


@given(
    account=accounts,
    container=containers,
    prefix=prefixes,
    sas=st.one_of(st.none(), sas_values),
    path_style=st.booleans(),
    port=st.one_of(st.none(), st.integers(1, 65535)),
)
@settings(max_examples=200)
def test_generated_urls_round_trip(
    account: str, container: str, prefix: str, sas: str | None, path_style: bool, port: int | None
) -> None:
    host = "127.0.0.1" if path_style else f"{account}.blob.core.windows.net"
    netloc = host if port is None else f"{host}:{port}"
    endpoint = f"https://{netloc}/{account}" if path_style else f"https://{netloc}"
    url = f"{endpoint}/{container}"
    if prefix:
        url += "/" + quote(prefix, safe="/")
    if sas is not None:
        url += "?" + sas
    src = parse_blob_url(url)
    assert src == BlobSource(endpoint=endpoint, account=account, container=container, prefix=prefix, sas=sas)
    assert src.container_url == f"{endpoint}/{container}"


@given(
    st.sampled_from(["", "https://", "http://", "https://acct.blob.core.windows.net/", "http://127.0.0.1:10000/"]),
    st.text(max_size=60),
)
@settings(max_examples=300)
def test_arbitrary_text_parses_or_raises_usage_error(head: str, tail: str) -> None:
    """Whatever the input, the outcome is a BlobSource or a UsageError that does not leak the query string."""
    text = f"{head}{tail}?{SECRET}"
    try:
        src = parse_blob_url(text)
    except UsageError as exc:
        assert "TOPSECRET" not in exc.one_line()
        return
    assert src.sas is not None and src.sas.endswith(SECRET)
    assert "TOPSECRET" not in src.redacted()


# ---------------------------------------------------------------------------------------
# is_url


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("https://acct.blob.core.windows.net/c", True),
        ("http://127.0.0.1:10000/a/c", True),
        ("s3://bucket", True),
        ("git+ssh://host/x", True),
        ("/shared/data", False),
        ("relative/path", False),
        ("C:\\data", False),
        ("./https://x", False),
        ("", False),
    ],
)
def test_is_url(text: str, expected: bool) -> None:
    assert is_url(text) is expected


@pytest.mark.parametrize(
    "url",
    ["https://ab.blob.core.windows.net/container/prefix", "https://Has_Underscore.blob.core.windows.net/c"],
)
def test_virtual_host_with_an_invalid_account_is_refused(url: str) -> None:
    with pytest.raises(UsageError, match="not a storage account name"):
        parse_blob_url(url)


# ---------------------------------------------------------------------------------------
# Other clouds and custom endpoints


@pytest.mark.parametrize(
    ("url", "endpoint", "account"),
    [
        ("https://acct.blob.core.usgovcloudapi.net/data/x", "https://acct.blob.core.usgovcloudapi.net", "acct"),
        ("https://acct.blob.core.chinacloudapi.cn/data/x", "https://acct.blob.core.chinacloudapi.cn", "acct"),
        ("https://acct.blob.local.azurestack.external/data/x", "https://acct.blob.local.azurestack.external", "acct"),
        ("https://acct.z42.blob.storage.azure.net/data/x", "https://acct.z42.blob.storage.azure.net", "acct"),
        (
            "https://acct.privatelink.blob.core.windows.net/data/x",
            "https://acct.privatelink.blob.core.windows.net",
            "acct",
        ),
        ("https://acct-secondary.blob.core.windows.net/data/x", "https://acct-secondary.blob.core.windows.net", "acct"),
        # Path style: a custom endpoint (a proxy, a gateway) names the account in the path.
        ("https://storage.example.com:8443/acct/data/x", "https://storage.example.com:8443/acct", "acct"),
        ("https://10.1.2.3/acct/data/x", "https://10.1.2.3/acct", "acct"),
    ],
)
def test_other_clouds_and_custom_endpoints(url: str, endpoint: str, account: str) -> None:
    src = parse_blob_url(f"{url}?{SAS}")
    assert (src.endpoint, src.account, src.container, src.prefix, src.sas) == (endpoint, account, "data", "x", SAS)
    assert src.container_url == f"{endpoint}/data"
    assert SECRET not in src.redacted()


@pytest.mark.parametrize(
    "url",
    [
        "https://acct.z1.blob.storage.azure.net/data",  # zone numbers have two digits
        "https://acct.other.blob.core.windows.net/data",
        "https://acct-primary.blob.core.windows.net/data",
    ],
)
def test_unknown_host_forms_with_blob_are_refused(url: str) -> None:
    with pytest.raises(UsageError, match="not a storage account name"):
        parse_blob_url(url)
