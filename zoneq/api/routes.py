"""The API's routes: one table, registered on the application by ``setup_routes``."""

from __future__ import annotations

from typing import Final

from aiohttp import web
from aiohttp.typedefs import Handler

from zoneq.api import browse, export, metrics, openapi, operations, submit, suppression

V1: Final = "/api/v1"

ROUTES: Final[tuple[tuple[str, str, Handler], ...]] = (
    ("GET", "/health", metrics.health),
    ("GET", "/metrics", metrics.metrics),
    ("GET", "/openapi.json", openapi.document),
    ("POST", f"{V1}/messages", submit.submit_json),
    ("POST", f"{V1}/messages/raw", submit.submit_raw),
    ("GET", f"{V1}/messages/{{id}}", browse.show),
    ("DELETE", f"{V1}/messages/{{id}}", operations.delete_message),
    ("GET", f"{V1}/messages/{{id}}/source", browse.source),
    ("POST", f"{V1}/messages/{{id}}/retry", operations.retry_message),
    ("POST", f"{V1}/messages/{{id}}/hold", operations.hold_message),
    ("POST", f"{V1}/messages/{{id}}/release", operations.release_message),
    ("GET", f"{V1}/queue", browse.counts),
    ("POST", f"{V1}/queue/purge", operations.purge),
    ("GET", f"{V1}/zones/{{zone}}/recipients", browse.browse),
    ("GET", f"{V1}/zones/{{zone}}/domains", browse.domains),
    ("POST", f"{V1}/zones/{{zone}}/retry", operations.retry_zone),
    ("POST", f"{V1}/zones/{{zone}}/hold", operations.hold_zone),
    ("POST", f"{V1}/zones/{{zone}}/release", operations.release_zone),
    ("POST", f"{V1}/zones/{{zone}}/move", operations.move_zone),
    ("POST", f"{V1}/zones/{{zone}}/pause", operations.pause_zone),
    ("POST", f"{V1}/zones/{{zone}}/resume", operations.resume_zone),
    ("POST", f"{V1}/domains/{{domain}}/retry", operations.retry_domain),
    ("GET", f"{V1}/export/events", export.events),
    ("GET", f"{V1}/export/queue", export.queue),
    ("GET", f"{V1}/suppression/{{zone}}", suppression.list_zone),
    ("POST", f"{V1}/suppression/{{zone}}", suppression.add),
    ("DELETE", f"{V1}/suppression/{{zone}}", suppression.remove),
    ("GET", f"{V1}/suppression/{{zone}}/check", suppression.check),
)


def setup_routes(app: web.Application) -> None:
    """Each route; a GET in ``openapi.HEAD`` answers HEAD too (``add_route("GET")`` alone
    does not add it, ``add_get`` does by default: explicit here, as the document says)."""
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
        if method == "GET" and path in openapi.HEAD:
            app.router.add_route("HEAD", path, handler)
