"""Bearer tokens: the refresh rule and the per-rank cache (azcp_cluster/azure/tokens.py), with an injected clock.

No network and no azure-identity: the credentials here are fakes that count their calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.azure.tokens import (
    MIN_REMAINING,
    REFRESH_MARGIN,
    RETRY_AFTER_FAILURE,
    STORAGE_SCOPE,
    SdkTokenCredential,
    TokenCache,
    refresh_time,
    summarize,
)
from azcp_cluster.core.errors import CredentialError, UsageError

HOUR = 3600.0
T0 = 1_700_000_000.0


@dataclass
class Token:
    token: str
    expires_on: float


@dataclass
class FakeCredential:
    """Issues SECRET-1, SECRET-2, ... each living ``lifetime`` seconds; fails while ``failing``."""

    clock: Clock
    lifetime: float = HOUR
    failing: BaseException | None = None
    calls: list[tuple[tuple[str, ...], dict[str, Any]]] = field(default_factory=list)

    def get_token(self, *scopes: str, **kwargs: Any) -> Token:
        self.calls.append((scopes, kwargs))
        if self.failing is not None:
            raise self.failing
        return Token(f"SECRET-{len(self.calls)}", self.clock.now + self.lifetime)


@dataclass
class Clock:
    now: float = T0

    def __call__(self) -> float:
        return self.now


def cache_with(lifetime: float = HOUR) -> tuple[TokenCache, FakeCredential, Clock]:
    clock = Clock()
    cred = FakeCredential(clock, lifetime)
    return TokenCache(cred, "the test credential", clock), cred, clock


# ---------------------------------------------------------------------------------------
# refresh_time: 5 minutes before expiry, or half-way for short-lived tokens


def test_refresh_time_examples() -> None:
    assert refresh_time(T0, T0 + HOUR) == T0 + HOUR - REFRESH_MARGIN  # azure-identity's usual 1 h token
    assert refresh_time(T0, T0 + 24 * HOUR) == T0 + 24 * HOUR - 300  # managed identity: 24 h
    assert refresh_time(T0, T0 + 60) == T0 + 30  # short-lived: half-way
    assert refresh_time(T0, T0 + 0.002) == T0 + 0.001
    assert refresh_time(T0, T0 - 5) == T0 - 5  # already expired: due at once


@given(issued=st.floats(0, 2e9), lifetime=st.floats(0, 1e6), margin=st.floats(0, 1e4))
@settings(max_examples=300)
def test_refresh_time_is_within_the_lifetime(issued: float, lifetime: float, margin: float) -> None:
    due = refresh_time(issued, issued + lifetime, margin)
    assert issued - 1e-6 <= due <= issued + lifetime + 1e-6
    assert due >= issued + lifetime - margin - 1e-6  # never earlier than the margin asks
    assert due >= issued + lifetime / 2 - 1e-6  # nor earlier than half-way


# ---------------------------------------------------------------------------------------
# TokenCache


def test_first_use_fetches_then_the_token_is_reused_until_due() -> None:
    cache, cred, clock = cache_with()
    assert cred.calls == []  # nothing until a rank needs a token
    assert cache.header() == {"Authorization": "Bearer SECRET-1"}
    assert cred.calls == [((STORAGE_SCOPE,), {})]
    clock.now = T0 + HOUR - REFRESH_MARGIN - 1
    assert cache.get() == ("SECRET-1", T0 + HOUR)
    assert cache.issued == 1
    clock.now = T0 + HOUR - REFRESH_MARGIN  # 5 minutes left: refreshed
    assert cache.get() == ("SECRET-2", clock.now + HOUR)
    assert cache.issued == 2 and len(cred.calls) == 2


def test_a_long_run_refreshes_about_once_per_lifetime() -> None:
    cache, _cred, clock = cache_with(lifetime=HOUR)
    seen = set()
    for _ in range(10 * 3600):  # ten hours, a request a second
        seen.add(cache.get()[0])
        clock.now += 1
    assert 10 <= cache.issued <= 12 and len(seen) == cache.issued


def test_short_lived_tokens_are_refreshed_half_way() -> None:
    cache, _cred, clock = cache_with(lifetime=60)
    cache.get()
    clock.now = T0 + 29.9
    assert cache.get()[0] == "SECRET-1"
    clock.now = T0 + 30
    assert cache.get()[0] == "SECRET-2"


def test_a_failed_refresh_keeps_a_token_that_is_still_good() -> None:
    cache, cred, clock = cache_with()
    cache.get()
    cred.failing = RuntimeError("AADSTS90002: tenant not found\nTrace ID: x")
    clock.now = T0 + HOUR - 200  # due, 200 s left
    assert cache.get()[0] == "SECRET-1"
    calls = len(cred.calls)
    clock.now += RETRY_AFTER_FAILURE - 1
    assert cache.get()[0] == "SECRET-1" and len(cred.calls) == calls  # no retry storm
    clock.now += 1
    assert cache.get()[0] == "SECRET-1" and len(cred.calls) == calls + 1  # tried again
    cred.failing = None
    clock.now += RETRY_AFTER_FAILURE
    assert cache.get()[0] == "SECRET-4"


def test_a_failed_refresh_of_an_almost_expired_token_is_an_error() -> None:
    cache, cred, clock = cache_with()
    cache.get()
    cred.failing = RuntimeError("down")
    clock.now = T0 + HOUR - MIN_REMAINING + 0.5
    with pytest.raises(CredentialError):
        cache.get()


def test_errors_are_one_short_line_with_exit_code_2() -> None:
    cache, cred, _clock = cache_with()
    message = "ManagedIdentityCredential authentication unavailable. " + "x" * 1000 + "\nsecond line\n  Trace ID"
    cred.failing = RuntimeError(message)
    with pytest.raises(CredentialError) as info:
        cache.get()
    error = info.value
    assert isinstance(error, UsageError) and error.exit_code == 2
    line = error.one_line()
    assert line.startswith(
        "azcp-cluster: error [credentials]: cannot get a token from the test credential: "
        "RuntimeError: ManagedIdentityCredential authentication unavailable."
    )
    assert "second line" not in line and "\n" not in line and len(line) < 400


@pytest.mark.parametrize("token", ["", None])
def test_an_empty_token_is_an_error(token: str | None) -> None:
    class Empty:
        def get_token(self, *scopes: str, **kwargs: Any) -> Token:
            return Token(token, T0 + HOUR)  # type: ignore[arg-type]

    with pytest.raises(CredentialError, match="returned an empty token"):
        TokenCache(Empty(), "o", Clock()).get()


def test_tokens_are_never_in_reprs() -> None:
    cache, _cred, _clock = cache_with()
    cache.get()
    for text in (repr(cache), str(cache), repr(SdkTokenCredential(cache))):
        assert "SECRET" not in text


def test_summarize_drops_query_strings() -> None:
    exc = RuntimeError("GET https://login.example/token?client_assertion=SECRETJWT failed")
    assert "SECRETJWT" not in summarize(exc)
    assert summarize(RuntimeError("")) == "RuntimeError"


# ---------------------------------------------------------------------------------------
# SdkTokenCredential: what azure-storage-blob's listing calls


def test_the_listing_shares_the_downloads_token() -> None:
    cache, cred, _clock = cache_with()
    sdk = SdkTokenCredential(cache)
    access = sdk.get_token(STORAGE_SCOPE)
    assert (access.token, access.expires_on) == ("SECRET-1", int(T0 + HOUR))
    assert cache.header() == {"Authorization": "Bearer SECRET-1"}
    assert sdk.get_token(STORAGE_SCOPE, enable_cae=False).token == "SECRET-1"
    assert len(cred.calls) == 1


def test_other_scopes_and_challenges_go_to_the_credential() -> None:
    cache, cred, _clock = cache_with()
    sdk = SdkTokenCredential(cache)
    assert sdk.get_token("https://acct.blob.core.windows.net/.default").token == "SECRET-1"
    assert sdk.get_token(STORAGE_SCOPE, claims="{...}").token == "SECRET-2"
    assert cred.calls[1] == ((STORAGE_SCOPE,), {"claims": "{...}"})
    cred.failing = RuntimeError("no\nway")
    with pytest.raises(CredentialError, match=r"cannot get a token from the test credential: RuntimeError: no$"):
        sdk.get_token(STORAGE_SCOPE, tenant_id="t")
