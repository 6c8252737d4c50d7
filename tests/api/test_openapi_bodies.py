"""Every operation of the OpenAPI document, called on its success path against a real store
with real messages queued, answers with a status the document lists and a body that is
valid against the schema the document gives for that status and content type.

The schemas are JSON Schema 2020-12 (OpenAPI 3.1, section 4.8.24), built from the pydantic
models; ``jsonschema`` validates them, its ``referencing`` registry resolving the
``#/components/schemas/...`` references inside the served document itself.  A last check
makes sure no operation was left out, so a route added later without a call here fails.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any, Final

import pytest
from jsonschema import Draft202012Validator
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from tests.api.conftest import TOKEN, Api, api_running, async_test, queue_message
from tests.api.test_queue import defer_all
from tests.api.test_suppression import empty_list, suppression_config
from zoneq.protocol.ids import format_id
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

DOCUMENT_URI: Final = "urn:zoneq:openapi"
RAW: Final = b"From: Alice <alice@src.test>\r\nTo: bob@ok.test\r\nSubject: raw\r\n\r\nbody\r\n"


def pointer(*parts: str) -> str:
    """A JSON pointer (RFC 6901): "~" and "/" escaped in each part."""
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)


class Checker:
    """Validates answers against the served document; remembers which operations it saw."""

    def __init__(self, api: Api, document: dict[str, Any]) -> None:
        self.api = api
        self.document = document
        resource = DRAFT202012.create_resource(document)
        self.registry: Registry[Any] = Registry().with_resource(DOCUMENT_URI, resource)
        self.seen: set[tuple[str, str]] = set()

    async def call(
        self, method: str, template: str, concrete: str | None = None, **kwargs: Any
    ) -> Any:
        """Call ``concrete`` (default: the template itself) and check the answer against
        the template's operation; the decoded body (JSON, NDJSON lines, or bytes)."""
        operation = self.document["paths"][template][method.lower()]
        url = self.api.url(concrete or template)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with self.api.session.request(method, url, headers=headers, **kwargs) as answer:
            status, content_type, raw = answer.status, answer.content_type, await answer.read()
        where = (method, template, status, raw[:300])
        assert 200 <= status < 300, where
        assert str(status) in operation["responses"], where
        self.seen.add((method.lower(), template))
        response = operation["responses"][str(status)]
        content = response.get("content", {})
        if method == "HEAD":  # RFC 9110 9.3.2: the GET's fields, no content, none documented
            assert raw == b"" and not content, where
            return None
        assert content_type in content, (where, content_type, list(content))
        body = decode(content_type, raw)
        schema = content[content_type].get("schema")
        if schema is not None:
            at = pointer(
                "paths", template, method.lower(), "responses", str(status), "content",
                content_type, "schema",
            )  # fmt: skip
            validator = Draft202012Validator(
                {"$ref": f"{DOCUMENT_URI}#{at}"}, registry=self.registry
            )
            # NDJSON is documented as a string (the stream); each line is an object.
            validator.validate(raw.decode() if content_type.endswith("ndjson") else body)
        return body


def decode(content_type: str, raw: bytes) -> Any:
    if content_type == "application/json":
        return json.loads(raw)
    if content_type == "application/x-ndjson":
        return [json.loads(line) for line in raw.decode().splitlines()]
    if content_type.startswith("text/"):
        return raw.decode()
    return raw


