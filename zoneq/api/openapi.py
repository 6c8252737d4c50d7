"""The OpenAPI 3.1 description of the API, served at ``/openapi.json``.

Written out per operation rather than generated from the route table, so that it says what
each operation is for; ``tests/api/test_openapi.py`` checks that its paths and methods are
exactly the routes the application registers, so the two cannot drift apart.  Request and
response schemas come from the pydantic models (``models.py``).
"""

from __future__ import annotations

from typing import Any, Final

from aiohttp import web
from pydantic import BaseModel

from zoneq import __version__
from zoneq.api import models

JSON: Final = "application/json"


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _param(name: str, where: str, text: str, *, required: bool = False) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    if where == "query" and name in ("to",):
        schema = {"type": "array", "items": {"type": "string"}}
    return {
        "name": name,
        "in": where,
        "required": required or where == "path",
        "description": text,
        "schema": schema,
        **({"style": "form", "explode": True} if schema["type"] == "array" else {}),
    }


MSG_ID: Final = _param("id", "path", "message id, 16 hex digits")
ZONE: Final = _param("zone", "path", "zone name")
STATE: Final = _param("state", "query", "ready (default), leased, deferred or held")
LIST_ZONE: Final = _param("zone", "path", 'zone name, or "*" for the list every zone consults')
ADDRESS: Final = _param(
    "address", "query", "the address; compared lower-cased (RFC 5321 2.4)", required=True
)


def _op(
    summary: str,
    ok: dict[str, Any],
    *,
    params: tuple[dict[str, Any], ...] = (),
    body: dict[str, Any] | None = None,
    required: bool = True,
    errors: tuple[int, ...] = (),
    status: str = "200",
) -> dict[str, Any]:
    """One operation; ``required`` says whether its ``body`` must be sent (OpenAPI 3.1
    section 4.8.13: a request body is optional unless marked so)."""
    responses: dict[str, Any] = {status: ok}
    for code in (401, *errors):
        responses[str(code)] = {
            "description": _ERRORS[code],
            "content": {JSON: {"schema": _ref(models.Error)}},
        }
    operation: dict[str, Any] = {"summary": summary, "responses": responses}
    if params:
        operation["parameters"] = list(params)
    if body is not None:
        operation["requestBody"] = {"required": required, "content": body}
    return operation


_ERRORS: Final = {
    400: "bad input, named in the message",
    401: "missing or wrong bearer token",
    404: "no such message or zone",
    409: "nothing in the message is in a state the operation applies to; for the "
    "suppression routes: the suppression plugin is not enabled",
    413: "over receiver.max_message_size",
    422: "every recipient was refused by a queue:route plugin (5yz replies): nothing stored",
    503: "queue storage unavailable (local, temporary): nothing stored, try again; for a "
    "submission also a failing plugin, every recipient refused with a 4yz reply among them, "
    "or (JSON) too long a wait behind other submissions being built",
}


def _json(model: type[BaseModel], text: str) -> dict[str, Any]:
    return {"description": text, "content": {JSON: {"schema": _ref(model)}}}


COUNT: Final = _json(models.Count, "how many recipients it changed")


def _submit_op(summary: str, body: dict[str, Any], *params: dict[str, Any]) -> dict[str, Any]:
    """A submission: 201 once durable (``refused`` lists recipients a plugin refused), 200
    when a plugin dropped every recipient (nothing stored, no Location)."""
    queued = _json(models.Queued, "queued; recipients a plugin refused are in refused")
    operation = _op(
        summary, queued, params=params, body=body, errors=(400, 413, 422, 503), status="201"
    )
    operation["responses"]["200"] = _json(
        models.Queued, "every recipient was dropped by a plugin (an event each): nothing stored"
    )
    return operation


def _message_op(summary: str) -> dict[str, Any]:
    """retry of one message: a count, or 409 when nothing applied."""
    return _op(summary, COUNT, params=(MSG_ID,), errors=(400, 404, 409, 503))


ZONE_STATE: Final = _json(models.ZoneState, "the zone's pause state")
# Optional: without it the hold has no reason (``operations._optional``).
HOLD_BODY: Final = {JSON: {"schema": _ref(models.HoldRequest)}}
NDJSON: Final = {
    "description": "one JSON object per line, from one consistent snapshot",
    "content": {"application/x-ndjson": {"schema": {"type": "string"}}},
}

