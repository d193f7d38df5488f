"""Drive a RouterService's app in-process, with no socket between client and router."""

from __future__ import annotations

import httpx

from kvtier.router.app import build_app
from kvtier.router.service import RouterService


async def run_scenario(service: RouterService, scenario) -> None:
    """`await scenario(service, client)` against the service's app, then stop the service."""
    transport = httpx.ASGITransport(app=build_app(service))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        try:
            await scenario(service, client)
        finally:
            await service.stop()
