"""The health model every kvroute server shares: which workers the router may choose.

A worker is **in** (the router may choose it) or **ejected** (``router.set_healthy(w, False)``).
It is ejected

- at once when it cannot be reached (``down``: connection refused, connect timeout) — it would
  fail every request;
- after ``eject_after`` failures in a row (``failed``), counted across requests and reset by any
  success (``succeeded``), so that a failure caused by one request's content — which the caller
  attributes to no worker, see ``kvroute.gateway.upstream`` — or by one tenant's occasional
  requests between other tenants' successes never takes a worker out; and never so that more than
  ``max_ejected_fraction`` of the fleet is out through failures (Envoy's ``max_ejection_percent``):
  past that, failing workers stay in and callers see the failures, not a fleet-wide 503.

A worker under suspicion (``suspect``: it failed a request that also failed elsewhere, so the
request's content may be the cause) is probed at once, at most once per ``interval``: it is
ejected if its health endpoint does not answer — within ``max_ejected_fraction`` too — and left
alone otherwise.

An ejected worker is readmitted when, at least ``eject_seconds`` after its ejection, its health
endpoint answers (``probe``, every ``interval`` seconds); its failure count starts again at 0.
State changes happen on the server's event loop; the router is told through ``set_healthy``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from .config import HealthConfig
from .tasks import cancel_tasks

__all__ = ["Health"]

log = logging.getLogger("kvroute.server.health")


class Health:
    """Ejection and readmission of a fleet's workers (see the module docs)."""

    def __init__(
        self,
        workers: Iterable[str],
        config: HealthConfig,
        *,
        set_healthy: Callable[[str, bool], None],
        probe: Callable[[str], Awaitable[bool]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.workers = tuple(workers)
        self.config = config
        self._set_healthy = set_healthy
        self._probe = probe
        self._clock = clock
        self.ejected: dict[str, float] = {}  # worker -> clock() at ejection
        self.failures: dict[str, int] = {}  # worker -> failures in a row
        self._task: asyncio.Task[None] | None = None
        self._suspected: dict[str, float] = {}  # worker -> clock() of its last suspicion probe
        self._probes: set[asyncio.Task[None]] = set()

    # ---- state -------------------------------------------------------------------------------

    def status(self) -> dict[str, bool]:
        """Per worker: True when the router may choose it."""
        return {w: w not in self.ejected for w in self.workers}

    def any_in(self) -> bool:
        return len(self.ejected) < len(self.workers)

    # ---- reports -----------------------------------------------------------------------------

    def succeeded(self, worker: str) -> None:
        """A request to the worker succeeded: its failures in a row start again at 0."""
        if self.failures:
            self.failures.pop(worker, None)

    def failed(self, worker: str, why: str) -> bool:
        """One failure attributed to the worker; True when it is (now) ejected."""
        count = self.failures[worker] = self.failures.get(worker, 0) + 1
        log.warning("upstream %s failed (%s, %d in a row)", worker, why, count)
        if count < self.config.eject_after or worker in self.ejected:
            return worker in self.ejected
        return self._eject_within_limit(worker, f"{count} failures in a row")

    def _eject_within_limit(self, worker: str, why: str) -> bool:
        """Ejects the worker unless ``max_ejected_fraction`` of the fleet is out already."""
        limit = int(self.config.max_ejected_fraction * len(self.workers))
        if len(self.ejected) >= limit:
            log.warning(
                "not ejecting %s (%s): %d of %d workers are out already "
                "(max_ejected_fraction %.2f)",
                worker,
                why,
                len(self.ejected),
                len(self.workers),
                self.config.max_ejected_fraction,
            )
            return False
        self.eject(worker, why)
        return True

    def down(self, worker: str, why: str) -> None:
        """The worker cannot be reached: ejected at once."""
        self.failures[worker] = self.failures.get(worker, 0) + 1
        self.eject(worker, why)

    def suspect(self, worker: str, why: str) -> None:
        """Probes the worker now (at most once per ``interval``); ejects it if the probe fails."""
        now = self._clock()
        if (
            worker in self.ejected
            or now - self._suspected.get(worker, -1e18) < self.config.interval
        ):
            return
        self._suspected[worker] = now
        task = asyncio.get_running_loop().create_task(self._check(worker, why))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _check(self, worker: str, why: str) -> None:
        try:
            ok = await self._probe(worker)
        except Exception:
            ok = False
        if ok is not True and worker not in self.ejected:
            self._eject_within_limit(worker, f"{why}, and its health probe failed")

    def eject(self, worker: str, why: str) -> None:
        if worker not in self.ejected:
            log.warning("ejecting upstream %s: %s", worker, why)
            self.ejected[worker] = self._clock()
            self._set_healthy(worker, False)

    def readmit(self, worker: str) -> None:
        if self.ejected.pop(worker, None) is not None:
            self.failures.pop(worker, None)
            self._set_healthy(worker, True)
            log.info("upstream %s is healthy again", worker)

    # ---- probing -----------------------------------------------------------------------------

    async def probe_due(self) -> None:
        """Probes the ejected workers whose ``eject_seconds`` are over; readmits those that
        answer."""
        now = self._clock()
        due = [w for w, t in self.ejected.items() if now - t >= self.config.eject_seconds]
        if not due:
            return
        results = await asyncio.gather(*(self._probe(w) for w in due), return_exceptions=True)
        for worker, ok in zip(due, results, strict=True):
            if ok is True:
                self.readmit(worker)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval)
            try:
                await self.probe_due()
            except Exception:  # a prober bug must not end readmission for good
                log.exception("health probe round failed")

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="kvroute-health")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_tasks(*self._probes, task)
