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

**Fallback endpoints.** With ``[epp] fallbacks = N`` the value is a list, ``ip:port,ip:port,…``:
the pick, then up to N other workers the router ranks next (the ``kv_aware`` or ``least_loaded``
policy's scores) that take the same request (API key, cache-salt field). A proxy sends the request
to the first and each retry to the next: Envoy's ``override_host`` load-balancing policy over a
cluster of the workers (``override_host_sources`` the header or ``envoy.lb`` metadata above) with
a route ``retry_policy`` (``tests/test_epp_fallback.py`` runs one). An ``ORIGINAL_DST`` cluster
takes one ``ip:port`` only: keep the default, 0, there. The served endpoint the proxy reports
moves the request's accounting; a pick that failed before the retry is not reported to the
picker (its health is the proxy's outlier detection's to judge).

Needs the ``epp`` extra (``pip install 'kvroute[epp]'``: grpcio, grpcio-health-checking,
xds-protos, and the gateway's starlette/uvicorn/httpx); ``[epp.pool]`` needs ``kubernetes``.
"""

from __future__ import annotations

from .picker import Picker
from .server import EppServer
from .service import ExtProcService

__all__ = ["EppServer", "ExtProcService", "Picker"]
