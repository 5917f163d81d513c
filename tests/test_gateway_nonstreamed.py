"""A response that shows nothing until it is whole (``stream: false``) leaves the router's prefill
queue when its prefill is predicted done — by ``prefill_tokens_per_second`` or the model learned
from streamed requests — not at its end, and is never a sample of that model; with nothing to
predict from, at its end (``kvroute.gateway.upstream.Flight.expect_prefill``)."""

from __future__ import annotations

import threading
import time

from support.gateway_fleet import Fleet, GatewayServer, chat, config_dict, wait_for


def _load(gw: GatewayServer) -> tuple[int, int]:
    """(requests in flight, of them waiting for their prefill) over the fleet."""
    router = gw.gateway.router
    loads = [router.load(w) for w in router.workers]
    return sum(x["active"] for x in loads), sum(x["queued"] for x in loads)


def _in_background(gw: GatewayServer, question: str) -> threading.Thread:
    t = threading.Thread(target=lambda: chat(gw.client(None), "base-model", question), daemon=True)
    t.start()
    return t


def _stall(fleet: Fleet, seconds: float) -> None:
    for u in fleet.upstreams:
        u.stall = seconds


def test_a_predicted_prefill_leaves_the_queue_before_the_answer():
    fleet = Fleet(2)
    try:
        cfg = config_dict(fleet, gateway={"prefill_tokens_per_second": 1e6})  # ~2 ms predicted
        with GatewayServer(cfg) as gw:
            _stall(fleet, 4.0)
            t = _in_background(gw, "slow")
            wait_for(lambda: _load(gw) == (1, 0), "in flight, its prefill predicted done", 3.5)
            assert t.is_alive()  # the answer is still being held back
            _stall(fleet, 0.0)
            t.join(10)
            assert _load(gw) == (0, 0)
    finally:
        fleet.close()


def test_without_a_prediction_it_waits_in_the_queue_until_its_end():
    fleet = Fleet(2)
    try:
        with GatewayServer(config_dict(fleet)) as gw:  # nothing learned, no rate configured
            _stall(fleet, 1.5)
            t = _in_background(gw, "slow")
            wait_for(lambda: _load(gw)[0] == 1, "in flight", 5)
            seen = set()
            while t.is_alive():
                seen.add(_load(gw))
                time.sleep(0.02)
            assert seen <= {(1, 1), (0, 0)} and (1, 1) in seen
            assert _load(gw) == (0, 0)
    finally:
        fleet.close()


def test_the_learned_model_predicts_it_and_learns_nothing_from_it():
    fleet = Fleet(2, delay=0.05)
    try:
        with GatewayServer(config_dict(fleet)) as gw:
            samples = gw.gateway.admission.prefill.samples
            for i in range(3):
                for _ in chat(gw.client(None), "base-model", f"streamed {i}", stream=True)[0]:
                    pass
            assert len(samples) == 3
            learned = list(samples)
            _stall(fleet, 4.0)
            t = _in_background(gw, "slow")
            wait_for(lambda: _load(gw) == (1, 0), "in flight, its prefill predicted done", 3.5)
            assert t.is_alive()
            _stall(fleet, 0.0)
            t.join(10)
            assert list(samples) == learned
    finally:
        fleet.close()
