"""Bearer-token auth: everything but /health needs the token; refusals are JSON 401s."""

from __future__ import annotations

import hmac

import pytest

from tests.api.conftest import TOKEN, api_running, async_test
from zoneq.api import auth
from zoneq.api.routes import ROUTES
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

WRONG = [
    None,  # no Authorization header at all
    "",  # "Bearer " with nothing after it
    "x",
    TOKEN[:-1],  # a prefix of the right one
    TOKEN + "x",
    TOKEN.upper(),
]


@async_test
async def test_every_route_but_health_refuses_without_the_right_token(store: QueueStore) -> None:
    async with api_running(store) as api:
        for method, path, _ in ROUTES:
            concrete = path.format(id="0" * 16, zone="default", domain="ok.test")
            for token in WRONG:
                status, body = await api.call(method, concrete, token=token)
                if path == "/health":
                    assert status == 200
                    continue
                assert status == 401, (method, path, token)
                assert body["error"]["status"] == 401
        # Other schemes than Bearer are refused too.
        async with api.session.get(
            api.url("/api/v1/queue"), headers={"Authorization": f"Basic {TOKEN}"}
        ) as response:
            assert response.status == 401
            assert response.headers["WWW-Authenticate"].startswith("Bearer")


@async_test
async def test_challenge_says_bearer_and_names_a_wrong_token(store: QueueStore) -> None:
    async with api_running(store) as api:
        async with api.session.get(api.url("/api/v1/queue")) as response:
            assert response.status == 401
            assert response.headers["WWW-Authenticate"] == 'Bearer realm="zoneq"'
        headers = {"Authorization": "Bearer wrong"}
        async with api.session.get(api.url("/api/v1/queue"), headers=headers) as response:
            assert 'error="invalid_token"' in response.headers["WWW-Authenticate"]
        status, _ = await api.call("GET", "/api/v1/queue")
        assert status == 200


@async_test
async def test_the_token_is_compared_in_constant_time(
    store: QueueStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every comparison goes through hmac.compare_digest (not ==, which stops at the first
    differing character and so leaks the token's prefix through timing)."""
    seen: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    async with api_running(store) as api:
        assert (await api.call("GET", "/api/v1/queue", token="guess"))[0] == 401
        assert (await api.call("GET", "/api/v1/queue"))[0] == 200
    assert seen == [(b"guess", TOKEN.encode()), (TOKEN.encode(), TOKEN.encode())]
