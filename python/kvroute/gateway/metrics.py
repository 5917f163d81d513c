"""The gateway's Prometheus series (``GET /metrics``), on the shared ``kvroute.server.metrics``.

Series (``kvroute_gateway_`` prefix):

- ``requests_total{route,model,status}`` — answered requests by outcome (499: the client went
  away; a stream that broke after its 200 was sent counts as 502).
- ``request_duration_seconds{route}`` — histogram, request received → response (or stream) ended.
- ``time_to_first_byte_seconds{route}`` — histogram, request received → first body byte sent.
- ``routing_decisions_total{policy,reason,worker}`` — one per upstream attempt.
- ``cached_tokens_predicted_total{worker}`` / ``cached_tokens_reported_total{worker}`` /
  ``prompt_tokens_total{worker}`` — in routing tokens, counted together when an upstream reports
  ``cached_tokens`` (so predicted/reported is the router's accuracy on reported requests).
- ``upstream_errors_total{worker,kind}`` — kind ``connect``, ``pool_timeout``, ``reset``,
  ``status_5xx``, ``stream_error``, ``timeout``, ``broken_stream``, ``protocol``.
- ``retries_total`` — upstream attempts after the first.
- ``rejected_total{reason}`` — requests answered without reaching an upstream, by error code
  (``invalid_json``, ``request_timeout``, ``client_gone``, ``invalid_api_key`` …).
- ``rate_limited_total{scope,limit}`` — 429s of the token buckets (scope ``endpoint``/``key``,
  limit ``requests``/``tokens``).
- ``shed_total{reason}`` — 429s of admission control (``worker_queue``, ``fleet_queue``,
  ``fair_share``, ``slo``).
- ``warm_requests_total{endpoint,worker,result}`` — requests keeping an endpoint's prefix warm
  (``kvroute.gateway.warm``): ``hit``, ``filled``, ``sent``, ``failed``.
- ``in_flight{worker}`` — upstream requests begun and not finished.
- ``worker_healthy{worker}`` — 1 when the router may choose the worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from kvroute.server.metrics import Counter, Gauge, Histogram, Registry

__all__ = ["GatewayMetrics"]

P = "kvroute_gateway_"


class GatewayMetrics:
    """The gateway's series on one registry (``render()`` is the scrape)."""

    def __init__(
        self,
        in_flight: Callable[[], Mapping[str, int]],
        healthy: Callable[[], Mapping[str, bool]],
        tokenizer: tuple[str, bool] = ("bytes", False),
    ) -> None:
        reg = self.registry = Registry()
        self.requests = reg.add(
            Counter(P + "requests_total", "Requests answered.", ("route", "model", "status"))
        )
        self.latency = reg.add(
            Histogram(
                P + "request_duration_seconds",
                "Request received to response or stream end.",
                ("route",),
            )
        )
        self.first_byte = reg.add(
            Histogram(
                P + "time_to_first_byte_seconds",
                "Request received to first body byte sent.",
                ("route",),
            )
        )
        self.decisions = reg.add(
            Counter(
                P + "routing_decisions_total",
                "Routing decisions (one per upstream attempt).",
                ("policy", "reason", "worker"),
            )
        )
        self.predicted = reg.add(
            Counter(
                P + "cached_tokens_predicted_total",
                "Cached routing tokens the router predicted, on "
                "requests whose upstream reported cached tokens.",
                ("worker",),
            )
        )
        self.reported = reg.add(
            Counter(
                P + "cached_tokens_reported_total",
                "Cached tokens reported by upstreams, in routing tokens.",
                ("worker",),
            )
        )
        self.prompt_tokens = reg.add(
            Counter(
                P + "prompt_tokens_total",
                "Routing tokens of prompts whose upstream reported cached tokens.",
                ("worker",),
            )
        )
        self.errors = reg.add(
            Counter(P + "upstream_errors_total", "Upstream failures.", ("worker", "kind"))
        )
        self.retries = reg.add(Counter(P + "retries_total", "Upstream attempts after the first."))
        self.rejected = reg.add(
            Counter(
                P + "rejected_total",
                "Requests answered without reaching an upstream.",
                ("reason",),
            )
        )
        self.rate_limited = reg.add(
            Counter(
                P + "rate_limited_total", "Requests refused by a rate limit.", ("scope", "limit")
            )
        )
        self.shed = reg.add(
            Counter(P + "shed_total", "Requests shed by admission control.", ("reason",))
        )
        self.warm = reg.add(
            Counter(
                P + "warm_requests_total",
                "Requests keeping an endpoint's shared prefix warm on its pool, by result: hit "
                "(the worker held it), filled (it prefilled part of it), sent (no cached tokens "
                "reported), failed.",
                ("endpoint", "worker", "result"),
            )
        )
        reg.add(
            Gauge(
                P + "in_flight",
                "Upstream requests begun and not finished.",
                ("worker",),
                lambda: (((w,), n) for w, n in in_flight().items()),
            )
        )
        reg.add(
            Gauge(
                P + "tokenizer_exact",
                "1 when requests route by the engine's own tokens (the model directory's chat "
                "template and tokenizer), 0 for a fallback tokenizer.",
                ("tokenizer",),
                lambda: [((tokenizer[0],), 1 if tokenizer[1] else 0)],
            )
        )
        reg.add(
            Gauge(
                P + "worker_healthy",
                "1 when the router may choose the worker.",
                ("worker",),
                lambda: (((w,), 1 if ok else 0) for w, ok in healthy().items()),
            )
        )

    def done(self, route: str, model: str, status: int, started: float) -> None:
        """One answered request: counted with its status, its duration observed."""
        self.requests.inc(route, model, str(status))
        self.latency.observe(time.perf_counter() - started, route)

    def render(self) -> str:
        return self.registry.render()

    @property
    def content_type(self) -> str:
        return self.registry.content_type
