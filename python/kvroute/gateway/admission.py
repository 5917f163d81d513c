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
predicted time to first token exceeds it. The prediction is ``base + work / prefill rate``, the
work being the prefill tokens queued on the worker plus the prompt's tokens not expected cached
there. With ``prefill_tokens_per_second`` configured, base is 0 and the rate is that; else both
are learned from the fleet's streamed requests (each: its work and the time to its first event)
by ``PrefillModel``: a least-squares line through the last ``WINDOW`` samples, each weighted
``(1 - ALPHA) ** age`` (the decay of the average it replaces), with base and seconds per token
never negative and the rate never below the fastest sample's work ÷ time (a sample shows the
engine did that much work in that time, whatever its base). A fixed base (the engine's
scheduling, the first decode step, the network) is thus not read as slow prefill: a workload that
mostly hits the prefix cache — small work, ~base seconds — no longer teaches a rate of a few
hundred tokens/s that sheds fresh long prompts the engine serves in a fraction of a second. Until
a sample arrives, nothing is shed on the objective. Shedding answers 429 with ``Retry-After: 1``,
counted by reason.

The same prediction tells the router when a response that shows nothing until it is whole (not
streamed) has done its prefill (``Flight.expect_prefill``); it is never a sample itself.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from kvroute import Decision, Router

__all__ = ["Admission", "PrefillModel", "Shed"]


@dataclass(frozen=True)
class Shed:
    """Why a request is not admitted."""

    reason: str  # "worker_queue" | "fleet_queue" | "fair_share" | "slo"
    message: str


class PrefillModel:
    """Time to first token = ``base + work * seconds_per_token``, fitted to recent samples (see
    the module docs). ``fit`` is None until the first sample."""

    ALPHA = 0.2  # weight of a new sample relative to the rest (an age costs a factor 1 - ALPHA)
    WINDOW = 64  # samples kept: the oldest's weight is 0.8 ** 63 < 1e-6 of the newest's

    def __init__(self) -> None:
        self.samples: deque[tuple[float, float]] = deque(maxlen=self.WINDOW)
        self._fit: tuple[float, float] | None = None

    def add(self, work: float, seconds: float) -> None:
        """A sample; ignored unless both are positive and finite."""
        if 0 < work < math.inf and 0 < seconds < math.inf:
            self.samples.append((float(work), float(seconds)))
            self._fit = None

    @property
    def fit(self) -> tuple[float, float] | None:
        """(base seconds, seconds per token), or None without samples."""
        if self._fit is None and self.samples:
            self._fit = self._solve()
        return self._fit

    def _solve(self) -> tuple[float, float]:
        keep = 1.0 - self.ALPHA
        n = len(self.samples)
        w = [keep ** (n - 1 - i) for i in range(n)]
        sw = math.fsum(w)
        mx = math.fsum(wi * x for wi, (x, _) in zip(w, self.samples, strict=True)) / sw
        my = math.fsum(wi * y for wi, (_, y) in zip(w, self.samples, strict=True)) / sw
        sxx = math.fsum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, self.samples, strict=True))
        sxy = math.fsum(
            wi * (x - mx) * (y - my) for wi, (x, y) in zip(w, self.samples, strict=True)
        )
        # The largest slope the samples support: each did its work within its time.
        cap = min(y / x for x, y in self.samples)
        if sxx <= 1e-12 * math.fsum(wi * x * x for wi, (x, _) in zip(w, self.samples, strict=True)):
            slope = math.inf  # one work size only: the slope is unknown, take the most it can be
            base = my
        else:
            slope, base = sxy / sxx, my - (sxy / sxx) * mx
            if slope < 0 or base < 0:  # the best line with base >= 0 and slope >= 0
                sxx0 = math.fsum(wi * x * x for wi, (x, _) in zip(w, self.samples, strict=True))
                sxy0 = math.fsum(wi * x * y for wi, (x, y) in zip(w, self.samples, strict=True))
                through_zero = (0.0, max(sxy0 / sxx0, 0.0))
                flat = (max(my, 0.0), 0.0)
                base, slope = min((through_zero, flat), key=lambda ab: self._sse(w, ab[0], ab[1]))
        if slope > cap:  # then the best base for that slope
            slope = cap
            base = max(my - cap * mx, 0.0)
        return base, slope

    def _sse(self, w: list[float], base: float, slope: float) -> float:
        return math.fsum(
            wi * (y - base - slope * x) ** 2 for wi, (x, y) in zip(w, self.samples, strict=True)
        )

    def predict(self, work: float) -> float | None:
        fit = self.fit
        if fit is None:
            return None
        base, slope = fit
        return base + work * slope


class Admission:
    """The slots of every worker and tenant (see the module docs)."""

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
        self.prefill = PrefillModel()
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
    def learned_rate(self) -> float | None:
        """The learned prefill rate in tokens/s (inf: the work makes no measured difference), or
        None before the first sample."""
        fit = self.prefill.fit
        if fit is None:
            return None
        return 1.0 / fit[1] if fit[1] > 0 else math.inf

    @property
    def learned_base(self) -> float | None:
        """The learned fixed part of a time to first token, in seconds."""
        fit = self.prefill.fit
        return None if fit is None else fit[0]

    def queued_tokens(self, worker: str) -> float:
        return self.router.load(worker)["prefill_blocks"] * self.block_size

    def predict_prefill(self, work: float) -> float | None:
        """Seconds to the first token for ``work`` prefill tokens (queued + the prompt's own
        uncached), or None while nothing is known."""
        if self.fixed_rate:
            return work / self.fixed_rate
        return self.prefill.predict(work)

    def predicted_ttft(self, d: Decision) -> float | None:
        """Seconds to the first token on the decision's worker, or None while nothing is
        known."""
        uncached = max(d.prompt_tokens - d.cached_tokens, 0)
        return self.predict_prefill(self.queued_tokens(d.worker) + uncached)

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
        if not self.fixed_rate:
            self.prefill.add(tokens, seconds)
