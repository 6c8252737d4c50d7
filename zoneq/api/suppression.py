"""The suppression list's routes: list (paged), add, remove, check, per zone or ``"*"``.

They answer 409 when ``[plugins.suppression]`` is not enabled: a list nobody consults would
let an operator believe an address is suppressed while mail to it still goes out.
"""

from __future__ import annotations

from aiohttp import web

from zoneq.api.browse import page_limit
from zoneq.api.context import context
from zoneq.api.errors import BadRequest, Conflict, parse_body
from zoneq.api.models import (
    SuppressionAdd,
    SuppressionAdded,
    SuppressionCheck,
    SuppressionPage,
    SuppressionRemoved,
)
from zoneq.api.suppression_list import PLUGIN, SuppressionLists


def _address(request: web.Request) -> str:
    address = request.query.get("address")
    if address is None:
        raise BadRequest("address: required, as ?address=")
    return address


def _lists(request: web.Request) -> SuppressionLists:
    lists = context(request).suppression
    if lists is None:
        raise Conflict(
            f"the {PLUGIN} plugin is not enabled: add [plugins.{PLUGIN}] with options.file "
            "to the config (and restart) to manage a suppression list"
        )
    return lists


async def list_zone(request: web.Request) -> web.Response:
    zone = request.match_info["zone"]
    page = await _lists(request).page(
        zone, request.query.get("cursor") or None, page_limit(request)
    )
    body = SuppressionPage(
        zone=zone, addresses=page.addresses, total=page.total, cursor=page.cursor
    )
    return web.json_response(body.model_dump())


async def add(request: web.Request) -> web.Response:
    lists = _lists(request)
    zone = request.match_info["zone"]
    body = parse_body(SuppressionAdd, await request.read())
    added, total = await lists.add(zone, body.addresses)
    return web.json_response(SuppressionAdded(zone=zone, added=added, total=total).model_dump())


async def remove(request: web.Request) -> web.Response:
    zone = request.match_info["zone"]
    address = await _lists(request).remove(zone, _address(request))
    return web.json_response(
        SuppressionRemoved(zone=zone, address=address, removed=True).model_dump()
    )


async def check(request: web.Request) -> web.Response:
    zone = request.match_info["zone"]
    found = await _lists(request).check(zone, _address(request))
    body = SuppressionCheck(
        zone=zone, address=found.address, suppressed=bool(found.lists), lists=found.lists
    )
    return web.json_response(body.model_dump())
