"""What the operator tells about itself: its counters in the Prometheus text format (`OperatorMetrics`),
and the HTTP server of /healthz and /metrics (`serve_health`) that the chart's probes and scrape
annotations use, which also takes the instance pods' certificate requests (`controller.k8s.certificates`).

Apart from the reconciler, which only counts: serving runs in a thread of its own.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from controller.k8s.certificates import Issuer, Refused

log = logging.getLogger(__name__)


@dataclass
class OperatorMetrics:
    """Counters served on /metrics (Prometheus text format)."""

    leader: bool = False
    reconciles: int = 0
    failures: int = 0
    pipelines: int = 0
    last_loop: float = field(default_factory=time.monotonic)

    def render(self) -> str:
        return (
            "# HELP fluxjoin_operator_leader 1 when this replica holds the Lease.\n"
            "# TYPE fluxjoin_operator_leader gauge\n"
            f"fluxjoin_operator_leader {int(self.leader)}\n"
            "# HELP fluxjoin_operator_pipelines JoinPipelines seen in the last round.\n"
            "# TYPE fluxjoin_operator_pipelines gauge\n"
            f"fluxjoin_operator_pipelines {self.pipelines}\n"
            "# HELP fluxjoin_operator_reconciles_total Pipeline reconciles run.\n"
            "# TYPE fluxjoin_operator_reconciles_total counter\n"
            f"fluxjoin_operator_reconciles_total {self.reconciles}\n"
            "# HELP fluxjoin_operator_reconcile_failures_total Pipeline reconciles that failed.\n"
            "# TYPE fluxjoin_operator_reconcile_failures_total counter\n"
            f"fluxjoin_operator_reconcile_failures_total {self.failures}\n"
        )


def serve_health(
    healthy: Callable[[], bool],
    metrics: OperatorMetrics,
    port: int,
    host: str = "0.0.0.0",
    issuer: Issuer | None = None,
) -> ThreadingHTTPServer:
    """Serve /healthz (`healthy()`) and /metrics in a daemon thread (the chart's probes and scrape
    annotations), and with an `issuer` POST /certificates (instance pods' signing certificates)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path != "/certificates" or issuer is None:
                self._send(404, "not found\n")
                return
            token = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            try:
                length = min(int(self.headers.get("Content-Length") or 0), 64 * 1024)
                request = json.loads(self.rfile.read(length) or b"{}")
                if not isinstance(request, dict):
                    raise ValueError("not a JSON object")
                certificate = issuer.issue(token, request)
            except ValueError as exc:
                self._send(400, f"not a certificate request: {exc}\n")
            except Refused as exc:
                log.warning("certificate refused: %s", exc)
                self._send(exc.status, f"{exc}\n")
            except Exception as exc:  # the API server away: the pod asks again
                log.warning("certificate request not answered: %r", exc)
                self._send(503, f"cannot answer now: {exc!r}\n")
            else:
                self._send_bytes(200, certificate, "application/json")

        def do_GET(self) -> None:
            if self.path == "/healthz":
                ok = healthy()
                self._send(200 if ok else 503, "ok\n" if ok else "reconcile loop stalled\n")
            elif self.path == "/metrics":
                self._send(200, metrics.render(), "text/plain; version=0.0.4")
            else:
                self._send(404, "not found\n")

        def _send(self, code: int, text: str, content_type: str = "text/plain") -> None:
            self._send_bytes(code, text.encode(), content_type)

        def _send_bytes(self, code: int, data: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("health: " + format, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="fluxjoin-health", daemon=True).start()
    return server
