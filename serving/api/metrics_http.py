"""The Prometheus endpoint, served from the event loop (aiohttp): a connection costs a socket, not a thread, and
there is no small fixed number of slots, so idle or slow connections cannot lock scrapes out; an idle keep-alive
connection is closed after --http-keepalive-timeout, and a scrape is rendered in a worker thread."""

from __future__ import annotations

import asyncio

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

LOAD_PATH = "/metrics/load"  # the load gauges alone (serving/metrics.py), for pickers that scrape often


async def scrape(request: web.Request, registry: CollectorRegistry) -> web.Response:
    """`registry` rendered in the text format or OpenMetrics, as the scraper's Accept asks (in a worker thread)."""
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    body = await asyncio.to_thread(encoder, registry)
    return web.Response(body=body, headers={"Content-Type": content_type})


class MetricsServer:
    """Serves `registry` at any path (GET) but LOAD_PATH, which serves `load`."""

    def __init__(self, registry: CollectorRegistry, load: CollectorRegistry, keepalive: float):
        self.registry, self.load, self.keepalive = registry, load, keepalive
        self.runner: web.AppRunner | None = None
        self.port: int | None = None

    async def _scrape(self, request: web.Request) -> web.Response:
        return await scrape(request, self.load if request.path == LOAD_PATH else self.registry)

    async def start(self, host: str, port: int) -> int:
        app = web.Application()
        app.router.add_get("/{path:.*}", self._scrape)
        self.runner = web.AppRunner(
            app, access_log=None, keepalive_timeout=self.keepalive, auto_decompress=False, shutdown_timeout=1
        )
        await self.runner.setup()
        try:
            await web.TCPSite(self.runner, host, port, reuse_port=False).start()
        except OSError:
            await self.stop()
            raise
        self.port = self.runner.addresses[0][1]
        return self.port

    async def stop(self) -> None:
        runner, self.runner = self.runner, None  # once, even when a drain and an exit both stop it
        if runner is not None:
            await runner.cleanup()
