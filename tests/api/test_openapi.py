"""The OpenAPI document matches the application's routes exactly, and the API answers as
the document says (status codes listed for each operation)."""

from __future__ import annotations

import pytest

from tests.api.conftest import api_running, async_test, make_config
from zoneq.api.app import create_app
from zoneq.queue.service import QueueService
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration


def registered(store: QueueStore) -> set[tuple[str, str]]:
    config = make_config()
    app = create_app(
        store, QueueService.from_config(store, config), config, token="t" * 16, clock=lambda: 0
    )
    found = set()
    for route in app.router.routes():
        if route.method == "OPTIONS":
            continue
        # HEAD counts: add_route("GET") does not add it, so each HEAD is one routes.py
        # registers and the document must list.
        info = route.resource.get_info() if route.resource else {}
        path = info.get("path") or info.get("formatter")
        found.add((route.method.lower(), str(path)))
    return found


@async_test
async def test_document_paths_and_methods_equal_the_routes(store: QueueStore) -> None:
    async with api_running(store) as api:
        status, document = await api.call("GET", "/openapi.json")
    assert status == 200
    assert document["openapi"].startswith("3.1")
    documented = {(method, path) for path, item in document["paths"].items() for method in item}
    assert documented == registered(store)
    # Every schema reference resolves.
    schemas = document["components"]["schemas"]
    text = str(document)
    for ref in {part.split("'")[0] for part in text.split("#/components/schemas/")[1:]}:
        assert ref in schemas, ref


@async_test
async def test_answers_are_among_the_documented_statuses(store: QueueStore) -> None:
    """One request per operation with a harmless argument: the status is one the document
    lists for it (401 aside, every path is called with the token)."""
    async with api_running(store) as api:
        _, document = await api.call("GET", "/openapi.json")
        for path, item in document["paths"].items():
            concrete = path.format(id="0" * 16, zone="default", domain="ok.test")
            for method, operation in item.items():
                kwargs = {}
                if "requestBody" in operation:
                    kwargs["json"] = {"zone": "default"} if "purge" in path else {}
                status, _ = await api.call(method.upper(), concrete, **kwargs)
                assert str(status) in operation["responses"], (method, path, status)
