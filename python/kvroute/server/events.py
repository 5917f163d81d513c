"""The KV-event subscriber of a server in events mode, built from the fleet's configuration.

``event_subscriber`` gives a ``kvroute.events.KvEventSubscriber`` over the workers that have
``kv_events`` (their ``kv_replay`` and ``kv_events_bind`` too), with ``[events]``' topic and mode —
or None when ``router.index`` is not ``"events"`` or no worker publishes. The server enters it
(``async with`` / ``__aenter__``) and leaves it when it stops; zmq is imported only then.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvroute import Router

from .config import EventsConfig, RouterConfig, WorkerConfig

__all__ = ["event_subscriber"]


def event_subscriber(
    router: Router, workers: Iterable[WorkerConfig], config: RouterConfig, events: EventsConfig
) -> Any:
    """The subscriber feeding ``router`` from ``workers``' KV events, or None (see the module)."""
    workers = [w for w in workers if w.kv_events]
    if not config.events or not workers:
        return None
    from kvroute.events import KvEventSubscriber

    return KvEventSubscriber(
        router,
        {w.name: w.kv_events for w in workers},
        replay={w.name: w.kv_replay for w in workers if w.kv_replay},
        bind={w.name: w.kv_events_bind for w in workers},
        topic=events.topic,
        mode=events.mode,
    )
