"""List a blob container prefix (rank 0 only) with azure-storage-blob."""

from __future__ import annotations

import base64
import contextlib
import logging
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from azcp_cluster.azure.credentials import ANONYMOUS, Authorizer, Credential, denied
from azcp_cluster.azure.netfailure import host_port, network_cause
from azcp_cluster.azure.proxies import Proxy, proxy_refused, refusal_message
from azcp_cluster.azure.tls import sdk_verify
from azcp_cluster.core.config import Config
from azcp_cluster.core.errors import ListError
from azcp_cluster.core.model import Listing
from azcp_cluster.core.naming import RawEntry, directory_prefix, select
from azcp_cluster.core.source import BlobSource

if TYPE_CHECKING:  # azure-core is imported where a listing fails, not with this module
    from azure.core.exceptions import HttpResponseError

# The SDK's logger for the error responses it decodes (its warnings are not ours to print).
_SDK_ERRORS = "azure.storage.blob._shared.response_handlers"


def _raw(props: Any) -> RawEntry:
    md5 = props.content_settings.content_md5 if props.content_settings else None
    metadata = props.metadata or {}
    return RawEntry(
        name=props.name,
        size=int(props.size or 0),
        etag=str(props.etag or ""),
        content_md5=base64.b64encode(bytes(md5)).decode("ascii") if md5 else "",
        last_modified=props.last_modified.timestamp() if props.last_modified else 0.0,
        is_folder=str(metadata.get("hdi_isfolder", "")).lower() == "true",
    )


def _tunnel_refusal(exc: BaseException) -> str | None:
    """The status and reason a proxy refused a CONNECT with, from the SDK's chain of causes
    (requests says "Tunnel connection failed: 407 Proxy Authentication Required")."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        found = re.search(r"Tunnel connection failed: (\d{3}(?: [A-Za-z][A-Za-z ]*)?)", str(current))
        if found:
            return found.group(1).strip()
        todo += [current.__cause__, current.__context__, getattr(current, "inner_exception", None)]
        todo += [a for a in getattr(current, "args", ()) if isinstance(a, BaseException)]
    return None


def _explain(
    exc: Exception, source: BlobSource, credential: Credential = ANONYMOUS, proxy: Proxy | None = None
) -> ListError:
    """A one-line cause for a listing failure; never echoes URLs (they may carry a SAS)."""
    from azure.core.exceptions import HttpResponseError, ServiceRequestError, ServiceResponseError

    if isinstance(exc, HttpResponseError):
        return _explain_answer(exc, source, credential, proxy)
    if isinstance(exc, ServiceRequestError | ServiceResponseError):
        return _explain_unreached(exc, source, proxy)
    return ListError(f"{source.redacted()}: listing failed ({type(exc).__name__})")


def _explain_answer(
    exc: HttpResponseError, source: BlobSource, credential: Credential, proxy: Proxy | None
) -> ListError:
    """:func:`_explain` for an HTTP answer (``HttpResponseError`` and its kinds): the proxy's
    refusal where the answer is the proxy's own, else what the service said, by its code."""
    from azure.core.exceptions import ClientAuthenticationError, ResourceNotFoundError

    where = source.redacted()
    if proxy is not None:
        response = getattr(exc, "response", None)
        headers = response.headers if response is not None else {}
        status = exc.status_code or 0
        if proxy_refused(proxy, status, headers):  # no x-ms-request-id: the proxy's answer
            return ListError(refusal_message(proxy, "the listing", status, str(exc.reason or "")))
    if isinstance(exc, ResourceNotFoundError):
        code = getattr(exc, "error_code", None) or "NotFound"
        if str(code) == "ContainerNotFound":
            return ListError(f"container '{source.container}' not found at {source.endpoint}")
        return ListError(f"{where}: not found ({code})")
    if isinstance(exc, ClientAuthenticationError):
        code = getattr(exc, "error_code", None) or "AuthenticationFailed"
        return ListError(f"{where}: {denied(exc.status_code or 401, str(code), credential)}")
    code = getattr(exc, "error_code", None) or exc.reason
    code = getattr(code, "value", code)  # an enum member: show Azure's own spelling
    if exc.status_code in (401, 403):
        return ListError(f"{where}: {denied(exc.status_code, str(code), credential)}")
    return ListError(f"{where}: listing failed (HTTP {exc.status_code}, {code})")


