"""Bearer tokens for Azure Storage: obtained on first use, cached, refreshed before expiry.

One :class:`TokenCache` per rank and run, around any azure-core ``TokenCredential``
(azure-identity's, or one given to :func:`azcp_cluster.stage`). Only the ranks that need a
token ask for one: the lister (through :class:`SdkTokenCredential`, for azure-storage-blob)
and each downloading rank (``Authorization`` headers of its ranged GETs).

The refresh rule is pure (:func:`refresh_time`) and the clock is injected. Tokens never
appear in a ``repr``, a message or a report; failures of the credential become one
:class:`CredentialError` line.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from azcp_cluster.core.errors import CredentialError

# The Azure Storage resource, the same in every cloud; a token for it is valid for every
# storage account the identity may read.
STORAGE_SCOPE = "https://storage.azure.com/.default"
# Refresh when less than this is left (azure-core's own margin), or after half the
# lifetime for tokens that live shorter than twice this.
REFRESH_MARGIN = 300.0
# After a failed refresh while the old token is still good: try again this much later.
RETRY_AFTER_FAILURE = 30.0
# An old token is kept after a failed refresh only while it has at least this long left.
MIN_REMAINING = 10.0
# Longest cause taken over from an azure-identity message.
MAX_CAUSE = 240


def refresh_time(issued_at: float, expires_on: float, margin: float = REFRESH_MARGIN) -> float:
    """When a token obtained at ``issued_at`` that expires at ``expires_on`` should be replaced.

    ``margin`` before expiry, but never earlier than half-way through its lifetime; a
    token that is already expired is due at once.
    """
    lifetime = max(0.0, expires_on - issued_at)
    return expires_on - min(margin, lifetime / 2)


def summarize(exc: BaseException) -> str:
    """One short line from a credential's exception: its first line, without URLs' query strings."""
    from azcp_cluster.run.cluster import redact

    text = str(getattr(exc, "message", "") or exc)
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    first = redact(" ".join(first.split()))
    if len(first) > MAX_CAUSE:
        first = first[: MAX_CAUSE - 3] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


class TokenCache:
    """The current token of one credential for one scope; thread-safe.

    ``clock`` returns seconds since the epoch (tokens' ``expires_on`` are epoch seconds).
    """

    def __init__(
        self,
        credential: Any,
        origin: str,
        clock: Callable[[], float],
        scope: str = STORAGE_SCOPE,
        margin: float = REFRESH_MARGIN,
    ) -> None:
        self.credential = credential
        self.origin = origin
        self.scope = scope
        self.issued = 0  # tokens obtained so far (refreshes included)
        self._clock = clock
        self._margin = margin
        self._lock = threading.Lock()
        self._token = ""
        self._expires_on = 0.0
        self._due = 0.0

    def __repr__(self) -> str:
        return f"TokenCache(origin={self.origin!r}, scope={self.scope!r}, issued={self.issued})"

    def get(self) -> tuple[str, float]:
        """The current token and its expiry, obtained or refreshed when due.

        A refresh that fails while the cached token still has :data:`MIN_REMAINING` seconds
        keeps it and retries after :data:`RETRY_AFTER_FAILURE`; otherwise the failure is a
        :class:`CredentialError`.
        """
        with self._lock:
            now = self._clock()
            if self._token and now < self._due:
                return self._token, self._expires_on
            try:
                token, expires_on = self._fetch()
            except CredentialError:
                if self._token and now < self._expires_on - MIN_REMAINING:
                    self._due = min(now + RETRY_AFTER_FAILURE, self._expires_on - MIN_REMAINING)
                    return self._token, self._expires_on
                raise
            self.issued += 1
            self._token, self._expires_on = token, expires_on
            self._due = refresh_time(now, expires_on, self._margin)
            return token, expires_on

    def _fetch(self) -> tuple[str, float]:
        try:
            access = self.credential.get_token(self.scope)
            token, expires_on = access.token, float(access.expires_on)
        except CredentialError:
            raise
        except Exception as exc:  # azure-identity raises many kinds, with long texts
            raise CredentialError(f"cannot get a token from {self.origin}: {summarize(exc)}") from None
        if not isinstance(token, str) or not token:
            raise CredentialError(f"cannot get a token from {self.origin}: it returned an empty token")
        return token, expires_on

    def header(self) -> dict[str, str]:
        """The ``Authorization`` header for a request."""
        return {"Authorization": f"Bearer {self.get()[0]}"}


class SdkTokenCredential:
    """A ``TokenCredential`` for azure-storage-blob that answers from a :class:`TokenCache`.

    The lister and the downloads of one rank then share one token. Requests for another
    scope, or with claims or a tenant (challenges), go to the wrapped credential directly.
    """

    def __init__(self, cache: TokenCache) -> None:
        self._cache = cache

    def __repr__(self) -> str:
        return f"SdkTokenCredential({self._cache!r})"

    def get_token(self, *scopes: str, **kwargs: Any) -> Any:
        """An ``azure.core.credentials.AccessToken`` for ``scopes``."""
        from azure.core.credentials import AccessToken

        plain = {k: v for k, v in kwargs.items() if v and k != "enable_cae"}
        if scopes == (self._cache.scope,) and not plain:
            token, expires_on = self._cache.get()
            return AccessToken(token, int(expires_on))
        try:
            return self._cache.credential.get_token(*scopes, **kwargs)
        except Exception as exc:
            raise CredentialError(f"cannot get a token from {self._cache.origin}: {summarize(exc)}") from None