PATHS: Final[dict[str, dict[str, Any]]] = {
    "/health": {
        "get": {
            "summary": (
                "Liveness: 200 while the queue accepts writes, 503 while not (no auth);"
                " the count of quarantined corrupt records either way"
            ),
            "security": [],
            "responses": {
                "200": _json(models.Health, "ok"),
                "503": _json(models.Health, "unavailable, with the reason"),
            },
        }
    },
    "/metrics": {
        "get": _op(
            "Prometheus text format: queue sizes, quarantined records, totals, delivery latency",
            {"description": "metrics", "content": {"text/plain": {"schema": {"type": "string"}}}},
        )
    },
    "/openapi.json": {
        "get": _op("This document", {"description": "OpenAPI 3.1", "content": {JSON: {}}})
    },
    "/api/v1/messages": {
        "post": _submit_op(
            "Submit a message built from fields; 201 once it is durable",
            {JSON: {"schema": _ref(models.Submission)}},
        )
    },
    "/api/v1/messages/raw": {
        "post": _submit_op(
            "Upload an RFC 5322 message, streamed; envelope from the query or the headers."
            " Line ends (CRLF, LF or CR) are stored as CRLF; NUL is refused",
            {"message/rfc822": {"schema": {"type": "string", "format": "binary"}}},
            _param("from", "query", 'envelope sender; "" for <>; absent: Sender, else From'),
            _param(
                "to", "query", "envelope recipient, repeatable; none: To, Cc, Bcc (Bcc removed)"
            ),
        )
    },
    "/api/v1/messages/{id}": {
        "get": _op(
            "A message's metadata and its recipients with their states, attempts, replies",
            _json(models.MessageView, "the message"),
            params=(MSG_ID,),
            errors=(400, 404),
        ),
        "delete": _op(
            "Delete a message, or one recipient of it with ?recipient=, without a DSN",
            COUNT,
            params=(MSG_ID, _param("recipient", "query", "only this recipient")),
            errors=(400, 404, 503),
        ),
    },
    "/api/v1/messages/{id}/source": {
        "get": _op(
            "The message as stored, streamed",
            {"description": "the text", "content": {"message/rfc822": {}}},
            params=(MSG_ID,),
            errors=(400, 404),
        )
    },
    "/api/v1/messages/{id}/retry": {
        "post": _message_op(
            "Deferred recipients of the message are ready now, and those on the wire when"
            " their attempt defers (both counted); 409 when it has none of either"
        )
    },
    "/api/v1/messages/{id}/hold": {
        "post": _op(
            "Hold the message's ready and deferred recipients now, and those on the wire when"
            " their attempt ends undelivered; 409 when it has none of either",
            _json(models.HoldCount, "held now (count), and to be held on return (on_return)"),
            params=(MSG_ID,),
            body=HOLD_BODY,
            required=False,
            errors=(400, 404, 409, 503),
        )
    },
    "/api/v1/messages/{id}/release": {
        "post": _op(
            "Release the message's held recipients: ready now; and cancel the hold of those"
            " on the wire, taken when their attempt ends; 409 when it has none of either",
            _json(
                models.HoldCount, "released now (count), and no longer held on return (on_return)"
            ),
            params=(MSG_ID,),
            errors=(400, 404, 409, 503),
        )
    },
    "/api/v1/queue": {
        "get": _op("Counts per zone and state (O(1))", _json(models.QueueCounts, "counts"))
    },
    "/api/v1/queue/purge": {
        "post": _op(
            "Delete every recipient matching a filter, without DSNs; how many",
            COUNT,
            body={JSON: {"schema": _ref(models.Selection)}},
            errors=(400, 404, 503),
        )
    },
    "/api/v1/zones/{zone}/recipients": {
        "get": _op(
            "A page of the zone's recipients in one state, oldest first",
            _json(models.RecipientPage, "one page"),
            params=(
                ZONE,
                STATE,
                _param("limit", "query", "1 to 1000, default 100"),
                _param("cursor", "query", "the cursor of the previous page"),
            ),
            errors=(400, 404),
        )
    },
    "/api/v1/zones/{zone}/domains": {
        "get": _op(
            "Recipients of the zone per destination domain in one state (O(1) each)",
            {
                "description": "domain -> count",
                "content": {
                    JSON: {
                        "schema": {"type": "object", "additionalProperties": {"type": "integer"}}
                    }
                },
            },
            params=(ZONE, STATE),
            errors=(400, 404),
        )
    },
    "/api/v1/zones/{zone}/retry": {
        "post": _op(
            "Deferred recipients of the zone (or of ?domain= in it) are ready now, and those"
            " on the wire when their attempt defers (both counted)",
            COUNT,
            params=(ZONE, _param("domain", "query", "only this destination domain (not empty)")),
            errors=(400, 404, 503),
        )
    },
    "/api/v1/zones/{zone}/hold": {
        "post": _op(
            "Hold every ready and deferred recipient of the zone",
            COUNT,
            params=(ZONE,),
            body=HOLD_BODY,
            required=False,
            errors=(400, 404, 503),
        )
    },
    "/api/v1/zones/{zone}/release": {
        "post": _op("Release the zone's held recipients", COUNT, params=(ZONE,), errors=(404, 503))
    },
    "/api/v1/zones/{zone}/move": {
        "post": _op(
            "Move the zone's recipients (or those in one state) to another configured zone,"
            " each in its state (a deferred one keeps its due time); those on the wire stay",
            _json(models.MoveCount, "moved (count), and left on the wire (in_flight)"),
            params=(ZONE,),
            body={JSON: {"schema": _ref(models.MoveRequest)}},
            errors=(400, 404, 503),
        )
    },
    "/api/v1/zones/{zone}/pause": {
        "post": _op(
            "Stop the zone's deliveries (mail still queues); survives a restart",
            ZONE_STATE,
            params=(ZONE,),
            errors=(404, 503),
        )
    },
    "/api/v1/zones/{zone}/resume": {
        "post": _op("Resume the zone's deliveries", ZONE_STATE, params=(ZONE,), errors=(404, 503))
    },
    "/api/v1/domains/{domain}/retry": {
        "post": _op(
            "Deferred recipients for a destination domain, in every zone, are ready now, and"
            " those on the wire when their attempt defers (both counted)",
            COUNT,
            params=(_param("domain", "path", "destination domain"),),
            errors=(503,),
        )
    },
    "/api/v1/export/events": {
        "get": _op(
            "Delivery events after an event id, as NDJSON",
            NDJSON,
            params=(_param("after", "query", "16-hex event id: only events after it"),),
            errors=(400,),
        )
    },
    "/api/v1/export/queue": {"get": _op("Every queued recipient, as NDJSON", NDJSON)},
    "/api/v1/suppression/{zone}": {
        "get": _op(
            "A page of the zone's suppressed addresses, sorted (zone * applies to every zone)",
            _json(models.SuppressionPage, "one page"),
            params=(
                LIST_ZONE,
                _param("limit", "query", "1 to 1000, default 100"),
                _param("cursor", "query", "the cursor of the previous page"),
            ),
            errors=(400, 404, 409, 503),
        ),
        "post": _op(
            "Suppress one or many addresses in the zone (all checked before any is added)",
            _json(models.SuppressionAdded, "how many were new"),
            params=(LIST_ZONE,),
            body={JSON: {"schema": _ref(models.SuppressionAdd)}},
            errors=(400, 404, 409, 503),
        ),
        "delete": _op(
            "Take ?address= off the zone's list (off the * list only when zone is *)",
            _json(models.SuppressionRemoved, "removed"),
            params=(LIST_ZONE, ADDRESS),
            errors=(400, 404, 409, 503),
        ),
    },
    "/api/v1/suppression/{zone}/check": {
        "get": _op(
            "Whether mail to ?address= is suppressed in the zone, and by which lists",
            _json(models.SuppressionCheck, "the answer"),
            params=(LIST_ZONE, ADDRESS),
            errors=(400, 404, 409, 503),
        ),
    },
}