def _explain_unreached(exc: Exception, source: BlobSource, proxy: Proxy | None) -> ListError:
    """:func:`_explain` for a request that got no answer: the proxy's refusal of the tunnel, if
    that is what happened, else the network's cause (through the proxy, if any)."""
    refused = _tunnel_refusal(exc) if proxy is not None else None
    if proxy is not None and refused:
        return ListError(f"proxy {proxy.shown} refused the tunnel to {source.endpoint}: HTTP {refused}")
    through = f" through proxy {proxy.shown}" if proxy is not None else ""
    cause = network_cause(exc) or type(exc).__name__
    return ListError(f"cannot reach {host_port(source.endpoint)} ({source.endpoint}){through}: {cause}")


@contextlib.contextmanager
def _sdk_quiet() -> Iterator[None]:
    """Keep the SDK's warnings off stderr while it lists: a refusal with a page of HTML (a
    proxy's) made it log "Unexpected return type" next to our one line about it."""
    logger = logging.getLogger(_SDK_ERRORS)

    def quiet(record: logging.LogRecord) -> bool:
        return False

    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def list_source(source: BlobSource, auth: Authorizer, cfg: Config, proxy: Proxy | None = None) -> Listing:
    """Return the files under ``source`` after the prefix, marker, filter and safety rules.

    ``proxy``: the one the ranged GETs use (proxies.py), passed to the SDK explicitly and its
    own reading of the environment turned off, so that the listing and the GETs never take
    different ways (NO_PROXY read twice, two ways). Without one, the lean listing
    (bloblist.py: the same REST calls, several at once, no model objects).
    """
    if proxy is None:
        from azcp_cluster.azure.bloblist import list_blobs

        return list_blobs(source, auth, cfg)
    return list_with_sdk(source, auth, cfg, proxy)


def list_with_sdk(source: BlobSource, auth: Authorizer, cfg: Config, proxy: Proxy | None = None) -> Listing:
    """:func:`list_source` through azure-storage-blob (one page at a time, a model object per blob)."""
    from azure.core.exceptions import AzureError, ResourceNotFoundError
    from azure.storage.blob import ContainerClient

    # Through a proxy, a connection that fails is the proxy's answer (a refused tunnel, or no
    # proxy there): not asked again, which with the SDK's backoff (15 s, then longer) took a
    # minute and a half to say so.
    through: dict[str, Any] = {"retry_connect": 0} if proxy is not None else {}
    client = ContainerClient(
        account_url=source.endpoint,
        container_name=source.container,
        credential=auth.sdk_credential(),
        connection_verify=sdk_verify(),
        retry_total=cfg.max_retries,
        connection_timeout=cfg.connect_timeout,
        read_timeout=cfg.read_timeout,
        use_env_settings=False,
        proxies={source.endpoint.split(":", 1)[0].lower(): proxy.url} if proxy is not None else None,
        **through,
    )
    try:
        with client, _sdk_quiet():
            exact = None
            if source.prefix and not source.prefix.endswith("/"):
                try:
                    exact = _raw(client.get_blob_client(source.prefix).get_blob_properties())
                except ResourceNotFoundError as exc:
                    if str(getattr(exc, "error_code", "")) == "ContainerNotFound":
                        raise
                if exact is not None and not exact.is_folder:
                    return select(source.prefix, exact, (), cfg.include, cfg.exclude)
            listed = client.list_blobs(name_starts_with=directory_prefix(source.prefix) or None, include=["metadata"])
            return select(source.prefix, None, (_raw(b) for b in listed), cfg.include, cfg.exclude)
    except ListError:
        raise
    except AzureError as exc:
        raise _explain(exc, source, auth.credential, proxy) from None