@async_test
async def test_every_operation_answers_as_documented(store: QueueStore, tmp_path: Path) -> None:
    one = format_id(await queue_message(store, [("a@ok.test", "default"), ("b@b.test", "bulk")]))
    deferred = format_id(await queue_message(store, [("c@b.test", "bulk")]))
    await defer_all(store, "bulk")
    config = suppression_config(empty_list(tmp_path))
    async with api_running(store, config) as api:
        _, document = await api.call("GET", "/openapi.json")
        check = Checker(api, document)
        await check.call("GET", "/health")
        assert "zoneq_queue_messages 2.0" in await check.call("GET", "/metrics")
        assert (await check.call("GET", "/openapi.json"))["openapi"] == document["openapi"]

        attachment = base64.b64encode(b"\x00binary\xff").decode()
        made = await check.call(
            "POST",
            "/api/v1/messages",
            json={
                "from": "Alice <alice@src.test>",
                "to": ["x@ok.test"],
                "subject": "hi",
                "text": "hello\n",
                "html": "<p>hello</p>",
                "headers": {"X-Campaign": "c1"},
                "attachments": [{"filename": "a.bin", "content": attachment}],
            },
        )
        assert made["recipients"] == ["x@ok.test"]
        uploaded = await check.call(
            "POST", "/api/v1/messages/raw", "/api/v1/messages/raw?from=&to=y@ok.test", data=RAW
        )
        assert uploaded["recipients"] == ["y@ok.test"]

        msg = "/api/v1/messages/{id}"
        shown = await check.call("GET", msg, f"/api/v1/messages/{one}")
        assert {r["address"] for r in shown["recipients"]} == {"a@ok.test", "b@b.test"}
        source = await check.call(
            "GET", msg + "/source", f"/api/v1/messages/{uploaded['id']}/source"
        )
        assert source.endswith(RAW)
        counts = await check.call("GET", "/api/v1/queue")
        assert counts["zones"]["bulk"]["deferred"] == 2
        zone = "/api/v1/zones/{zone}"
        page = await check.call(
            "GET", zone + "/recipients", "/api/v1/zones/bulk/recipients?state=deferred&limit=1"
        )
        assert page["cursor"] is not None and len(page["recipients"]) == 1
        domains = await check.call(
            "GET", zone + "/domains", "/api/v1/zones/bulk/domains?state=deferred"
        )
        assert domains == {"b.test": 2}

        assert await check.call("POST", msg + "/retry", f"/api/v1/messages/{deferred}/retry") == {
            "count": 1
        }
        assert await check.call(
            "POST", "/api/v1/domains/{domain}/retry", "/api/v1/domains/b.test/retry"
        ) == {"count": 1}
        await defer_all(store, "bulk")
        assert await check.call(
            "POST", zone + "/retry", "/api/v1/zones/bulk/retry?domain=b.test"
        ) == {"count": 2}
        held = await check.call(
            "POST", msg + "/hold", f"/api/v1/messages/{one}/hold", json={"reason": "look"}
        )
        assert held == {"count": 2, "on_return": 0}
        assert await check.call("POST", msg + "/release", f"/api/v1/messages/{one}/release") == {
            "count": 2,
            "on_return": 0,
        }
        assert (await check.call("POST", zone + "/hold", "/api/v1/zones/default/hold"))[
            "count"
        ] >= 1
        assert (await check.call("POST", zone + "/release", "/api/v1/zones/default/release"))[
            "count"
        ] >= 1
        paused = await check.call("POST", zone + "/pause", "/api/v1/zones/default/pause")
        assert paused == {"zone": "default", "paused": True}
        resumed = await check.call("POST", zone + "/resume", "/api/v1/zones/default/resume")
        assert resumed == {"zone": "default", "paused": False}
        move = {"to": "default", "state": "held"}  # none held: the purge below sees all
        moved = await check.call("POST", zone + "/move", "/api/v1/zones/bulk/move", json=move)
        assert moved == {"count": 0, "in_flight": 0}

        events = await check.call("GET", "/api/v1/export/events")
        assert events, "retries and holds wrote no events"
        queued = await check.call("GET", "/api/v1/export/queue")
        assert {r["message_id"] for r in queued} == {one, deferred, made["id"], uploaded["id"]}

        lists = "/api/v1/suppression/{zone}"
        added = await check.call(
            "POST", lists, "/api/v1/suppression/default", json={"addresses": ["No@Ok.test"]}
        )
        assert added == {"zone": "default", "added": 1, "total": 1}
        listed = await check.call("GET", lists, "/api/v1/suppression/default")
        assert listed["addresses"] == ["no@ok.test"]
        found = await check.call(
            "GET", lists + "/check", "/api/v1/suppression/default/check?address=no@ok.test"
        )
        assert found["suppressed"] is True
        for template, concrete in (
            ("/health", None),
            ("/metrics", None),
            ("/openapi.json", None),
            (msg, f"/api/v1/messages/{one}"),
            ("/api/v1/queue", None),
            (zone + "/recipients", "/api/v1/zones/default/recipients"),
            (zone + "/domains", "/api/v1/zones/default/domains"),
            (lists, "/api/v1/suppression/default"),
            (lists + "/check", "/api/v1/suppression/default/check?address=no@ok.test"),
        ):
            assert await check.call("HEAD", template, concrete) is None
        removed = await check.call(
            "DELETE", lists, "/api/v1/suppression/default?address=no@ok.test"
        )
        assert removed["removed"] is True

        deleted = await check.call("DELETE", msg, f"/api/v1/messages/{made['id']}")
        assert deleted == {"count": 1}
        purged = await check.call("POST", "/api/v1/queue/purge", json={"zone": "bulk"})
        assert purged == {"count": 2}

    documented = {(m, p) for p, item in document["paths"].items() for m in item}
    assert check.seen == documented, sorted(documented - check.seen)
