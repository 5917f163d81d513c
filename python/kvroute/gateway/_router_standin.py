"""TEMPORARY stand-in for kvroute.Router (issue #5) until it lands on main; removed then.

Implements the slice of the Router's Python API (ROUTER_TASK.md) the gateway calls, crudely.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

import numpy as np

from kvroute import BlockHasher, PrefixIndex, Rendezvous


@dataclass
class Decision:
    worker: str
    cached_blocks: int
    cached_tokens: int
    policy: str
    reason: str
    prompt_blocks: int
    id: int
    hashes: np.ndarray
    scores: dict = field(default_factory=dict)


class Router:
    def __init__(
        self,
        workers,
        *,
        policy="kv_aware",
        block_size=16,
        hash_profile="native",
        index="approx",
        **_options,
    ):
        weights = dict(workers) if isinstance(workers, dict) else {w: 1.0 for w in workers}
        self.policy = policy
        self.block_size = block_size
        self.hash_profile = hash_profile
        self.index = PrefixIndex()
        self._weights = weights
        self._healthy = dict.fromkeys(weights, True)
        self._load = dict.fromkeys(weights, 0)
        self._endpoints: dict[str, int] = {}
        self._salts: dict[str, str] = {}
        self._hashers = {None: BlockHasher(block_size, profile=hash_profile)}
        self._ids = itertools.count(1)
        self._active: set[int] = set()
        self._lock = threading.Lock()

    def add_endpoint(self, endpoint_id, *, pool_size, reserved_blocks=None, salt=None):
        self._endpoints[endpoint_id] = pool_size
        self._salts[endpoint_id] = salt or endpoint_id
        self._hashers[endpoint_id] = BlockHasher(
            self.block_size, profile=self.hash_profile, salt=self.endpoint_salt(endpoint_id)
        )

    def endpoint_salt(self, endpoint_id):
        if endpoint_id not in self._endpoints:
            raise KeyError(endpoint_id)
        return self._salts[endpoint_id]

    def endpoint_pool(self, endpoint_id):
        healthy = [w for w in self._weights if self._healthy[w]]
        return Rendezvous(healthy).preference(
            endpoint_id, min(self._endpoints[endpoint_id], len(healthy))
        )

    def set_healthy(self, name, ok):
        self._healthy[name] = bool(ok)

    def route(self, tokens=None, *, block_hashes=None, key=None, endpoint=None, exclude=None):
        hashes = self._hashers[endpoint].hash(tokens)
        with self._lock:
            cands = (
                self.endpoint_pool(endpoint)
                if endpoint
                else [w for w in self._weights if self._healthy[w]]
            )
            cands = [w for w in cands if w not in (exclude or ())]
            if not cands:
                raise ValueError("no healthy worker")
            m = self.index.match(hashes)
            best = min(cands, key=lambda w: (len(hashes) - m.get(w, 0) + self._load[w], w))
            cb = m.get(best, 0)
            return Decision(
                best,
                cb,
                cb * self.block_size,
                self.policy,
                "standin",
                len(hashes),
                next(self._ids),
                hashes,
            )

    def begin(self, d):
        with self._lock:
            self._active.add(d.id)
            self._load[d.worker] += 1
            self.index.store(d.worker, d.hashes)

    def finish(self, d):
        with self._lock:
            self._active.remove(d.id)
            self._load[d.worker] -= 1

    def prefilled(self, d):
        pass

    def observe(self, d, cached_tokens):
        pass
