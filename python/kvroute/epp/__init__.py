"""``kvroute epp``: kvroute's router as a Gateway API Inference Extension endpoint picker.

An Envoy-based gateway (Envoy Gateway, kgateway, Istio, GKE …) asks an endpoint picker (EPP) where
each request goes, over Envoy's ``ext_proc`` gRPC protocol as GIE's endpoint-picker protocol
(v1.0.0) specifies. ``EppServer`` answers with ``kvroute.Router``'s choice: the header
``x-gateway-destination-endpoint: ip:port`` and the same value as dynamic metadata ``envoy.lb``, so
the proxy's original-destination cluster connects there. The wire facts are in
``kvroute.epp.protocol``, the per-stream state machine in ``kvroute.epp.service``, what a request
names and how it is routed, shed and accounted in ``kvroute.epp.picker``, the process in
``kvroute.epp.server``, the Kubernetes ``InferencePool`` watch in ``kvroute.epp.pool``.

The configuration (``kvroute.epp.config``) is the fleet's TOML file as ``kvroute serve`` reads it
(the same workers, endpoints, router, tokenizer and events, through the loader every kvroute
server shares) plus an ``[epp]`` table. A worker's ``url`` must have an IP address as host: it is
the ``ip:port`` the proxy connects to. Workers are ejected and readmitted by the health model
every kvroute server shares (``kvroute.server.health``): a 5xx response counts as a failure of
the worker that served it.

A matching Envoy configuration: an ``envoy.filters.http.ext_proc`` filter with
``processing_mode`` request/response headers ``SEND``, bodies ``FULL_DUPLEX_STREAMED``, trailers
``SEND``, ``metadata_options`` forwarding ``envoy.lb`` and ``envoy.lb.subset_hint`` and receiving
``envoy.lb``; routes to an ``ORIGINAL_DST`` cluster with ``original_dst_lb_config { use_http_header:
true, http_header_name: x-gateway-destination-endpoint }``; the gRPC health check of the picker's
cluster asks for ``envoy.service.ext_proc.v3.ExternalProcessor``. The test suite runs exactly such
an Envoy (``tests/test_epp_envoy.py``).

Needs the ``epp`` extra (``pip install 'kvroute[epp]'``: grpcio, grpcio-health-checking,
xds-protos, and the gateway's starlette/uvicorn/httpx); ``[epp.pool]`` needs ``kubernetes``.
"""

from __future__ import annotations

from .picker import Picker
from .server import EppServer
from .service import ExtProcService

__all__ = ["EppServer", "ExtProcService", "Picker"]
