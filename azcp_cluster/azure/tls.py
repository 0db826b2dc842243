"""Which certificate authorities the HTTPS connections trust.

By default, the system's (OpenSSL's default paths) for the ranged GETs and the listing
(bloblist.py), and certifi's for the SDK's listing through a proxy (requests).
``REQUESTS_CA_BUNDLE`` or ``SSL_CERT_FILE`` (the first one set) names a PEM bundle that then
replaces both, so a private CA (a TLS-inspecting proxy, a
private endpoint with its own certificate, the emulator over HTTPS) is configured once.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping

from azcp_cluster.core.errors import UsageError

CA_BUNDLE_VARS = ("REQUESTS_CA_BUNDLE", "SSL_CERT_FILE")


def ca_bundle(env: Mapping[str, str] | None = None) -> str | None:
    """The PEM bundle named by the environment, or None for the defaults.

    Raises :class:`UsageError` when the variable names no readable file.
    """
    env = os.environ if env is None else env
    for name in CA_BUNDLE_VARS:
        path = env.get(name, "").strip()
        if path:
            if not os.path.isfile(path):
                raise UsageError(f"{name}={path} is not a readable certificate bundle")
            return path
    return None


def ssl_context(env: Mapping[str, str] | None = None) -> ssl.SSLContext:
    """A client TLS context (hostname and certificate checks on) trusting :func:`ca_bundle`."""
    bundle = ca_bundle(env)
    try:
        return ssl.create_default_context(cafile=bundle)
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(f"cannot load the certificate bundle {bundle}: {exc.__class__.__name__}") from None


def sdk_verify(env: Mapping[str, str] | None = None) -> str | bool:
    """azure-core's ``connection_verify``: the bundle's path, or True for the defaults."""
    return ca_bundle(env) or True
