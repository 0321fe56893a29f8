"""The Prometheus endpoint: an HTTP server with bounded concurrency and socket timeouts, so idle or slow
connections cannot pile up threads (prometheus-client's own server spends one thread per connection, forever)."""

from __future__ import annotations

import threading
from http.server import HTTPServer
from socketserver import ThreadingMixIn

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import MetricsHandler


class MetricsServer(ThreadingMixIn, HTTPServer):
    """Serves `registry` at any path; at most `max_connections` at once (more are closed at once), each with a
    `timeout`-second socket timeout."""

    daemon_threads = True

    def __init__(self, host: str, port: int, registry: CollectorRegistry, max_connections: int = 8, timeout: float = 5):
        handler = type("Handler", (MetricsHandler.factory(registry),), {"timeout": timeout, "log_message": _quiet})
        self.slots = threading.BoundedSemaphore(max_connections)
        super().__init__((host, port), handler)
        self.thread = threading.Thread(target=self.serve_forever, name="sharp-metrics", daemon=True)

    @property
    def port(self) -> int:
        return self.server_address[1]

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)  # over the bound: refuse rather than queue
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def start(self) -> MetricsServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


def _quiet(self, *args) -> None:  # no access log on stderr
    return None
