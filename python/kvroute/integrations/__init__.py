"""kvroute inside the routers Python teams already run: LiteLLM and Ray Serve.

- ``kvroute.integrations.litellm`` (``pip install 'kvroute[litellm]'``): ``KvRouteStrategy``, a
  LiteLLM custom routing strategy — one ``kvroute.Router`` per model group, fed back from
  LiteLLM's deployment callbacks.
- ``kvroute.integrations.ray_serve`` (``pip install 'kvroute[ray]'``): ``KvRequestRouter``, a Ray
  Serve ``RequestRouter`` — one ``kvroute.Router`` per deployment handle.

Both render and tokenize a request exactly as ``kvroute serve`` does (``kvroute.gateway.prompt``),
so the three put the same prompt on the same blocks. Importing this package imports neither
library; each module imports its own on first use.
"""

from __future__ import annotations

__all__: list[str] = []