# GET routes answered for HEAD too (RFC 9110 section 9.3.2: the GET's status and header
# fields, no content), for monitors and load balancers that probe with HEAD; ``routes.py``
# registers them from this set.  Not the streamed ones (a message's source, the exports): a
# HEAD would read all of it only to send none.
HEAD: Final = frozenset(
    {
        "/health", "/metrics", "/openapi.json", "/api/v1/messages/{id}", "/api/v1/queue",
        "/api/v1/zones/{zone}/recipients", "/api/v1/zones/{zone}/domains",
        "/api/v1/suppression/{zone}", "/api/v1/suppression/{zone}/check",
    }
)  # fmt: skip


def _head(get: dict[str, Any]) -> dict[str, Any]:
    """The GET operation as a HEAD: the same statuses, no content."""
    responses = {
        code: {k: v for k, v in answer.items() if k != "content"}
        for code, answer in get["responses"].items()
    }
    return {**get, "summary": f"{get['summary']} (headers only)", "responses": responses}


def _paths() -> dict[str, dict[str, Any]]:
    return {
        path: {**item, "head": _head(item["get"])} if path in HEAD else item
        for path, item in PATHS.items()
    }


SCHEMAS: Final = (
    models.Submission,
    models.Attachment,
    models.Queued,
    models.RefusedRecipient,
    models.Selection,
    models.HoldRequest,
    models.Count,
    models.HoldCount,
    models.MoveRequest,
    models.MoveCount,
    models.QueueCounts,
    models.ZoneCounts,
    models.ZoneState,
    models.RecipientView,
    models.RecipientPage,
    models.MessageView,
    models.Error,
    models.ErrorBody,
    models.Health,
    models.SuppressionAdd,
    models.SuppressionAdded,
    models.SuppressionPage,
    models.SuppressionCheck,
    models.SuppressionRemoved,
)


def build_document() -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    for model in SCHEMAS:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "zoneq admin and submission API",
            "version": __version__,
            "description": "Bearer-token auth (RFC 6750) on everything but /health.",
        },
        "security": [{"bearer": []}],
        "paths": _paths(),
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


async def document(request: web.Request) -> web.Response:
    return web.json_response(build_document())
