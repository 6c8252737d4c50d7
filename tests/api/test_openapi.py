"""The OpenAPI document matches the application's routes exactly, and the API answers as
the document says (status codes listed for each operation)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.api.conftest import api_running, async_test, make_config, queue_message
from tests.api.test_suppression import empty_list, suppression_config
from zoneq.api.app import create_app
from zoneq.protocol.ids import format_id
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


@async_test
async def test_a_request_body_is_required_exactly_where_the_document_says(
    store: QueueStore, tmp_path: Path
) -> None:
    """Every operation with a request body, called without one on a path that exists (a
    queued message, a zone, a suppression list with its plugin on): a 400 when the
    document marks the body required, and not a 400 when it does not (OpenAPI 3.1 section
    4.8.13: optional unless marked)."""
    msg_id = format_id(await queue_message(store, [("bob@ok.test", "default")]))
    config = suppression_config(empty_list(tmp_path))
    checked = set()
    async with api_running(store, config=config) as api:
        _, document = await api.call("GET", "/openapi.json")
        for path, item in document["paths"].items():
            concrete = path.format(id=msg_id, zone="default", domain="ok.test")
            for method, operation in item.items():
                if "requestBody" not in operation:
                    continue
                required = operation["requestBody"]["required"]
                status, body = await api.call(method.upper(), concrete)
                assert (status == 400) == required, (method, path, required, status, body)
                checked.add((method, path, required))
    # The hold routes take no body (no reason); the others cannot go without one.
    assert ("post", "/api/v1/zones/{zone}/hold", False) in checked
    assert ("post", "/api/v1/messages/{id}/hold", False) in checked
    assert ("post", "/api/v1/queue/purge", True) in checked
