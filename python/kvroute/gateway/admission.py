"""Admission control: bounded queues, shedding on a TTFT objective, fair share under overload.

Each upstream attempt occupies one slot of its worker from ``begin`` to ``finish``. A worker takes
at most ``max_in_flight_per_worker`` requests (default, and at most: its ``max_connections``); the
router's choice skips full workers, and a request for which every candidate is full is shed. The
fleet takes at most ``max_in_flight`` requests (default: the sum of the per-worker bounds); past
that, a tenant (an endpoint, or the direct models as one tenant) is still admitted while its own
requests in flight are below its **weighted fair share** of the fleet bound — ``max_in_flight ×
weight / Σ weights of the tenants with requests in flight``, at least one — so that under
overload a noisy tenant is shed first and every tenant keeps its share (in-flight requests never
exceed the bound by more than one per tenant).

A request may carry ``x-slo-ttft-ms`` (as llm-d reads it): the router's choice is shed when its
predicted time to first token exceeds it. The prediction is ``(prefill tokens queued on the
worker + the prompt's tokens not expected cached there) / prefill rate``; the rate is
``prefill_tokens_per_second`` when configured, else learned from the fleet's streamed requests
(tokens prefilled ÷ time to their first event, averaged); until it is known, nothing is shed on
the objective. Shedding answers 429 with ``Retry-After: 1``, counted by reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvroute import Decision, Router

__all__ = ["Admission", "Shed"]


@dataclass(frozen=True)
class Shed:
    """Why a request is not admitted."""

    reason: str  # "worker_queue" | "fleet_queue" | "fair_share" | "slo"
    message: str


class Admission:
    """The slots of every worker and tenant (see the module docs)."""

    ALPHA = 0.2  # weight of a new sample in the learned prefill rate

    def __init__(
        self,
        router: Router,
        per_worker: Mapping[str, int],
        fleet: int | None,
        weights: Mapping[str, float],
        prefill_tokens_per_second: float | None,
    ) -> None:
        self.router = router
        self.block_size = router.block_size
        self.per_worker = dict(per_worker)
        self.fleet = fleet if fleet else sum(self.per_worker.values())
        self.weights = dict(weights)
        self.fixed_rate = prefill_tokens_per_second
        self.learned_rate: float | None = None
        self.total = 0
        self.tenants: dict[str, int] = {}

    # ---- fleet and tenants -------------------------------------------------------------------

    def admit(self, tenant: str) -> Shed | None:
        """Takes a fleet slot for the tenant, or says why not."""
        if self.total >= self.fleet:
            mine = self.tenants.get(tenant, 0)
            weight = self.weights.get(tenant, 1.0)
            active = {t for t, n in self.tenants.items() if n > 0} | {tenant}
            share = self.fleet * weight / sum(self.weights.get(t, 1.0) for t in active)
            if mine >= max(1, int(share)):
                if len(active) == 1:
                    return Shed(
                        "fleet_queue",
                        f"the gateway has {self.total} requests in flight (max_in_flight "
                        f"{self.fleet}); try again shortly",
                    )
                return Shed(
                    "fair_share",
                    f"the gateway is at its bound of {self.fleet} requests in flight and this "
                    f"endpoint has its fair share ({mine}); try again shortly",
                )
        self.total += 1
        self.tenants[tenant] = self.tenants.get(tenant, 0) + 1
        return None

    def release(self, tenant: str) -> None:
        self.total -= 1
        left = self.tenants[tenant] - 1
        if left:
            self.tenants[tenant] = left
        else:
            del self.tenants[tenant]

    # ---- workers -----------------------------------------------------------------------------

    def full(self, worker: str, in_flight: int) -> bool:
        return in_flight >= self.per_worker.get(worker, 1 << 62)

    # ---- the TTFT objective ------------------------------------------------------------------

    @property
    def rate(self) -> float | None:
        return self.fixed_rate or self.learned_rate

    def queued_tokens(self, worker: str) -> float:
        return self.router.load(worker)["prefill_blocks"] * self.block_size

    def predicted_ttft(self, d: Decision) -> float | None:
        """Seconds to the first token on the decision's worker, or None while the rate is
        unknown."""
        rate = self.rate
        if not rate:
            return None
        uncached = max(d.prompt_tokens - d.cached_tokens, 0)
        return (self.queued_tokens(d.worker) + uncached) / rate

    def check_slo(self, d: Decision, slo_seconds: float | None) -> Shed | None:
        if slo_seconds is None:
            return None
        predicted = self.predicted_ttft(d)
        if predicted is None or predicted <= slo_seconds:
            return None
        return Shed(
            "slo",
            f"predicted time to first token {predicted * 1e3:.0f} ms on the best worker exceeds "
            f"x-slo-ttft-ms {slo_seconds * 1e3:.0f}",
        )

    def observe_prefill(self, tokens: float, seconds: float) -> None:
        """A streamed request's prefill work (queued + own uncached tokens) and its TTFT."""
        if self.fixed_rate or tokens <= 0 or seconds <= 0:
            return
        sample = tokens / seconds
        prev = self.learned_rate
        self.learned_rate = sample if prev is None else prev + self.ALPHA * (sample - prev)
