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
- :mod:`.config` — the ``[cluster]`` section of ``kvroute serve``'s TOML file.

Nothing below the router knows about NATS: the router only fills an outbox of bytes and
applies batches of bytes (``Router.take_updates`` / ``apply_updates``, ``dump_model`` /
``load_model``, ``set_load``); this package moves them.
"""

from __future__ import annotations

from typing import Any

from kvroute.server.metrics import Registry

from .config import ClusterConfig, parse_cluster
from .relay import EventFollower, EventRelay
from .scrape import EngineLoad, EngineScraper, parse_engine_metrics
from .sync import ReplicaSync

__all__ = [
    "Cluster",
    "ClusterConfig",
    "EngineLoad",
    "EngineScraper",
    "EventFollower",
    "EventRelay",
    "ReplicaSync",
    "parse_cluster",
    "parse_engine_metrics",
]


class Cluster:
    """A server's cluster side: replica sync, the engine scraper and (``relay = true``, which
    needs an events-mode router) the follower of ``kvroute relay``'s stream, from ``[cluster]``.

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
        self.scraper = EngineScraper(
            router,
            workers,
            interval=config.scrape_interval,
            timeout=config.scrape_timeout,
            registry=registry,
        )

    def start(self) -> None:
        """Starts both in the background (on the running event loop)."""
        self.sync.start()
        self.scraper.start()
        if self.follower is not None:
            self.follower.start()

    async def stop(self) -> None:
        if self.follower is not None:
            await self.follower.stop()
        await self.scraper.stop()
        await self.sync.stop()

    def describe(self) -> dict[str, Any]:
        """``/health``'s ``cluster`` entry."""
        out = {**self.sync.describe(), "engine_load": self.scraper.describe()}
        if self.follower is not None:
            out["relay"] = self.follower.describe()
        return out
