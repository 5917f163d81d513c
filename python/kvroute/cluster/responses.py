"""Which worker holds each stored Responses response, known to every replica
(``[cluster] share_responses``, on by default).

A follow-up (``previous_response_id``) can only be served by the engine holding the response
(``kvroute.gateway.responses``); behind a load balancer it reaches any replica. Each replica's
:class:`ResponseShare` sends the owners its gateway learns (the response id, the worker, the
target) on ``responses_subject`` (plain NATS, :mod:`.share`'s guarantees) and records the other
replicas' in its own ``ResponseOwners``, so a follow-up any replica receives goes to the worker
holding its previous response, and ``GET /v1/responses/{id}`` finds it.

- An entry is applied only when its id is a ``RESPONSE_ID`` and its worker one this replica routes
  to (a replica configured with another fleet skips the others'); a message with anything else
  malformed in it is counted and changes nothing.
- A follow-up sent within a message's delay (``limits_interval`` plus NATS' delivery, about a
  millisecond) to another replica than the one that answered may find it unknown there: it is then
  routed as any request (and the engine answers 404 if it is not the holder). An owner learnt
  while NATS is unreachable is never sent; a replica that starts knows only what is learnt from
  then on (NATS keeps no copy).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvroute.gateway.responses import RESPONSE_ID
from kvroute.server.metrics import Registry

from .config import ClusterConfig
from .share import Share, read_message, write_message

if TYPE_CHECKING:
    from kvroute.gateway.responses import ResponseOwners

__all__ = ["ResponseShare", "decode_owners", "encode_owners"]

#: Entries per message (each under 600 bytes): far below NATS' 1 MiB ``max_payload``.
MAX_ENTRIES = 1000
#: The longest worker or target name an entry may carry.
MAX_NAME = 256

Owner = tuple[str, str, str]  # (response id, worker, target)


def encode_owners(replica: str, owners: list[Owner]) -> bytes:
    """One message: the sender and its ``[id, worker, target]`` entries."""
    return write_message(replica, "owners", owners)


def decode_owners(data: bytes) -> tuple[str, list[Owner]]:
    """The sender and entries of a message; ``ValueError`` naming what is wrong otherwise."""
    replica, entries = read_message(data, "owners")
    out: list[Owner] = []
    for e in entries:
        if not (isinstance(e, list) and len(e) == 3 and all(isinstance(x, str) for x in e)):
            raise ValueError(f"entry {e!r:.80} is not [id, worker, target] strings")
        response_id, worker, target = e
        if not RESPONSE_ID.fullmatch(response_id):
            raise ValueError(f"entry {e!r:.80}: the id is not a response id")
        if not (0 < len(worker) <= MAX_NAME and 0 < len(target) <= MAX_NAME):
            raise ValueError(f"entry {e!r:.80}: a name is empty or longer than {MAX_NAME}")
        out.append((response_id, worker, target))
    return replica, out


class ResponseShare(Share):
    """Shares ``owners`` (a gateway's ``ResponseOwners``) with the other replicas (module
    docs); ``workers``: the workers this replica routes to."""

    label = "response owners"
    item = "response-owner"
    max_entries = MAX_ENTRIES

    def __init__(
        self,
        owners: ResponseOwners,
        config: ClusterConfig,
        workers: Iterable[str],
        *,
        registry: Registry | None = None,
    ) -> None:
        super().__init__(
            config,
            config.responses_subject,
            config.limits_interval,
            registry,
            messages=(
                "kvroute_cluster_response_messages_total",
                "Shared response-owner messages: sent, applied (another replica's), malformed; "
                "unsent: each owner learnt while not connected (never sent).",
            ),
            connected=(
                "kvroute_cluster_responses_connected",
                "1 while response owners are shared with the other replicas.",
            ),
        )
        self.owners = owners
        self.workers = frozenset(workers)
        self._out: list[Owner] = []
        owners.on_learn = self._learnt

    def _learnt(self, response_id: str, worker: str, target: str) -> None:
        if not self.connected:  # kept, it would wait unbounded for a connection
            self.messages.inc("unsent")
            return
        self._out.append((response_id, worker, target))
        self.wake()

    def drain(self) -> list[Any]:
        out, self._out = self._out, []
        return out

    def restore(self, entries: list[Any]) -> None:
        self._out[:0] = entries

    def encode(self, entries: list[Any]) -> bytes:
        return encode_owners(self.replica, entries)

    def decode(self, data: bytes) -> tuple[str, list[Any]]:
        return decode_owners(data)

    def apply(self, entries: list[Any]) -> None:
        for response_id, worker, target in entries:
            if worker in self.workers:
                self.owners.learn(response_id, worker, target, told=True)
