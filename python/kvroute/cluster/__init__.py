"""Many router replicas, one view of the fleet (``pip install 'kvroute[cluster]'``).

A production gateway runs several replicas behind a load balancer; each replica's router sees
only the requests it routes. This package makes the replicas share what they know, over NATS
JetStream, and reads the engines' own load:

- :mod:`.sync` — :class:`ReplicaSync`: every replica publishes its router's updates (in approx
  mode the blocks each decision newly predicts on its worker; in both modes its load changes) to
  a JetStream stream and applies every other replica's, once each and in order; snapshots of
  the model in a JetStream object store start new replicas; NATS failures degrade to local
  routing, never to failed requests.
- :mod:`.scrape` — :class:`EngineScraper`: vLLM's and SGLang's Prometheus ``/metrics`` (running
  and waiting requests, KV usage) fed to ``Router.set_load``.
- :mod:`.relay` — events mode: ``kvroute relay`` (:class:`EventRelay`) reads every engine's KV
  events once and republishes them into JetStream; each replica's :class:`EventFollower`
  (``[cluster] relay = true``) applies them with the subscriber's gap and restart semantics.
- :mod:`.limits` — :class:`LimitShare`: the gateway's rate limits, held by all replicas
  together (each sends the others what it takes from its buckets).
- :mod:`.responses` — :class:`ResponseShare`: which worker holds each stored Responses response,
  known to every replica (a follow-up reaching any replica goes to it). Both on :mod:`.share`.
- :mod:`.config` — the ``[cluster]`` section of ``kvroute serve``'s TOML file.

Nothing below the router knows about NATS: the router only fills an outbox of bytes and
applies batches of bytes (``Router.take_updates`` / ``apply_updates``, ``dump_model`` /
``load_model``, ``set_load``); this package moves them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvroute.server.metrics import Registry

from .config import ClusterConfig, parse_cluster
from .limits import LimitShare
from .relay import EventFollower, EventRelay
from .responses import ResponseShare
from .scrape import EngineLoad, EngineScraper, parse_engine_metrics
from .sync import ReplicaSync

if TYPE_CHECKING:
    from kvroute.gateway.limits import RateLimits
    from kvroute.gateway.responses import ResponseOwners

__all__ = [
    "Cluster",
    "ClusterConfig",
    "EngineLoad",
    "EngineScraper",
    "EventFollower",
    "EventRelay",
    "LimitShare",
    "ReplicaSync",
    "ResponseShare",
    "parse_cluster",
    "parse_engine_metrics",
]


class Cluster:
    """A server's cluster side: replica sync, the engine scraper, (``relay = true``, which
    needs an events-mode router) the follower of ``kvroute relay``'s stream, (a gateway's rate
    ``limits`` with ``share_limits``) their sharing and (a gateway's Responses ``responses``
    owners with ``share_responses``) theirs, from ``[cluster]``.

    ``workers``: ``(name, base url, kind, api key or None)`` of the fleet; ``event_mode``: how
    the follower applies events (``[events] mode``).
    """

    def __init__(
        self,
        router: Any,
        config: ClusterConfig,
        workers: list[tuple[str, str, str, str | None]],
        *,
        registry: Registry | None = None,
        event_mode: str = "rehash",
        limits: RateLimits | None = None,
        responses: ResponseOwners | None = None,
    ) -> None:
        self.config = config
        self.follower: EventFollower | None = None
        if config.relay and router.mode != "events":
            raise ValueError(
                "cluster.relay = true needs an events-mode router (router.index = 'events'), "
                f"got mode {router.mode!r}"
            )
        if config.relay:
            self.follower = EventFollower(router, config, mode=event_mode, registry=registry)
        self.sync = ReplicaSync(router, config, registry=registry)
        self.limits: LimitShare | None = None
        if limits is not None and limits.active and config.share_limits:
            self.limits = LimitShare(limits, config, registry=registry)
        self.responses: ResponseShare | None = None
        if responses is not None and config.share_responses:
            names = [w[0] for w in workers]
            self.responses = ResponseShare(responses, config, names, registry=registry)
        self.scraper = EngineScraper(
            router,
            workers,
            interval=config.scrape_interval,
            timeout=config.scrape_timeout,
            registry=registry,
        )

    def start(self) -> None:
        """Starts each part in the background (on the running event loop)."""
        self.sync.start()
        self.scraper.start()
        if self.limits is not None:
            self.limits.start()
        if self.responses is not None:
            self.responses.start()
        if self.follower is not None:
            self.follower.start()

    async def stop(self) -> None:
        if self.follower is not None:
            await self.follower.stop()
        if self.limits is not None:
            await self.limits.stop()
        if self.responses is not None:
            await self.responses.stop()
        await self.scraper.stop()
        await self.sync.stop()

    def describe(self) -> dict[str, Any]:
        """``/health``'s ``cluster`` entry."""
        out = {**self.sync.describe(), "engine_load": self.scraper.describe()}
        if self.follower is not None:
            out["relay"] = self.follower.describe()
        if self.limits is not None:
            out["limits"] = self.limits.describe()
        if self.responses is not None:
            out["responses"] = self.responses.describe()
        return out
