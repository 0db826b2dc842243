"""Which CAs the HTTPS connections trust (azcp_cluster/azure/tls.py): one bundle for the listing and the GETs."""

from __future__ import annotations

import ssl
from pathlib import Path

import certifi
import pytest

from azcp_cluster.azure.tls import ca_bundle, sdk_verify, ssl_context
from azcp_cluster.core.errors import UsageError


def test_the_defaults_without_a_bundle() -> None:
    assert ca_bundle({}) is None
    assert sdk_verify({}) is True
    ctx = ssl_context({})
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname


def test_requests_ca_bundle_then_ssl_cert_file(tmp_path: Path) -> None:
    first, second = tmp_path / "a.pem", tmp_path / "b.pem"
    first.write_text(Path(certifi.where()).read_text())
    second.write_text(Path(certifi.where()).read_text())
    both = {"REQUESTS_CA_BUNDLE": str(first), "SSL_CERT_FILE": str(second)}
    assert ca_bundle(both) == sdk_verify(both) == str(first)
    assert ca_bundle({"SSL_CERT_FILE": str(second), "REQUESTS_CA_BUNDLE": " "}) == str(second)
    ctx = ssl_context({"SSL_CERT_FILE": str(second)})
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert ctx.cert_store_stats()["x509_ca"] > 10  # certifi's roots, and only those


def test_a_bundle_that_is_not_there_or_not_pem_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"SSL_CERT_FILE=/nonexistent/ca\.pem is not a readable certificate bundle"):
        ca_bundle({"SSL_CERT_FILE": "/nonexistent/ca.pem"})
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(UsageError, match="cannot load the certificate bundle") as info:
        ssl_context({"REQUESTS_CA_BUNDLE": str(junk)})
    assert info.value.exit_code == 2
